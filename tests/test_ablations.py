"""The pipeline's ablations (compile/pipeline.py ABLATIONS): each name leaves out exactly
its rewrite, so benchmarks A/B one inside a whole model through the public build()."""

from __future__ import annotations

import re

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
from tvm import relax  # noqa: E402
from tvm.script import relax as R  # noqa: E402
from tvm.script import tirx as T  # noqa: E402

from blockforge.compile.schedule.ragged import CPUMatmulRaggedN  # noqa: E402
from blockforge.compile.pipeline import build, default_rules, phases, run_phases  # noqa: E402
from blockforge.targets import resolve  # noqa: E402

HOST = resolve("host")


def test_unknown_ablation_is_refused():
    with pytest.raises(ValueError, match="unknown ablation"):
        phases(HOST, without={"fuse-attentoin"})


def test_readme_lists_every_ablation():
    """README's list of `pipeline.ABLATIONS` is how users find the A/B switches: it names each
    one and nothing else (two were missing before this test)."""
    from pathlib import Path

    from blockforge.compile.pipeline import ABLATIONS

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = text.index("(`pipeline.ABLATIONS`:")
    listed = set(re.findall(r"`([a-z0-9-]+)`", text[start:text.index(")", start)]))
    assert listed == set(ABLATIONS), (sorted(set(ABLATIONS) - listed), sorted(listed - set(ABLATIONS)))


def test_phase_ablations():
    assert "fuse-attention" in [p.name for p in phases(HOST)]
    assert "fuse-attention" not in [p.name for p in phases(HOST, without={"fuse-attention"})]
    fp16 = [p.name for p in phases(HOST, fp16=True, without={"fp32-compute"})]
    assert "fp32-compute" not in fp16 and "fp32-accumulate" in fp16, fp16


def test_ragged_n_rule_ablation():
    assert any(isinstance(r, CPUMatmulRaggedN) for r in default_rules(HOST))
    assert not any(isinstance(r, CPUMatmulRaggedN) for r in default_rules(HOST, frozenset({"ragged-n"})))


@tvm.script.ir_module
class Patch:
    @R.function
    def main(x: R.Tensor((1, 3, 32, 32), "float32"), w: R.Tensor((8, 3, 16, 16), "float32")):
        with R.dataflow():
            y = R.nn.conv2d(x, w, strides=16)
            R.output(y)
        return y


def test_patch_conv_ablation_keeps_the_conv_and_the_numbers():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 3, 16, 16)).astype("float32")
    x = rng.standard_normal((1, 3, 32, 32)).astype("float32")
    mod = relax.transform.BindParams("main", {"w": tvm.runtime.tensor(w)})(Patch)
    outs = {}
    for without in (set(), {"patch-conv"}):
        opt, _ = run_phases(mod, HOST, stop_after="optimize", without=without)
        assert ("conv2d" in opt.script()) == bool(without)
        vm = relax.VirtualMachine(build(mod, HOST, without=without).executable, tvm.cpu())
        outs[bool(without)] = vm["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_allclose(outs[True], outs[False], rtol=1e-4, atol=1e-4)



@tvm.script.ir_module
class Residual:
    @R.function
    def main(x: R.Tensor((1, "seq", 64), "float32"), r: R.Tensor((1, "seq", 64), "float32")):
        return R.add(x, r)


def test_elementwise_ablation_schedules_a_float_residual_add():
    """A lone float add over symbolic rows: parallel rows with CPUElementwise, TVM's serial
    loop without it (what float builds ran before); the same numbers at a row count that
    ends mid-vector nowhere and at one row."""
    rng = np.random.default_rng(1)
    for without in (set(), {"elementwise"}):
        sched, _ = run_phases(Residual, HOST, stop_after="schedule", without=without)
        kernel = next(f for gv, f in sched.functions_items() if isinstance(f, tvm.tirx.PrimFunc))
        assert ("T.parallel" in kernel.script()) != bool(without), kernel.script()
        vm = relax.VirtualMachine(build(Residual, HOST, without=without).executable, tvm.cpu())
        for seq in (1, 37):
            x, r = (rng.standard_normal((1, seq, 64)).astype("float32") for _ in range(2))
            got = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(r)).numpy()
            np.testing.assert_array_equal(got, x + r)


