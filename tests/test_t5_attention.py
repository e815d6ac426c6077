"""T5's attention as torch.export decomposes SDPA (the T5-base encoder of the whole-model
table): no 1/sqrt(d) scale, an additive relative-position bias with the mask folded in
(where(mask, bias, finfo.min), (B, H, S, S)), both products as (batch*heads) matmuls between
reshapes, and _safe_softmax's guard where(all(x == -inf), 0, softmax(x)). Before: no kernel
(the matcher saw a reshape where it wanted matmul(P, V), and the guard's second use of the
scores). After: one kernel call per layer, outputs as ONNX Runtime's, NaN/Inf included."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

tvm = pytest.importorskip("tvm")

from blockforge.compile import attention  # noqa: E402
from blockforge.compile.artifact.runtime import run_vm, tvm_device  # noqa: E402
from blockforge.compile.pipeline import run_phases  # noqa: E402
from blockforge.compile.session import open_model  # noqa: E402
from blockforge.graph import ort as ort_runner  # noqa: E402
from test_sdpa_attention import non_finite_diffs, save_model  # noqa: E402

T5 = Path(__file__).parent / "fixtures" / "whole_models" / "t5_base_encoder.onnx"
B, H, S, D = 2, 3, 16, 8


def _ops(mod) -> list[str]:
    return [getattr(b.value.op, "name", "") for blk in mod["main"].body.blocks for b in blk.bindings
            if hasattr(b.value, "op")]


def _calls(mod) -> int:
    kernels = {gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc) and attention.is_kernel(f)}
    return sum(1 for blk in mod["main"].body.blocks for b in blk.bindings
               if getattr(b.value, "op", None) is not None and getattr(b.value.op, "name", "") == "relax.call_tir"
               and b.value.args[0].name_hint in kernels)


def _vm(session):
    from tvm import relax

    dev = tvm_device("cpu")
    return relax.VirtualMachine(session.build().executable, dev), dev


def test_t5_encoder_fixture_fuses_every_layer_and_matches_ort():
    """The committed tiny T5 encoder (2 layers, 2 heads, d_kv 16), batch 2 (the bias
    broadcasts over it), the second sequence's last 3 tokens masked."""
    session = open_model(T5, "host", {"s33": 2, "s50": 8, "s6": 2})
    fused, _ = run_phases(session.relax(), session.target, stop_after="fuse-attention")
    specs = attention.kernel_specs(fused)
    assert len(specs) == 1 and _calls(fused) == 2, [s.describe() for s in specs]
    spec = specs[0]
    assert spec.inf_rows_zero and not spec.nan_rows_zero and spec.scale == 1.0 and spec.add is not None, spec.describe()
    assert (spec.heads, spec.d, spec.sq, spec.skv) == (2, 16, 8, 8)
    assert "relax.nn.softmax" not in _ops(fused)
    vm, dev = _vm(session)
    rng = np.random.default_rng(0)
    mask = np.ones((2, 8), np.int64)
    mask[1, 5:] = 0
    inputs = {"input_ids": rng.integers(0, 128, (2, 8)).astype(np.int64), "attention_mask": mask}
    ours = run_vm(vm, dev, session.inputs, session.outputs, inputs)
    ref = ort_runner.run(session.model, inputs)
    for name in ref:
        np.testing.assert_allclose(ours[name], ref[name], rtol=1e-4, atol=1e-5, err_msg=name)


