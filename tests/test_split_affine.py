"""A combined projection's per-part bias add and scalar scale folded into it (compile/passes/
split_affine.py): Whisper's q/v biases and the query's d**-0.5 after the split moved into the
weights and one bias, so qkv_heads takes the split; near misses left as written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
from tvm import relax  # noqa: E402

from blockforge.compile.passes.split_affine import split_affine_pass  # noqa: E402
from blockforge.compile.pipeline import build, run_phases  # noqa: E402
from blockforge.targets import resolve  # noqa: E402
from conftest import relax_op_names as _ops  # noqa: E402

HOST = resolve("host")
WHISPER = Path(__file__).parent / "fixtures" / "whole_models" / "whisper_base_encoder.onnx"
B, S, K, N = 2, 5, 16, 8  # three parts of N columns
RNG = np.random.default_rng(0)
W = RNG.standard_normal((K, 3 * N)).astype("float32")
BQ, BV = (RNG.standard_normal(N).astype("float32") for _ in range(2))


def _module(scale: float = 0.125, bias_shape=(N,), extra_use: bool = False, x_escapes: bool = False,
            const_bias: bool = True):
    """h @ W -> split in 3 -> (q + bq) * scale, k, v + bv (Whisper's encoder attention inputs).
    extra_use: q's part also read as it is; x_escapes: the projection also returned; const_bias
    False: bq a function parameter."""
    h = relax.Var("h", relax.TensorType((B, S, K), "float32"))
    params = [h]
    bq = relax.const(BQ.reshape(bias_shape))
    if not const_bias:
        bq = relax.Var("bq", relax.TensorType((N,), "float32"))
        params.append(bq)
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            x = bb.emit(relax.op.matmul(h, relax.const(W)))
            parts = bb.emit(relax.op.split(x, [N, 2 * N], axis=2))
            q0 = bb.emit(relax.TupleGetItem(parts, 0))
            q = bb.emit(relax.op.multiply(bb.emit(relax.op.add(q0, bq)), relax.const(scale, "float32")))
            k = bb.emit(relax.TupleGetItem(parts, 1))
            v = bb.emit(relax.op.add(bb.emit(relax.TupleGetItem(parts, 2)), relax.const(BV)))
            outs = [q, k, v] + ([q0] if extra_use else []) + ([x] if x_escapes else [])
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    return bb.get()


def _run(mod, h, without=frozenset(), *extra) -> list[np.ndarray]:
    vm = relax.VirtualMachine(build(mod, HOST, without=without).executable, tvm.cpu())
    return [t.numpy() for t in vm["main"](tvm.runtime.tensor(h), *[tvm.runtime.tensor(e) for e in extra])]


def _h() -> np.ndarray:
    return RNG.standard_normal((B, S, K)).astype("float32")


def test_bias_and_scale_move_into_the_projection():
    new = split_affine_pass()(_module())
    ops = _ops(new)
    assert ops.count("relax.add") == 1 and "relax.multiply" not in ops, ops  # one bias, after the matmul
    assert ops.index("relax.add") < ops.index("relax.split"), ops
    h = _h()
    x = h @ W
    want = [(x[..., :N] + BQ) * np.float32(0.125), x[..., N:2 * N], x[..., 2 * N:] + BV]
    got = _run(_module(), h)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    # a power-of-two scale: the folded build gives what the unfolded one gives, bit for bit
    for g, u in zip(got, _run(_module(), h, {"split-affine"})):
        np.testing.assert_array_equal(g, u)


def test_any_scalar_scale_within_one_rounding():
    h = _h()
    got, unfolded = _run(_module(scale=0.1), h), _run(_module(scale=0.1), h, {"split-affine"})
    for g, u in zip(got, unfolded):
        np.testing.assert_allclose(g, u, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", [dict(extra_use=True), dict(x_escapes=True), dict(bias_shape=(1, 1, 1, N)),
                                  dict(const_bias=False), dict(scale=0.0)])
def test_near_misses_keep_their_chain(case):
    """The part also read as it is (its own q chain stays; v's folds); the projection read by
    more than its split; a bias that broadcasts q to more dims; a bias computed at run time; a
    zero scale (NaN * 0 must stay NaN): each left as written where it would change a value."""
    mod = _module(**case)
    new = split_affine_pass()(mod)
    ops = _ops(new)
    if case.get("extra_use") or case.get("const_bias") is False or case.get("bias_shape") or "scale" in case:
        assert "relax.multiply" in ops, ops  # q's chain as written
    if case.get("x_escapes"):
        tvm.ir.assert_structural_equal(new, mod)
    h = _h()
    extra = [BQ] if case.get("const_bias") is False else []
    for g, u in zip(_run(mod, h, frozenset(), *extra), _run(mod, h, {"split-affine"}, *extra)):
        np.testing.assert_allclose(g, u, rtol=1e-6, atol=1e-6)


def test_whisper_fixture_runs_one_qkv_kernel_per_layer():
    """The committed tiny Whisper encoder: after optimize, each layer's split and its parts'
    adds and scale are one qkv_heads kernel (before: a split, two elementwise kernels and a
    transpose per layer)."""
    from blockforge.compile.session import open_model

    session = open_model(WHISPER, "host", {"s33": 1})
    mod, _ = run_phases(session.relax(), session.target, stop_after="optimize")
    kernels = {gv.name_hint for gv, f in mod.functions_items()
               if getattr(f, "attrs", None) is not None and "blockforge.qkv_heads" in f.attrs}
    calls = [b.value.args[0].name_hint for blk in mod["main"].body.blocks for b in blk.bindings
             if getattr(getattr(b.value, "op", None), "name", "") == "relax.call_tir"]
    layers = json.loads(WHISPER.with_suffix(".json").read_text())["config"]["layers"]
    assert sum(c in kernels for c in calls) == layers and "relax.split" not in _ops(mod), calls
    off, _ = run_phases(session.relax(), session.target, stop_after="optimize", without={"split-affine"})
    assert "relax.split" in _ops(off)
