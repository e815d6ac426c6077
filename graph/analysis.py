"""Static facts about a model: op histogram, parameter count, MatMul FLOPs."""

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
    flops: int  # 2*M*N*K summed over MatMul/Gemm at `dims`
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


def matmul_flops(model: onnx.ModelProto, dims: dict[str, int] | None = None) -> int:
    """2*M*N*K for every MatMul/Gemm, with symbolic dims bound (defaults: batch 2, seq 32)."""
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
    total = 0
    for n in inferred.graph.node:
        if n.op_type not in ("MatMul", "Gemm"):
            continue
        a, out = shapes.get(n.input[0]), shapes.get(n.output[0])
        if not a or not out or None in a or None in out:
            continue
        k = a[-1] if not (n.op_type == "Gemm" and any(x.name == "transA" and x.i for x in n.attribute)) else a[0]
        total += 2 * int(np.prod(out, dtype=np.int64)) * k
    return int(total)


def analyze(model: onnx.ModelProto, dims: dict[str, int] | None = None) -> ModelFacts:
    ops = collections.Counter(n.op_type for n in model.graph.node)
    params = sum(int(np.prod(t.dims, dtype=np.int64)) for t in model.graph.initializer)
    nbytes = sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer)
    ins, outs = signature(model)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    bound = {**DEFAULT_DIMS, **(dims or {})}
    used = {d: bound[d] for s in ins for d in s.dims if isinstance(d, str) and d in bound}
    return ModelFacts(dict(sorted(ops.items())), params, nbytes, matmul_flops(model, bound), used, ins, outs, opset)
