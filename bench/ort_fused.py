"""The same math through ONNX Runtime's fused transformer kernels (the `ort-fused` peer).

    blockforge MHA    query/key/value projections (MatMul) -> com.microsoft.MultiHeadAttention
                      (bias, masks and causality inside the fused kernel) -> output projection,
                      with the weights the spec's seed gives (graph.weights.make_weights)
    blockforge block  rebuilt in the packed layout (same weights), then ORT's transformer
                      optimizer (Attention, SkipLayerNormalization, BiasGelu)
    FFN, foreign      ORT's transformer optimizer on the model as given

The result must compute what the model computes: bench checks its outputs against the
reference before timing it, so a fusion that changes the math is refused, not timed.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from blockforge.graph import BlockSpec, MHASpec, Spec, build, make_weights
from blockforge.graph.builders import IR_VERSION
from blockforge.graph.model_io import bind_dims, signature

CONTRIB = "com.microsoft"
# Fused ops worth naming in the note (what the optimizer reports in its statistics).
FUSED_OPS = ("Attention", "MultiHeadAttention", "SkipLayerNormalization", "BiasGelu", "FastGelu", "Gelu",
             "SkipSimplifiedLayerNormalization", "GemmFastGelu")


class NotFusable(Exception):
    """ORT's fusions do not apply to this model (bench skips the peer with this reason)."""


def _packed(w: np.ndarray) -> np.ndarray:
    """(h, d_model, d_k) per-head weights -> (d_model, h*d_k), head i in columns i*d_k:(i+1)*d_k."""
    h, d, dk = w.shape
    return w.transpose(1, 0, 2).reshape(d, h * dk)


def mha_graph(spec: MHASpec, model: onnx.ModelProto) -> onnx.ModelProto:
    """A blockforge MHA as projections around one com.microsoft.MultiHeadAttention node.

    `model` is the blockforge export (dims bound): its inputs and output keep their names,
    types and shapes, so the same feed runs both."""
    w = make_weights(spec)
    ins, outs = signature(model)
    dims = {s.name: s.dims for s in ins}
    if not all(isinstance(d, int) for s in ins for d in s.dims):
        raise NotFusable("the fused MHA graph needs static dims (bind every dim in the shape)")
    nodes, inits = [], []

    def init(name: str, a: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(np.ascontiguousarray(a), name))
        return name

    def op(op_type: str, inputs: list[str], name: str, domain: str = "", **attrs) -> str:
        nodes.append(helper.make_node(op_type, inputs, [name], name=name, domain=domain, **attrs))
        return name

    proj = [op("MatMul", [x, init(f"{x}_proj.weight", _packed(w[k]))], f"{x}_proj")  # (B, S|S_kv, h*d_k)
            for x, k in (("query", "W_Q"), ("key", "W_K"), ("value", "W_V"))]
    bias = init("qkv_bias", np.concatenate([w[k].reshape(-1) for k in ("b_Q", "b_K", "b_V")])) if spec.bias else ""
    fill = float(np.finfo(spec.dtype).min)  # the builders' mask fill: exp() underflows to 0
    padding, attn_bias = "", ""
    if spec.mask == "bool":  # key_padding_mask: int32, 1 keeps a key
        padding = op("Cast", ["key_padding_mask"], "key_padding_mask_int", to=TensorProto.INT32)  # (B, S_kv)
    elif spec.mask == "additive":  # (B, S_kv) -> attention_bias (B, 1, S, S_kv)
        b, s, _ = dims["query"]
        kv = dims["key"][1]
        m = op("Unsqueeze", ["key_padding_mask", init("mask_axes", np.array([1, 2], np.int64))], "mask_4d")
        attn_bias = op("Expand", [m, init("mask_shape", np.array([b, 1, s, kv], np.int64))], "attention_bias")
    mha_in = [*proj, bias, padding, attn_bias]
    while mha_in and not mha_in[-1]:
        mha_in.pop()  # trailing optional inputs are left off
    ctx = op("MultiHeadAttention", mha_in, "attention", domain=CONTRIB, num_heads=spec.heads,
             mask_filter_value=fill, unidirectional=int(spec.causal))  # (B, S, h*d_k)
    y = op("MatMul", [ctx, init("out_proj.weight", w["W_O"])], "out_proj")  # (B, S, d_model)
    if spec.bias:
        y = op("Add", [y, init("out_proj.bias", w["b_O"])], "out_proj_bias")
    nodes.append(helper.make_node("Identity", [y], [outs[0].name], name="output"))
    graph = helper.make_graph(nodes, "mha_ort_fused", list(model.graph.input), list(model.graph.output), inits)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), spec.opset)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(CONTRIB, 1)],
                          producer_name="blockforge-bench")
    m.ir_version = IR_VERSION
    return m


def optimized(model: onnx.ModelProto, spec: Spec | None) -> tuple[onnx.ModelProto, dict[str, int]]:
    """ORT's transformer optimizer on `model` (a copy): the model and its fused-op counts.

    opt_level 0: the Python fusions only; ORT's own graph optimizations still run when the
    session loads the result (levels >= 1 import torch in this onnxruntime)."""
    try:
        from onnxruntime.transformers.optimizer import optimize_model
    except ImportError as e:  # sympy, a dependency of its shape inference, is in the [peers] extra
        raise NotFusable(f"ORT's transformer optimizer is unavailable ({e}); pip install 'blockforge[peers]'") from None
    heads = getattr(spec, "heads", 0) if isinstance(spec, (MHASpec, BlockSpec)) else 0
    hidden = spec.d_model if heads else 0  # 0/0: the optimizer infers them
    kind = "gpt2" if getattr(spec, "causal", False) else "bert"
    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # the optimizer edits its input in place
    logging.getLogger("onnxruntime.transformers").setLevel(logging.ERROR)  # "producer not matched" etc.
    try:
        opt = optimize_model(copy, model_type=kind, num_heads=heads, hidden_size=hidden, opt_level=0, use_gpu=False)
    except Exception as e:  # a third-party optimizer: whatever it raises means "cannot take this model"
        raise NotFusable(f"ORT's transformer optimizer failed: {type(e).__name__}: {str(e)[:200]}") from None
    counts: dict[str, int] = {}
    for n in opt.model.graph.node:
        if n.op_type in FUSED_OPS and n.domain == CONTRIB:
            counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return opt.model, counts


def fused_model(model: onnx.ModelProto, spec: Spec | None, dims: dict[str, int]) -> tuple[onnx.ModelProto, str]:
    """The ort-fused contender's model (dims bound) and a one-line description of it."""
    if isinstance(spec, MHASpec):
        return mha_graph(spec, model), "com.microsoft.MultiHeadAttention graph with the spec's weights"
    src, how = model, "ORT transformer optimizer"
    if isinstance(spec, BlockSpec) and spec.layout != "packed":
        # The optimizer recognises attention in the packed layout only (measured: it fuses
        # nothing of the per-head graph's 12 attentions); same weights, same math.
        packed = dataclasses.replace(spec, layout="packed")
        src = bind_dims(build(packed, make_weights(spec))[0], dims, strict=False)
        how += " on the packed-layout rebuild"
    fused, counts = optimized(src, spec)
    if not counts:
        raise NotFusable("ORT's transformer optimizer fused nothing in this model (it would be `ort` again)")
    return fused, f"{how}: " + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))


