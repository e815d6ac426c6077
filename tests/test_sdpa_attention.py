"""The attention form torch's scaled_dot_product_attention exports (transformers' default):
sqrt(scale) on Q and on K^T, an additive mask, where(isnan(P), 0, P) zeroing NaN rows, and
grouped-query K/V repeated by Unsqueeze/Expand/Reshape. Fused, it must give ONNX Runtime's
NaN/Inf pattern; a form left unfused says why in a log line."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

tvm = pytest.importorskip("tvm")

from blockforge.compile import attention  # noqa: E402
from blockforge.compile.frontend.importer import import_onnx  # noqa: E402
from blockforge.compile.pipeline import run_phases  # noqa: E402
from blockforge.compile.artifact.runtime import run_vm, tvm_device  # noqa: E402
from blockforge.compile.session import open_model  # noqa: E402
from blockforge.graph import ort as ort_runner  # noqa: E402
from blockforge.targets import resolve  # noqa: E402

B, H, S, D = 2, 4, 16, 8


def _sdpa_model(path, kv_heads: int, softmax_axis: int = -1):
    """SDPA's ONNX form over inputs q (B, H, S, D), k/v (B, kv_heads, S, D), mask (B, 1, 1, S)."""
    f32 = TensorProto.FLOAT
    g = H // kv_heads
    c = np.float32((1 / np.sqrt(D)) ** 0.5)
    inits = [numpy_helper.from_array(np.array(c, np.float32), "c"), numpy_helper.from_array(np.array(0, np.float32), "zero"),
             numpy_helper.from_array(np.array([2], np.int64), "ax2"),
             numpy_helper.from_array(np.array([B, kv_heads, g, S, D], np.int64), "rep5"),
             numpy_helper.from_array(np.array([B, H, S, D], np.int64), "rep4")]
    nodes = []
    for x in ("k", "v"):
        if g == 1:
            nodes.append(helper.make_node("Identity", [x], [x + "r"]))
            continue
        nodes += [helper.make_node("Unsqueeze", [x, "ax2"], [x + "u"]),
                  helper.make_node("Expand", [x + "u", "rep5"], [x + "e"]),
                  helper.make_node("Reshape", [x + "e", "rep4"], [x + "r"])]
    nodes += [helper.make_node("Transpose", ["kr"], ["kt"], perm=[0, 1, 3, 2]),
              helper.make_node("Mul", ["q", "c"], ["qs"]), helper.make_node("Mul", ["kt", "c"], ["ks"]),
              helper.make_node("MatMul", ["qs", "ks"], ["s"]), helper.make_node("Add", ["s", "mask"], ["sm"]),
              helper.make_node("Softmax", ["sm"], ["p"], axis=softmax_axis),
              helper.make_node("IsNaN", ["p"], ["isnan"]), helper.make_node("Where", ["isnan", "zero", "p"], ["p0"]),
              helper.make_node("MatMul", ["p0", "vr"], ["output"])]
    ins = [helper.make_tensor_value_info("q", f32, [B, H, S, D]),
           helper.make_tensor_value_info("k", f32, [B, kv_heads, S, D]),
           helper.make_tensor_value_info("v", f32, [B, kv_heads, S, D]),
           helper.make_tensor_value_info("mask", f32, [B, 1, 1, S])]
    return save_model(path, "sdpa", nodes, ins, [B, H, S, D], inits)


