"""`verify` reports relative error only where it means something: over elements where
rtol * |expected| >= atol. Near-zero expected values are judged by atol alone and do not
blow the relative column up; the err/allowed column is what decides pass or fail."""

from __future__ import annotations

import json

import numpy as np
import pytest

from blockforge.graph.tolerance import Tolerance, compare

from conftest import run_cli_in_process

TOL = Tolerance(rtol=1e-4, atol=1e-5)  # float32 op row: relative error counts from |expected| >= 0.1


def test_near_zero_elements_do_not_set_the_relative_error():
    expected = np.array([1e-7, 1e-3, 0.05, 0.5, 2.0])
    err = np.array([5e-6, 1e-6, 1e-6, 1e-5, 2e-5])  # the first three: tiny against atol, huge against |e|
    c = compare("a vs b", "y", expected + err, expected, TOL)
    assert c.passed
    assert c.count == 5 and c.rel_count == 2  # 0.5 and 2.0
    assert c.max_rel == pytest.approx(2e-5)  # 1e-5 / 0.5, not 5e-6 / 1e-7 = 50
    assert c.max_abs == pytest.approx(2e-5)
    allowed = TOL.atol + TOL.rtol * np.abs(expected)
    assert c.tol_used == pytest.approx((err / allowed).max())
    assert c.tol_used < 1 and c.rel_floor == pytest.approx(0.1)


def test_all_near_zero_has_no_relative_error():
    expected = np.full((3, 4), 1e-6)
    c = compare("a vs b", "y", expected + 2e-6, expected, TOL)
    assert c.passed and c.max_rel is None and c.rel_count == 0 and c.count == 12


def test_failure_is_still_a_failure():
    """Leaving small values out of the relative column does not loosen the check."""
    expected = np.array([1e-6, 1.0])
    c = compare("a vs b", "y", expected + np.array([3e-5, 0.0]), expected, TOL)  # 3e-5 > atol on a near-zero
    assert not c.passed and c.tol_used > 1 and c.max_rel == 0.0
    c = compare("a vs b", "y", np.array([1e-6, 1.001]), expected, TOL)  # 1e-3 relative where rtol governs
    assert not c.passed and c.max_rel == pytest.approx(1e-3) and c.tol_used == pytest.approx(1e-3 / 1.1e-4)


def test_deep_float_models_are_judged_against_their_range():
    """A foreign float32 model's row allows 1e-5 of max|expected| on top of rtol + atol: ResNet-50's
    output (max 285, rms 50) differs from ORT's by up to 6.1e-4 in blockforge and 5.3e-4 in
    OpenVINO, both beyond rtol + atol on elements near 1. A wrong value stays a failure."""
    from blockforge.graph.tolerance import output_tolerance

    tol = output_tolerance("float32", None)
    assert tol.step == 1e-5
    rng = np.random.default_rng(0)
    want = np.concatenate([[285.0, 1.0], rng.standard_normal(1000) * 50]).astype(np.float32)
    got = want.copy()
    got[1] += 6.1e-4  # 3.05x rtol + atol on this element, 0.2x with the range allowance
    assert not compare("tvm vs ort", "y", got, want, Tolerance(rtol=1e-4, atol=1e-4)).passed
    assert compare("tvm vs ort", "y", got, want, tol).passed
    got[1] += 0.05  # a wrong value
    assert not compare("tvm vs ort", "y", got, want, tol).passed


def test_zero_atol_and_exact_zero():
    c = compare("a vs b", "y", np.zeros(4), np.zeros(4), Tolerance(rtol=1e-4, atol=0.0))
    assert c.passed and c.tol_used == 0.0 and c.max_rel is None  # 0 / 0 is no error, and no relative one


