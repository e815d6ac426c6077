"""Autotuning with tiny budgets: records, resume, crash safety, locking, RPC, bad input."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from blockforge.compile.records.reader import WORKLOADS, read_contents
from blockforge.tune.database import DeviceDB
from blockforge.graph import FFNSpec, export
from blockforge.targets.toolchain import cpu_id

from blockforge.targets import resolve

from conftest import BLOCKFORGE, assert_user_error, gpu_present, run_cli, run_cli_in_process

pytestmark = pytest.mark.slow
SHAPE = "batch=1,seq=16"


@pytest.fixture(scope="module")
def ffn(tmp_path_factory):
    d = tmp_path_factory.mktemp("tune")
    return export(FFNSpec(d_model=64, d_ff=128), d / "ffn.onnx").model_path


# These tests check records, resume, budgets, locking and RPC, not the search: a small
# evolutionary population (the default 512 scores that many candidates every round).
SEARCH_POPULATION = 32


def _tune(model, db, *extra, cwd, run=run_cli):
    return run("tune", model, "--target", "host", "--shape", SHAPE, "--db", db, "--no-progress",
               "--population", SEARCH_POPULATION, *extra, cwd=cwd)


def _refused(model, db, *extra, cwd):
    """A tune the CLI refuses before any search: in-process (the refusals, not the process, are
    under test here; test_second_job_refused_while_first_runs runs one as a process)."""
    return _tune(model, db, *extra, cwd=cwd, run=run_cli_in_process)


def _summary(db: Path, model: Path) -> dict:
    return json.loads((db / "summaries" / f"{model.stem}.json").read_text())


@dataclass(frozen=True)
class Tuned:
    result: object  # the CliResult of the tune
    db: Path
    summary: Path  # its --json

    def copy_db(self, dest: Path) -> Path:
        """A copy of the tuned database for a test that changes it (a database is one self-contained folder)."""
        shutil.copytree(self.db, dest)
        return dest


@pytest.fixture(scope="module")
def tuned(ffn, tmp_path_factory) -> Tuned:
    """One CLI tune of the FFN (4 trials per task, with the whole-model A/B), shared by the tests
    that check it, resume it, apply it and reuse it from another model: each tune process costs
    a TVM import, the isolation child, the worker pools and every search round."""
    d = tmp_path_factory.mktemp("tuned")
    r = _tune(ffn, d / "db", "--trials-per-task", 4, "--json", d / "s.json", cwd=d)
    return Tuned(r, d / "db", d / "s.json")


def test_tune_resume_apply_verify(ffn, tuned, tmp_path):
    r = tuned.result
    assert r.rc == 0, r.text
    db = tuned.copy_db(tmp_path / "db")
    s = json.loads(tuned.summary.read_text())
    assert len(s["tasks"]) == 2 and all(t["trials_new"] == 4 and t["status"] == "new" for t in s["tasks"])
    assert all(t["best_us"] and t["gflops"] > 0 for t in s["tasks"])
    assert s["seeded"] == 2  # every workload got its default-schedule record, outside the budget
    # The tuning CPU is recorded, and every in-model verdict names the CPU it was made on.
    assert json.loads((db / "device.json").read_text())["cpu_model"] == cpu_id() == s["cpu"]
    verdicts = [e["in_model"] for e in json.loads((db / "ledger.json").read_text()).values()]
    assert len(verdicts) == 2 and all(set(v) == {cpu_id()} for v in verdicts)
    # The whole-model timings exist (their values are the machine's business, not a test's);
    # the guarantee that tuning never slows the model is structural: every verdict follows its
    # measured numbers, and the tasks whose record lost are the ones that kept the default.
    assert all(isinstance(s[k], float) and s[k] > 0 for k in ("naive_ms", "untuned_ms", "tuned_ms")), s
    by_name = {t["name"]: json.loads((db / "ledger.json").read_text())[t["workload"]]["in_model"][cpu_id()]
               for t in s["tasks"]}
    assert {n for n, v in by_name.items() if v["prefer_default"]} == set(s["kept_default"]), by_name
    c = read_contents(db, tolerate_torn_tail=False)
    assert len(c.records) >= 8 + 2 and len(c.workloads) == 2
    assert (db / "tune.log").stat().st_size > 0 and "Traceback" not in r.text

    # Resume: the same job spends nothing; a raised budget spends only the difference.
    r = _tune(ffn, db, "--trials-per-task", 4, "--no-measure", cwd=tmp_path)
    assert r.rc == 0 and "spent 0 new trials, reused 8" in r.out, r.text
    r = _tune(ffn, db, "--trials-per-task", 5, "--no-measure", cwd=tmp_path)
    assert r.rc == 0 and "spent 2 new trials, reused 8" in r.out, r.text
    assert all(t["trials_new"] == 1 and t["status"] == "extended" for t in _summary(db, ffn)["tasks"])
    assert _summary(db, ffn)["seeded"] == 0

    # Applying: compile records the database hash; verify passes on the tuned build.
    r = run_cli_in_process("compile", ffn, "--target", "host", "--shape", SHAPE, "--tuning-db", db,
                           "-o", tmp_path / "art", cwd=tmp_path)
    assert r.rc == 0 and "tuning records:" in r.out and "warning" not in r.err, r.text
    m = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert m["tuning"]["sha256"] == DeviceDB(db).digest() and m["tuning"]["missing"] == []
    assert "apply-tuning" in m["phases"]
    r = run_cli_in_process("verify", ffn, "--target", "host", "--shape", SHAPE, "--tuning-db", db, cwd=tmp_path)
    assert r.rc == 0 and "tuning records applied" in r.out and "tvm vs ort" in r.out, r.text


def test_database_shared_across_models(tuned, tmp_path):
    """A second model with the same FFN workloads reuses them instead of tuning again."""
    assert tuned.result.rc == 0, tuned.result.text
    db = tuned.copy_db(tmp_path / "db")
    other = export(FFNSpec(d_model=64, d_ff=128, seed=9), tmp_path / "other.onnx").model_path
    r = _tune(other, db, "--trials-per-task", 4, "--no-measure", cwd=tmp_path)
    assert r.rc == 0 and "spent 0 new trials, reused 8" in r.out, r.text


def test_budget_semantics():
    from blockforge.tune.jobs import per_task_budget
    from blockforge.errors import BlockforgeError

    assert per_task_budget(3, None, None) == 64
    assert per_task_budget(3, 30, None) == 10
    assert per_task_budget(3, 30, 4) == 4 and per_task_budget(3, 9, 4) == 3
    for bad in [(3, 2, None), (3, 0, None), (3, None, -1)]:
        with pytest.raises(BlockforgeError):
            per_task_budget(*bad)


def test_second_job_refused_while_first_runs(ffn, tmp_path):
    db = tmp_path / "db"
    cmd = [*BLOCKFORGE, "tune", ffn, "--target", "host", "--shape", SHAPE, "--db", db, "--no-progress",
           "--no-measure", "--trials-per-task", 8, "--population", SEARCH_POPULATION]
    p = subprocess.Popen([str(c) for c in cmd], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         # killed below: its temporary root (candidate tars) stays in tmp_path
                         env={**os.environ, "BLOCKFORGE_LOG": str(tmp_path / "log"), "TMPDIR": str(tmp_path)})
    try:
        deadline = time.monotonic() + 60
        while not (db / ".lock.owner").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        r = _tune(ffn, db, "--trials-per-task", 8, cwd=tmp_path)
        assert_user_error(r, "in use by pid")
        assert str(p.pid) in r.err
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("args, fragment", [
    (["--trials", "0"], "positive"),
    (["--trials-per-task", "-3"], "positive"),
    (["--trials", "1"], "every task needs"),
    (["--rpc-tracker", "127.0.0.1:1", "--rpc-key", "x"], "no RPC tracker"),
    (["--rpc-tracker", "nohost", "--rpc-key", "x"], "HOST:PORT"),
    (["--rpc-key", "x"], "go together"),
])
def test_tune_bad_input(ffn, tmp_path, args, fragment):
    r = _refused(ffn, tmp_path / "db", *args, cwd=tmp_path)
    assert_user_error(r, fragment)


def test_tune_binds_every_dim_or_says_which(ffn, tmp_path, monkeypatch):
    """MetaSchedule times tasks at fixed shapes: a dim --shape leaves symbolic is one error line
    naming it, and nothing is written (before, `tune MODEL --target host` on a model with a
    symbolic seq was an internal error in MetaSchedule's ArgInfo, exit 70). Without --shape the
    dims the model has get bench's default, batch=1 and seq=128."""
    r = run_cli_in_process("tune", ffn, "--target", "host", "--shape", "batch=1", "--db", tmp_path / "db",
                           "--no-progress", cwd=tmp_path)
    assert_user_error(r, "symbolic dim 'seq'", "--shape")
    assert not (tmp_path / "db").exists()
    import blockforge.tune as tune_api

    seen = []

    def fake_tune(opts):
        seen.append(opts)
        raise KeyboardInterrupt  # stop here: what the CLI asked for is under test
    monkeypatch.setattr(tune_api, "tune", fake_tune)
    run_cli_in_process("tune", ffn, "--target", "host", "--db", tmp_path / "db", cwd=tmp_path)
    run_cli_in_process("tune", ffn, "--target", "host", "--shape", "batch=2,seq=8", "--db", tmp_path / "db",
                       cwd=tmp_path)
    assert [o.default_dims for o in seen] == [{"batch": 1, "seq": 128}, {}]


def test_tune_unknown_target(ffn, tmp_path):
    assert_user_error(run_cli_in_process("tune", ffn, "--target", "nope", cwd=tmp_path), "unknown target")


@pytest.mark.skipif(gpu_present() or resolve("cuda-sm90").build_problem() is not None,
                    reason="needs nvcc and no GPU (nothing here can measure CUDA)")
def test_tune_without_device_asks_for_rpc(ffn, tmp_path):
    # CUDA builds here, but nothing can measure it without a device.
    assert_user_error(run_cli_in_process("tune", ffn, "--target", "cuda-sm90", cwd=tmp_path), "--rpc-tracker")


@pytest.mark.parametrize("content, fragment", [
    ("not json at all\n[1, 2]\n", "corrupt"),
    ('{"a": 1}\n', "foreign or corrupt"),
])
def test_corrupt_or_foreign_db_refused_untouched(ffn, tmp_path, content, fragment):
    db = tmp_path / "db"
    db.mkdir()
    (db / WORKLOADS).write_text(content)
    r = _refused(ffn, db, "--trials-per-task", 2, cwd=tmp_path)
    assert_user_error(r, fragment)
    assert (db / WORKLOADS).read_text() == content


def test_db_for_another_device_refused(ffn, tmp_path):
    db = tmp_path / "db"
    db.mkdir()
    (db / "device.json").write_text(json.dumps({"format": "blockforge.tuning-db/1", "key": "cuda-sm90"}))
    assert_user_error(_refused(ffn, db, "--trials-per-task", 2, cwd=tmp_path), "is for device")
    assert_user_error(run_cli_in_process("compile", ffn, "--target", "host", "--tuning-db", db, cwd=tmp_path),
                      "is for device")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, timeout: float = 60.0) -> None:
    """Until something accepts on 127.0.0.1:port (a loaded machine starts Python slowly)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_rpc_tracker_and_two_servers(ffn, tmp_path):
    port = _free_port()
    env = {**os.environ, "BLOCKFORGE_LOG": str(tmp_path / "log")}
    procs = [subprocess.Popen([*BLOCKFORGE, "rpc", "tracker", "--port", str(port)], cwd=tmp_path, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        _wait_listening(port)
        for i in range(2):
            procs.append(subprocess.Popen(
                [*BLOCKFORGE, "rpc", "server", "--port", str(_free_port()), "--tracker", f"127.0.0.1:{port}",
                 "--key", "bf-test"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        r = _tune(ffn, tmp_path / "db", "--trials-per-task", 2, "--rpc-tracker", f"127.0.0.1:{port}",
                  "--rpc-key", "bf-test", "--rpc-wait", 30, cwd=tmp_path)
        log = tmp_path / "db" / "tune.log"
        assert r.rc == 0, r.text + (log.read_text()[-3000:] if log.exists() else "")
        c = read_contents(tmp_path / "db", tolerate_torn_tail=False)
        ok = [line for _, line in c.records if json.loads(line)[1][1][0] < 1e9]
        assert len(ok) >= 2, "no candidate was measured successfully on the RPC servers"
        r = _refused(ffn, tmp_path / "db2", "--trials-per-task", 2, "--rpc-tracker", f"127.0.0.1:{port}",
                     "--rpc-key", "no-such-device", "--rpc-wait", 1, cwd=tmp_path)
        assert_user_error(r, "no device for key 'no-such-device'")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=10)
