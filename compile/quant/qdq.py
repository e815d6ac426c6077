"""QDQ matmuls as MatMulInteger, before TVM's import (targets with an int8 instruction only).

ONNX Runtime's `quantize_static` (QDQ format) writes MatMul(DequantizeLinear(x_q),
DequantizeLinear(W_q)) (or Gemm, with a bias, where quant_pre_process fused a static-shape
MatMul + Add): TVM's importer folds the weights' DequantizeLinear into a float32
constant and computes a dequantize + float32 GEMM, so the int8 weights are gone before any
Relax pass could see them. Here, on the ONNX graph TVM imports (not the one ONNX Runtime
runs), each such MatMul becomes

    Cast(MatMulInteger(x_q, W_q, zp_x, zp_w), float) * (s_x * s_w)

which is the same sum in integers ((x_q - zp_x)(W_q - zp_w), scaled once): what the
int8-gemm pass then puts on the int8 kernel. Only weights given as initializers, activation
scale and zero point per tensor (8-bit zero point given), weight scale per tensor or per
column (axis 1; 0 for a Gemm reading them transposed); anything else is left as written.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

INT8_TYPES = (onnx.TensorProto.INT8, onnx.TensorProto.UINT8)


def _axis(node) -> int:
    return _attr(node, "axis", 1)


def qdq_matmuls_as_integer(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """(model with the QDQ MatMuls rewritten, how many); the input is not modified."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    producer = {o: n for n in g.node for o in n.output}

    def init(name):
        return numpy_helper.to_array(inits[name]) if name in inits else None

    def dq_parts(name):
        n = producer.get(name)
        if n is None or n.op_type != "DequantizeLinear" or n.domain not in ("", "ai.onnx") or len(n.input) < 2:
            return None
        zp = n.input[2] if len(n.input) > 2 and n.input[2] else None
        return n, n.input[0], n.input[1], zp

    new_nodes, new_inits, count = [], [], 0
    for node in g.node:
        rewritten = None
        if node.op_type in ("MatMul", "Gemm") and node.domain in ("", "ai.onnx") and _plain(node):
            a, b = dq_parts(node.input[0]), dq_parts(node.input[1])
            if a is not None and b is not None:
                try:
                    rewritten = _rewrite(node, a, b, init, inits, f"bf_qdq{count}")
                except (ValueError, TypeError):  # an initializer numpy cannot read: leave the MatMul
                    rewritten = None
        if rewritten is None:
            new_nodes.append(node)
            continue
        nodes, tensors = rewritten
        new_nodes += nodes
        new_inits += tensors
        count += 1
    return (with_nodes(model, new_nodes, new_inits), count) if count else (model, 0)


def with_nodes(model: onnx.ModelProto, nodes: list, inits: list) -> onnx.ModelProto:
    """A copy of `model` whose graph runs `nodes`, with `inits` added to its initializers."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    out.graph.initializer.extend(inits)
    return out


def _attr(node, name, default):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _plain(node) -> bool:
    """A MatMul, or a Gemm that is one plus a bias: alpha = beta = 1, A not transposed (what
    quant_pre_process makes of a static-shape MatMul + Add; B transposed is taken)."""
    if node.op_type == "MatMul":
        return True
    return _attr(node, "alpha", 1.0) == 1.0 and _attr(node, "beta", 1.0) == 1.0 and not _attr(node, "transA", 0)


def _rewrite(node, a, b, init, inits, tag):
    (_, xq, sx_name, zx_name), (bnode, wq_name, sw_name, zw_name) = a, b
    w, sx, sw = init(wq_name), init(sx_name), init(sw_name)
    if w is None or sx is None or sw is None or w.ndim != 2 or inits[wq_name].data_type not in INT8_TYPES:
        return None
    trans_b = node.op_type == "Gemm" and bool(_attr(node, "transB", 0))
    w = np.ascontiguousarray(w.T) if trans_b else w  # (K, N) either way
    k, n = w.shape
    if sx.size != 1 or sw.dtype != np.float32 or sx.dtype != np.float32:
        return None
    # per column: the weights' DequantizeLinear axis is N's (0 when Gemm reads them transposed)
    if sw.size != 1 and not (sw.shape == (n,) and _axis(bnode) in ((0, -2) if trans_b else (1, -1))):
        return None
    # The activations' zero point says their type (MatMulInteger takes 8-bit only; a
    # DequantizeLinear without one may read int32): required, per tensor, 8-bit.
    zx = init(zx_name) if zx_name else None
    if zx is None or zx.size != 1 or inits[zx_name].data_type not in INT8_TYPES:
        return None
    zw = init(zw_name) if zw_name else None
    if zw_name and (zw is None or zw.size not in (1, n)):
        return None
    scale = (sx.reshape(()) * sw).astype(np.float32)  # the one float scale per column
    names = {s: f"{tag}_{s}" for s in ("scale", "acc", "accf", "w", "scaled")}
    tensors = [numpy_helper.from_array(scale, names["scale"])]
    if trans_b:
        tensors.append(numpy_helper.from_array(w, names["w"]))
    mi_inputs = [xq, names["w"] if trans_b else wq_name, zx_name, zw_name or ""]
    if zw is not None and zw.size == 1 and zw.ndim:
        tensors.append(numpy_helper.from_array(zw.reshape(()), f"{tag}_zw"))  # MatMulInteger: scalar or (N,)
        mi_inputs[3] = f"{tag}_zw"
    while mi_inputs and mi_inputs[-1] == "":
        mi_inputs.pop()
    bias = node.input[2] if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2] else None
    nodes = [helper.make_node("MatMulInteger", mi_inputs, [names["acc"]], name=f"{tag}_matmul_integer"),
             helper.make_node("Cast", [names["acc"]], [names["accf"]], to=onnx.TensorProto.FLOAT, name=f"{tag}_cast"),
             helper.make_node("Mul", [names["accf"], names["scale"]], [names["scaled"]] if bias else list(node.output),
                              name=f"{tag}_scale")]
    if bias:  # Gemm's C (QDQ: the dequantized int32 bias, which TVM's import folds to a constant)
        nodes.append(helper.make_node("Add", [names["scaled"], bias], list(node.output), name=f"{tag}_bias"))
    return nodes, tensors
