"""ONNX graph builders that read like the seed formulas.

    head_i  = softmax(Q_i K_i^T / sqrt(d_k)) V_i,  Q_i = query W_Q^(i), K_i = key W_K^(i), V_i = value W_V^(i)
    MHA     = Concat(head_1, ..., head_h) W_O
    FFN(x)  = act(x W_1 + b_1) W_2 + b_2

Every node gets a meaningful name (head_3/q_proj, ffn/gelu) so a netron view is legible;
a node's output tensor carries the node's name.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import blockforge

from .spec import GELU_OPSET, PAST_DIM, TOTAL_DIM, BlockSpec, FFNSpec, MHASpec, Spec
from .weights import Weights, make_weights

# onnx 1.23 writes IR 14; onnxruntime 1.31 accepts <= 13. IR 10 covers opsets up to 21.
IR_VERSION = 10
# The attention-op layout's opsets came with IR 11 (opset 23, onnx 1.18) and IR 12 (opset 24,
# onnx 1.19), per onnx.helper.VERSION_TABLE; onnxruntime 1.31 loads and runs both.
ATTENTION_IR_VERSION = {23: 11, 24: 12}
ONNX_DTYPE = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}
SPEC_KEY = "blockforge.spec"
VERSION_KEY = "blockforge.version"


class _Graph:
    """Collects nodes and initializers; `op` returns the produced tensor's name."""

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []

    def input(self, name: str, shape: list, elem: int | None = None) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem or ONNX_DTYPE[self.dtype], shape))
        return name

    def init(self, name: str, array: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def const(self, name: str, value: float) -> str:
        return self.init(name, np.array(value, dtype=self.dtype))

    def op(self, op_type: str, inputs: list[str], name: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op_type, inputs, [name], name=name, **attrs))
        return name

    def linear(self, x: str, w: np.ndarray, b: np.ndarray | None, node: str) -> str:
        """x W (+ b); the weight is stored as `<node>.weight`, PyTorch-style."""
        y = self.op("MatMul", [x, self.init(f"{node}.weight", w)], node)
        if b is not None:
            y = self.op("Add", [y, self.init(f"{node}.bias", b)], f"{node}_bias")
        return y

    def model(self, outputs: list[onnx.ValueInfoProto], spec: Spec, name: str) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, self.inputs, outputs, self.inits)
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", spec.opset)],
            producer_name="blockforge",
            producer_version=blockforge.__version__,
        )
        model.ir_version = ATTENTION_IR_VERSION.get(spec.opset, IR_VERSION)
        helper.set_model_props(model, {SPEC_KEY: spec.to_json(), VERSION_KEY: blockforge.__version__})
        return model


def _dims(spec: Spec) -> tuple:
    return (spec.batch or "batch", spec.seq or "seq")


def _mask_fill(dtype: str) -> float:
    # The most negative finite value: exp() of it underflows to 0, and unlike -inf a
    # fully masked row gives a uniform softmax rather than NaN.
    return float(np.finfo(dtype).min)


PAST_KEY, PAST_VALUE, PRESENT_KEY, PRESENT_VALUE = "past_key", "past_value", "present_key", "present_value"