def test_verify_table_says_where_relative_error_counts(tmp_path):
    r = run_cli_in_process("export", "ffn", "--d-model", 64, "-o", tmp_path / "f.onnx", cwd=tmp_path)
    assert r.rc == 0, r.text
    r = run_cli_in_process("verify", tmp_path / "f.onnx", "--shape", "batch=1,seq=8", "--json", tmp_path / "rep.json",
                           cwd=tmp_path)
    assert r.rc == 0, r.text
    header = r.out.splitlines()[0]
    assert "max rel err (|expected| >= atol/rtol)" in header and "err/allowed" in header, r.out
    assert "relative error is left out" in r.out
    (c,) = json.loads((tmp_path / "rep.json").read_text())["comparisons"]
    assert c["count"] == 8 * 64 and 0 < c["rel_count"] <= c["count"]
    assert c["max_rel"] <= 2 * c["rtol"]  # where rtol governs, a pass keeps it within (atol + rtol|e|) / |e|
    row = next(ln for ln in r.out.splitlines() if ln.startswith("| ort vs oracle"))
    if c["rel_count"] < c["count"]:
        assert f"(n={c['rel_count']}/{c['count']})" in row, row


# int8 parity judged again against ONNX Runtime's own spread (tolerance.within_spread)
INT8 = Tolerance(rtol=1e-4, atol=1e-5, step=4 / 255)


def _flip(expected, where, by):
    out = expected.copy()
    out[where] += by
    return out


def test_within_spread_passes_what_is_no_farther_than_ort_from_itself():
    from blockforge.graph.tolerance import within_spread

    e = np.linspace(-1.0, 1.0, 101)
    row = INT8.step * 1.0  # the row's allowance (max|e| = 1) is about 0.0157
    tvm, written = _flip(e, 10, 1.9 * row), _flip(e, 50, -2.0 * row)  # ORT's runs part by 2.0x the row
    c = compare("tvm vs ort", "y", tvm, e, INT8)
    assert not c.passed and c.tol_used == pytest.approx(1.9, rel=1e-2)  # (the row has atol and rtol too)
    again = within_spread(c, tvm, e, written)
    assert again.passed and "within ONNX Runtime's own spread" in again.note and "1.89x" in again.note
    assert again.tol_used == c.tol_used  # the row's figure is kept
    # farther than ORT's own spread: still a failure, and the note says both figures
    far = _flip(e, 10, 2.5 * row)
    c = compare("tvm vs ort", "y", far, e, INT8)
    assert not within_spread(c, far, e, written).passed
    assert "beyond ONNX Runtime's own spread" in within_spread(c, far, e, written).note


def test_within_spread_is_capped_and_leaves_other_rows_alone():
    from blockforge.graph.tolerance import SPREAD_CAP, within_spread

    e = np.linspace(-1.0, 1.0, 101)
    row = INT8.step
    broken = _flip(e, 3, 50 * row)  # one of ORT's runs broken, not rounded
    tvm = _flip(e, 10, (SPREAD_CAP + 1) * row)
    c = compare("tvm vs ort", "y", tvm, e, INT8)
    again = within_spread(c, tvm, e, broken)
    assert not again.passed and "capped" in again.note
    ok = _flip(e, 10, (SPREAD_CAP - 0.5) * row)
    assert within_spread(compare("tvm vs ort", "y", ok, e, INT8), ok, e, broken).passed
    # a passed row, a float row (no steps), a shape mismatch: unchanged
    fine = compare("tvm vs ort", "y", e, e, INT8)
    assert within_spread(fine, e, e, broken) is fine
    f32 = compare("tvm vs ort", "y", tvm, e, TOL)
    assert within_spread(f32, tvm, e, _flip(e, 10, 1.0)) is f32
    assert within_spread(c, tvm, e, e[:50]) is c
    # non-finite values in ORT's runs: no spread to speak of
    nan = e.copy()
    nan[0] = np.nan
    assert within_spread(c, tvm, e, nan) is c