# fmt: off
@tvm.script.ir_module
class OpaqueThenReshape:
    @T.prim_func(s_tir=True)
    def double(a: T.Buffer((T.int64(8), T.int64(16)), "float32"), b: T.Buffer((T.int64(8), T.int64(16)), "float32")):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})  # opaque, as the int8 GEMM
        for i, j in T.grid(T.int64(8), T.int64(16)):
            with T.sblock("b"):
                vi, vj = T.axis.remap("SS", [i, j])
                b[vi, vj] = a[vi, vj] * T.float32(2)

    @R.function
    def main(x: R.Tensor((1, 8, 16), "float32")):
        cls = OpaqueThenReshape
        with R.dataflow():
            flat = R.reshape(x, (8, 16))
            y = R.call_tir(cls.double, (flat,), out_ty=R.Tensor((8, 16), "float32"))
            z = R.reshape(y, (1, 8, 16))
            R.output(z)
        return z

    @R.function
    def of_input(x: R.Tensor((1, 8, 16), "float32")):
        with R.dataflow():
            z = R.reshape(x, (8, 16))
            R.output(z)
        return z
# fmt: on


def _reshape_kernels(mod, func: str) -> int:
    text = mod[func].script()
    return sum(len(re.findall(rf"(?<![\w.]){gv.name_hint}\(", text)) for gv, f in mod.functions_items()
               if isinstance(f, tvm.tirx.PrimFunc) and "reshape" in gv.name_hint)


def test_output_views_make_the_output_reshape_of_a_kernel_a_view():
    """The reshape after an opaque kernel (the int8 GEMM's rows back to (B, S, N)) is a view with
    output-views, a copy kernel without; the same numbers; each call's output its own (the next
    call does not write the last one's); a reshape of the function's input stays a copy (a view
    would alias the caller's tensor)."""
    rng = np.random.default_rng(3)
    x1, x2 = (rng.standard_normal((1, 8, 16)).astype("float32") for _ in range(2))
    for without in (set(), {"output-views"}):
        low, _ = run_phases(OpaqueThenReshape, HOST, stop_after="lower", without=without)
        assert _reshape_kernels(low, "main") == (1 if without else 0), low["main"].script()
        assert _reshape_kernels(low, "of_input") == 1, low["of_input"].script()
        vm = relax.VirtualMachine(build(OpaqueThenReshape, HOST, without=without).executable, tvm.cpu())
        first = vm["main"](tvm.runtime.tensor(x1))
        second = vm["main"](tvm.runtime.tensor(x2))
        np.testing.assert_array_equal(first.numpy(), 2 * x1)
        np.testing.assert_array_equal(second.numpy(), 2 * x2)
        xin = tvm.runtime.tensor(x1)
        out = vm["of_input"](xin)
        xin.copyfrom(x2)
        np.testing.assert_array_equal(out.numpy(), x1.reshape(8, 16))


def _softmax_quantize(scale: float):
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([2, 7, 37], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            p = bb.emit(relax.op.nn.softmax(x, axis=-1))
            q = bb.emit(relax.op.quantize(p, relax.const(scale, "float32"), relax.const(3, "uint8"),
                                          out_dtype="uint8"))
            out = bb.emit_output(relax.Tuple([p, q]))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("scale", [1 / 255, 1e-40])  # a hostile file's subnormal scale keeps the division
def test_reciprocal_ablation_softmax_and_quantize(scale):
    """`reciprocal`: softmax normalised by 1 / its row sum (one division a row) and a quantize
    with a constant per-tensor scale as x times 1 / scale; without it, TVM's division per
    element. The softmax within 2 ulp of numpy's either way; the quantize is numpy's
    clip(round(x * r) + zp) with it, clip(round(x / s) + zp) without (exactly)."""
    from blockforge.compile.quant.gemm import reciprocal_scale

    mod = _softmax_quantize(scale)
    rng = np.random.default_rng(4)
    xv = (rng.standard_normal((2, 7, 37)) * 4).astype("float32")
    e = np.exp(xv.astype(np.float64) - xv.max(-1, keepdims=True))
    want_p = (e / e.sum(-1, keepdims=True)).astype(np.float32)
    for without in (set(), {"reciprocal"}):
        opt, _ = run_phases(mod, HOST, stop_after="optimize", without=without)
        quotient_form = reciprocal_scale(scale) is None or bool(without)
        assert ("R.multiply(" in opt["main"].script()) != quotient_form, opt["main"].script()
        softmax = next(f.script() for gv, f in opt.functions_items() if "softmax" in gv.name_hint)
        assert ("* (T.float32(1.0) / T_softmax_expsum" in softmax) != bool(without), softmax
        p, q = relax.VirtualMachine(build(mod, HOST, without=without).executable, tvm.cpu())["main"](
            tvm.runtime.tensor(xv))
        np.testing.assert_allclose(p.numpy(), want_p, rtol=2.5e-7 * 4, atol=1e-7)
        r = reciprocal_scale(scale)
        with np.errstate(over="ignore", invalid="ignore"):
            quotient = p.numpy() / np.float32(scale) if quotient_form else p.numpy() * r
        np.testing.assert_array_equal(q.numpy(), np.clip(np.round(quotient) + 3, 0, 255).astype(np.uint8))