def _causal_allowed(g: _Graph, query: str, keys: str | None = None, key_axis: int = 1) -> str:
    """(S, S) bool, True where key j <= query i. Built in-graph so it follows a symbolic seq;
    Shape -> ConstantOfShape -> Trilu keeps the shape symbolic in TVM's importer (Range does not).

    With a cache (`keys`: the P+S cached and new keys, sequence on `key_axis`), (S, T) with
    T = P+S: query i sits at absolute position P+i and sees keys j <= P+i. TVM's importer does
    no arithmetic on shapes (no P = T - S), nor keeps the shape through a reversing Slice, so
    positions are counted from the end instead: a reversed CumSum of ones gives T-j and S-i,
    and j <= i + (T-S) is exactly T-j >= S-i."""
    s = g.op("Shape", [query], "causal/seq_len", start=1, end=2)  # (1,) = [S]
    one = helper.make_tensor("one", TensorProto.INT64, [1], [1])
    if keys is not None:
        t = g.op("Shape", [keys], "causal/total_len", start=key_axis, end=key_axis + 1)  # (1,) = [T]
        axis = g.init("causal/axis", np.array(0, np.int64))
        to_end = {}
        for n, length in (("query", s), ("key", t)):
            ones = g.op("ConstantOfShape", [length], f"causal/{n}_ones", value=one)  # (S,) | (T,)
            to_end[n] = g.op("CumSum", [ones, axis], f"causal/{n}_to_end", reverse=1)  # S-i | T-j
        col = g.init("causal/column", np.array([1], np.int64))
        rows = g.op("Unsqueeze", [to_end["query"], col], "causal/query_rows")  # (S, 1)
        return g.op("GreaterOrEqual", [to_end["key"], rows], "causal/allowed")  # (S, T)
    ss = g.op("Concat", [s, s], "causal/square", axis=0)  # (2,) = [S, S]
    ones = g.op("ConstantOfShape", [ss], "causal/ones",
                value=helper.make_tensor("true", TensorProto.BOOL, [1], [True]))  # (S, S)
    return g.op("Trilu", [ones], "causal/allowed", upper=0)  # (S, S), lower triangle


def _attention_mask(g: _Graph, spec: MHASpec, query: str, mask_axes: list[int],
                    keys: str | None = None, key_axis: int = 1) -> tuple[str | None, str | None]:
    """Returns (allowed, additive): a bool mask for Where and/or a float mask to Add."""
    allowed = _causal_allowed(g, query, keys, key_axis) if spec.causal else None
    additive = None
    if spec.mask is not None:
        axes = g.init("mask/axes", np.array(mask_axes, np.int64))
        m = g.op("Unsqueeze", ["key_padding_mask", axes], "mask/broadcast")  # (B, 1, [1,] S_kv)
        if spec.mask == "bool":
            allowed = m if allowed is None else g.op("And", [allowed, m], "mask/combine")
        else:
            additive = m
    return allowed, additive


def _apply_mask(g: _Graph, scores: str, allowed: str | None, additive: str | None, scope: str) -> str:
    if additive is not None:
        scores = g.op("Add", [scores, additive], f"{scope}/mask_add")
    if allowed is not None:
        scores = g.op("Where", [allowed, scores, "mask/fill"], f"{scope}/mask")
    return scores


def _mha_inputs(g: _Graph, spec: MHASpec) -> tuple[str, str, str]:
    b, s = _dims(spec)
    kv = (spec.kv_seq or "kv_seq") if spec.cross else s
    q = g.input("query", [b, s, spec.d_model])
    k = g.input("key", [b, kv, spec.d_model])
    v = g.input("value", [b, kv, spec.d_model])
    if spec.mask == "bool":
        g.input("key_padding_mask", [b, kv], TensorProto.BOOL)
    elif spec.mask == "additive":
        g.input("key_padding_mask", [b, kv])
    if spec.kv_cache:
        _cache_inputs(g, spec)
    return q, k, v


def _cache_inputs(g: _Graph, spec: MHASpec) -> None:
    """past_key / past_value: (B, h, P, d_k), the keys and values of the P earlier positions."""
    b, _ = _dims(spec)
    for name in (PAST_KEY, PAST_VALUE):
        g.input(name, [b, spec.heads, PAST_DIM, spec.d_k])


