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
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator


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


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 would surprise users
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
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
    import time

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
    try:
        for dest, data in files.items():
            dest = Path(dest)
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
            staged.append((dest, tmp))
            os.fchmod(fd, 0o666 & ~_umask())
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        with stop_deferred(), (hold if hold is not None else contextlib.nullcontext()):
            done: list[tuple[Path, str | None]] = []  # (dest, backup of what it replaced)
            try:
                for dest, tmp in staged:
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
    for parent in {Path(d).parent for d in files}:
        _fsync_dir(parent)
    return [Path(d) for d in files]


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8")


def atomic_write_json(path: str | os.PathLike, obj) -> Path:
    return atomic_write_bytes(path, json_bytes(obj))


def check_output(dest: str | os.PathLike, *, is_ours: Callable[[Path], bool] | None = None,
                 what: str = "output", force: bool = False) -> None:
    """The output policy every verb applies before any work:

    - nothing there, or an empty directory: fine;
    - the same kind of blockforge output (`is_ours`): replaced, the old one kept until the
      new one is complete;
    - anything else (a user's folder, a file, another kind of output): refused unless
      `force`; even then the old one is only removed once the new one is complete;
    - the parent directory must be writable (checked now, not after the work).
    """
    from blockforge.errors import BlockforgeError

    dest = Path(dest)
    if dest.is_symlink() and not force:
        raise BlockforgeError(f"{dest} is a symbolic link; refusing to replace it (pass --force to replace the link)")
    if dest.exists():
        empty_dir = dest.is_dir() and not dest.is_symlink() and not any(dest.iterdir())
        ours = is_ours is not None and dest.is_dir() and not dest.is_symlink() and is_ours(dest)
        if not (empty_dir or ours or force):
            kind = "a directory" if dest.is_dir() else "a file"
            raise BlockforgeError(f"{dest} exists and is {kind} that is not a blockforge {what}; refusing to "
                                  "replace it (choose another output, or pass --force)")
    check_parent(dest)


def check_parent(dest: str | os.PathLike) -> None:
    """The nearest existing ancestor of `dest` must be a directory we can write in."""
    from blockforge.errors import BlockforgeError

    dest = Path(dest)
    probe = dest.parent if str(dest.parent) else Path(".")
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise BlockforgeError(f"{dest}: {probe} is a file, not a directory")
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        raise BlockforgeError(f"{dest}: cannot write in {probe} (permission denied)")


def check_dir_output(dest: str | os.PathLike, what: str = "output directory") -> Path:
    """A directory output written into (not replaced), checked before any work."""
    from blockforge.errors import BlockforgeError

    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise BlockforgeError(f"{dest}: the {what} must be a directory, and this is a file")
    if not dest.exists():
        check_parent(dest)
    elif not os.access(dest, os.W_OK | os.X_OK):
        raise BlockforgeError(f"{dest}: cannot write in it (permission denied)")
    return dest


def check_file_output(dest: str | os.PathLike, what: str = "output file") -> Path:
    """A file output (--json, --output, --plot, -o MODEL.onnx), checked before any work:
    not a directory, and a writable directory to put it in."""
    from blockforge.errors import BlockforgeError

    dest = Path(dest)
    if dest.is_dir():
        raise BlockforgeError(f"{dest} is a directory; the {what} must be a file path")
    check_parent(dest)
    return dest


def write_error(dest: str | os.PathLike, e: OSError):
    """One line for a write that failed after the checks (a full disk, a race)."""
    from blockforge.errors import BlockforgeError

    return BlockforgeError(f"cannot write {dest}: {e.strerror or e}")


@contextlib.contextmanager
def private_temp_root(prefix: str = "blockforge-") -> Iterator[Path | None]:
    """A fresh directory under the temporary directory that is TMPDIR (and tempfile's
    default) inside the block, removed at its end whatever happens.

    TVM writes intermediate files (export_library's tmp*/lib0.o, MetaSchedule's candidate
    tars) to the default temporary directory, in this process and in the worker processes
    it starts, which inherit TMPDIR. A worker killed mid-export cannot remove its own; this
    root takes them all. Yields None (and changes nothing) where no directory can be made."""
    from blockforge.errors import stop_deferred

    try:
        root = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=tempfile.gettempdir())
    except OSError:
        yield None
        return
    saved_env, saved_default = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = root
    try:
        yield Path(root)
    finally:
        with stop_deferred():  # a signal now must not leave half the tree behind
            tempfile.tempdir = saved_default
            if saved_env is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = saved_env
            shutil.rmtree(root, ignore_errors=True)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


@contextlib.contextmanager
def atomic_directory(dest: str | os.PathLike, *, is_ours: Callable[[Path], bool] | None = None,
                     what: str = "output", force: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that replaces `dest` only if the block succeeds.

    The output policy (check_output) is applied before and again at the swap (another
    process may have written `dest` meanwhile). The previous `dest` is moved aside and
    removed only after the new one is in place; two writers racing to one `dest` end with
    one complete result, never a mix."""
    from blockforge.errors import BlockforgeError

    dest = Path(dest)
    check_output(dest, is_ours=is_ours, what=what, force=force)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    except OSError as e:
        raise BlockforgeError(f"{dest}: cannot create the output ({e.strerror or e})") from None
    os.chmod(tmp, 0o777 & ~_umask())
    try:
        yield tmp
        for p in tmp.rglob("*"):
            if p.is_file():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
        for _attempt in range(20):
            check_output(dest, is_ours=is_ours, what=what, force=force)
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
        shutil.rmtree(tmp, ignore_errors=True)
        raise
