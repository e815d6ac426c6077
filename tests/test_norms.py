"""RMSNorm as exporters spell it, rewritten to one rms_norm row kernel (compile/passes/norms.py)
that CPURowReduction schedules (issue #20: Llama-style GQA's 25 norms were a `square` kernel and
an unscheduled keepdims-mean kernel each)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
from tvm import relax, s_tir  # noqa: E402

from blockforge.compile.passes.norms import rms_norm_pass  # noqa: E402
from blockforge.compile.pipeline import build, run_phases  # noqa: E402
from blockforge.compile.schedule.reduction import CPURowReduction  # noqa: E402
from blockforge.targets import resolve  # noqa: E402
from conftest import relax_op_names as _ops  # noqa: E402

HOST = resolve("host")
AVX512 = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "skylake-avx512", "num-cores": 2})
FIXTURES = Path(__file__).parent / "fixtures" / "models"
H = 48


TEXT = {"input_ids": (2, 9), "attention_mask": (2, 9)}  # odd seq: no dim a multiple of the vector width


def _legalized_calls(path: Path, ablation: str, monkeypatch) -> dict:
    """The call_tir kernels of main after legalize, with and without `ablation` (in process)."""
    from blockforge.compile import open_model

    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    session = open_model(path, "host", TEXT)
    out = {}
    for without in (frozenset(), frozenset({ablation})):
        mod, _ = run_phases(session.relax(), session.target, stop_after="legalize", without=without)
        out[without] = _calls(mod)
    return out


def _calls(mod) -> list[str]:
    return [b.value.args[0].name_hint for blk in mod["main"].body.blocks for b in blk.bindings
            if getattr(getattr(b.value, "op", None), "name", None) == "relax.call_tir"]


def _rms_module(square: str, inverse: str, weight: str | None, axis: int = -1):
    """x * inverse(mean(square(x)) + eps) [* w] in the spellings exporters use."""
    rng = np.random.default_rng(0)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 5, H), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            sq = bb.emit(relax.op.power(x, relax.const(2.0, "float32")) if square == "power"
                         else relax.op.multiply(x, x))
            m = bb.emit(relax.op.mean(sq, axis=[axis], keepdims=True))
            a = bb.emit(relax.op.add(m, relax.const(1e-6, "float32")))
            inv = bb.emit(relax.op.rsqrt(a) if inverse == "rsqrt"
                          else relax.op.divide(relax.const(1.0, "float32"), relax.op.sqrt(a)))
            y = bb.emit(relax.op.multiply(x, inv))
            if weight is not None:
                w = relax.const(rng.standard_normal(H).astype("float32"))
                y = bb.emit(relax.op.multiply(w, y) if weight == "left" else relax.op.multiply(y, w))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def _run(mod, without=frozenset()) -> np.ndarray:
    x = np.random.default_rng(1).standard_normal((2, 5, H)).astype("float32")
    vm = relax.VirtualMachine(build(mod, HOST, without=without).executable, tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy()


@pytest.mark.parametrize("square, inverse, weight", [("power", "sqrt", None), ("power", "sqrt", "right"),
                                                     ("multiply", "rsqrt", "left"), ("power", "rsqrt", "right")])
def test_spellings_become_one_rms_norm_with_the_same_numbers(square, inverse, weight):
    mod = _rms_module(square, inverse, weight)
    ops = _ops(rms_norm_pass()(mod))
    assert ops == ["relax.nn.rms_norm"], ops
    np.testing.assert_allclose(_run(mod), _run(mod, without={"rms-norm"}), rtol=1e-5, atol=1e-5)


def test_a_mean_over_another_axis_is_left_alone():
    ops = _ops(rms_norm_pass()(_rms_module("power", "sqrt", "right", axis=1)))
    assert "relax.nn.rms_norm" not in ops and "relax.mean" in ops, ops


def test_row_reduction_schedules_the_legalized_rms_norm():
    """rms_norm's legalization casts x, its 1-D weight and the result (float32 -> float32):
    the weight's copy has no row axis, which made CPURowReduction refuse the kernel (serial)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 128, 768), "float32"))
    with bb.function("main", [x]):
        y = bb.emit(relax.op.nn.rms_norm(x, relax.const(np.ones(768, "float32")), axes=[-1], epsilon=1e-6))
        bb.emit_func_output(y)
    func = relax.transform.LegalizeOps()(bb.get())["rms_norm"]
    with AVX512:
        sch = CPURowReduction().apply(func, AVX512, False)
    assert sch is not None, "CPURowReduction did not apply"
    text = sch.mod["main"].script()
    assert text.count("T.parallel(") == 1 and text.count("T.vectorized(T.int64(16))") >= 3, text
    assert "T_cast" not in [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root", "main"))]


def test_llama_export_norms_are_one_kernel_each_and_match_ort(monkeypatch):
    """The SDPA Llama fixture (2 layers: 5 RMSNorms): one rms_norm call each after legalize,
    no square kernel, every kernel scheduled; outputs vs ONNX Runtime."""
    from blockforge.compile import VerifyOptions, verify

    path = FIXTURES / "llama_sdpa_dynamo_op18.onnx"
    counts = {w: (sum(c.startswith("rms_norm") for c in calls), sum(c == "square" for c in calls))
              for w, calls in _legalized_calls(path, "rms-norm", monkeypatch).items()}
    assert counts[frozenset()] == (5, 0), counts
    assert counts[frozenset({"rms-norm"})] == (0, 5), counts
    report = verify(VerifyOptions(model=path, target="host", shape=TEXT, use_tuning=False))
    assert report.passed, [c for c in report.comparisons if not c.passed]


def _swiglu_module(n: int = 64):
    """Llama's SwiGLU after the gate/up projections were combined: split, silu(gate) * up."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 5, 2 * n), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            t = bb.emit(relax.op.split(x, [n], axis=2))
            g, u = bb.emit(relax.TupleGetItem(t, 0)), bb.emit(relax.TupleGetItem(t, 1))
            out = bb.emit_output(bb.emit(relax.op.multiply(relax.op.multiply(g, relax.op.sigmoid(g)), u)))
        bb.emit_func_output(out)
    return bb.get()


def test_sigmoid_is_a_polynomial_kernel_with_numpy_numbers_at_the_extremes():
    """fast_math's sigmoid: fast_exp's polynomial instead of TIR's sigmoid (a libm expf per
    element, which kept Llama-style GQA's SwiGLU kernel scalar: 10.7% of its kernel time)."""
    mod = _swiglu_module()
    texts = {}
    for without in (frozenset(), frozenset({"fast-sigmoid"})):
        sched, _ = run_phases(mod, HOST, stop_after="schedule", without=without)
        texts[without] = "\n".join(f.script() for gv, f in sched.functions_items() if gv.name_hint != "main")
    assert "T.sigmoid" not in texts[frozenset()] and "T.exp" not in texts[frozenset()], texts[frozenset()]
    assert "T.sigmoid" in texts[frozenset({"fast-sigmoid"})]
    x = np.random.default_rng(2).standard_normal((2, 5, 128)).astype("float32") * 8
    x[0, 0, :8] = [-np.inf, np.inf, -1e4, 1e4, -100, 100, 0, -0.0]
    g, u = x[..., :64], x[..., 64:]
    with np.errstate(over="ignore", invalid="ignore"):
        want = g / (1 + np.exp(-g.astype(np.float64))) * u
    want[0, 0, 1] = np.inf * u[0, 0, 1]  # inf * sigmoid(inf) = inf * 1 (inf / inf above); [0] is -inf * 0
    vm = relax.VirtualMachine(build(mod, HOST).executable, tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_allclose(got[0, 0, 1:], want[0, 0, 1:], rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(got[1:], want[1:], rtol=2e-6, atol=1e-6)


def _linear_module(twice_used: bool = False):
    """A dynamo-style Linear: reshape to 2-D, matmul, reshape back, bias, relu, residual."""
    rng = np.random.default_rng(3)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 6, 2, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            a = bb.emit(relax.op.reshape(x, [6, 16]))
            y = bb.emit(relax.op.matmul(a, relax.const(rng.standard_normal((16, 16)).astype("float32"))))
            z = bb.emit(relax.op.reshape(y, [1, 6, 16]))
            z = bb.emit(relax.op.nn.relu(relax.op.add(z, relax.const(rng.standard_normal(16).astype("float32")))))
            z = bb.emit(relax.op.add(z, relax.op.reshape(x, [1, 6, 16])))
            if twice_used:
                z = bb.emit(relax.op.add(z, relax.op.reshape(relax.op.sum(y, axis=[1]), [1, 6, 1])))
            out = bb.emit_output(z)
        bb.emit_func_output(out)
    return bb.get()


def test_matmul_between_reshapes_takes_its_epilogue_with_the_same_numbers():
    mod = _linear_module()
    fused = {}
    for without in (frozenset(), frozenset({"matmul-reshape"})):
        leg, _ = run_phases(mod, HOST, stop_after="legalize", without=without)
        fused[without] = _calls(leg)
    assert [c for c in fused[frozenset()] if "matmul" in c] == ["fused_matmul_add_relu_add1"], fused
    assert not any("add" in c and "matmul" not in c for c in fused[frozenset()]), fused
    assert any("add" in c and "matmul" not in c for c in fused[frozenset({"matmul-reshape"})]), fused
    x = np.random.default_rng(4).standard_normal((1, 6, 2, 8)).astype("float32")
    outs = [relax.VirtualMachine(build(mod, HOST, without=w).executable, tvm.cpu())["main"](
        tvm.runtime.tensor(x)).numpy() for w in (frozenset(), frozenset({"matmul-reshape"}))]
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_a_matmul_read_elsewhere_too_is_left_alone():
    """Rewritten, its 2-D result would be computed twice (once for the other reader)."""
    from blockforge.compile.passes.matmul_reshape import matmul_reshape_pass

    ops = _ops(matmul_reshape_pass()(_linear_module(twice_used=True)))
    assert ops.count("relax.matmul") == 1 and ops.count("relax.reshape") >= 2, ops


def test_gpt2_dynamo_export_gelu_and_residuals_fuse_into_the_gemms_and_match_ort(monkeypatch):
    """GPT-2 (2 layers) exported by dynamo: every MLP's tanh-gelu chain in its up projection's
    epilogue and both residual adds of a layer in GEMM epilogues (before: 2 gelu and 4
    reshape + add kernels alone); outputs vs ONNX Runtime."""
    from blockforge.compile import VerifyOptions, verify

    path = FIXTURES / "gpt2_dynamo_op18.onnx"
    calls = _legalized_calls(path, "matmul-reshape", monkeypatch)
    new, old = calls[frozenset()], calls[frozenset({"matmul-reshape"})]
    lone = lambda cs, op: [c for c in cs if op in c and "matmul" not in c]  # noqa: E731
    assert len([c for c in new if c.startswith("fused_matmul") and "tanh" in c]) == 2, new
    assert len([c for c in new if c.startswith("fused_matmul") and "add" in c]) >= 4, new
    assert lone(new, "tanh") == [], new
    assert not any(c.startswith("fused_reshape") and "add" in c for c in new), new
    assert len(lone(old, "tanh")) == 2 and sum(c.startswith("fused_reshape") and "add" in c for c in old) >= 4, old
    report = verify(VerifyOptions(model=path, target="host", shape=TEXT, use_tuning=False))
    assert report.passed, [c for c in report.comparisons if not c.passed]


def test_rms_norm_with_symbolic_rows_is_scheduled_and_right():
    """Decoders' norms have symbolic rows (past + seq): the unchecked schedule those get starts
    from the function again, and must drop rms_norm's copies again (before: the copies of x and
    of the result stayed, two more passes over the tensor)."""
    bb = relax.BlockBuilder()
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((1, n, H), "float32"))
    w = np.random.default_rng(5).standard_normal(H).astype("float32")
    with bb.function("main", [x]):
        y = bb.emit(relax.op.nn.rms_norm(x, relax.const(w), axes=[-1], epsilon=1e-6))
        bb.emit_func_output(y)
    mod = bb.get()
    func = relax.transform.LegalizeOps()(mod)["rms_norm"]
    with AVX512:
        sch = CPURowReduction().apply(func, AVX512, False)
    assert sch is not None and "T.parallel(" in sch.mod["main"].script()
    names = [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root", "main"))]
    assert not any(b.startswith("T_cast") for b in names), names
    xs = np.random.default_rng(6).standard_normal((1, 7, H)).astype("float32")
    got = relax.VirtualMachine(build(mod, HOST).executable, tvm.cpu())["main"](tvm.runtime.tensor(xs)).numpy()
    want = xs / np.sqrt((xs.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
