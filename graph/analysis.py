"""Static facts about a model: op histogram, parameter count, MatMul/Gemm/Conv/attention FLOPs."""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper, shape_inference

from .model_io import DEFAULT_DIMS, TensorSig, bind_dims, signature


@dataclass(frozen=True)
class ModelFacts:
    ops: dict[str, int]
    params: int
    param_bytes: int
    flops: int  # 2 per multiply-add of MatMul/Gemm/Conv/attention at `dims`
    dims: dict[str, int]
    inputs: list[TensorSig]
    outputs: list[TensorSig]
    opset: int

    def to_dict(self) -> dict:
        return {
            "ops": self.ops, "params": self.params, "param_bytes": self.param_bytes,
            "matmul_flops": self.flops, "flops_at": self.dims, "opset": self.opset,
            "inputs": [s.to_dict() for s in self.inputs],
            "outputs": [s.to_dict() for s in self.outputs],
        }


def _attention_flops(n: onnx.NodeProto, shapes: dict[str, list]) -> int:
    """QK^T and PV of ONNX Attention (opset 23) and com.microsoft.MultiHeadAttention:
    2 * B * H * Sq * Skv * (Dqk + Dv). 4-D inputs are (B, H, S, D); 3-D are (B, S, H*D)."""
    q, k, v = (shapes.get(n.input[i]) if len(n.input) > i and n.input[i] else None for i in range(3))
    if not q or not k or None in q or None in k:
        return 0
    attrs = {a.name: a.i for a in n.attribute}
    if len(q) == 4:
        b, h, sq, dqk = q
        skv = k[2]
        dv = v[3] if v and len(v) == 4 and v[3] else dqk
        return 2 * b * h * sq * skv * (dqk + dv)
    heads = attrs.get("q_num_heads") or attrs.get("num_heads")
    if len(q) != 3 or not heads or len(k) != 3:
        return 0
    b, sq, hidden = q
    dv_total = v[2] if v and len(v) == 3 and v[2] else hidden
    return 2 * b * sq * k[1] * (hidden + dv_total)


# Quantized matmuls count as the float op they compute (ops of int8 x int8 -> int32 MACs).
_AS_FLOAT_OP = {"MatMulInteger": "MatMul", "QLinearMatMul": "MatMul", "MatMulIntegerToFloat": "MatMul",
                "DynamicQuantizeMatMul": "MatMul", "QGemm": "Gemm"}
_B_INPUT = {"QLinearMatMul": 3, "QGemm": 3}  # where B is (the scales come between)


def _matmul_out(n: onnx.NodeProto, a: list | None, b: list | None) -> list | None:
    """The output shape of a MatMul-like node from A and a 2-D B, where inference gave none."""
    if not a or not b or len(b) != 2 or None in a or None in b:
        return None
    trans_b = any(x.name == "transB" and x.i for x in n.attribute)
    rows = a[:-1] if not any(x.name == "transA" and x.i for x in n.attribute) else a[1:]
    return [*rows, b[0] if trans_b else b[1]]


def matmul_flops(model: onnx.ModelProto, dims: dict[str, int] | None = None) -> int:
    """Multiply-add FLOPs (2 per MAC) of MatMul, Gemm, Conv and attention ops, with symbolic
    dims bound (defaults: batch 2, seq 32). Exports compute their reshape targets at run
    time: count on the prepared model (compile/frontend/prepare.py), where shapes are static."""
    bound = {**DEFAULT_DIMS, **(dims or {})}
    try:
        inferred = shape_inference.infer_shapes(bind_dims(model, bound, strict=False), data_prop=True)
    except Exception:
        return 0
    shapes: dict[str, list] = {}
    for vi in list(inferred.graph.input) + list(inferred.graph.value_info) + list(inferred.graph.output):
        shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
    for t in inferred.graph.initializer:
        shapes[t.name] = list(t.dims)
    for n in inferred.graph.node:  # Constant nodes (legacy exports keep weights there too)
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            shapes[n.output[0]] = list(n.attribute[0].t.dims)
    total = 0
    for n in inferred.graph.node:
        if n.op_type in ("Attention", "MultiHeadAttention"):
            total += _attention_flops(n, shapes)
            continue
        op = _AS_FLOAT_OP.get(n.op_type, n.op_type)
        if op not in ("MatMul", "Gemm", "Conv"):
            continue
        a, out = shapes.get(n.input[0]), shapes.get(n.output[0])
        if op != "Conv" and (not out or None in out):  # com.microsoft ops: ONNX shape inference skips them
            out = _matmul_out(n, a, shapes.get(n.input[_B_INPUT.get(n.op_type, 1)]))
        if not a or not out or None in a or None in out:
            continue
        if op == "Conv":
            w = shapes.get(n.input[1])
            if not w or None in w:
                continue
            total += 2 * int(np.prod(out, dtype=np.int64)) * int(np.prod(w[1:], dtype=np.int64))
            continue
        k = a[-1] if not (op == "Gemm" and any(x.name == "transA" and x.i for x in n.attribute)) else a[0]
        total += 2 * int(np.prod(out, dtype=np.int64)) * k
    return int(total)


def analyze(model: onnx.ModelProto, dims: dict[str, int] | None = None,
            prepared: onnx.ModelProto | None = None) -> ModelFacts:
    """Facts of `model`; FLOPs are counted on `prepared` (its shapes folded) when given."""
    ops = collections.Counter(n.op_type for n in model.graph.node)
    params = sum(int(np.prod(t.dims, dtype=np.int64)) for t in model.graph.initializer)
    nbytes = sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer)
    ins, outs = signature(model)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    bound = {**DEFAULT_DIMS, **(dims or {})}
    used = {d: bound[d] for s in ins for d in s.dims if isinstance(d, str) and d in bound}
    return ModelFacts(dict(sorted(ops.items())), params, nbytes, matmul_flops(prepared if prepared is not None else model, bound),
                      used, ins, outs, opset)