def save_model(path, name: str, nodes: list, ins: list, out_shape: list, inits: list):
    """An opset-18 graph with one float32 output "output" of out_shape, saved at path."""
    out = [helper.make_tensor_value_info("output", TensorProto.FLOAT, out_shape)]
    m = helper.make_model(helper.make_graph(nodes, name, ins, out, inits), opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    onnx.save(m, str(path))
    return path


def non_finite_diffs(what: str, ours: np.ndarray, ref: np.ndarray) -> list[str]:
    """Where TVM's NaN/+Inf/-Inf/zero pattern or finite values differ from ORT's, in words."""
    bad = []
    for label, test in (("NaN", np.isnan), ("+Inf", np.isposinf), ("-Inf", np.isneginf), ("zero", lambda a: a == 0)):
        if not np.array_equal(test(ours), test(ref)):
            bad.append(f"{what}: {label} TVM {int(test(ours).sum())}, ORT {int(test(ref).sum())}")
    fin = np.isfinite(ref) & np.isfinite(ours)
    if not np.allclose(ours[fin], ref[fin], rtol=1e-4, atol=1e-5):
        bad.append(f"{what}: max abs diff {np.abs(ours[fin] - ref[fin]).max():.3e}")
    return bad


def _inject(x: dict, what: str) -> dict:
    x = {k: v.copy() for k, v in x.items()}
    if what == "nan query":
        x["q"][0, 1, 3, 5] = np.nan
    elif what == "inf key":
        x["k"][0, 1, 7, 2] = np.inf
    elif what == "-inf key":
        x["k"][1, 0, 9, 0] = -np.inf
    elif what == "nan value":
        x["v"][1, 1, 4, 3] = np.nan
    elif what == "nan mask":
        x["mask"][0, 0, 0, 4] = np.nan
    elif what == "fully masked rows":  # batch 0: every key -inf, softmax NaN, SDPA's guard gives 0
        x["mask"][0] = -np.inf
    return x


@pytest.mark.parametrize("kv_heads", [H, 2])
def test_sdpa_form_fuses_and_matches_ort_non_finite(tmp_path, kv_heads):
    """Before: no kernel (the split scale and the isnan guard stopped the matcher). After: one
    call, reading the kv heads without the repeat (GQA), NaN/Inf exactly where ORT has them."""
    from tvm import relax

    session = open_model(_sdpa_model(tmp_path / "m.onnx", kv_heads), "host", {})
    fused, _ = run_phases(session.relax(), session.target, stop_after="fuse-attention")
    specs = attention.kernel_specs(fused)
    assert len(specs) == 1 and specs[0].nan_rows_zero, [s.describe() for s in specs]
    assert specs[0].kv_heads == (kv_heads if kv_heads != H else None)
    assert abs(specs[0].scale - 1 / np.sqrt(D)) < 1e-6
    ops = [getattr(b.value.op, "name", "") for blk in fused["main"].body.blocks for b in blk.bindings
           if hasattr(b.value, "op")]
    assert "relax.nn.softmax" not in ops and "relax.broadcast_to" not in ops, ops
    dev = tvm_device("cpu")
    vm = relax.VirtualMachine(session.build().executable, dev)
    rng = np.random.default_rng(0)
    base = {"q": rng.standard_normal((B, H, S, D)), "k": rng.standard_normal((B, kv_heads, S, D)),
            "v": rng.standard_normal((B, kv_heads, S, D)),
            "mask": np.where(rng.random((B, 1, 1, S)) < 0.8, 0.0, -np.inf)}
    base = {k: v.astype(np.float32) for k, v in base.items()}
    base["mask"][..., 0] = 0.0
    bad = []
    for what in ("none", "nan query", "inf key", "-inf key", "nan value", "nan mask", "fully masked rows"):
        inputs = _inject(base, what)
        ours = run_vm(vm, dev, session.inputs, session.outputs, inputs)["output"].astype(np.float64)
        ref = ort_runner.run(session.model, inputs)["output"].astype(np.float64)
        if what != "none":
            assert not np.isfinite(ref).all() or (ref == 0).any(), f"{what}: the case must reach the output"
        bad += non_finite_diffs(what, ours, ref)
    assert not bad, bad


def test_unfused_softmax_says_why(tmp_path, caplog):
    """A softmax the kernel cannot take (here over the query axis) stays, and a log line of
    the phase's logger says which and why."""
    target = resolve("host").tvm_target()
    mod = import_onnx(onnx.load(_sdpa_model(tmp_path / "m.onnx", H, softmax_axis=2)))
    with caplog.at_level(logging.INFO, logger="blockforge.attention"), target:
        fused = attention.fuse_attention(target)(mod)
    assert attention.kernel_specs(fused) == []
    lines = [r.getMessage() for r in caplog.records if r.name == "blockforge.attention"]
    assert any("attention not fused" in x and "softmax over axis 2" in x for x in lines), lines


def test_kernel_grouped_query_heads_against_numpy():
    """kv_heads: query head h reads key/value head h // (heads / kv_heads)."""
    from tvm.runtime import tensor

    from blockforge.compile.schedule.base import vector_lanes

    lanes = vector_lanes(resolve("host").tvm_target())
    spec = attention.AttentionSpec(dtype="float32", q="bhsd", k="bhds", v="bhsd", o="bhsd", heads=4, d=8, dv=8,
                                   scale=0.3, kv_heads=2)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 4, 37, 8)).astype(np.float32)
    k = rng.standard_normal((2, 2, 37, 8)).astype(np.float32)
    v = rng.standard_normal((2, 2, 37, 8)).astype(np.float32)
    lib = tvm.compile(tvm.IRModule({"main": attention.kernel(spec, None, lanes)}), target=resolve("host").tvm_target())
    out = tensor(np.zeros((2, 4, 37, 8), np.float32))
    lib["main"](tensor(q), tensor(np.ascontiguousarray(k.transpose(0, 1, 3, 2))), tensor(v), out)
    kr, vr = np.repeat(k, 2, axis=1).astype(np.float64), np.repeat(v, 2, axis=1).astype(np.float64)
    s = np.einsum("bhsd,bhkd->bhsk", q.astype(np.float64), kr) * 0.3
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bhsk,bhkd->bhsd", p / p.sum(-1, keepdims=True), vr)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-5)