def test_parity_runs_ort_as_written_only_for_a_failed_int8_row():
    """graph/parity._judge_by_spread: ORT's as-written run is asked for once, only when a
    quantized model's TVM-vs-ORT elementwise row fails; a passed one never pays for it."""
    from blockforge.graph.parity import ParityReport, _judge_by_spread
    from blockforge.graph.tolerance import OrtSpread

    e = np.linspace(-1.0, 1.0, 101)
    calls = []

    def as_written():
        calls.append(1)
        return {"y": _flip(e, 50, -2.0 * INT8.step)}

    def report(tvm):
        from dataclasses import replace

        return ParityReport(comparisons=[replace(compare("tvm vs ort", "y", tvm, e, INT8), precision="int8")])

    good = report(e)
    _judge_by_spread({"tvm": {"y": e}, "ort": {"y": e}}, good, OrtSpread(as_written))
    assert not calls and good.passed
    tvm = _flip(e, 10, 1.9 * INT8.step)
    bad = report(tvm)
    assert not bad.passed
    spread = OrtSpread(as_written)
    _judge_by_spread({"tvm": {"y": tvm}, "ort": {"y": e}}, bad, spread)
    assert calls == [1] and bad.passed and any("within_spread" in n for n in bad.notes)
    again = report(tvm)
    _judge_by_spread({"tvm": {"y": tvm}, "ort": {"y": e}}, again, spread)
    assert calls == [1] and again.passed  # the holder's run is made once, then reused


def test_bench_times_an_int8_contender_within_ort_spread_and_says_so():
    """bench's check (harness._check) on a quantized model: blockforge beyond the int8 row but
    within ORT's own spread is timed with a note; beyond it, refused."""
    from types import SimpleNamespace

    from blockforge.bench.harness import Reference, _check
    from blockforge.graph.tolerance import OrtSpread

    e = np.linspace(-1.0, 1.0, 101).astype(np.float32)
    ref = Reference(expected={"y": e}, source={"y": "ONNX Runtime"},
                    spread=OrtSpread(lambda: {"y": _flip(e, 50, -2.0 * INT8.step)}))
    sigs = [SimpleNamespace(name="y")]
    near = SimpleNamespace(outputs=lambda: [_flip(e, 10, 1.9 * INT8.step)])
    far = SimpleNamespace(outputs=lambda: [_flip(e, 10, 3.0 * INT8.step)])
    assert _check("untuned", near, ref, sigs, "mha", precision="int8") is None
    assert ref.notes and "within ONNX Runtime's own spread" in ref.notes[0]
    why = _check("untuned", far, ref, sigs, "mha", precision="int8")
    assert why and "not timed" in why and "beyond ONNX Runtime's own spread" in why


def test_ort_as_written_runs_in_the_bounded_child_too(tmp_path, monkeypatch):
    """compile/isolate.run_ort(optimize=False): ORT's graph optimizations off, in the child
    (--as-written) as in-process; a float model gives the same numbers both ways."""
    import onnx

    from blockforge.compile.isolate import run_ort
    from blockforge.graph import ort as ort_runner
    from blockforge.graph.builders import build
    from blockforge.graph.model_io import random_inputs, signature
    from blockforge.graph.spec import FFNSpec

    model, _ = build(FFNSpec(d_model=16, d_ff=32))
    path = tmp_path / "ffn.onnx"
    onnx.save(model, str(path))
    inputs = random_inputs(signature(model)[0], {"batch": 1, "seq": 5}, 0)
    fast = ort_runner.run(model, inputs)["output"]
    sess = ort_runner.session(model, optimize=False)
    import onnxruntime as ort

    assert sess.get_session_options().graph_optimization_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    for isolate in ("0", "1"):
        monkeypatch.setenv("BLOCKFORGE_ISOLATE", isolate)
        written = run_ort(path, model, inputs, optimize=False)["output"]
        np.testing.assert_allclose(written, fast, rtol=1e-5, atol=1e-6)
