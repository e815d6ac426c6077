"""Tuning records and the CPU they were judged on: records whose in-model verdict was made on
another CPU are skipped (with a warning) until `tune --check-only` re-checks them here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from blockforge.compile.records.reader import DEVICE, FORMAT, LEDGER, RECORDS, WORKLOADS, plan_apply
from blockforge.graph import FFNSpec, export
from blockforge.targets.toolchain import cpu_id

from conftest import assert_user_error, run_cli_in_process

HERE = cpu_id()
OTHER = "Intel(R) Xeon(R) Platinum 8480+ (cpu family 6, model 143)"


def _verdict(prefer: bool) -> dict:
    return {"prefer_default": prefer, "default_ms": 1.0, "record_ms": 1.1 if prefer else 0.9}


def _fake_db(d: Path, ledger: dict, db_cpu: str | None) -> Path:
    """A database whose files have the right structure (an empty trace: plan_apply replays none)."""
    d.mkdir()
    names = sorted(ledger)
    (d / WORKLOADS).write_text("".join(json.dumps([sh, {}]) + "\n" for sh in names))
    (d / RECORDS).write_text("".join(json.dumps([i, [[[], []], [1e-5]]]) + "\n" for i in range(len(names))))
    dev = {"format": FORMAT, "key": "llvm-x", "target": {"kind": "llvm"}}
    if db_cpu:
        dev["cpu_model"] = db_cpu
    (d / DEVICE).write_text(json.dumps(dev))
    (d / LEDGER).write_text(json.dumps(ledger))
    return d


def test_apply_plan_by_cpu(tmp_path):
    ledger = {
        "1": {"task": "wins_here", "in_model": {HERE: _verdict(False), OTHER: _verdict(True)}},
        "2": {"task": "loses_here", "in_model": {HERE: _verdict(True), OTHER: _verdict(False)}},
        "3": {"task": "judged_elsewhere", "in_model": {OTHER: _verdict(False)}},
        "4": {"task": "never_judged", "trials": 8},
        "5": {"task": "legacy", "prefer_default": True, "in_model_ms": {"default": 1.0, "record": 1.2}},
    }
    p = plan_apply(_fake_db(tmp_path / "other", ledger, OTHER), HERE)
    assert p.exclude == {"2", "3", "4", "5"}
    assert p.kept_default == ["loses_here"]
    assert p.unvalidated == ["judged_elsewhere", "legacy", "never_judged"] and p.verdict_cpus == [OTHER]
    # Tuned on this CPU: records nobody judged apply (tune --no-measure); others' verdicts do not count.
    p = plan_apply(_fake_db(tmp_path / "mine", ledger, HERE), HERE)
    assert p.exclude == {"2", "3", "5"} and p.unvalidated == ["judged_elsewhere"]
    assert p.kept_default == ["legacy", "loses_here"]  # legacy flat fields: the tuning CPU's verdict
    # A database from before CPUs were recorded: its verdicts were made on an unknown CPU.
    p = plan_apply(_fake_db(tmp_path / "legacy", {"5": ledger["5"]}, None), HERE)
    assert p.unvalidated == ["legacy"] and p.verdict_cpus == ["unknown CPU"]
    # A build that does not run here (cross): the tuning CPU's verdicts rule, as before.
    p = plan_apply(tmp_path / "other", None)
    assert p.exclude == {"1", "5"} and p.kept_default == ["legacy", "wins_here"] and p.unvalidated == []


def _default_schedule_db(model: Path, d: Path, shape: dict) -> list[tuple[str, str]]:
    """A real database holding blockforge's default schedule for every task (unmeasured):
    (workload, task) pairs. Stands in for records tuned on another machine."""
    from tvm.s_tir import meta_schedule as ms

    from blockforge.compile.pipeline import extract_tasks, run_phases
    from blockforge.compile.session import open_model
    from blockforge.tune.jobs import default_schedule

    session = open_model(model, "host", shape)
    legal, _ = run_phases(session.relax(), session.target, stop_after="legalize")
    tasks = extract_tasks(legal, session.target)
    tgt = session.target.tvm_target()
    d.mkdir()
    db = ms.database.JSONDatabase(work_dir=str(d))
    out = []
    for t in tasks:
        func = t.dispatched[0]
        wl = db.commit_workload(func)
        args = ms.arg_info.ArgInfo.from_prim_func(func["main"])
        db.commit_tuning_record(ms.database.TuningRecord(default_schedule(t, session.target).trace, wl, [1e-5], tgt, args))
        out.append((ms.database.Workload(func).as_json()[0], t.task_name))
    (d / DEVICE).write_text(json.dumps({"format": FORMAT, "key": session.target.key(),
                                        "target": session.target.target_json, "cpu_model": OTHER}))
    (d / LEDGER).write_text(json.dumps({w: {"task": n, "trials": 8, "in_model": {OTHER: _verdict(False)}}
                                        for w, n in out}))
    return out


@pytest.mark.slow
def test_foreign_records_skipped_until_checked_here(tmp_path):
    model = export(FFNSpec(d_model=64, d_ff=128), tmp_path / "f.onnx").model_path
    db = tmp_path / "db"
    tasks = _default_schedule_db(model, db, {"batch": 1, "seq": 16})
    names = sorted(n for _, n in tasks)
    compile_args = ("compile", model, "--target", "host", "--shape", "batch=1,seq=16", "--tuning-db", db, "--force")

    r = run_cli_in_process(*compile_args, "-o", tmp_path / "a1", cwd=tmp_path)
    assert r.rc == 0, r.text
    assert f"validated on {OTHER}, not this CPU ({HERE}): skipped" in r.err and "--check-only" in r.err, r.err
    t = json.loads((tmp_path / "a1" / "manifest.json").read_text())["tuning"]
    assert sorted(t["unvalidated"]) == names and t["applied"] == 0 and t["missing"] == [] and t["cpu"] == HERE

    assert_user_error(run_cli_in_process("tune", model, "--target", "host", "--tuning-db", tmp_path / "nodb",
                                         "--check-only", cwd=tmp_path), "no such tuning database")
    r = run_cli_in_process("tune", model, "--target", "host", "--shape", "batch=1,seq=16", "--tuning-db", db,
                           "--check-only", "--no-progress", "--json", tmp_path / "s.json", cwd=tmp_path)
    assert r.rc == 0 and f"in-model verdicts recorded for this CPU: {HERE}" in r.out, r.text
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["trials_new"] == 0 and s["naive_ms"] is None and s["cpu"] == HERE
    # Never slower where applied: the tuned build is the untuned one unless records won here.
    assert s["tuned_ms"] is not None and s["untuned_ms"] is not None
    ledger = json.loads((db / LEDGER).read_text())
    for w, _ in tasks:
        assert set(ledger[w]["in_model"]) == {OTHER, HERE}  # the other CPU's verdict is kept
    assert json.loads((db / DEVICE).read_text())["cpu_model"] == OTHER  # who tuned is unchanged

    r = run_cli_in_process(*compile_args, "-o", tmp_path / "a2", cwd=tmp_path)
    assert r.rc == 0 and "validated on" not in r.err, r.text
    t = json.loads((tmp_path / "a2" / "manifest.json").read_text())["tuning"]
    kept = {n for w, n in tasks if ledger[w]["in_model"][HERE]["prefer_default"]}
    assert t["unvalidated"] == [] and t["applied"] == len(tasks) - len(kept)
