"""`tune --precision bf16`: the bf16 GEMM's tile space (compile/bf16/gemm.py tile_candidates,
compile/bf16/tiles.py records) and the bf16 attention kernel's (compile/attention/tiles.py,
bf16=True), searched by tune/gemm_tiles.py and tune/attention_tiles.py. Every candidate fits
the registers and computes the default's bits, its IR on a fixed target; a choice round-trips
through a tuning database (untrusted: only candidates are taken); the phases apply it; tune's
A/B keeps the default unless a candidate beats it; and tune's builder builds as compile does
(the stack pass: no workspace call per accumulator tile)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from blockforge.compile.bf16 import gemm, tiles  # noqa: E402
from blockforge.targets import resolve  # noqa: E402
from test_bf16_gemm import ZNVER4, _need_bf16_host  # noqa: E402

FFN_DEFAULT = "6x64 tiles"  # the untuned tile of the tiny FFN's kernels (16 rows: 6 x 4 vectors)


def test_candidates_fit_the_registers_and_the_spec():
    static, symbolic = gemm.Bf16GemmSpec(k=64, n=96, m=40), gemm.Bf16GemmSpec(k=64, n=96)
    for spec in (static, symbolic):
        cands = gemm.tile_candidates(spec)
        assert cands[0] == gemm.default_tiles(spec) and len(set(cands)) == len(cands) > 3
        assert all(t.mr * t.nv + t.nv + 1 <= 32 and (spec.np_ // 16) % t.nv == 0 for t in cands)
    assert {t.split for t in gemm.tile_candidates(symbolic)} == {"panels"}  # the guarded tail needs it
    assert {t.split for t in gemm.tile_candidates(static)} == {"tiles", "panels"}
    # N = 100 pads to 112 = 7 panels: only 1-vector tiles divide it
    assert {t.nv for t in gemm.tile_candidates(gemm.Bf16GemmSpec(k=64, n=100, m=8))} == {1}
    with pytest.raises(ValueError, match="do not fit"):
        gemm.kernel(gemm.Bf16GemmSpec(k=64, n=64, m=8), tiles=gemm.GemmTiles(4, 3))  # 3 vectors, 4 panels
    with pytest.raises(ValueError, match="do not fit"):
        gemm.kernel(symbolic, tiles=gemm.GemmTiles(6, 2, "tiles"))


def test_default_tiles_are_the_untuned_kernel_and_others_change_the_tile():
    spec = gemm.Bf16GemmSpec(k=768, n=96, m=128, bias=True, activation="gelu")
    tvm.ir.assert_structural_equal(gemm.kernel(spec, True), gemm.kernel(spec, True, gemm.default_tiles(spec)))
    assert str(gemm.kernel(spec).attrs[gemm.TILES_ATTR]) == "4x96 tiles"  # 128 rows: 4 x 6 (row_fit)

    def parallel(f):
        return [ln.strip().split(" in ")[0] for ln in f.script().splitlines() if "T.parallel" in ln]
    f = gemm.kernel(spec, True, gemm.GemmTiles(8, 3, "panels"))
    text = f.script()
    assert str(f.attrs[gemm.TILES_ATTR]) == "8x48 panels"
    assert "T.unroll(T.int64(8))" in text and "T.unroll(T.int64(3))" in text
    # the rounding pass's rows, then the 2 column panels (their 16 row tiles serial inside)
    assert parallel(f) == ["for i", "for j_0"] and "T.parallel(T.int64(2)" in text
    assert parallel(gemm.kernel(spec, True, gemm.GemmTiles(8, 3, "tiles"))) == ["for i", "for j_0_i_0_fused"]
    # below PARALLEL_MACS one thread either way
    small = gemm.Bf16GemmSpec(k=64, n=96, m=16)
    assert not parallel(gemm.kernel(small, tiles=gemm.GemmTiles(8, 3, "panels")))
    asm = tvm.compile(tvm.IRModule({"main": f}), target=tvm.target.Target(ZNVER4)).mod.inspect_source("asm")
    assert asm.count("vdpbf16ps") >= 8 * 3, "8 rows x 3 vectors per k pair, unrolled"


def test_every_candidate_computes_the_default_bits():
    """The tile changes which outputs a micro-kernel holds, not any output's sum order (k pairs
    in order into one float32 accumulator): every candidate is bit-equal to the default."""
    _need_bf16_host()
    rng = np.random.default_rng(5)
    k, n = 64, 96
    w = rng.standard_normal((k, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    host = resolve("host").tvm_target()
    for spec, rows in ((gemm.Bf16GemmSpec(k=k, n=n, m=40, bias=True, activation="gelu"), (40,)),
                       (gemm.Bf16GemmSpec(k=k, n=n, bias=True), (1, 13))):
        want = {}
        for t in gemm.tile_candidates(spec):
            lib = tvm.compile(tvm.IRModule({"main": gemm.kernel(spec, True, t)}), target=host)
            for m in rows:
                a = rng.standard_normal((m, k)).astype(np.float32) if m not in want else want[m][0]
                out = tvm.runtime.tensor(np.zeros((m, n), np.float32))
                lib["main"](*[tvm.runtime.tensor(x) for x in (a, gemm.pack_weights(w), bias)], out)
                if m not in want:
                    want[m] = (a, out.numpy())
                    if spec.activation == "none":
                        np.testing.assert_array_equal(want[m][1], gemm.reference(a, w, bias))
                np.testing.assert_array_equal(out.numpy(), want[m][1], err_msg=f"{t.describe()} M={m}")


def test_tile_choice_round_trips_and_the_database_picks_only_candidates(tmp_path):
    from test_int8_tiles import round_trip

    target = tvm.target.Target(ZNVER4)
    spec = gemm.Bf16GemmSpec(k=64, n=96, m=40, bias=True, activation="gelu")
    db, cands = round_trip(tiles, spec, gemm.Bf16GemmSpec(k=64, n=96, m=41, bias=True, activation="gelu"),
                           gemm.GemmTiles(2, 2), target, tmp_path)
    # the workload is the kernel the phase builds: without its gelu segments it is another one
    assert tiles.tile_record(db, spec, target, gelu_segments=False) is None


def _bf16_ffn(tmp_path):
    from blockforge.graph import FFNSpec, export

    return export(FFNSpec(d_model=64, d_ff=128, activation="gelu"), tmp_path / "ffn.onnx").model_path


def _applied(session, db_path, cpu):
    from blockforge.compile.pipeline import run_phases
    from blockforge.compile.records.reader import load_database

    ms_db, _ = load_database(db_path, cpu=cpu)
    mod, _ = run_phases(session.relax(), session.target, database=ms_db, stop_after="bf16-gemm", precision="bf16")
    return {gemm.Bf16GemmSpec(**json.loads(str(f.attrs[gemm.KERNEL_ATTR]))).describe():
            str(f.attrs[gemm.TILES_ATTR]) for _, f in mod.functions_items()
            if isinstance(f, tvm.tirx.PrimFunc) and gemm.is_kernel(f)}


def _tune(tmp_path, monkeypatch, fake_secs):
    """tune_gemm_tiles on the tiny bf16 FFN's two kernels, two candidates each, the runner's
    seconds fixed per tiles (the A/B's outcome decided)."""
    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    from blockforge.compile.pipeline import run_phases
    from blockforge.compile.session import open_model
    from blockforge.tune import gemm_tiles, kernel_timing
    from blockforge.tune.database import DeviceDB
    from blockforge.tune.jobs import TuneOptions, make_builder, make_runner

    s = open_model(_bf16_ffn(tmp_path), ZNVER4, {"batch": 1, "seq": 16}, precision="bf16")
    mod, _ = run_phases(s.relax(), s.target, stop_after="bf16-gemm", precision="bf16")
    fake = lambda art, func, *a: [fake_secs[str(func.attrs[gemm.TILES_ATTR])]]  # noqa: E731
    monkeypatch.setattr(gemm_tiles, "run_kernel", fake)  # the A/B
    monkeypatch.setattr(kernel_timing, "run_kernel", fake)  # the first timings
    monkeypatch.setattr(kernel_timing, "build_kernel", lambda func, *a: "built")  # znver4 need not run here
    db = DeviceDB(tmp_path / "db", s.target, create=True, cpu="cpu-a")
    two = lambda spec: [gemm.default_tiles(spec), gemm.GemmTiles(4, 4, "panels")]  # noqa: E731
    builder, runner = make_builder(s.target, str(tmp_path)), make_runner(TuneOptions(model=Path("m.onnx")), s.target, 0)
    kinds, lines = gemm_tiles.bf16_kernels(), []
    assert gemm_tiles.tune_gemm_tiles(kinds, mod, db, s.target, builder, runner, s.dims, "t", "cpu-a", lines.append,
                                      candidates=two) == 2
    assert gemm_tiles.tune_gemm_tiles(kinds, mod, db, s.target, builder, runner, s.dims, "t", "cpu-a",
                                      candidates=two) == 0, "timed by an earlier job: reused"
    return s, db, lines


@pytest.mark.parametrize("ratio, challenger_wins", [(0.5, True), (2.0, False), (0.99, False)])
def test_tune_ab_keeps_the_default_unless_a_candidate_beats_it(tmp_path, monkeypatch, ratio, challenger_wins):
    secs = {FFN_DEFAULT: 2e-5, "4x64 panels": 2e-5 * ratio}
    s, db, lines = _tune(tmp_path, monkeypatch, secs)
    entries = [e for e in db.ledger().values() if "bf16_tiles" in e]
    assert len(entries) == 2 and all(set(e["bf16_tiles"]) == set(secs) for e in entries)
    assert all(e["task"].startswith("bf16_gemm (") for e in entries)
    assert all(e["in_model"]["cpu-a"]["prefer_default"] is (not challenger_wins) for e in entries)
    assert len(lines) == 2 and all(line.startswith("bf16 GEMM ") for line in lines)
    assert sorted(_applied(s, db.path, "cpu-a").values()) == ["4x64 panels" if challenger_wins else FFN_DEFAULT] * 2
    # another CPU never judged these records: its builds keep the defaults
    assert sorted(_applied(s, db.path, "cpu-b").values()) == [FFN_DEFAULT] * 2


def test_tune_cli_times_real_bf16_tiles_and_compile_applies_them(tmp_path, monkeypatch):
    """`blockforge tune --precision bf16` on this CPU: the bf16 kernels' candidates timed and
    recorded, the summary says bf16, and the tuned build takes exactly what the verdicts say."""
    _need_bf16_host()
    from conftest import run_cli_in_process

    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    model, db = _bf16_ffn(tmp_path), tmp_path / "db"
    out = run_cli_in_process("tune", str(model), "--target", "host", "--precision", "bf16", "--shape",
                             "batch=1,seq=16", "--trials-per-task", "1", "--tuning-db", str(db), "--no-progress",
                             "--json", str(tmp_path / "s.json"))
    assert out.rc == 0, out.text
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["precision"] == "bf16"
    ledger = json.loads((db / "ledger.json").read_text())
    entries = {e["task"]: e for e in ledger.values() if "bf16_tiles" in e}
    # the FFN's two GEMMs (16 rows, 64 -> 128 +gelu, 128 -> 64), every candidate timed
    specs = {"16x64x128 +bias +gelu": gemm.Bf16GemmSpec(k=64, n=128, m=16, bias=True, activation="gelu"),
             "16x128x64 +bias": gemm.Bf16GemmSpec(k=128, n=64, m=16, bias=True)}
    assert sorted(entries) == sorted(f"bf16_gemm ({k})" for k in specs)
    for k, spec in specs.items():
        timed = entries[f"bf16_gemm ({k})"]["bf16_tiles"]
        assert set(timed) == {t.describe() for t in gemm.tile_candidates(spec)} and min(timed.values()) > 0
    from blockforge.compile.session import open_model
    from blockforge.targets.toolchain import cpu_id

    s = open_model(model, "host", {"batch": 1, "seq": 16}, precision="bf16")
    got = _applied(s, db, cpu_id())
    assert sorted(got) == sorted(specs)
    for k, tiles_ in got.items():
        e = entries[f"bf16_gemm ({k})"]
        if e["in_model"][cpu_id()]["prefer_default"]:
            assert tiles_ == FFN_DEFAULT
        else:  # the fastest when first timed (the ledger's times are rounded to 0.1 us: ties)
            assert tiles_ != FFN_DEFAULT and e["bf16_tiles"][tiles_] == min(e["bf16_tiles"].values())


# ---------------------------------------------------------------- the bf16 attention kernel

def test_bf16_attention_candidates_and_records(tmp_path):
    from tvm.s_tir import meta_schedule as ms

    from blockforge.compile.attention import flash, tiles as atiles
    from blockforge.compile.attention.flash import AttentionSpec

    assert flash.bf16_tile_candidates(16, 512)[0] == (128, 128)
    assert flash.bf16_tile_candidates(16, 100) == ((128, 64), (64, 64), (256, 64)), "key tiles Skv holds"
    assert flash.bf16_tile_candidates(16, 31) == (), "no bf16 key tile: the float32 kernel's"
    assert all(kt % 32 == 0 for _, kt in flash.bf16_tile_candidates(16)), "whole 32-key blocks (bf16_pairs)"
    target = tvm.target.Target(ZNVER4)
    spec = AttentionSpec(dtype="float32", q="bhsd", k="bhds", v="bhsd", o="bhsd", heads=2, d=64, dv=64, scale=0.125,
                         batch=1, sq=256, skv=256)
    # the bf16 kernel is its own workload: a float32 record does not pick its tiles, nor the reverse
    with pytest.raises(ValueError):
        tvm.ir.assert_structural_equal(atiles.workload(spec, 16, True), atiles.workload(spec, 16))
    cands = atiles.candidates(spec, 16, bf16=True)
    db = ms.database.JSONDatabase(work_dir=str(tmp_path))
    wl = db.commit_workload(atiles.workload(spec, 16, bf16=True))
    for t, secs in ((cands[0], 3e-5), (cands[2], 1e-5)):
        db.commit_tuning_record(ms.database.TuningRecord(atiles.tile_trace(spec, 16, t, bf16=True), wl, [secs],
                                                         target, None))
    assert atiles.tile_record(db, spec, target, bf16=True) == cands[2]
    assert atiles.tile_record(db, spec, target) is None
    odd = (32, 32)
    db.commit_tuning_record(ms.database.TuningRecord(atiles.tile_trace(spec, 16, odd, [odd, *cands], bf16=True), wl,
                                                     [1e-7], target, None))
    assert atiles.tile_record(db, spec, target, bf16=True) is None, "only candidates"


def test_fuse_attention_at_bf16_takes_the_bf16_record(tmp_path):
    from tvm import tirx
    from tvm.s_tir import meta_schedule as ms

    from blockforge.compile import attention, open_model
    from blockforge.compile.attention import tiles as atiles
    from blockforge.compile.pipeline import run_phases
    from blockforge.graph import MHASpec, export

    model = export(MHASpec(d_model=128, heads=2), tmp_path / "mha.onnx").model_path
    s = open_model(model, ZNVER4, {"batch": 1, "seq": 256}, precision="bf16")

    def fused(database=None):
        mod, _ = run_phases(s.relax(), s.target, database=database, stop_after="fuse-attention", precision="bf16")
        return [(f, str(f.attrs[attention.KERNEL_ATTR + ".tiles"])) for _, f in mod.functions_items()
                if isinstance(f, tirx.PrimFunc) and attention.is_kernel(f)]

    ((f, untuned),) = fused()
    assert untuned == "128x128"
    spec = attention.AttentionSpec.from_json(str(f.attrs[attention.KERNEL_ATTR]))
    target = tvm.target.Target(ZNVER4)
    (tmp_path / "db").mkdir()
    db = ms.database.JSONDatabase(work_dir=str(tmp_path / "db"))
    wl = db.commit_workload(atiles.workload(spec, 16, bf16=True))
    db.commit_tuning_record(ms.database.TuningRecord(atiles.tile_trace(spec, 16, (256, 64), bf16=True), wl, [1e-5],
                                                     target, None))
    assert [t for _, t in fused(db)] == ["256x64"]


def test_tune_builder_builds_as_compile_does(tmp_path):
    """A candidate is built with the stack pass (compile/passes/stack_allocs.py): the bf16
    kernel's 4 x 96 float32 accumulator tile (1.5 KiB) is a stack slot, not a workspace
    allocated and freed per output tile, as TVM's own pipeline builds it."""
    from tvm.driver import build as tvm_build

    from blockforge.tune.measure import build_cpu

    mod = tvm.IRModule({"main": gemm.kernel(gemm.Bf16GemmSpec(k=256, n=96, m=128, bias=True))})
    target = tvm.target.Target(ZNVER4)
    ours = build_cpu(mod, target, None).inspect_source("ll")
    tvms = tvm_build(mod, target=target).inspect_source("ll")
    assert ours.count("TVMBackendAllocWorkspace") == 0 < tvms.count("TVMBackendAllocWorkspace")


def test_tune_refuses_bf16_on_a_target_without_it(tmp_path):
    """One error line, before anything is tuned or written (the database is not created)."""
    from conftest import assert_user_error, run_cli_in_process

    res = run_cli_in_process("tune", str(_bf16_ffn(tmp_path)), "--target", "x86-64-avx512", "--precision", "bf16",
                             "--tuning-db", str(tmp_path / "db"), "--no-progress")
    assert_user_error(res, "needs a CPU target with AVX512_BF16")
    assert not (tmp_path / "db").exists()
