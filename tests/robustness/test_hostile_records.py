"""Tuning databases are untrusted input: a record may only replay what MetaSchedule's search
writes (compile/records/policy.py). A record that annotates a loop `pragma_import_llvm`
links native code into module.so (its constructor runs where the module is loaded); these
tests plant one that creates a marker file and prove it never runs, and fuzz mutated real
traces through the policy and read_contents.
"""

from __future__ import annotations

import json
import platform
import random
from pathlib import Path

import numpy as np
import pytest

from blockforge.compile.records.policy import ANNOTATIONS, KINDS, record_problem
from blockforge.compile.records.reader import RECORDS, read_contents
from blockforge.graph import FFNSpec, export
from blockforge.targets.toolchain import cpu_id

from conftest import run_cli
from hostile_records import constructor_ir, default_schedule_db, with_annotation, write_records

SHIPPED = Path(__file__).resolve().parents[2] / "artifacts" / "shipped" / "tuning" / "x86-64-avx512"

# Loop/block annotation keys TVM 0.27 knows (strings of libtvm_compiler.so and the Python
# package: pragma_*, meta_schedule.*, software_pipeline_*, tirx attribute keys), and
# near-misses of the allowed ones.
TVM_KEYS = sorted(set(ANNOTATIONS) | {
    "pragma_import_llvm", "pragma_import_c", "pragma_debug_skip_region", "pragma_parallel",
    "pragma_parallel_barrier_when_finish", "pragma_parallel_launch_point", "pragma_parallel_stride_pattern",
    "pragma_unroll", "pragma_vectorize", "pragma_scope", "pragma_", "meta_schedule.adaptive_pool_avg",
    "meta_schedule.adaptive_pool_max", "meta_schedule.pool_avg", "meta_schedule.pool_max",
    "meta_schedule.inline_rule", "meta_schedule.write_cache_level", "software_pipeline_depth",
    "double_buffer_scope", "layout_free_buffers", "irregular_loop_mark", "thread_extent", "virtual_thread",
    "coproc_scope", "storage_alignment", "buffer_bound", "async_scope", "hand_threaded", "tirx.noalias",
    "tirx.is_scheduled", "tirx.disable_vectorize", "tirx.manifest_shared_memory_local_stage",
    "tirx.use_async_copy", "tir.disable_cse_tir", "tirx.disable_storage_rewrite",
    "PRAGMA_IMPORT_LLVM", "pragma_import_llvm ", "meta_schedule.parallel.", "meta_schedule_parallel",
})
# Instruction kinds TVM 0.27 registers (InstructionKind.get accepts each) and made-up ones.
TVM_KINDS = sorted(KINDS | {
    "UnsafeSetDType", "UnsafeHideBufferAccess", "AnnotateBufferAccess", "CacheInplace", "CacheIndex",
    "DecomposePadding", "RollingBuffer", "ReadAt", "WriteAt", "LoopPartition", "ReorderBlockIterVar",
    "FuseReductionEpilogue", "SetDType", "Eval", "ImportLLVM", "", "annotate", "Annotate ",
})
# A value of the right type for each allowed key ("v_sampled" stands for a sampled variable).
GOOD = {"int": 16, "int or sampled variable": "v_sampled", "flag": True, "name": '"SSRSRS"',
        "list of ints": [0, 0, 1]}


JUNK = [None, 0, -1, 1.5, float("nan"), "x", '"pragma_import_llvm"', "pragma_import_llvm", [], {}, [[]],
        {"type": "tirx.Call"}, True, 10 ** 30]


def _mutate(rng: random.Random, node, depth: int = 0):
    """One random structural change somewhere in a JSON tree (replace, delete, duplicate, swap)."""
    if isinstance(node, list) and node and (depth < 3 or rng.random() < 0.5):
        node = list(node)
        i = rng.randrange(len(node))
        op = rng.random()
        if op < 0.5:
            node[i] = _mutate(rng, node[i], depth + 1)
        elif op < 0.65:
            node[i] = rng.choice(JUNK)
        elif op < 0.8:
            del node[i]
        elif op < 0.9:
            node.insert(i, node[i])
        else:
            j = rng.randrange(len(node))
            node[i], node[j] = node[j], node[i]
        return node
    return rng.choice(JUNK)


def _real_records() -> list[list]:
    return [json.loads(line)[1] for line in (SHIPPED / RECORDS).read_text().splitlines()]


