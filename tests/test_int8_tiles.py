"""The int8 GEMM's tile space (compile/quant/gemm.py tile_candidates, compile/quant/tiles.py
records, tune/gemm_tiles.py search): every candidate fits the registers and is exact int32
against numpy, its IR on a fixed target, the choice round-trips through a tuning database
(untrusted: only candidates are taken), and tune's A/B keeps the default unless a candidate
beats it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from blockforge.compile.quant import gemm, tiles  # noqa: E402
from test_int8_gemm import ZNVER4, _need_vnni_host, quantized_ffn  # noqa: E402,F401  (fixture)


# The untuned tile of the quantized_ffn fixture's two kernels (d_model 64, d_ff 128: N = 128 and
# 64, 2 panels of 16 columns divide both, so 7 rows: accumulators under gemm.STACK_BYTES).
DEFAULT = "7x32 tiles"


def test_candidates_fit_the_registers_and_the_spec():
    static, symbolic = gemm.Int8GemmSpec(k=64, n=96, m=40), gemm.Int8GemmSpec(k=64, n=96)
    for spec in (static, symbolic):
        cands = gemm.tile_candidates(spec)
        assert cands[0] == gemm.default_tiles(spec) and len(set(cands)) == len(cands)
        assert all(t.mr * t.nv + t.nv + 1 <= gemm.ZMM and (spec.n // 16) % t.nv == 0 for t in cands)
    assert {t.split for t in gemm.tile_candidates(symbolic)} == {"panels"}  # the guarded tail needs it
    assert {t.split for t in gemm.tile_candidates(static)} == set(gemm.SPLITS)
    with pytest.raises(ValueError, match="tiles"):
        gemm.GemmTiles(8, 4)  # 32 accumulators + 4 weights + 1 broadcast: more than 32 zmm
    with pytest.raises(ValueError, match="do not fit"):
        gemm.kernel(gemm.Int8GemmSpec(k=64, n=64, m=8), gemm.GemmTiles(4, 3))  # 3 vectors do not divide N
    with pytest.raises(ValueError, match="do not fit"):
        gemm.kernel(symbolic, gemm.GemmTiles(6, 2, "tiles"))


def test_default_tiles_are_the_untuned_kernel_and_others_change_the_tile():
    spec = gemm.Int8GemmSpec(k=256, n=96, m=128, scale="scalar", bias=True)
    tvm.ir.assert_structural_equal(gemm.kernel(spec), gemm.kernel(spec, gemm.default_tiles(spec)))
    f = gemm.kernel(spec, gemm.GemmTiles(8, 3, "panels"))
    text = f.script()
    assert str(f.attrs[gemm.TILES_ATTR]) == "8x48 panels"
    assert "T.unroll(T.int64(8))" in text and "T.unroll(T.int64(3))" in text and text.count("vpdpbusd.512") == 1
    assert "T.where" not in text, "128 rows are whole 8-row tiles: no guarded tail"
    assert "T.where" in gemm.kernel(spec).script(), "128 rows in 6-row tiles: a guarded tail"
    lib = tvm.compile(tvm.IRModule({"main": f}), target=ZNVER4)  # cross: no VNNI needed here
    assert "vpdpbusd" in lib.mod.inspect_source("asm")


def test_every_candidate_is_exact_int32():
    _need_vnni_host()
    from blockforge.targets import resolve

    rng = np.random.default_rng(3)
    w = rng.integers(-128, 128, (64, 96), dtype=np.int8)
    w[:, 0] = -128
    packed = [gemm.pack_weights(w), gemm.column_sums(w), np.array(131, np.int32)]
    for spec, rows in ((gemm.Int8GemmSpec(k=64, n=96, m=40), (40,)), (gemm.Int8GemmSpec(k=64, n=96), (1, 13))):
        for t in gemm.tile_candidates(spec):
            lib = tvm.compile(tvm.IRModule({"main": gemm.kernel(spec, t)}), target=resolve("host").tvm_target())
            for m in rows:
                a = rng.integers(0, 256, (m, 64), dtype=np.uint8)
                a[0] = 255
                out = tvm.runtime.tensor(np.zeros((m, 96), np.int32))
                lib["main"](*[tvm.runtime.tensor(x) for x in (a, *packed)], out)
                np.testing.assert_array_equal(out.numpy(), gemm.reference(spec, a, w, 131),
                                              err_msg=f"{t.describe()} M={m}")


def round_trip(tiles_module, spec, other_spec, odd, target, tmp_path):
    """A tile module's choices through a MetaSchedule database: the fastest record of the spec's
    workload wins, another spec's workload has none, and a record of `odd` (valid registers, not
    a candidate; recorded fastest) picks nothing: returns (the database, its candidates)."""
    from tvm.s_tir import meta_schedule as ms

    cands = tiles_module.tile_candidates(spec)
    assert odd not in cands
    db = ms.database.JSONDatabase(work_dir=str(tmp_path))
    wl = db.commit_workload(tiles_module.workload(spec))
    for t, secs in ((cands[0], 3e-5), (cands[3], 1e-5), (cands[-1], 2e-5)):
        trace = tiles_module.tile_trace(spec, t)
        assert tiles_module.tiles_from_trace(trace) == t
        db.commit_tuning_record(ms.database.TuningRecord(trace, wl, [secs], target, None))
    reread = ms.database.JSONDatabase(work_dir=str(tmp_path))
    assert tiles_module.tile_record(reread, spec, target) == cands[3], "the fastest record wins"
    assert tiles_module.tile_record(reread, other_spec, target) is None, "another workload"
    db.commit_tuning_record(ms.database.TuningRecord(tiles_module.tile_trace(spec, odd, [odd, *cands]), wl, [1e-6],
                                                     target, None))
    assert tiles_module.tile_record(db, spec, target) is None
    return reread, cands


def test_tile_choice_round_trips_and_the_database_picks_only_candidates(tmp_path):
    _, cands = round_trip(tiles, gemm.Int8GemmSpec(k=64, n=96, m=40), gemm.Int8GemmSpec(k=64, n=96, m=41),
                          gemm.GemmTiles(2, 8), ZNVER4, tmp_path)
    # codes no GemmTiles can be (too many registers, an unknown split, negative) decode to nothing
    assert [gemm.GemmTiles.from_code(c) for c in (840, 643, -1, 10**9)] == [None] * 4
    assert gemm.GemmTiles.from_code(cands[3].code()) == cands[3]


def _tune(tmp_path, quantized_ffn, monkeypatch, fake_secs=None):
    """tune_gemm_tiles on the tiny FFN's two kernels, two candidates each; fake_secs: tiles ->
    seconds the runner reports (the A/B's outcome fixed), else real timings."""
    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    from blockforge.compile.pipeline import run_phases
    from blockforge.compile.session import open_model
    from blockforge.tune import gemm_tiles, kernel_timing
    from blockforge.tune.database import DeviceDB
    from blockforge.tune.jobs import TuneOptions, make_builder, make_runner

    s = open_model(quantized_ffn, "host", {"batch": 1, "seq": 16})
    mod, _ = run_phases(s.relax(), s.target, stop_after="int8-gemm")
    if fake_secs is not None:
        fake = lambda art, func, *a: [fake_secs[str(func.attrs[gemm.TILES_ATTR])]]  # noqa: E731
        monkeypatch.setattr(gemm_tiles, "run_kernel", fake)  # the A/B
        monkeypatch.setattr(kernel_timing, "run_kernel", fake)  # the first timings
    db = DeviceDB(tmp_path / "db", s.target, create=True, cpu="cpu-a")
    two = lambda spec: [gemm.default_tiles(spec), gemm.GemmTiles(4, 4, "panels")]  # noqa: E731
    builder, runner = make_builder(s.target, str(tmp_path)), make_runner(TuneOptions(model=Path("m.onnx")), s.target, 0)
    lines = []
    kinds = gemm_tiles.int8_kernels()
    assert gemm_tiles.tune_gemm_tiles(kinds, mod, db, s.target, builder, runner, s.dims, "t", "cpu-a", lines.append,
                                      candidates=two) == 2
    assert gemm_tiles.tune_gemm_tiles(kinds, mod, db, s.target, builder, runner, s.dims, "t", "cpu-a",
                                      candidates=two) == 0, "timed by an earlier job: reused"
    return s, db, lines


def _applied_tiles(session, db_path, cpu):
    from blockforge.compile.pipeline import run_phases
    from blockforge.compile.records.reader import load_database

    ms_db, _ = load_database(db_path, cpu=cpu)
    mod, _ = run_phases(session.relax(), session.target, database=ms_db, stop_after="int8-gemm")
    return sorted(str(f.attrs[gemm.TILES_ATTR]) for _, f in mod.functions_items()
                  if isinstance(f, tvm.tirx.PrimFunc) and gemm.is_kernel(f))


@pytest.mark.parametrize("ratio, challenger_wins", [(0.5, True), (2.0, False), (0.99, False)])
def test_tune_ab_keeps_the_default_unless_a_candidate_beats_it(tmp_path, quantized_ffn, monkeypatch, ratio,
                                                               challenger_wins):
    """The challenger at `ratio` x the default's time: it must win by the A/B margin (2%)."""
    _need_vnni_host()
    secs = {DEFAULT: 2e-5, "4x64 panels": 2e-5 * ratio}
    s, db, lines = _tune(tmp_path, quantized_ffn, monkeypatch, secs)
    entries = [e for e in db.ledger().values() if "int8_tiles" in e]
    assert len(entries) == 2 and all(set(e["int8_tiles"]) == set(secs) for e in entries)
    assert all(e["in_model"]["cpu-a"]["prefer_default"] is (not challenger_wins) for e in entries)
    assert len(lines) == 2
    want = ["4x64 panels" if challenger_wins else DEFAULT] * 2
    assert _applied_tiles(s, db.path, "cpu-a") == want
    # another CPU never judged these records: its builds keep the defaults
    assert _applied_tiles(s, db.path, "cpu-b") == [DEFAULT] * 2


def test_tune_times_real_candidates(tmp_path, quantized_ffn, monkeypatch):
    _need_vnni_host()
    s, db, _ = _tune(tmp_path, quantized_ffn, monkeypatch)
    entries = [e for e in db.ledger().values() if "int8_tiles" in e]
    assert len(entries) == 2 and all(len(e["int8_tiles"]) == 2 and all(v > 0 for v in e["int8_tiles"].values())
                                     for e in entries)
    # whatever won here, the build takes a candidate of each kernel, exactly as the verdict says
    got = _applied_tiles(s, db.path, "cpu-a")
    assert len(got) == 2 and set(got) <= {DEFAULT, "4x64 panels"}


def test_whole_model_ab_that_loses_keeps_the_default_tiles_too(tmp_path, quantized_ffn, monkeypatch):
    """tune's last A/B (all winning records together vs the untuned build) covers the int8
    tile records: when the tuned build loses, they are marked to keep the default as well."""
    _need_vnni_host()
    s, db, _ = _tune(tmp_path, quantized_ffn, monkeypatch, {DEFAULT: 2e-5, "4x64 panels": 1e-5})
    assert _applied_tiles(s, db.path, "cpu-a") == ["4x64 panels"] * 2
    summary = tuned_build_loses(monkeypatch, s, db)
    assert len(summary.kept_default) == 2 and all(n.startswith("int8_gemm (") for n in summary.kept_default)
    assert _applied_tiles(s, db.path, "cpu-a") == [DEFAULT] * 2


def tuned_build_loses(monkeypatch, session, db, cpu: str = "cpu-a"):
    """tune's last step (jobs._measure_model) on `cpu` with the whole-model A/B decided: the
    tuned build slower than the untuned one. Returns the summary."""
    from types import SimpleNamespace

    from blockforge.tune import jobs

    monkeypatch.setattr(jobs, "cpu_id", lambda: cpu)
    monkeypatch.setattr(jobs, "measure_latency_ms", lambda *a, **k: 1.0)
    monkeypatch.setattr(jobs, "validate_in_model", lambda *a, **k: [])
    monkeypatch.setattr(jobs, "_ab_ms", lambda *a, **k: ([1.0, 1.0, 1.0], [2.0, 2.0, 2.0]))  # tuned loses
    summary = SimpleNamespace()
    jobs._measure_model(SimpleNamespace(session=session, db=db, tasks=[], workloads=[]), summary, naive=False)
    return summary