def _cache_outputs(spec: Spec) -> list:
    b, _ = _dims(spec)
    h, dk = (spec.heads, spec.d_model // spec.heads)
    return [helper.make_tensor_value_info(n, ONNX_DTYPE[spec.dtype], [b, h, TOTAL_DIM, dk])
            for n in (PRESENT_KEY, PRESENT_VALUE)]


def _mha_per_head(g: _Graph, spec: MHASpec, w: Weights, q_in: str, k_in: str, v_in: str, prefix: str) -> str:
    """The seed, literally: h separate attentions over d_model x d_k projections."""
    scale = g.const(f"{prefix}sqrt_d_k", math.sqrt(spec.d_k))
    if not spec.kv_cache:
        allowed, additive = _attention_mask(g, spec, q_in, [1])
    heads, cached_k, cached_v = [], [], []
    for i in range(spec.heads):
        p = f"{prefix}head_{i}"
        bias = (lambda n: w[n][i]) if spec.bias else (lambda n: None)
        q = g.linear(q_in, w["W_Q"][i], bias("b_Q"), f"{p}/q_proj")  # (B, S, d_k)
        k = g.linear(k_in, w["W_K"][i], bias("b_K"), f"{p}/k_proj")  # (B, S_kv, d_k)
        v = g.linear(v_in, w["W_V"][i], bias("b_V"), f"{p}/v_proj")  # (B, S_kv, d_k)
        if spec.kv_cache:  # K_i = Concat(past_K_i, X W_K^(i)), V_i likewise
            k, v = (_per_head_cache(g, spec, past, new, i, f"{p}/{kv}")
                    for past, new, kv in ((PAST_KEY, k, "k"), (PAST_VALUE, v, "v")))  # (B, P+S, d_k)
            cached_k.append(k)
            cached_v.append(v)
            if i == 0:  # the causal mask spans the cached keys: (S, P+S)
                allowed, additive = _attention_mask(g, spec, q_in, [1], k, 1)
        kt = g.op("Transpose", [k], f"{p}/k_transpose", perm=[0, 2, 1])  # (B, d_k, S_kv)
        s = g.op("MatMul", [q, kt], f"{p}/scores")  # (B, S, S_kv)
        s = g.op("Div", [s, scale], f"{p}/scale")  # (B, S, S_kv)
        s = _apply_mask(g, s, allowed, additive, p)
        a = g.op("Softmax", [s], f"{p}/softmax", axis=-1)  # (B, S, S_kv)
        heads.append(g.op("MatMul", [a, v], f"{p}/context"))  # (B, S, d_k)
    if spec.kv_cache:  # present_key = the K_i stacked on the head axis (B, h, P+S, d_k)
        axis = g.init(f"{prefix}present/head_axis", np.array([1], np.int64))
        for name, parts in ((PRESENT_KEY, cached_k), (PRESENT_VALUE, cached_v)):
            stacked = [g.op("Unsqueeze", [t, axis], f"{t}/as_head") for t in parts]  # (B, 1, P+S, d_k)
            g.op("Concat", stacked, name, axis=1)  # (B, h, P+S, d_k)
    concat = g.op("Concat", heads, f"{prefix}concat_heads", axis=-1)  # (B, S, h*d_k)
    return g.linear(concat, w["W_O"], w.get("b_O"), f"{prefix}out_proj")  # (B, S, d_model)


def _per_head_cache(g: _Graph, spec: MHASpec, past: str, new: str, i: int, p: str) -> str:
    """Concat(past[:, i], new) along the sequence: (B, P, d_k) + (B, S, d_k) -> (B, P+S, d_k)."""
    head = f"{p}_cache/head_index"
    g.inits.append(numpy_helper.from_array(np.array(i, np.int64), head))  # 0-d: Gather drops the head axis
    cached = g.op("Gather", [past, head], f"{p}_cache/past", axis=1)  # (B, P, d_k)
    return g.op("Concat", [cached, new], f"{p}_cache", axis=1)  # (B, P+S, d_k)


def _packed(w: np.ndarray) -> np.ndarray:
    """(h, d_model, d_k) per-head weights -> (d_model, h*d_k), head i in columns i*d_k:(i+1)*d_k."""
    h, d, dk = w.shape
    return w.transpose(1, 0, 2).reshape(d, h * dk)


def _mha_packed(g: _Graph, spec: MHASpec, w: Weights, q_in: str, k_in: str, v_in: str, prefix: str) -> str:
    """Same math, one d_model x d_model GEMM per Q/K/V and one batched attention for all heads."""
    h, dk = spec.heads, spec.d_k
    scale = g.const(f"{prefix}sqrt_d_k", math.sqrt(dk))
    split = g.init(f"{prefix}split_heads_shape", np.array([0, 0, h, dk], np.int64))
    merge = g.init(f"{prefix}merge_heads_shape", np.array([0, 0, h * dk], np.int64))
    if not spec.kv_cache:
        allowed, additive = _attention_mask(g, spec, q_in, [1, 2])
    b = (lambda n: w[n].reshape(-1)) if spec.bias else (lambda n: None)
    q = g.linear(q_in, _packed(w["W_Q"]), b("b_Q"), f"{prefix}q_proj")  # (B, S, h*d_k)
    k = g.linear(k_in, _packed(w["W_K"]), b("b_K"), f"{prefix}k_proj")  # (B, S_kv, h*d_k)
    v = g.linear(v_in, _packed(w["W_V"]), b("b_V"), f"{prefix}v_proj")  # (B, S_kv, h*d_k)
    q = g.op("Reshape", [q, split], f"{prefix}q/split_heads")  # (B, S, h, d_k)
    k = g.op("Reshape", [k, split], f"{prefix}k/split_heads")  # (B, S_kv, h, d_k)
    v = g.op("Reshape", [v, split], f"{prefix}v/split_heads")  # (B, S_kv, h, d_k)
    q = g.op("Transpose", [q], f"{prefix}q/heads_first", perm=[0, 2, 1, 3])  # (B, h, S, d_k)
    v = g.op("Transpose", [v], f"{prefix}v/heads_first", perm=[0, 2, 1, 3])  # (B, h, S_kv, d_k)
    if not spec.kv_cache:
        kt = g.op("Transpose", [k], f"{prefix}k/heads_first_transposed", perm=[0, 2, 3, 1])  # (B, h, d_k, S_kv)
    else:  # K = Concat(past_K, X W_K) on the sequence axis: it is present_key
        k = g.op("Transpose", [k], f"{prefix}k/heads_first", perm=[0, 2, 1, 3])  # (B, h, S, d_k)
        k = g.op("Concat", [PAST_KEY, k], PRESENT_KEY, axis=2)  # (B, h, P+S, d_k)
        v = g.op("Concat", [PAST_VALUE, v], PRESENT_VALUE, axis=2)  # (B, h, P+S, d_k)
        kt = g.op("Transpose", [k], f"{prefix}k/transposed", perm=[0, 1, 3, 2])  # (B, h, d_k, P+S)
        allowed, additive = _attention_mask(g, spec, q_in, [1, 2], k, 2)
    s = g.op("MatMul", [q, kt], f"{prefix}attn/scores")  # (B, h, S, S_kv)
    s = g.op("Div", [s, scale], f"{prefix}attn/scale")  # (B, h, S, S_kv)
    s = _apply_mask(g, s, allowed, additive, f"{prefix}attn")
    a = g.op("Softmax", [s], f"{prefix}attn/softmax", axis=-1)  # (B, h, S, S_kv)
    c = g.op("MatMul", [a, v], f"{prefix}attn/context")  # (B, h, S, d_k)
    c = g.op("Transpose", [c], f"{prefix}attn/seq_first", perm=[0, 2, 1, 3])  # (B, S, h, d_k)
    c = g.op("Reshape", [c, merge], f"{prefix}concat_heads")  # (B, S, h*d_k)
    return g.linear(c, w["W_O"], w.get("b_O"), f"{prefix}out_proj")  # (B, S, d_model)


def _mha_attention_op(g: _Graph, spec: MHASpec, w: Weights, q_in: str, k_in: str, v_in: str, prefix: str) -> str:
    """The packed projections around one ONNX Attention node (opset 23): it splits the heads,
    scales by 1/sqrt(d_k) (its default), masks, softmaxes and merges the heads itself."""
    b = (lambda n: w[n].reshape(-1)) if spec.bias else (lambda n: None)
    q = g.linear(q_in, _packed(w["W_Q"]), b("b_Q"), f"{prefix}q_proj")  # (B, S, h*d_k)
    k = g.linear(k_in, _packed(w["W_K"]), b("b_K"), f"{prefix}k_proj")  # (B, S_kv, h*d_k)
    v = g.linear(v_in, _packed(w["W_V"]), b("b_V"), f"{prefix}v_proj")  # (B, S_kv, h*d_k)
    inputs = [q, k, v]
    if spec.mask is not None:  # bool: True attends (as ours); additive: added to the scores
        axes = g.init("mask/axes", np.array([1, 2], np.int64))
        m = g.op("Unsqueeze", ["key_padding_mask", axes], "mask/broadcast")  # (B, 1, 1, S_kv)
        # onnxruntime 1.31's CPU Attention wants the mask's query axis at full length
        # ("inconsistent q_sequence_length (between attn_mask and Q)"), though ONNX broadcasts it.
        s = g.op("Shape", [q_in], "mask/seq_len", start=1, end=2)  # (1,) = [S]
        one = g.init("mask/one", np.array([1], np.int64))
        rows = g.op("Concat", [one, one, s, one], "mask/rows", axis=0)  # (4,) = [1, 1, S, 1]
        inputs.append(g.op("Expand", [m, rows], "mask/per_query"))  # (B, 1, S, S_kv)
    attrs = dict(q_num_heads=spec.heads, kv_num_heads=spec.heads, is_causal=int(spec.causal))
    if spec.kv_cache:  # the op's own cache inputs (4, 5) and outputs (1, 2): (B, h, P[+S], d_k)
        c = f"{prefix}attention"
        inputs += [""] * (4 - len(inputs)) + [PAST_KEY, PAST_VALUE]
        g.nodes.append(helper.make_node("Attention", inputs, [c, PRESENT_KEY, PRESENT_VALUE], name=c, **attrs))
    else:
        c = g.op("Attention", inputs, f"{prefix}attention", **attrs)  # (B, S, h*d_k)
    return g.linear(c, w["W_O"], w.get("b_O"), f"{prefix}out_proj")  # (B, S, d_model)


def _mha(g: _Graph, spec: MHASpec, w: Weights, q: str, k: str, v: str, prefix: str = "") -> str:
    if spec.layout == "attention-op":
        return _mha_attention_op(g, spec, w, q, k, v, prefix)
    if spec.causal or spec.mask == "bool":
        g.const("mask/fill", _mask_fill(spec.dtype))
    body = _mha_per_head if spec.layout == "per-head" else _mha_packed
    return body(g, spec, w, q, k, v, prefix)


def _gelu(g: _Graph, x: str, approximate: str, opset: int, p: str) -> str:
    if opset >= GELU_OPSET:
        return g.op("Gelu", [x], f"{p}/gelu", approximate=approximate)
    half = g.const(f"{p}/gelu/half", 0.5)
    one = g.const(f"{p}/gelu/one", 1.0)
    if approximate == "none":  # 0.5 x (1 + erf(x / sqrt(2)))
        t = g.op("Div", [x, g.const(f"{p}/gelu/sqrt2", math.sqrt(2.0))], f"{p}/gelu/x_over_sqrt2")
        t = g.op("Erf", [t], f"{p}/gelu/erf")
    else:  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        x3 = g.op("Mul", [x, g.op("Mul", [x, x], f"{p}/gelu/x2")], f"{p}/gelu/x3")
        t = g.op("Mul", [x3, g.const(f"{p}/gelu/c", 0.044715)], f"{p}/gelu/cx3")
        t = g.op("Add", [x, t], f"{p}/gelu/inner")
        t = g.op("Mul", [t, g.const(f"{p}/gelu/k", math.sqrt(2.0 / math.pi))], f"{p}/gelu/scaled")
        t = g.op("Tanh", [t], f"{p}/gelu/tanh")
    t = g.op("Add", [t, one], f"{p}/gelu/one_plus")
    return g.op("Mul", [g.op("Mul", [x, half], f"{p}/gelu/half_x"), t], f"{p}/gelu")


def _ffn(g: _Graph, spec: FFNSpec, w: Weights, x: str, p: str = "ffn") -> str:
    h = g.linear(x, w["W_1"], w["b_1"], f"{p}/fc1")  # (B, S, d_ff)
    if spec.activation == "relu":
        h = g.op("Relu", [h], f"{p}/relu")  # (B, S, d_ff)
    else:
        h = _gelu(g, h, "tanh" if spec.activation == "gelu_tanh" else "none", spec.opset, p)
    return g.linear(h, w["W_2"], w["b_2"], f"{p}/fc2")  # (B, S, d_model)


def _layer_norm(g: _Graph, x: str, w: Weights, name: str, eps: float) -> str:
    return g.op("LayerNormalization", [x, g.init(f"{name}/gamma", w[f"{name}/gamma"]),
                                       g.init(f"{name}/beta", w[f"{name}/beta"])],
                name, axis=-1, epsilon=eps)


def _out(spec: Spec, name: str = "output") -> list:
    b, s = _dims(spec)
    out = [helper.make_tensor_value_info(name, ONNX_DTYPE[spec.dtype], [b, s, spec.d_model])]
    return out + (_cache_outputs(spec) if getattr(spec, "kv_cache", False) else [])


def _named_output(g: _Graph, y: str) -> None:
    g.op("Identity", [y], "output")


def build_mha(spec: MHASpec, weights: Weights | None = None) -> tuple[onnx.ModelProto, Weights]:
    w = weights if weights is not None else make_weights(spec)
    g = _Graph(spec.dtype)
    q, k, v = _mha_inputs(g, spec)
    _named_output(g, _mha(g, spec, w, q, k, v))
    return g.model(_out(spec), spec, f"mha_{spec.layout}"), w


def build_ffn(spec: FFNSpec, weights: Weights | None = None) -> tuple[onnx.ModelProto, Weights]:
    w = weights if weights is not None else make_weights(spec)
    g = _Graph(spec.dtype)
    b, s = _dims(spec)
    x = g.input("x", [b, s, spec.d_model])
    _named_output(g, _ffn(g, spec, w, x))
    return g.model(_out(spec), spec, f"ffn_{spec.activation}"), w


def build_block(spec: BlockSpec, weights: Weights | None = None) -> tuple[onnx.ModelProto, Weights]:
    w = weights if weights is not None else make_weights(spec)
    mw = {k[4:]: v for k, v in w.items() if k.startswith("mha/")}
    fw = {k[4:]: v for k, v in w.items() if k.startswith("ffn/")}
    g = _Graph(spec.dtype)
    b, s = _dims(spec)
    x = g.input("x", [b, s, spec.d_model])
    mha, ffn = spec.mha_spec(), spec.ffn_spec()
    if spec.kv_cache:
        _cache_inputs(g, mha)
    if spec.norm == "pre":  # y = h + FFN(LN2(h)),  h = x + MHA(LN1(x))
        a = _layer_norm(g, x, w, "ln1", spec.eps)
        h = g.op("Add", [x, _mha(g, mha, mw, a, a, a, "mha/")], "residual1")
        y = g.op("Add", [h, _ffn(g, ffn, fw, _layer_norm(g, h, w, "ln2", spec.eps))], "residual2")
    else:  # y = LN2(h + FFN(h)),  h = LN1(x + MHA(x))
        h = _layer_norm(g, g.op("Add", [x, _mha(g, mha, mw, x, x, x, "mha/")], "residual1"), w, "ln1", spec.eps)
        y = _layer_norm(g, g.op("Add", [h, _ffn(g, ffn, fw, h)], "residual2"), w, "ln2", spec.eps)
    _named_output(g, y)
    return g.model(_out(spec), spec, f"block_{spec.norm}ln"), w


def build(spec: Spec, weights: Weights | None = None) -> tuple[onnx.ModelProto, Weights]:
    """Build the ONNX model for any spec; returns (model, weights) so the oracle can use them."""
    if isinstance(spec, MHASpec):
        return build_mha(spec, weights)
    if isinstance(spec, FFNSpec):
        return build_ffn(spec, weights)
    return build_block(spec, weights)
