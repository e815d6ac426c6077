"""Atomic file and directory writes, hashing.

Nothing blockforge writes is ever left half-written: data goes to a temporary
sibling first, is fsynced, then renamed over the destination.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _refuse_node(dest: Path) -> None:
    """At the rename itself: never over a device, FIFO or socket (check_outputs refused one
    before the work; this holds when one appeared meanwhile, and for internal writes)."""
    from blockforge.errors import BlockforgeError

    st = _lstat(dest)
    node = _node_kind(st) if st is not None else None
    if node:
        raise BlockforgeError(f"{dest} is {node}, not a regular file; refusing to replace it")


# A staged output (`.NAME.XXXXXXXX.tmp`, a file or a directory beside its destination) is locked
# (flock on its own descriptor) by its writer until it is renamed into place or removed, so a
# writer killed before its cleanup (SIGKILL, the OOM killer) leaves a stage whose lock is free:
# the next write of the same destination removes it. Before, it stayed, hidden, as large as the
# output it was to become (GPT-2 small's weights.bin alone: 124M parameters x 4 bytes).
_STAGE_MIN_AGE_S = 60.0  # a stage changed this recently is left alone (its writer may be between
# mkstemp and its lock, or between its last write and the rename, where the file is closed)


def _lock_stage(fd: int) -> None:
    import fcntl

    # (no flock on this file system, some network ones: a sweeper cannot take one either, and
    # _lock_is_free then never calls a stage free)
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _lock_is_free(path: Path, is_dir: bool) -> bool:
    """Whether an exclusive flock on `path` (never followed if a link) can be taken now: its
    holder, if it had one, is gone (ours ends with the close)."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_DIRECTORY if is_dir else 0))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: someone's process lives under that pid
        return False
    return False


