"""Private temporary roots left by processes killed before their cleanup (SIGKILL, the OOM
killer) are swept by the next run: only ours (name, owner, a directory, not a link) and only
once their owner's lock is free; a live owner's root is never touched."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_cli

_HOLDER = """
import sys, time
from pathlib import Path
from blockforge.fsutil import private_temp_root
with private_temp_root() as root:
    (root / "candidate.tar").write_bytes(b"x" * 1000)
    print(root, flush=True)
    time.sleep(600)
"""


def _holder(tmp: Path) -> tuple[subprocess.Popen, Path]:
    p = subprocess.Popen([sys.executable, "-c", _HOLDER], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "TMPDIR": str(tmp)})
    root = Path(p.stdout.readline().strip())
    assert root.parent == tmp and (root / "candidate.tar").exists(), root
    return p, root


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _old(path: Path) -> Path:
    t = time.time() - 2 * 3600
    os.utime(path, (t, t))
    return path


def test_a_killed_owners_root_goes_a_live_ones_stays(tmp_path):
    from blockforge.fsutil import sweep_stale_roots

    live, live_root = _holder(tmp_path)
    killed, killed_root = _holder(tmp_path)
    try:
        assert sweep_stale_roots(tmp_path) == []  # both owners alive: both locks held
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert killed_root.exists()  # SIGKILL: no cleanup ran
        assert sweep_stale_roots(tmp_path) == [killed_root]
        assert not killed_root.exists() and (live_root / "candidate.tar").exists()
    finally:
        live.kill()
        live.wait()


def test_only_our_directories_whose_owner_is_gone(tmp_path):
    from blockforge.fsutil import sweep_stale_roots

    dead = _dead_pid()
    # a root from a version before the lock: no .owner; its pid gone and untouched for an hour
    old_dead = tmp_path / f"blockforge-{dead}-abc123"
    old_dead.mkdir()
    (old_dead / "f").write_text("x")
    _old(old_dead)
    tune_dead = tmp_path / f"blockforge-tune-{dead}-q_9z"
    tune_dead.mkdir()
    _old(tune_dead)
    # kept: recent (its owner may be between mkdtemp and the lock), a live pid, not our name,
    # a link to a directory, a plain file
    recent = tmp_path / f"blockforge-{dead}-recent"
    recent.mkdir()
    live_old = tmp_path / f"blockforge-{os.getppid()}-liveold"
    live_old.mkdir()
    _old(live_old)
    other = tmp_path / f"blockforged-{dead}-x"
    other.mkdir()
    _old(other)
    target = tmp_path / "precious"
    target.mkdir()
    (target / "keep").write_text("x")
    link = tmp_path / f"blockforge-{dead}-link"
    link.symlink_to(target)
    plain = tmp_path / f"blockforge-{dead}-file"
    plain.write_text("x")
    _old(plain)

    assert sorted(sweep_stale_roots(tmp_path)) == sorted([old_dead, tune_dead])
    for kept in (recent, live_old, other, link, plain, target / "keep"):
        assert kept.exists() or kept.is_symlink(), kept
    assert sweep_stale_roots(tmp_path / "missing") == []


def test_a_linked_lock_file_is_not_followed(tmp_path):
    """ROOT/.owner as a link (to a file nobody locks) is not opened: the root stays."""
    from blockforge.fsutil import sweep_stale_roots

    root = tmp_path / f"blockforge-{_dead_pid()}-linked"
    root.mkdir()
    (tmp_path / "elsewhere").write_text("")
    (root / ".owner").symlink_to(tmp_path / "elsewhere")
    _old(root)
    assert sweep_stale_roots(tmp_path) == [] and (root / ".owner").is_symlink()


def test_the_next_command_sweeps(tmp_path):
    killed, root = _holder(tmp_path)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    r = run_cli("targets", cwd=tmp_path, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert r.rc == 0, r.text
    assert not root.exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("blockforge-")]


# Stages: a writer's `.NAME.XXXXXXXX.tmp` beside its destination, locked until renamed in.
_STAGER = """
import sys, time, contextlib
from pathlib import Path
from blockforge import fsutil
kind, dest = sys.argv[1], Path(sys.argv[2])

@contextlib.contextmanager
def stop_here():
    print("staged", flush=True)
    time.sleep(600)
    yield

if kind == "dir":
    with fsutil.atomic_directory(dest) as tmp:
        (tmp / "weights.bin").write_bytes(b"w" * 4096)
        stop_here().__enter__()
else:
    fsutil.atomic_write_group({dest: b"model", dest.with_name("other.json"): b"{}"}, hold=stop_here())
