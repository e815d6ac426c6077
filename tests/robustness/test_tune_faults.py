"""Tuning under faults: SIGKILL at several points, and a full disk, never cost a finished
record and never leave a database that does not load."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import tempfile
import time

import pytest

from blockforge.compile.records.reader import RECORDS, load_database, read_contents
from blockforge.errors import BlockforgeError
from blockforge.graph import FFNSpec, export

from conftest import BLOCKFORGE

pytestmark = pytest.mark.slow
SHAPE = {"batch": 1, "seq": 8}
# These tests check kills and merges, not the search: a small evolutionary population (the
# default 512 samples and scores that many candidates every 1-trial round). Measured: one tune
# of this FFN, 4 trials per task in 1-trial rounds: 96 s of CPU with 32, 165 s with 512.
POPULATION = 32
# Two trials per task in 1-trial rounds: after each fault (a kill, a full disk) the job still has
# later rounds of both tasks to resume, and every round is a search (seconds each).
TRIALS_PER_TASK = 2
KILL_POINTS = [
    ("while importing, before any record", lambda db: (db / ".lock.owner").exists(), 0.3),
    ("just after a merge", lambda db: _records(db) >= 1, 0.0),
    ("inside a later round", lambda db: _records(db) >= 3, 0.8),
]


def _records(db) -> int:
    try:
        return len(read_contents(db, tolerate_torn_tail=False).records)
    except Exception:
        return 0


def test_sigkill_at_several_points(tmp_path):
    model = export(FFNSpec(d_model=32, d_ff=64), tmp_path / "f.onnx").model_path
    db = tmp_path / "db"
    cmd = [*map(str, BLOCKFORGE), "tune", str(model), "--target", "host", "--shape", "batch=1,seq=8", "--db", str(db),
           "--no-progress", "--no-measure", "--trials-per-task", str(TRIALS_PER_TASK), "--round-trials", "1",
           "--population", str(POPULATION)]
    env = {**os.environ, "BLOCKFORGE_LOG": str(tmp_path / "log")}
    kept: list[str] = []
    survived = 0
    for label, ready, delay in KILL_POINTS:
        p = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 180
        while not ready(db) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait()
        lines = (db / RECORDS).read_text().splitlines() if (db / RECORDS).exists() else []
        assert lines[: len(kept)] == kept, f"records lost by the kill {label!r}"
        if lines:
            load_database(db)  # MetaSchedule loads what the kill left
        kept = lines
        survived += 1
    tmpdir = tmp_path / "tmpdir"  # a completed job leaves nothing in TMPDIR (TVM's tmp*/tvm_tmp_mod.tar)
    tmpdir.mkdir()
    r = subprocess.run(cmd, cwd=tmp_path, env={**env, "TMPDIR": str(tmpdir)}, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    assert list(tmpdir.iterdir()) == [], f"left in TMPDIR: {list(tmpdir.rglob('*'))[:5]}"
    final = (db / RECORDS).read_text().splitlines()
    assert final[: len(kept)] == kept
    assert "spent" in r.stdout
    assert survived == len(KILL_POINTS)


def test_disk_full_keeps_database(tmp_path, monkeypatch):
    """The second merge fails with ENOSPC: a clear error, and the first merge's records stay."""
    from blockforge.tune import database as tuning_db
    from blockforge.tune.jobs import TuneOptions, tune

    model = export(FFNSpec(d_model=32, d_ff=64), tmp_path / "f.onnx").model_path
    db = tmp_path / "db"
    real = tuning_db.atomic_write_group  # a merge stages and renames both files as one group
    calls = {"n": 0}

    def flaky(files, hold=None):
        if any(p.name == RECORDS for p in files):
            calls["n"] += 1
            if calls["n"] >= 3:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(files, hold)

    monkeypatch.setattr(tuning_db, "atomic_write_group", flaky)
    opts = TuneOptions(model=model, target="host", shape=SHAPE, tuning_db=db, trials_per_task=TRIALS_PER_TASK,
                       round_trials=1, measure=False, progress=False, population=POPULATION)
    with pytest.raises(BlockforgeError, match="No space left on device.*intact"):
        tune(opts)
    before = (db / RECORDS).read_text().splitlines()
    assert len(before) >= 2
    load_database(db)
    monkeypatch.setattr(tuning_db, "atomic_write_group", real)
    tmpdir = tmp_path / "tmpdir"  # the library call, too, leaves nothing in TMPDIR (workers' exports)
    tmpdir.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
    s = tune(opts)
    after = (db / RECORDS).read_text().splitlines()
    assert after[: len(before)] == before and s.trials_new > 0
    # In-process, ONNX Runtime (loaded by earlier tests) may drop its telemetry session file
    # `.ses` (a timestamp and a UUID) into whatever TMPDIR is current: not the job's.
    left = [p for p in tmpdir.iterdir() if p.name != ".ses"]
    assert left == [], f"left in TMPDIR: {list(tmpdir.rglob('*'))[:5]}"