def sweep_stale_stages(dest: str | os.PathLike) -> list[Path]:
    """Remove what killed writers of `dest` left beside it: its stages (`.NAME.XXXXXXXX.tmp`,
    their `.old` backups) whose lock is free, and atomic_directory's moved-aside previous
    output (`.NAME.old-PID-N`) whose pid is gone; each unchanged for _STAGE_MIN_AGE_S (the
    inode's ctime), owned by this user, a file or directory, never a link. Returns what went."""
    dest = Path(dest)
    name = re.escape(dest.name)
    staged = re.compile(rf"\.{name}\.[A-Za-z0-9_]{{8}}\.tmp(\.old)?")
    aside = re.compile(rf"\.{name}\.old-(\d+)-\d+")
    removed: list[Path] = []
    try:
        entries = [e for e in os.scandir(dest.parent) if e.name.startswith(f".{dest.name}.")]
    except OSError:
        return removed
    now, uid = time.time(), os.getuid()
    for e in entries:
        m, old = staged.fullmatch(e.name), aside.fullmatch(e.name)
        if not (m or old):
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        is_dir = stat.S_ISDIR(st.st_mode)
        if st.st_uid != uid or not (is_dir or stat.S_ISREG(st.st_mode)) or now - st.st_ctime < _STAGE_MIN_AGE_S:
            continue
        path = Path(e.path)
        if m and m.group(1):  # a backup: its stage's writer is gone (or the stage is)
            stage = path.with_name(path.name[:-len(".old")])
            free = not stage.exists() or _lock_is_free(stage, False)
        elif m:
            free = _lock_is_free(path, is_dir)
        else:
            free = _pid_gone(int(old.group(1)))
            if free and not (dest.exists() or dest.is_symlink()):
                # killed between moving the previous output aside and renaming the new one in:
                # the user's previous output goes back (the stage, complete or not, is swept)
                with contextlib.suppress(OSError):
                    os.replace(path, dest)
                    removed.append(path)
                continue
        if free:
            _remove(path)
            if not (path.exists() or path.is_symlink()):
                removed.append(path)
    return removed


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale_stages(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    _lock_stage(fd)  # until the file is closed, after its last write (_STAGE_MIN_AGE_S covers the rest)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 would surprise users
        with naming(path), os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _refuse_node(path)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path


DIR_LOCK_WAIT_S = 10.0


@contextlib.contextmanager
def dir_lock(path: str | os.PathLike, *, exclusive: bool, wait_s: float = DIR_LOCK_WAIT_S) -> Iterator[bool]:
    """flock(2) on the directory itself: writers that replace several of its files hold it
    exclusively while they rename, readers hold it shared while they read, so a reader
    sees all of one write or none of it. Locking the directory (not a lock file in it)
    works where readers cannot write (a shipped, read-only database) and leaves nothing
    behind. Yields whether the lock is held: False where the file system has no flock or
    the wait ran out (callers that need consistency then check what they read)."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        yield False
        return
    try:
        deadline, held = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.001)  # the holder renames two files or reads them: milliseconds
            except OSError:
                break  # no flock here (some network file systems)
        yield held
    finally:
        os.close(fd)  # releases the lock


def atomic_write_group(files: dict[str | os.PathLike, bytes], hold=None) -> list[Path]:
    """Write several files that belong together (a model and its manifest): all of them
    or none. Each is staged (written, fsynced) beside its destination first; only then are
    they renamed into place, with stop signals deferred, and a failed rename puts back
    what the earlier ones replaced. `hold`: a context manager held around the renames
    only (dir_lock: readers never see some files new and others old)."""
    from blockforge.errors import stop_deferred

    staged: list[tuple[Path, str]] = []
    held: list[int] = []  # each stage's descriptor, its lock held until the renames are done
    try:
        for dest, data in files.items():
            dest = Path(dest)
            dest.parent.mkdir(parents=True, exist_ok=True)
            sweep_stale_stages(dest)
            fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
            held.append(fd)
            _lock_stage(fd)
            staged.append((dest, tmp))
            os.fchmod(fd, 0o666 & ~_umask())
            with naming(dest), os.fdopen(fd, "wb", closefd=False) as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        with stop_deferred(), (hold if hold is not None else contextlib.nullcontext()):
            done: list[tuple[Path, str | None]] = []  # (dest, backup of what it replaced)
            try:
                for dest, tmp in staged:
                    _refuse_node(dest)
                    backup = None
                    if dest.is_file() and not dest.is_symlink():
                        backup = f"{tmp}.old"
                        try:
                            os.link(dest, backup)  # the old file stays in place until the rename
                        except OSError:  # a file system without hard links
                            shutil.copy2(dest, backup)
                    done.append((dest, backup))
                    os.replace(tmp, dest)
            except BaseException:
                for dest, backup in reversed(done):
                    with contextlib.suppress(OSError):
                        if backup:
                            os.replace(backup, dest)
                        else:
                            dest.unlink()
                raise
            for _, backup in done:
                if backup:
                    with contextlib.suppress(OSError):
                        os.unlink(backup)
    finally:
        for _, tmp in staged:
            for leftover in (tmp, f"{tmp}.old"):
                with contextlib.suppress(OSError):
                    os.unlink(leftover)
        for fd in held:
            os.close(fd)
    for parent in {Path(d).parent for d in files}:
        _fsync_dir(parent)
    return [Path(d) for d in files]


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8")


def atomic_write_json(path: str | os.PathLike, obj) -> Path:
    return atomic_write_bytes(path, json_bytes(obj))


FILE, TREE, INTO = "file", "tree", "into"  # the kinds of output (Output.kind)


@dataclass(frozen=True)
class Output:
    """One path a run writes, named by the library argument that holds it (`argument`:
    output, dump_ir, tuning_db, json, plot; the CLI spells it as its flag) with `suffix` for
    a file derived from it ("'s manifest").

    kind FILE: a file replaced by rename (json, plot, a model); TREE: a directory replaced
    whole (compile's and package's output), `is_ours` says which existing ones may be
    replaced without `force`; INTO: a directory written into, never replaced (dump_ir, the
    tuning database)."""

    argument: str
    path: str | os.PathLike
    kind: str = FILE
    what: str = "output"
    is_ours: Callable[[Path], bool] | None = None
    suffix: str = ""

    @property
    def name(self) -> str:
        """How a message template names it: {argument} and the suffix."""
        return "{" + self.argument + "}" + self.suffix


_MAX_INPUT_FILES = 10_000  # an input directory's files compared by identity (artifacts hold a few)


def _lstat(p: Path) -> os.stat_result | None:
    try:
        return p.lstat()
    except OSError:
        return None


def _stat(p: Path) -> os.stat_result | None:
    try:
        return p.stat()
    except OSError:
        return None


def _node_kind(st: os.stat_result) -> str | None:
    """What a node that blockforge must never write to or rename over is, or None."""
    m = st.st_mode
    for test, name in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(m):
            return name
    return None


def _real(p: Path) -> Path:
    return Path(os.path.realpath(p))


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


@dataclass
class _Inputs:
    """What a run reads: identities (st_dev, st_ino) of every file, an input directory's
    files included, and the resolved paths of the inputs themselves."""

    ids: dict[tuple[int, int], Path] = field(default_factory=dict)
    paths: list[Path] = field(default_factory=list)

    @classmethod
    def of(cls, inputs: Iterable[str | os.PathLike | None]) -> "_Inputs":
        got = cls()
        for i in inputs:
            if i is None or str(i) == "":
                continue
            p = Path(i)
            st = _stat(p)
            if st is None:
                continue  # the run itself says the input is missing
            got.paths.append(_real(p))
            got.ids[(st.st_dev, st.st_ino)] = p
            if stat.S_ISDIR(st.st_mode):
                with contextlib.suppress(OSError):  # an unreadable corner: its files are not compared
                    for n, f in enumerate(p.rglob("*")):
                        if n >= _MAX_INPUT_FILES:
                            break
                        fst = _stat(f)
                        if fst is not None and stat.S_ISREG(fst.st_mode):
                            got.ids.setdefault((fst.st_dev, fst.st_ino), f)
        return got

    def match(self, st: os.stat_result | None) -> Path | None:
        return None if st is None else self.ids.get((st.st_dev, st.st_ino))


def check_outputs(outputs: Iterable[Output | None], inputs: Iterable[str | os.PathLike | None] = (), *,
                  force: bool = False) -> None:
    """The output policy every verb applies to every path it writes, before any work.

    Each output: not an empty path; never a device, FIFO or socket, nor a symbolic link to
    one (a write by rename would replace the node; `force` does not change that); not a
    symbolic link (FILE, TREE: the rename would replace the link) and not an input of the
    same run (the same file by identity: a hard link or a symbolic link to it counts),
    unless `force`; a directory replaced whole (TREE) never holds or lies inside an input;
    then the rules of its kind (_check_tree, _check_file, _check_into) and a parent one can
    create files in. Across outputs: no two on the same path, and none inside a TREE."""
    from blockforge.errors import ArgumentError, BlockforgeError

    def refuse(template: str, *named: Output, force_named: bool = False) -> ArgumentError:
        args = [o.argument for o in named] + (["force"] if force_named else [])
        return ArgumentError(template, *dict.fromkeys(args))

    outs = [o for o in outputs if o is not None]
    ins = _Inputs.of(inputs)
    for o in outs:
        if str(o.path) == "":
            raise refuse(f"{o.name}: the path is empty; give a path or leave {o.name} out", o)
        p = Path(o.path)
        lst, st = _lstat(p), _stat(p)
        node = _node_kind(st) if st is not None else None
        if node:
            via = f"a symbolic link to {node} ({os.path.realpath(p)})" if stat.S_ISLNK(lst.st_mode) else node
            raise refuse(f"{o.name} {p} is {via}, not a regular file; blockforge never writes to one, "
                         "even with {force} (choose another path)", o, force_named=True)
        same = ins.match(st)
        if same is not None and o.kind != INTO and not force:
            if stat.S_ISLNK(lst.st_mode):
                what = f"a symbolic link to {same}, an input of this run"
            else:
                what = "an input of this run" + ("" if _real(p) == _real(same) else f" (the same file as {same})")
            raise refuse(f"{o.name} {p} is {what}; writing it would destroy the input "
                         "(choose another output, or pass {force})", o, force_named=True)
        if o.kind == TREE:
            real = _real(p)
            for i in ins.paths:
                if _within(i, real) or _within(real, i):
                    raise refuse(f"{o.name} {p} overlaps the input {i}: the {o.what}, "
                                 "replaced whole, cannot be, hold or lie inside what the run reads; choose another "
                                 "output", o)
        try:
            if o.kind == INTO:
                _check_into(p, o.what)
            elif o.kind == TREE:
                _check_tree(p, is_ours=o.is_ours, what=o.what, force=force)
            else:
                _check_file(p, o.what, force=force)
        except ArgumentError as e:  # the rules of a kind name the path; the user named an argument
            raise ArgumentError(f"{o.name} {e.template}", *dict.fromkeys((o.argument, *e.arguments))) from None
        except BlockforgeError as e:
            raise refuse(f"{o.name} {e}", o) from None
    for n, a in enumerate(outs):
        ra = _real(Path(a.path))
        for b in outs[n + 1:]:
            rb = _real(Path(b.path))
            if ra == rb:
                raise refuse(f"{a.name} and {b.name} name the same path ({a.path}); one would "
                             "overwrite the other: give each its own", a, b)
            for tree, other, rt, ro in ((a, b, ra, rb), (b, a, rb, ra)):
                if tree.kind == TREE and _within(ro, rt):
                    raise refuse(f"{other.name} {other.path} lies inside {tree.name} "
                                 f"{tree.path}, which is replaced whole at the end; choose a path "
                                 "outside it", other, tree)


def _check_tree(dest: Path, *, is_ours: Callable[[Path], bool] | None, what: str, force: bool) -> None:
    """A directory replaced whole, checked before the work and again at the swap:

    - nothing there, or an empty directory: fine;
    - the same kind of blockforge output (`is_ours`): replaced, the old one kept until the
      new one is complete;
    - anything else (a user's folder, a file, another kind of output): refused unless
      `force`; even then the old one is only removed once the new one is complete."""
    from blockforge.errors import ArgumentError, BlockforgeError

    _refuse_node(dest)  # at the swap too: a FIFO or device that appeared meanwhile is never moved aside
    if dest.is_symlink() and not force:
        raise ArgumentError(f"{dest} is a symbolic link; refusing to replace it (pass {{force}} to replace "
                            "the link)", "force")
    if dest.exists():
        empty_dir = dest.is_dir() and not dest.is_symlink() and not any(dest.iterdir())
        ours = is_ours is not None and dest.is_dir() and not dest.is_symlink() and is_ours(dest)
        if not (empty_dir or ours or force):
            kind = "a directory" if dest.is_dir() else "a file"
            raise ArgumentError(f"{dest} exists and is {kind} that is not a blockforge {what}; "
                                "refusing to replace it (choose another output, or pass {force})", "force")
    _check_parent(dest)


def _check_file(dest: Path, what: str, *, force: bool) -> None:
    """A file replaced by rename: not a directory, not a symbolic link unless `force` (the
    rename replaces the link itself, never its target)."""
    from blockforge.errors import ArgumentError, BlockforgeError

    if dest.is_symlink() and not force:
        raise ArgumentError(f"{dest} is a symbolic link; refusing to replace it (pass {{force}} to "
                            "replace the link itself; its target is left alone)", "force")
    if dest.is_dir():
        raise BlockforgeError(f"{dest} is a directory; the {what} must be a file path")
    _check_parent(dest)


def _check_into(dest: Path, what: str) -> None:
    """A directory written into (a symbolic link to one is followed: nothing is renamed
    over it)."""
    from blockforge.errors import BlockforgeError

    if dest.exists() and not dest.is_dir():
        raise BlockforgeError(f"{dest}: the {what} must be a directory, and this is a file")
    if not dest.exists():
        _check_parent(dest)
    else:
        _probe_create(dest, dest)


def _check_parent(dest: str | os.PathLike) -> None:
    """The nearest existing ancestor of `dest` must be a directory we can create files in."""
    from blockforge.errors import BlockforgeError

    dest = Path(dest)
    probe = dest.parent if str(dest.parent) else Path(".")
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise BlockforgeError(f"{dest}: {probe} is a file, not a directory")
    _probe_create(dest, probe)


def _probe_create(dest: Path, where: Path) -> None:
    """Create and remove a file in `where`: mode bits do not tell (root writes anywhere by
    them, yet not in /proc or /sys, nor in an immutable directory), so ask the file system."""
    from blockforge.errors import BlockforgeError

    if not os.access(where, os.W_OK | os.X_OK):
        raise BlockforgeError(f"{dest}: cannot write in {where} ({_not_writable(where)})")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".blockforge-probe-", dir=where)
    except OSError as e:
        why = f"read-only file system: {where}" if e.errno == errno.EROFS else e.strerror or e
        raise BlockforgeError(f"{dest}: cannot write in {where} ({why})") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(tmp)


def _not_writable(directory: Path) -> str:
    """Why os.access said no: a read-only mount is not a permission the user can change."""
    try:
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            return f"read-only file system: {directory}"
    except OSError:
        pass
    return "permission denied"


def write_error(dest: str | os.PathLike, e: OSError):
    """One line for a write that failed after the checks (a full disk, a race)."""
    from blockforge.errors import BlockforgeError

    return BlockforgeError(f"cannot write {dest}: {e.strerror or e}")


@contextlib.contextmanager
def naming(path: str | os.PathLike, scratch: Path | None = None) -> Iterator[None]:
    """An OSError without a file name (write() and fsync() on a full disk give none), or
    naming a file in `scratch` (a temporary directory the user never sees), leaves the block
    naming `path`: the CLI's one line then says where ("PATH: No space left on device")."""
    try:
        yield
    except OSError as e:
        if e.filename is None or (scratch is not None and str(e.filename).startswith(str(scratch))):
            e.filename = str(path)
        raise


@contextlib.contextmanager
def private_temp_root(prefix: str = "blockforge-") -> Iterator[Path | None]:
    """A fresh directory under the temporary directory that is TMPDIR (and tempfile's
    default) inside the block, removed at its end whatever happens.

    TVM writes intermediate files (export_library's tmp*/lib0.o, MetaSchedule's candidate
    tars) to the default temporary directory, in this process and in the worker processes
    it starts, which inherit TMPDIR. A worker killed mid-export cannot remove its own; this
    root takes them all. Yields None (and changes nothing) where no directory can be made."""
    from blockforge.errors import stop_deferred

    # A signal between mkdtemp and the try below left the root behind (the interrupt test's
    # "run SIGINT as it starts", 1 in 12): it waits until the root is owned by the finally.
    making = stop_deferred()
    making.__enter__()
    try:
        # gettempdir's first call probes the directory with a file of its own (8 random letters,
        # written, unlinked): a signal there left it behind when the sweep below ran first, before
        # the deferral (the clean-clone CI of 44503ce, "run SIGINT as it starts")
        base = tempfile.gettempdir()
        root = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=base)
    except OSError:
        making.__exit__(None, None, None)
        yield None
        return
    owner = _hold_root(Path(root))
    saved_env, saved_default = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = root
    try:
        making.__exit__(None, None, None)  # a signal that came meanwhile is raised here, inside the try
        sweep_stale_roots(base)
        yield Path(root)
    finally:
        with stop_deferred():  # a signal now must not leave half the tree behind
            tempfile.tempdir = saved_default
            if saved_env is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = saved_env
            _remove_settled(Path(root))
            if owner is not None:
                os.close(owner)


# A root's owner holds an exclusive flock on ROOT/.owner for the root's life: the kernel drops it
# when the process dies however it dies (SIGKILL, the OOM killer), in any PID namespace sharing
# the directory, which a pid test cannot tell. A tune job killed that way left its candidate tars
# behind (the clean-clone CI found 4 roots a run, from a test that SIGKILLs a job).
_OWNER = ".owner"
_ROOT_NAME = re.compile(r"blockforge-(?:tune-)?(\d+)-[A-Za-z0-9_]+")
_UNLOCKED_AGE_S = 3600.0  # a root of a version before the lock: its pid gone this long


def _hold_root(root: Path) -> int | None:
    """Lock ROOT/.owner for as long as the returned descriptor stays open. The lock is taken
    on a temporary name and renamed into place, so a sweeper never sees an unlocked .owner."""
    import fcntl

    tmp = root / f".owner.{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(tmp, root / _OWNER)
    except OSError:
        os.close(fd)
        return None
    return fd


def _root_is_stale(path: Path, pid: int) -> bool:
    owner = path / _OWNER
    if os.path.lexists(owner):
        return _lock_is_free(owner, False)  # nobody holds it: the owner is gone
    # no lock file: a root from before the lock, or one whose owner is between mkdtemp and its
    # lock (microseconds): only a dead pid's, untouched for an hour, goes
    if not _pid_gone(pid):
        return False
    try:
        return time.time() - path.stat().st_mtime > _UNLOCKED_AGE_S
    except OSError:
        return False


def sweep_stale_roots(tmp: str | os.PathLike) -> list[Path]:
    """Remove the private temporary roots (private_temp_root) that processes killed before
    their cleanup left in the temporary directory `tmp`: only directories named as ours, owned
    by this user, not links, whose owner's lock is free. Returns what was removed. (`tmp` is the
    caller's: tempfile.gettempdir's first call writes a probe file, private_temp_root makes it
    inside its signal deferral.)"""
    base = Path(tmp)
    removed: list[Path] = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    uid = os.getuid()
    for entry in entries:
        m = _ROOT_NAME.fullmatch(entry.name)
        if not m or int(m.group(1)) == os.getpid():
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
            continue
        path = Path(entry.path)
        if _root_is_stale(path, int(m.group(1))):
            _remove(path)
            if not path.exists():
                removed.append(path)
    return removed


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


# Temporary outputs a failed block could not remove: a child may still be writing in them (ld,
# orphaned when a signal killed its g++ driver, linking module.so into an artifact's temporary
# directory while rmtree ran: the clean-clone CI of dd4a621 found one left). The CLI removes them
# again once it has ended its children (cli._dispatch).
_LEFTOVERS: list[Path] = []


def _discard(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    if tmp.exists():
        _LEFTOVERS.append(tmp)


def _remove_settled(root: Path, tries: int = 20, pause_s: float = 0.05) -> None:
    """rmtree until the directory stays gone (up to tries * pause_s, 1 s): a compiler process
    orphaned by a signal (gcc's `as`, reparented when its g++ driver died, so no longer a child
    end_children can wait for) may still create a temporary in it after a first rmtree; the
    clean-clone CI of 0cacb26 found its cc*.o left in the private TMPDIR root (once; every CI before passed)."""
    for _ in range(tries):
        shutil.rmtree(root, ignore_errors=True)
        if not root.exists():
            return
        time.sleep(pause_s)
    _LEFTOVERS.append(root)


def remove_leftovers() -> None:
    """Remove what _discard could not (call after the process's children have ended)."""
    while _LEFTOVERS:
        shutil.rmtree(_LEFTOVERS.pop(), ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(dest: str | os.PathLike, *, is_ours: Callable[[Path], bool] | None = None,
                     what: str = "output", force: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that replaces `dest` only if the block succeeds.

    The directory rule (_check_tree; check_outputs applies it with the rest of the policy before
    the work) is applied before and again at the swap (another
    process may have written `dest` meanwhile). The previous `dest` is moved aside and
    removed only after the new one is in place; two writers racing to one `dest` end with
    one complete result, never a mix."""
    from blockforge.errors import BlockforgeError

    dest = Path(dest)
    _check_tree(dest, is_ours=is_ours, what=what, force=force)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        sweep_stale_stages(dest)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    except OSError as e:
        raise BlockforgeError(f"{dest}: cannot create the output ({e.strerror or e})") from None
    lock = None
    with contextlib.suppress(OSError):
        lock = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        _lock_stage(lock)
    os.chmod(tmp, 0o777 & ~_umask())
    try:
        with naming(dest, tmp):  # a full disk while the output is written: say which output
            yield tmp
            for p in tmp.rglob("*"):
                if p.is_file():
                    with open(p, "rb") as f:
                        os.fsync(f.fileno())
        for _attempt in range(20):
            _check_tree(dest, is_ours=is_ours, what=what, force=force)
            old = None
            if dest.exists() or dest.is_symlink():
                old = dest.with_name(f".{dest.name}.old-{os.getpid()}-{_attempt}")
                try:
                    os.replace(dest, old)
                except FileNotFoundError:
                    old = None  # another writer moved it meanwhile
            try:
                os.replace(tmp, dest)
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.EISDIR, errno.ENOTDIR):
                    # another writer's complete result landed in between: ours replaces it next
                    if old is not None:
                        _remove(old)
                    continue
                if old is not None and not dest.exists():
                    with contextlib.suppress(OSError):
                        os.replace(old, dest)  # put the user's previous output back
                raise BlockforgeError(f"{dest}: cannot write the output ({e.strerror or e})") from None
            if old is not None:
                _remove(old)
            break
        else:
            raise BlockforgeError(f"{dest}: other processes keep replacing this output; giving up")
        _fsync_dir(dest.parent)
    except BaseException:
        _discard(tmp)
        raise
    finally:
        if lock is not None:
            os.close(lock)