"""


def _stager(kind: str, dest: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _STAGER, kind, str(dest)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "staged"
    return p


def _stages(d: Path, name: str) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith(f".{name}."))


@pytest.mark.parametrize("kind", ["dir", "files"])
def test_a_killed_writers_stage_goes_with_the_next_write_a_live_ones_stays(tmp_path, monkeypatch, kind):
    from blockforge import fsutil

    monkeypatch.setattr(fsutil, "_STAGE_MIN_AGE_S", 0.0)  # (the stages here are seconds old)
    dest = tmp_path / ("art" if kind == "dir" else "model.onnx")
    live = _stager(kind, dest)
    try:
        assert len(_stages(tmp_path, dest.name)) == 1
        assert fsutil.sweep_stale_stages(dest) == []  # its writer holds the lock
        assert len(_stages(tmp_path, dest.name)) == 1
    finally:
        live.send_signal(signal.SIGKILL)
        live.wait()
    left = _stages(tmp_path, dest.name)
    assert len(left) == 1 and left[0].endswith(".tmp"), left  # SIGKILL: no cleanup ran
    if kind == "dir":
        with fsutil.atomic_directory(dest) as tmp:  # the next write of the destination sweeps it
            (tmp / "weights.bin").write_bytes(b"new")
        assert (dest / "weights.bin").read_bytes() == b"new"
    else:
        assert _stages(tmp_path, "other.json"), "the group's second stage was written"
        fsutil.atomic_write_bytes(dest, b"new")
        assert dest.read_bytes() == b"new"
        assert len(_stages(tmp_path, "other.json")) == 1  # another destination's: left to its writes
    assert _stages(tmp_path, dest.name) == []


def test_what_a_stage_sweep_keeps_and_restores(tmp_path, monkeypatch):
    from blockforge import fsutil

    monkeypatch.setattr(fsutil, "_STAGE_MIN_AGE_S", 0.0)
    dead, alive = _dead_pid(), os.getppid()
    dest = tmp_path / "art"
    # killed between moving the previous output aside and renaming the new one in: it comes back
    aside = tmp_path / f".art.old-{dead}-0"
    aside.mkdir()
    (aside / "manifest.json").write_text("previous")
    assert fsutil.sweep_stale_stages(dest) == [aside]
    assert (dest / "manifest.json").read_text() == "previous" and not aside.exists()
    # with the destination in place, a dead writer's aside goes; a live pid's stays
    gone, kept = tmp_path / f".art.old-{dead}-1", tmp_path / f".art.old-{alive}-0"
    gone.mkdir()
    kept.mkdir()
    # a link named as a stage, another destination's stage, a different pattern: kept
    target = tmp_path / "precious"
    target.mkdir()
    link = tmp_path / ".art.abcdefgh.tmp"
    link.symlink_to(target)
    other = tmp_path / ".artifact.abcdefgh.tmp"
    other.mkdir()
    odd = tmp_path / ".art.notastage"
    odd.mkdir()
    # an unlocked stage file with its backup: both go
    stage = tmp_path / ".art.x1y2z3w4.tmp"
    stage.write_bytes(b"partial")
    backup = tmp_path / ".art.x1y2z3w4.tmp.old"
    backup.write_bytes(b"old")
    assert sorted(fsutil.sweep_stale_stages(dest)) == sorted([gone, stage, backup])
    for p in (kept, link, other, odd, target, dest / "manifest.json"):
        assert p.exists() or p.is_symlink(), p


def test_a_young_stage_is_left_alone(tmp_path):
    """Unchanged for less than a minute: its writer may be between mkstemp and its lock, or
    between its last write and the rename (the file closed)."""
    from blockforge import fsutil

    stage = tmp_path / ".model.onnx.abcdefgh.tmp"
    stage.write_bytes(b"partial")
    assert fsutil.sweep_stale_stages(tmp_path / "model.onnx") == [] and stage.exists()


def test_the_temporary_directory_is_probed_inside_the_signal_deferral(tmp_path, monkeypatch):
    """tempfile's first gettempdir() writes and unlinks a probe file (8 random letters) in the
    directory: a Ctrl-C between the two left it there when the root sweep called gettempdir
    before the deferral that guards mkdtemp (the clean-clone CI of 44503ce, 'run SIGINT as it
    starts'). Every call of the probe happens inside stop_deferred now."""
    import tempfile

    from blockforge import errors, fsutil

    real = getattr(tempfile, "_get_default_tempdir", None)
    if real is None:
        pytest.skip("this Python's tempfile has no _get_default_tempdir")
    deferring = []
    monkeypatch.setattr(tempfile, "_get_default_tempdir",
                        lambda *a: (deferring.append(errors._STOP.deferring), real(*a))[1])
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    with fsutil.private_temp_root() as root:
        assert root.parent == tmp_path
    assert deferring and all(d > 0 for d in deferring), deferring
    assert list(tmp_path.iterdir()) == []
