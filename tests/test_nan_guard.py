"""SDPA's NaN guard on a softmax, where(isnan(p), c, p), rewritten to where(p >= 0, p, c)
(compile/passes/nan_guard.py): the same values, a fully masked row (NaN) included, into float32 and
through an 8-bit quantize; only a softmax's guard is taken; the nan-guard ablation leaves it."""

from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from tvm import relax  # noqa: E402

from blockforge.compile.passes.nan_guard import nan_guard_pass  # noqa: E402


def _guarded(out_dtype: str, source: str = "softmax", fill: float = 0.0):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([2, 3, 64], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            p = bb.emit(relax.op.nn.softmax(x, axis=-1) if source == "softmax" else relax.op.exp(x))
            g = bb.emit(relax.op.where(relax.op.isnan(p), relax.const(fill, "float32"), p))
            if out_dtype == "uint8":
                g = bb.emit(relax.op.quantize(g, relax.const(1 / 255, "float32"), relax.const(0, "uint8"),
                                              out_dtype="uint8"))
            y = bb.emit_output(g)
        bb.emit_func_output(y)
    return bb.get()


def _run(mod, x):
    from blockforge.compile.pipeline import build
    from blockforge.targets import resolve

    return relax.VirtualMachine(build(mod, resolve("host")).executable, tvm.cpu())["main"](
        tvm.runtime.tensor(x)).numpy()


def test_a_softmax_guard_becomes_an_ordered_comparison():
    new = nan_guard_pass()(_guarded("float32"))
    text = new.script()
    assert "R.isnan" not in text and "R.greater_equal" in text, text
    # only a softmax's (its values are [0, 1] or NaN): exp's guard stays as written
    other = nan_guard_pass()(_guarded("float32", source="exp")).script()
    assert "R.isnan" in other and "R.greater_equal" not in other


@pytest.mark.parametrize("out_dtype, fill", [("float32", 0.0), ("uint8", 0.0), ("float32", -3.5)])
def test_values_are_the_guards_a_masked_row_included(out_dtype, fill):
    """Built through the pipeline (the optimize phase runs the pass) against numpy's guard: a row
    of -inf (softmax NaN) reads the fill, every other element the softmax (or its quantize)."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((2, 3, 64)) * 4).astype(np.float32)
    x[1, 2, :] = -np.inf  # fully masked
    x[0, 1, :5] = -np.inf  # partly masked: zeros, not NaN
    got = _run(_guarded(out_dtype, fill=fill), x)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    with np.errstate(invalid="ignore"):
        p = e / e.sum(axis=-1, keepdims=True)
    want = np.where(np.isnan(p), np.float32(fill), p).astype(np.float32)
    if out_dtype == "uint8":
        want = np.clip(np.round(want * np.float32(255)), 0, 255).astype(np.uint8)
        assert np.abs(got.astype(int) - want.astype(int)).max() <= 1  # (fast_exp vs numpy's exp)
        assert (got[1, 2] == 0).all()
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert (got[1, 2] == np.float32(fill)).all() and (got[0, 1, :5] == 0).all()
