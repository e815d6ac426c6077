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
