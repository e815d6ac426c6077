"""Integer matmuls on a CPU without an int8 instruction, as float32 GEMMs, before TVM's import.

TVM imports MatMulInteger(x_q, W, zp_x, zp_w) as an int32 matmul: a GEMM with no vector
instruction behind it on any CPU schedule, slower than the model's own fp32 (BERT-base FFN,
`quantize_dynamic`, an x86-64-avx2 build before it had the VPMADDUBSW/VPMADDWD kernels, on
Zen 5: 9.8 ms against 8.1 ms fp32). Where the target has no int8 instruction (SSE2-only
x86, aarch64 without +dotprod: compile/quant/isa.py), each MatMulInteger with constant
weights becomes

    MatMul(Cast(x_q, float) - Cast(zp_x, float), float32(W - zp_w))

on the graph TVM imports (ONNX Runtime still runs the file as written). Every product is an
integer of at most 255 x 256 in magnitude, exact in float32; only sums past 2^24 round (K x
32640 > 2^24 from K = 515 up: a relative 6e-8, beside the one quantization step the output
already carries). Only a MatMulInteger whose every consumer is a Cast to float (what ORT's
quantizers write) is rewritten, so the output's type change stays inside that Cast.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from blockforge.compile.quant.qdq import INT8_TYPES, with_nodes

FLOAT = onnx.TensorProto.FLOAT


def integer_matmuls_as_float(model: onnx.ModelProto, rewritten: list | None = None) -> tuple[onnx.ModelProto, int]:
    """(model with the MatMulIntegers rewritten, how many); the input is not modified. The
    "KxN" of each rewritten one is appended to `rewritten`."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    consumers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    graph_outputs = {o.name for o in g.output}
    producer = {o: n for n in g.node for o in n.output}

    def init(name):
        return numpy_helper.to_array(inits[name]) if name in inits else None

    new_nodes, new_inits, changed = [], [], set()
    for node in g.node:
        nodes = None
        if node.op_type == "MatMulInteger" and node.domain in ("", "ai.onnx"):
            try:
                nodes = _rewrite(node, init, inits, consumers, producer, graph_outputs, f"bf_i2f{len(changed)}",
                                 rewritten, new_inits)
            except (ValueError, TypeError):  # an initializer numpy cannot read: leave it
                nodes = None
        if nodes is None:
            new_nodes.append(node)
            continue
        new_nodes += nodes
        changed.add(node.output[0])
    if not changed:
        return model, 0
    out = with_nodes(model, new_nodes, new_inits)
    # the rewritten outputs are float now: drop their (int32) shape-inference records
    kept = [v for v in out.graph.value_info if v.name not in changed]
    del out.graph.value_info[:]
    out.graph.value_info.extend(kept)
    return out, len(changed)


def _scalar(name, inits, producer) -> bool:
    """A per-tensor zero point: a one-element initializer, or DynamicQuantizeLinear's."""
    if name in inits:
        return numpy_helper.to_array(inits[name]).size == 1
    p = producer.get(name)
    return p is not None and p.op_type == "DynamicQuantizeLinear" and len(p.output) > 2 and p.output[2] == name


def _rewrite(node, init, inits, consumers, producer, graph_outputs, tag, rewritten, new_inits):
    if len(node.input) < 2 or node.input[1] not in inits or inits[node.input[1]].data_type not in INT8_TYPES:
        return None
    w = init(node.input[1])
    if w is None or w.ndim != 2:
        return None
    k, n = w.shape
    zw_name = node.input[3] if len(node.input) > 3 and node.input[3] else None
    zw = init(zw_name) if zw_name else np.zeros((), np.int64)
    if zw is None or zw.size not in (1, n):
        return None
    x, zx = node.input[0], node.input[2] if len(node.input) > 2 and node.input[2] else None
    if zx is not None and not _scalar(zx, inits, producer):
        return None  # (a per-row zero point would broadcast along K)
    users = consumers.get(node.output[0], [])
    if node.output[0] in graph_outputs or not users or not all(
            u.op_type == "Cast" and any(a.name == "to" and a.i == FLOAT for a in u.attribute) for u in users):
        return None
    weff = w.astype(np.int64) - zw.reshape(-1).astype(np.int64)
    if rewritten is not None:
        rewritten.append(f"{k}x{n}")
    names = {s: f"{tag}_{s}" for s in ("w", "xf", "zf", "xc")}
    new_inits.append(numpy_helper.from_array(weff.astype(np.float32), names["w"]))
    nodes = [helper.make_node("Cast", [x], [names["xf"]], to=FLOAT, name=f"{tag}_cast_x")]
    xin = names["xf"]
    if zx is not None:
        nodes += [helper.make_node("Cast", [zx], [names["zf"]], to=FLOAT, name=f"{tag}_cast_zp"),
                  helper.make_node("Sub", [names["xf"], names["zf"]], [names["xc"]], name=f"{tag}_center")]
        xin = names["xc"]
    nodes.append(helper.make_node("MatMul", [xin, names["w"]], [node.output[0]], name=f"{tag}_matmul"))
    return nodes