def _safe_model(path, neg: float = -np.inf, shape: tuple = (B, H, S, D)):
    """The decomposed form over q, k, v (B, H, S, D) and bias (1, H, S, S); `neg`: the value
    the guard tests the scores against (-inf is _safe_softmax's). Also the kernel-level A/B at
    T5-base's shape (notes/vitt5.md): shape=(1, 12, 128, 64), then benchmarks/whole_ab.py."""
    B, H, S, D = shape
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    c = lambda a, n: numpy_helper.from_array(np.array(a), n)  # noqa: E731
    inits = [c([B * H, S, D], "s3"), c([B * H, D, S], "k3"), c([B, H, S, S], "p4"), c([B * H, S, S], "p3"),
             c([B, H, S, D], "o4"), c([-1], "last"), c(np.float32(neg), "neg"), c(np.float32(0), "zero"),
             c([B, H, S, S], "full")]
    nodes = [helper.make_node("Reshape", ["q", "s3"], ["q3"]),
             helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("Reshape", ["kt", "k3"], ["kt3"]),
             helper.make_node("MatMul", ["q3", "kt3"], ["s3x"]),
             helper.make_node("Reshape", ["s3x", "p4"], ["s4"]),
             helper.make_node("Add", ["s4", "bias"], ["x"]),
             helper.make_node("Softmax", ["x"], ["p"], axis=-1),
             helper.make_node("Equal", ["x", "neg"], ["eq"]),
             helper.make_node("Not", ["eq"], ["ne"]),
             helper.make_node("Cast", ["ne"], ["ne64"], to=i64),
             helper.make_node("ReduceMax", ["ne64", "last"], ["anyv"], keepdims=1),
             helper.make_node("Cast", ["anyv"], ["any"], to=TensorProto.BOOL),
             helper.make_node("Not", ["any"], ["dead"]),
             helper.make_node("Expand", ["zero", "full"], ["zeros"]),
             helper.make_node("Where", ["dead", "zeros", "p"], ["pg"]),
             helper.make_node("Reshape", ["pg", "p3"], ["pg3"]),
             helper.make_node("Reshape", ["v", "s3"], ["v3"]),
             helper.make_node("MatMul", ["pg3", "v3"], ["o3"]),
             helper.make_node("Reshape", ["o3", "o4"], ["output"])]
    ins = [helper.make_tensor_value_info(n, f32, [B, H, S, D]) for n in ("q", "k", "v")]
    ins.append(helper.make_tensor_value_info("bias", f32, [1, H, S, S]))
    return save_model(path, "t5_sdpa", nodes, ins, [B, H, S, D], inits)


def _inject(x: dict, what: str) -> dict:
    x = {k: v.copy() for k, v in x.items()}
    if what == "fully masked rows":  # every key -inf for 3 query rows of head 1: the guard's 0
        x["bias"][0, 1, 2:5, :] = -np.inf
    elif what == "nan query":  # a NaN score in a row: NaN, not 0 (where isnan(p)'s guard would give 0)
        x["q"][1, 0, 3, 5] = np.nan
    elif what == "inf key":  # +inf scores: softmax NaN on their rows
        x["k"][0, 2, 7, 1] = np.inf
    elif what == "-inf bias entries":
        x["bias"][0, 0, :, 4] = -np.inf
    elif what == "nan bias":
        x["bias"][0, 2, 6, 9] = np.nan
    return x


def test_safe_softmax_form_fuses_and_matches_ort_non_finite(tmp_path):
    """Fully masked rows give 0; a NaN or +inf score gives NaN, exactly where ORT has them."""
    session = open_model(_safe_model(tmp_path / "m.onnx"), "host", {})
    fused, _ = run_phases(session.relax(), session.target, stop_after="fuse-attention")
    specs = attention.kernel_specs(fused)
    assert len(specs) == 1 and specs[0].inf_rows_zero and not specs[0].nan_rows_zero, [s.describe() for s in specs]
    vm, dev = _vm(session)
    rng = np.random.default_rng(1)
    base = {n: rng.standard_normal((B, H, S, D)).astype(np.float32) for n in ("q", "k", "v")}
    base["bias"] = rng.standard_normal((1, H, S, S)).astype(np.float32)
    bad = []
    for what in ("none", "fully masked rows", "nan query", "inf key", "-inf bias entries", "nan bias"):
        inputs = _inject(base, what)
        ours = run_vm(vm, dev, session.inputs, session.outputs, inputs)["output"].astype(np.float64)
        ref = ort_runner.run(session.model, inputs)["output"].astype(np.float64)
        if what not in ("none", "-inf bias entries"):
            assert not np.isfinite(ref).all() or (ref == 0).any(), f"{what}: the case must reach the output"
        bad += non_finite_diffs(what, ours, ref)
    assert not bad, bad


def test_guard_on_another_value_is_not_taken(tmp_path):
    """where(all(x == +inf), 0, softmax(x)) is not _safe_softmax: left as the graph has it."""
    session = open_model(_safe_model(tmp_path / "m.onnx", neg=np.inf), "host", {})
    fused, _ = run_phases(session.relax(), session.target, stop_after="fuse-attention")
    assert attention.kernel_specs(fused) == [] and "relax.nn.softmax" in _ops(fused)


def test_spec_text_without_the_guard_is_unchanged():
    """A spec's JSON is its tuning workload's identity: the new field is written only when
    set, so tuning records of existing specs still match."""
    spec = attention.AttentionSpec(dtype="float32", q="bhsd", k="bhds", v="bhsd", o="bhsd", heads=2, d=8, dv=8, scale=1.0)
    assert "inf_rows_zero" not in spec.to_json()
    guarded = attention.AttentionSpec.from_json(spec.to_json().replace("}", ', "inf_rows_zero": true}'))
    assert guarded.inf_rows_zero and attention.AttentionSpec.from_json(guarded.to_json()) == guarded