def _with_sampled(rec: list) -> list:
    """The record with a SampleCategorical first, whose output is 'v_sampled'."""
    rec = json.loads(json.dumps(rec))
    rec[0][0].insert(0, ["SampleCategorical", [], [[0, 16], [0.5, 0.5]], ["v_sampled"]])
    rec[0][1] = [[i + 1, d] for i, d in rec[0][1]] + [[0, 1]]
    return rec


def _walk_ok(rec: list) -> bool:
    """Independent of record_policy: the trace uses only allowed kinds and annotation keys."""
    for inst in rec[0][0]:
        if inst[0] not in KINDS:
            return False
        if inst[0] in ("Annotate", "Unannotate") and inst[2][0] not in ANNOTATIONS:
            return False
    return True


def test_shipped_and_real_records_pass():
    recs = _real_records()
    assert recs and all(record_problem(r) is None for r in recs)
    c = read_contents(SHIPPED, tolerate_torn_tail=False)
    assert c.refused == [] and len(c.records) == len(recs)


def test_fuzz_annotation_keys_and_values():
    """Every key TVM knows x values of every type, on every real trace: allowed only for an
    allow-listed key with a value of its type; pragma_import_* never."""
    values = [16, -3, True, 1.5, '"SSRSRS"', '"16"', '"/tmp/payload.ll"', '"/tmp/payload.bc"',
              [0, 1], ['"a"'], "v_sampled", "v_undefined", "None", None, {"k": 1}, 2 ** 40]
    accepted = refused = 0
    for base in _real_records()[:3]:  # a MetaSchedule-tuned matmul and two of blockforge's schedules
        base = _with_sampled(base)
        for key in TVM_KEYS:
            for value in values:
                rec = with_annotation(base, key, value)
                problem = record_problem(rec)
                if key not in ANNOTATIONS or key.startswith("pragma_import"):
                    assert problem, (key, value)
                if problem is None:
                    accepted += 1
                    assert _walk_ok(rec)
                else:
                    refused += 1
            if key in ANNOTATIONS:
                good = GOOD[ANNOTATIONS[key]]
                assert record_problem(with_annotation(base, key, good)) is None, (key, good)
                # a string where a number is expected, and the reverse
                wrong = '"16"' if not isinstance(good, str) or good == "v_sampled" else 16
                assert record_problem(with_annotation(base, key, wrong)), (key, wrong)
    assert accepted and refused > accepted


