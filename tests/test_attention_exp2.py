"""The fused attention kernel's softmax exps as 2^t of t = (s - m) log2 e (flash.fast_exp2: a
rounding, a degree-5 polynomial of 2^f and the exponent bits), where flash.fast_exp's
Cody-Waite reduction and degree-7 tail took 3 more multiplies/FMAs a vector. Measured on
Whisper-base's attention (S = 1500, 8 heads, d 64, (b, s, h, d) q/v/out), one thread CPU time:
benchmarks/attention_qtile.py --ab-exp2 (numbers in compile/attention/flash.py, kernel())."""

from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
from tvm import te, tirx  # noqa: E402

from blockforge.compile import attention  # noqa: E402
from blockforge.compile.attention.flash import EXP2_POLY, LOG2E, fast_exp2  # noqa: E402
from blockforge.targets import resolve  # noqa: E402
from test_attention_fusion import LANES, TARGET, _innermost_loops, _padding, _reference, _spec, pipeline_kernel_script  # noqa: E402

RUN_TARGET = resolve("host").tvm_target()


def _exp2(a: np.ndarray) -> np.ndarray:
    x = te.placeholder((tirx.const(a.size, "int64"),), "float32", name="x")
    y = te.compute(x.shape, lambda i: fast_exp2(x[i]), name="y")
    lib = tvm.compile(tvm.IRModule({"main": te.create_prim_func([x, y])}), target=RUN_TARGET)
    out = tvm.runtime.tensor(np.zeros(a.shape, np.float32))
    lib["main"](tvm.runtime.tensor(a), out)
    return out.numpy()


def test_fast_exp2_matches_numpy():
    a = np.concatenate([np.linspace(-126, 0, 2000, dtype=np.float32),
                        np.array([-np.inf, -127.0, -126.6, -200.0, -0.5, 0.5 - 1e-7, 0.0], np.float32)])
    got = _exp2(a)
    want = np.exp2(a.astype(np.float64))
    np.testing.assert_allclose(got[:2000], want[:2000], rtol=4e-7, atol=0)
    assert (got[2000:2004] == 0).all(), "-inf and below 2^-126.5: exactly 0 (a masked score adds nothing)"
    np.testing.assert_allclose(got[2004:], want[2004:], rtol=4e-7)


def test_fast_exp2_keeps_nan():
    a = np.full(16, np.nan, np.float32)
    a[::2] = -1.0
    got = _exp2(a)
    assert np.isnan(got[1::2]).all() and np.allclose(got[::2], 0.5), got


def _exp_loops(text: str) -> list[str]:
    return _innermost_loops(text, "T.floor(")  # both exps round with floor(. + 1/2)


@pytest.mark.parametrize("causal", [False, True])
def test_kernel_softmax_exps_are_exp2(causal):
    """The scores' and alpha's exps: fast_exp2 of (s - m) * log2 e, vectorised (EXP2_POLY's
    top coefficient and log2 e in the kernel, not fast_exp's ln 2 reduction); exp2=False
    (ablation attention-exp2): fast_exp, as before."""
    spec = _spec(sq=1500, skv=1500, heads=8, d=64, dv=64, scale=1.0, causal=causal, fill=0.0 if causal else None)
    new = attention.kernel(spec, (64, 4 * LANES), LANES).script()
    old = attention.kernel(spec, (64, 4 * LANES), LANES, exp2=False).script()
    top, log2e, ln2 = (repr(np.float32(v).item())[:8] for v in (EXP2_POLY[-1], LOG2E, 0.693147180559945))
    assert top in new and log2e in new and ln2 not in new
    assert top not in old and ln2 in old
    for text in (new, old):
        loops = _exp_loops(text)
        assert len(loops) >= 2 and all("T.vectorized" in h for h in loops), loops


@pytest.mark.parametrize("kw", [dict(), dict(causal=True, fill=0.0), dict(keep=("b", "1", "1", "k"), fill=-1e4),
                                dict(add=("b", "1", "1", "k")), dict(keep=("b", "1", "1", "k"), fill=-np.inf, nan_rows_zero=True)])
def test_kernel_exp2_matches_exp(kw):
    """exp2 and fast_exp kernels agree with numpy and with each other on ragged tiles, masks,
    causal rows and fully masked rows (the padding mask's batch 1)."""
    spec = _spec(sq=150, skv=197, **kw)
    b, h, d = 2, spec.heads, spec.d
    rng = np.random.default_rng(1)
    q = rng.standard_normal((b, h, 150, d)).astype("float32") * 3  # wide scores: exps far from 1
    k = rng.standard_normal((b, h, 197, d)).astype("float32")
    v = rng.standard_normal((b, h, 197, d)).astype("float32")
    kt = np.ascontiguousarray(k.transpose(0, 1, 3, 2))
    lay = lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3))  # noqa: E731
    add = rng.standard_normal((b, 1, 1, 197)).astype("float32") if spec.add else None
    keep = _padding(rng, (b, 1, 1, 197)) if spec.keep else None
    args = [lay(q), kt, lay(v)] + [x for x in (add, keep) if x is not None]
    outs = []
    for exp2 in (True, False):
        lib = tvm.compile(tvm.IRModule({"main": attention.kernel(spec, (64, 4 * LANES), LANES, exp2=exp2)}),
                          target=TARGET)
        out = tvm.runtime.tensor(np.zeros((b, 150, h, d), "float32"))
        lib["main"](*[tvm.runtime.tensor(x) for x in args], out)
        outs.append(out.numpy().transpose(0, 2, 1, 3))
    want = _reference(q, kt, v, spec, add, keep)
    if spec.nan_rows_zero:  # SDPA's guard: a row with every key masked comes out 0, not NaN
        want = np.nan_to_num(want, nan=0.0)
    for got in outs:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)


def test_pipeline_ablation_reaches_the_kernel():
    """`--without attention-exp2` (benchmarks/whole_ab.py --ab) builds the fast_exp kernel."""
    top = repr(np.float32(EXP2_POLY[-1]).item())[:8]
    found = {}
    for without in (set(), {"attention-exp2"}):
        found[bool(without)] = top in pipeline_kernel_script(100, 32, without)
    assert found == {False: True, True: False}, found