def test_fuzz_instruction_kinds_and_structure():
    """Every instruction kind TVM registers in place of a real one, then random structural
    mutations of real traces: each record is accepted (only allowed kinds and keys) or
    refused with a reason; nothing raises."""
    recs = _real_records()
    for base in recs:
        for n in (0, len(base[0][0]) // 2, len(base[0][0]) - 1):
            for kind in TVM_KINDS:
                rec = json.loads(json.dumps(base))
                rec[0][0][n][0] = kind
                if kind not in KINDS:
                    assert record_problem(rec), kind
                elif kind == base[0][0][n][0]:
                    assert record_problem(rec) is None
    rng = random.Random(17)
    outcomes = {"accepted": 0, "refused": 0}
    for _ in range(3000):
        rec = _mutate(rng, rng.choice(recs))
        problem = record_problem(rec)  # must not raise
        assert problem is None or isinstance(problem, str)
        if problem is None:
            outcomes["accepted"] += 1
            assert _walk_ok(rec)
        else:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 1000 and outcomes["accepted"] > 0, outcomes


@pytest.mark.parametrize("run_secs, ok", [([1e-5], True), ([1e10], True), (None, True), ([1e-9], False),
                                          ([0.0], False), ([-1e-5], False), ([float("nan")], False),
                                          ([float("inf")], False), (["1e-5"], False), ([True], False),
                                          ([], False), (1e-5, False)])
def test_latencies_must_be_plausible(run_secs, ok):
    rec = _real_records()[0]
    rec[1] = run_secs
    assert (record_problem(rec) is None) == ok


def test_read_contents_refuses_each_bad_record_once(tmp_path):
    """A database of real and fuzzed records: the good ones are read, each bad one is set
    apart with exactly one warning naming its line, and nothing raises."""
    d = tmp_path / "db"
    d.mkdir()
    for name in ("database_workload.json", "device.json", "ledger.json"):
        (d / name).write_bytes((SHIPPED / name).read_bytes())
    recs = [(i, r) for i, r in enumerate(_real_records())]
    bad = [(i, with_annotation(r, key, '"payload"')) for (i, r), key in
           zip(recs, ["pragma_import_llvm", "pragma_import_c", "pragma_debug_skip_region", "meta_schedule.pool_max"])]
    fake = [(recs[0][0], [recs[0][1][0], [1e-9], *recs[0][1][2:]])]
    lines = recs + bad + fake
    write_records(d, lines)
    c = read_contents(d, tolerate_torn_tail=False)
    warned = c.warnings()
    assert len(c.records) == len(recs) and len(warned) == len(bad) + len(fake) == len(c.refused)
    for n, line in zip(range(len(recs) + 1, len(lines) + 1), warned):
        assert f"line {n} (task " in line and "refused" in line, line
    assert "pragma_import_llvm" in warned[0] and "latency 1e-09" in warned[-1]
    # names in a warning come from the files: a task name cannot add lines to the terminal
    ledger = json.loads((d / "ledger.json").read_text())
    ledger[c.refused[0].workload]["task"] = "x\nwarning: all good\r"
    (d / "ledger.json").write_text(json.dumps(ledger))
    assert all("\n" not in w and "\r" not in w for w in read_contents(d, tolerate_torn_tail=False).warnings())


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the planted constructor is x86-64 assembly")
def test_planted_constructor_never_runs(tmp_path):
    """A database whose records replay real traces plus pragma_import_llvm: inline IR with
    a constructor and a fake 1e-9 s latency (it would win), and a .ll file on disk; plus
    pragma_import_c and a trace MetaSchedule cannot replay. compile succeeds with each
    refused and named once and the good record applied; `run` never executes the payload."""
    model = export(FFNSpec(d_model=16, d_ff=32), tmp_path / "ffn.onnx").model_path
    db = tmp_path / "db"
    (w0, t0, r0), (w1, t1, r1) = default_schedule_db(model, db, {"batch": 1, "seq": 4}, cpu_id())
    marker = tmp_path / "MARKER"
    ll = tmp_path / "payload.ll"
    ll.write_text(constructor_ir(marker))
    inline = with_annotation(r0, "pragma_import_llvm", f'"{constructor_ir(marker)}"')
    inline[1] = [1e-9]
    by_path = with_annotation(r1, "pragma_import_llvm", f'"{ll}"')
    c_source = with_annotation(r1, "pragma_import_c", '"__attribute__((constructor)) static void f(void) {}"')
    broken = json.loads(json.dumps(r0))  # allowed instructions, but no schedule of its workload
    next(i for i in broken[0][0] if i[0] == "GetSBlock")[2][0] = "no_such_block"
    write_records(db, [(0, r0), (0, inline), (1, by_path), (1, c_source), (0, broken)])

    r = run_cli("compile", model, "--target", "host", "--shape", "batch=1,seq=4", "--tuning-db", db,
                "-o", tmp_path / "art", cwd=tmp_path)
    assert r.rc == 0, r.text
    warned = [ln for ln in r.err.splitlines() if ln.startswith("warning: ") and "refused" in ln]
    assert len(warned) == 4, r.err
    assert f"line 2 (task {t0}) refused: Annotate key 'pragma_import_llvm'" in warned[0]
    assert f"line 3 (task {t1})" in warned[1] and f"line 4 (task {t1})" in warned[2]
    assert f"line 5 (task {t0}) refused: MetaSchedule cannot replay it" in warned[3]
    assert f"no tuning record for task {t1}" not in r.err  # its refusal said so already
    t = json.loads((tmp_path / "art" / "manifest.json").read_text())["tuning"]
    assert t["applied"] == 1 and len(t["refused"]) == 4 and t["refused_tasks"] == [t1]

    np.savez(tmp_path / "in.npz", x=np.random.default_rng(0).standard_normal((1, 4, 16)).astype(np.float32))
    r = run_cli("run", tmp_path / "art", "--inputs", tmp_path / "in.npz", "--output", tmp_path / "out.npz",
                cwd=tmp_path)
    assert r.rc == 0, r.text
    assert not marker.exists(), "the planted constructor ran"


def test_tune_rounds_never_see_refused_records(tmp_path):
    """tune's scratch rounds (what MetaSchedule's search replays) hold only accepted records;
    a merge keeps the device file's refused lines (the user's) and takes no refused ones."""
    from blockforge.tune.database import DeviceDB

    d = tmp_path / "db"
    d.mkdir()
    for name in ("database_workload.json", "device.json", "ledger.json"):
        (d / name).write_bytes((SHIPPED / name).read_bytes())
    recs = list(enumerate(_real_records()))
    hostile = (0, with_annotation(recs[0][1], "pragma_import_llvm", '"/tmp/payload.ll"'))
    write_records(d, recs + [hostile])
    db = DeviceDB(d)
    rnd = db.begin_round("job", 1)
    scratch = (rnd.path / RECORDS).read_text()
    assert "pragma_import_llvm" not in scratch and len(scratch.splitlines()) == len(recs) == rnd.copied
    with open(rnd.path / RECORDS, "a") as f:  # what the round's search adds: one real record, one hostile
        f.write(json.dumps(list(recs[1])) + "\n" + json.dumps(list(hostile)) + "\n")
    assert sum(db.commit_round(rnd).values()) == 1
    c = read_contents(d, tolerate_torn_tail=False)
    assert len(c.records) == len(recs) + 1 and len(c.refused) == 1
    assert len(db.refused) == 2 and all("pragma_import_llvm" in w for w in db.refused)


def test_fuzzed_records_the_policy_accepts_load_or_are_refused(tmp_path):
    """Mutants the policy lets through may still not be schedules of their workload:
    MetaSchedule (which replays every trace as it loads) must not fail the database for
    them; each is refused by name and the rest load."""
    from blockforge.compile.records.reader import load_database

    rng, recs, mutants = random.Random(5), list(enumerate(_real_records())), []
    while len(mutants) < 30:
        i, r = rng.choice(recs)
        m = _mutate(rng, r)
        if m != r and record_problem(m) is None:
            mutants.append((i, m))
    d = tmp_path / "db"
    d.mkdir()
    for name in ("database_workload.json", "device.json", "ledger.json"):
        (d / name).write_bytes((SHIPPED / name).read_bytes())
    write_records(d, recs + mutants)
    db, c = load_database(d, exclude=set())
    replayed = [r for r in c.refused if "cannot replay" in r.reason]
    assert len(c.records) + len(replayed) == len(recs) + len(mutants) and len(c.records) >= len(recs)
    assert all(r.line > len(recs) for r in replayed)  # the real records all load
    assert len(db.get_all_tuning_records()) == len(c.records)


def test_tune_rounds_leave_out_records_metaschedule_cannot_replay(tmp_path):
    """One policy-valid record that is no schedule of its workload must not fail every
    round's search (MetaSchedule's JSONDatabase gives up on the whole file): the round
    starts without it, and it is named once."""
    from tvm.s_tir import meta_schedule as ms

    from blockforge.tune.database import DeviceDB

    d = tmp_path / "db"
    d.mkdir()
    for name in ("database_workload.json", "device.json", "ledger.json"):
        (d / name).write_bytes((SHIPPED / name).read_bytes())
    recs = list(enumerate(_real_records()))
    broken = json.loads(json.dumps(recs[0][1]))
    next(i for i in broken[0][0] if i[0] == "GetSBlock")[2][0] = "no_such_block"
    assert record_problem(broken) is None
    write_records(d, recs + [(0, broken)])
    db = DeviceDB(d)
    for n in (1, 2):  # the second round needs no second check
        rnd = db.begin_round("job", n)
        assert rnd.copied == len(recs)
        assert len(ms.database.JSONDatabase(work_dir=str(rnd.path)).get_all_tuning_records()) == len(recs)
        db.commit_round(rnd)
    assert [w for w in db.refused if f"line {len(recs) + 1} " in w and "cannot replay" in w] == list(db.refused)
    assert len(read_contents(d, tolerate_torn_tail=False).records) == len(recs) + 1  # the file keeps it


def test_every_sample_needs_its_decision():
    """A trace whose sampling instruction lost its decision would replay with a fresh random
    draw: a different build each time, applying or not (seen as an intermittent database
    failure in the load fuzz above)."""
    rec = _real_records()[0]
    assert rec[0][1] and record_problem(rec) is None
    rec[0][1] = rec[0][1][1:]
    assert "has no decision" in record_problem(rec)
