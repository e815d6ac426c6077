"""ONNX ops TVM 0.27's Relax importer lacks, and the importer that adds them.

    from_onnx(model, dtype_dict)   TVM's ONNXGraphImporter with the converters below looked
                                   up first; an op it cannot import (unknown, or its converter
                                   fails) raises OnnxImportError naming the op, node and opset:
                                   "unsupported ONNX op(s): Celu (node 'act', opset 17)",
                                   "ONNX op Pow (node 'p', opset 15): TypeError: ...".

Attention (ai.onnx, opsets 23-25). TVM maps every "Attention" node to its com.microsoft
contrib converter, which reads the contrib-only `num_heads` attribute (KeyError 'num_heads').
Here a node with `num_heads` still goes to TVM's contrib converter; the standard op is lowered
to the plain decomposition, per ONNX's reference implementation (onnx.reference op_attention):

    scores = R.matmul(q, R.permute_dims(k)) * scale        # (B, h, S_q, S_kv)
    [scores = softcap * tanh(scores / softcap)]
    scores = scores + bias                                  # mask, causal, padding, window
    y      = R.matmul(R.nn.softmax(scores), v)              # (B, h, S_q, d_v)
    [y     = y * keep]                                  # 0 for a row with no key at all

The fused CPU attention kernel pattern-matches exactly matmul -> *scale -> (+bias) -> softmax
-> matmul, so nothing else is placed between them: every mask (bool attn_mask, additive
attn_mask, is_causal, nonpad_kv_seqlen, sliding window) is folded into ONE additive bias
(0 / -inf) built from the inputs, and the fully-masked-row rule (such a row is 0, not NaN)
is applied to the output, after the last matmul. qk_matmul_output follows the reference's
numbering (0: scaled scores, 1: after softcap, 2: after the bias, 3: after softmax).

The other converters fill gaps TVM's own leave on ops of transformer exports (each falls back
to TVM's converter outside its case): Reshape / Expand / ConstantOfShape / Split with the
shape or sizes as a runtime tensor, Col2Im (TVM has none: MobileViT V2's fold), an Einsum that
is a batched matmul (TVM's is one opaque kernel: CvT's attention unfused), ReduceMean
with an empty axes input, Pow of mixed or integer types, and LayerNormalization's Mean and
InvStdDev outputs (TVM returns zeros).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import onnx
import tvm
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as tvm_onnx

from blockforge.compile.frontend import symbolic
from blockforge.graph.model_io import numpy_dtype

_T = relax.op


class OnnxImportError(Exception):
    """A model TVM cannot import, as one line naming the op(s), node(s) and opset."""


def _node(node: onnx.NodeProto, opset: int) -> str:
    return f"{node.op_type} (node {node.name!r}, opset {opset})"


# ---------------------------------------------------------------- helpers


def _dims(e) -> list:
    """The shape of a tensor expression as ints (static) or PrimExprs (symbolic)."""
    shape = e.ty.shape
    if shape is None:
        raise ValueError("needs an input of known shape")
    return [int(d) if isinstance(d, tvm.tirx.IntImm) else d for d in shape.values]


def _dtype(e) -> str:
    return str(e.ty.dtype.dtype)


def _full(value: float, dtype: str):
    """A scalar constant of `dtype` (bfloat16 and friends included)."""
    return relax.const(np.array(value, dtype="float32").astype(numpy_dtype(dtype)))


# ---------------------------------------------------------------- Attention


_ONNX_FLOAT = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16",
               onnx.TensorProto.DOUBLE: "float64", onnx.TensorProto.BFLOAT16: "bfloat16"}


def _heads_first(bb, x, heads: int, what: str):
    """(B, S, heads * d) -> (B, heads, S, d)."""
    b, s, hidden = _dims(x)
    if not isinstance(hidden, int) or hidden % heads:
        raise ValueError(f"3-D {what} needs a static hidden size divisible by its number of heads "
                         f"({hidden} vs {heads})")
    x = bb.emit(_T.reshape(x, [b, s, heads, hidden // heads]))  # (B, S, h, d)
    return bb.emit(_T.permute_dims(x, [0, 2, 1, 3]))  # (B, h, S, d)


def _positions(bb, n, start=0):
    """int64 positions start .. start + n - 1 as a 1-D tensor (n, start: ints or PrimExprs)."""
    return bb.emit(_T.arange(start, start + n, 1, "int64"))


def _where_bias(bb, allowed, dtype: str):
    """bool `allowed` -> additive bias: 0 where allowed, -inf elsewhere."""
    return bb.emit(_T.where(allowed, _full(0.0, dtype), _full(-np.inf, dtype)))


def _attention_bias(bb, *, mask, dtype: str, sq, skv, past, nonpad, causal: bool, left: int, right: int):
    """The additive bias (0 / -inf / user values) of every mask, or None; and whether a row
    can end up fully masked (then the output rule `fully masked row -> 0` must be applied)."""
    terms, may_mask_row = [], False
    if mask is not None:
        may_mask_row = True
        if _dtype(mask) == "bool":
            mask = _where_bias(bb, mask, dtype)
        mdims = _dims(mask)
        pad = skv - mdims[-1] if isinstance(skv, int) and isinstance(mdims[-1], int) else 0
        if pad > 0:  # a mask shorter than the keys: the missing keys are masked out
            mask = bb.emit(_T.nn.pad(mask, [0, 0] * (len(mdims) - 1) + [0, pad], pad_value=float("-inf")))
        terms.append(mask)
    window = left >= 0 or right >= 0
    if window:
        may_mask_row = True
    # Causal and window masks compare query and key positions; queries are aligned to the
    # end of the keys when a cache precedes them: query i sits at key position offset + i.
    offset = None
    if causal or window:
        offset = _dims(past)[2] if past is not None else ("per-batch" if nonpad is not None else 0)

    def allowed(diff, scalar):  # diff = query position - key position
        ok = []
        if causal:
            ok.append(diff >= 0 if scalar else _T.greater_equal(diff, relax.const(0, "int64")))
        if window:
            w = []
            if left >= 0:
                w.append(diff <= left if scalar else _T.less_equal(diff, relax.const(left, "int64")))
            if right >= 0:
                w.append(diff >= -right if scalar else _T.greater_equal(diff, relax.const(-right, "int64")))
            ok.append(w[0] if len(w) == 1 else (w[0] & w[1] if scalar else _T.logical_and(w[0], w[1])))
        return ok

    if offset is not None and all(isinstance(d, int) for d in (sq, skv, offset)):
        diff = np.arange(sq)[:, None] + offset - np.arange(skv)[None, :]  # (S_q, S_kv), a constant
        terms += [relax.const(np.where(ok, 0.0, -np.inf).astype(numpy_dtype(dtype))) for ok in allowed(diff, True)]
    elif offset is not None:
        j = bb.emit(_T.reshape(_positions(bb, skv), [1, 1, skv]))  # (1, 1, S_kv)
        if offset == "per-batch":  # query i sits at nonpad[b] - S_q + i
            b = _dims(nonpad)[0]
            i = bb.emit(_T.add(_T.reshape(_positions(bb, sq, -sq), [1, sq, 1]),
                               _T.reshape(nonpad, [b, 1, 1])))  # (B, S_q, 1)
            may_mask_row = True  # a negative offset leaves rows with no key at all
        else:
            b = 1
            i = bb.emit(_T.reshape(_positions(bb, sq, offset), [1, sq, 1]))  # (1, S_q, 1)
        diff = bb.emit(_T.subtract(i, j))  # (B|1, S_q, S_kv)
        terms += [bb.emit(_T.reshape(_where_bias(bb, ok, dtype), [b, 1, sq, skv])) for ok in allowed(diff, False)]
    if nonpad is not None:  # keys at or past nonpad_kv_seqlen[b] are padding
        may_mask_row = True
        b = _dims(nonpad)[0]
        j = bb.emit(_T.reshape(_positions(bb, skv), [1, skv]))  # (1, S_kv)
        valid = bb.emit(_T.less(j, _T.reshape(nonpad, [b, 1])))  # (B, S_kv)
        terms.append(bb.emit(_T.reshape(_where_bias(bb, valid, dtype), [b, 1, 1, skv])))
    # Every term after the first is a 0 / -inf structural mask, and it replaces the bias where
    # -inf rather than adding to it: as ONNX Runtime, a NaN or +inf attn_mask value at a causally
    # masked key is dropped there (an add would give NaN), while a NaN score still is not.
    bias = None
    for t in terms:
        bias = t if bias is None else bb.emit(_T.where(_T.equal(t, _full(-np.inf, dtype)), t, bias))
    return bias, may_mask_row


def attention(bb, inputs, attr: dict, opset: int):
    """ONNX Attention (opset 23+) -> Relax: returns (Y, present_key, present_value, qk_matmul_output)."""
    q, k, v = inputs[0], inputs[1], inputs[2]
    mask, past_k, past_v = inputs[3], inputs[4], inputs[5]
    nonpad = inputs[6] if opset >= 24 else None
    if (past_k is None) != (past_v is None):
        raise ValueError("past_key and past_value must be given together")
    if nonpad is not None and past_k is not None:
        raise ValueError("nonpad_kv_seqlen cannot be combined with past_key/past_value")
    rank = len(_dims(q))
    if rank not in (3, 4) or len(_dims(k)) != rank or len(_dims(v)) != rank:
        raise ValueError(f"Q, K and V must all be 3-D or all 4-D (got ranks {len(_dims(q))}, "
                         f"{len(_dims(k))}, {len(_dims(v))})")
    dtype = _dtype(q)
    mode = int(attr.get("qk_matmul_output_mode", 0))
    if mode not in (0, 1, 2, 3):
        raise ValueError(f"qk_matmul_output_mode {mode} is not one of 0..3")
    softcap = float(attr.get("softcap", 0.0))
    left, right = int(attr.get("left_window_size", -1)), int(attr.get("right_window_size", -1))
    if rank == 3:
        if "q_num_heads" not in attr or "kv_num_heads" not in attr:
            raise ValueError("3-D inputs need the q_num_heads and kv_num_heads attributes")
        q = _heads_first(bb, q, int(attr["q_num_heads"]), "Q")  # (B, h_q, S_q, d)
        k = _heads_first(bb, k, int(attr["kv_num_heads"]), "K")  # (B, h_kv, S_kv, d)
        v = _heads_first(bb, v, int(attr["kv_num_heads"]), "V")  # (B, h_kv, S_kv, d_v)
    if past_k is not None:
        k = bb.emit(_T.concat([past_k, k], axis=2))  # (B, h_kv, S_past + S_kv, d)
        v = bb.emit(_T.concat([past_v, v], axis=2))  # (B, h_kv, S_past + S_kv, d_v)
    present_k, present_v = k, v
    b, hq, sq, dq = _dims(q)
    hk, skv = _dims(k)[1], _dims(k)[2]
    if not isinstance(dq, int):
        raise ValueError("the head size of Q must be static")
    if isinstance(hq, int) and isinstance(hk, int) and hq != hk:  # grouped-query attention
        if hq % hk:
            raise ValueError(f"q heads ({hq}) must be a multiple of kv heads ({hk})")
        k = bb.emit(_T.repeat(k, hq // hk, axis=1))  # (B, h_q, S_kv, d): kv head i serves q heads i*r..
        v = bb.emit(_T.repeat(v, hq // hk, axis=1))  # (B, h_q, S_kv, d_v)
    scale = float(attr["scale"]) if "scale" in attr else 1.0 / float(np.sqrt(dq))

    scores = bb.emit(_T.matmul(q, _T.permute_dims(k, [0, 1, 3, 2])))  # (B, h, S_q, S_kv)
    scores = bb.emit(_T.multiply(scores, _full(scale, dtype)))  # (B, h, S_q, S_kv)
    qk = scores
    if softcap > 0:
        scores = bb.emit(_T.multiply(_T.tanh(_T.divide(scores, _full(softcap, dtype))), _full(softcap, dtype)))
        qk = scores  # the reference's mode 0 and 1 both report the softcapped scores
    bias, may_mask_row = _attention_bias(bb, mask=mask, dtype=dtype, sq=sq, skv=skv, past=past_k, nonpad=nonpad,
                                         causal=bool(attr.get("is_causal", 0)), left=left, right=right)
    keep = None
    if may_mask_row:
        # A row whose bias is -inf everywhere has no key to attend: its output is 0, where
        # softmax would give NaN. keep = 1.0 for rows with a key, 0.0 for the others; their
        # bias becomes 0 (finite scores), and y * keep zeroes them. Arithmetic, not a where on
        # a per-row bool: TVM's CUDA codegen mistypes that broadcast bool when it vectorizes
        # the fused matmul epilogue ("no suitable conversion from ushort2 to float2").
        keys = _T.astype(_T.not_equal(bias, _full(-np.inf, dtype)), "int32")
        keep = bb.emit(_T.astype(_T.max(keys, axis=-1, keepdims=True), dtype))  # (.., S_q, 1)
        # Other rows: -inf -> the lowest finite value, whose exp underflows to 0 all the same.
        lowest = bb.emit(_T.multiply(keep, _full(-float(ml_dtypes.finfo(numpy_dtype(dtype)).max), dtype)))
        if mode == 2:
            qk = bb.emit(_T.add(scores, bias))  # the reference's -inf, before the fix
        # A select, not maximum(bias, lowest): a NaN in the mask must reach the output as in
        # ONNX Runtime, and max drops NaN (TVM's LLVM max is select(a > b, a, b), CUDA's fmaxf).
        bias = bb.emit(_T.where(_T.less(bias, lowest), lowest, bias))
    if bias is not None:
        scores = bb.emit(_T.add(scores, bias))  # (B, h, S_q, S_kv)
    if mode == 2 and keep is None:
        qk = scores
    precision = _ONNX_FLOAT.get(int(attr.get("softmax_precision", 0)), dtype)
    if precision != dtype:
        probs = bb.emit(_T.astype(_T.nn.softmax(_T.astype(scores, precision), axis=-1), dtype))
    else:
        probs = bb.emit(_T.nn.softmax(scores, axis=-1))  # (B, h, S_q, S_kv)
    y = bb.emit(_T.matmul(probs, v))  # (B, h, S_q, d_v)
    if keep is not None:
        y = bb.emit(_T.multiply(y, keep))
        if mode == 3:
            probs = bb.emit(_T.multiply(probs, keep))
    if mode == 3:
        qk = probs
    if rank == 3:
        dv = _dims(y)[3]
        y = bb.emit(_T.reshape(_T.permute_dims(y, [0, 2, 1, 3]), [b, sq, _dims(y)[1] * dv]))  # (B, S_q, h*d_v)
    return relax.Tuple([y, present_k, present_v, qk])


def _outputs(out, attr):
    """As many outputs as the node names (TVM binds a 1-field Tuple itself to a single output)."""
    n = max(1, int(attr["tvm_custom"]["num_outputs"]))
    return out.fields[0] if n == 1 else relax.Tuple(list(out.fields)[:n])


def attention_op(bb, inputs, attr, params, opset):
    """ai.onnx Attention (23, 24; 25's sliding window too). com.microsoft Attention (it has
    `num_heads`) stays with TVM's contrib converter."""
    if "num_heads" in attr:
        return None
    if opset < 23:
        raise ValueError("the standard Attention op needs opset 23 or later")
    return _outputs(attention(bb, inputs, attr, opset), attr)


# ---------------------------------------------------------------- runtime shape inputs
# TVM's converters want shapes, split sizes and axes as constants. The ops below also
# take them as runtime int64 tensors of static length (the ONNX backend tests pass them as
# graph inputs): the values become symbolic dims via tensor_to_shape + match_cast.


def _runtime_tensor(e) -> bool:
    return (isinstance(e, relax.Expr) and not isinstance(e, (tvm.ir.GenericConst, relax.ShapeExpr))
            and isinstance(getattr(e, "ty", None), relax.TensorType))


def _length(e) -> int | None:
    return tvm_onnx._get_known_tensor_length(e)


def _shape_tensor(bb, x):
    return bb.emit(_T.shape_to_tensor(_T.shape_of(x)))  # (rank,) int64


def _left_pad(bb, t, n: int, m: int, value: int):
    """(n,) int64 -> (m,) with `value` in front."""
    if m == n:
        return t
    return bb.emit(_T.concat([relax.const(np.full(m - n, value, np.int64), "int64"), t], axis=0))


def _runtime_shape(inputs, params):
    """(data, shape tensor, its length) when Reshape/Expand get their target shape at run time
    (TVM's own converter handles a constant one: then None)."""
    data, shape = inputs[0], tvm_onnx.get_constant(inputs[1], params)
    n = _length(shape) if _runtime_tensor(shape) and _runtime_tensor(data) else None
    return None if n is None else (data, shape, n)


def reshape_op(bb, inputs, attr, params, opset):
    got = _runtime_shape(inputs, params)
    if got is None:
        return None
    data, shape, n = got
    rank = len(_dims(data))
    s = shape
    if not attr.get("allowzero", 0):  # 0 copies the input's dim at that position
        src = _shape_tensor(bb, data)
        src = (bb.emit(_T.strided_slice(src, axes=[0], begin=[0], end=[n])) if rank >= n
               else bb.emit(_T.concat([src, relax.const(np.zeros(n - rank, np.int64), "int64")], axis=0)))
        s = bb.emit(_T.where(_T.equal(s, relax.const(0, "int64")), src, s))
    minus = bb.emit(_T.equal(s, relax.const(-1, "int64")))  # -1: whatever size is left
    total = bb.emit(_T.prod(_shape_tensor(bb, data)))
    known = bb.emit(_T.prod(_T.where(minus, relax.const(1, "int64"), s)))
    # where() evaluates both sides: with a 0 dim (allowzero) total // known would be an
    # integer division by zero (SIGFPE), even where no -1 asks for it.
    known = bb.emit(_T.maximum(known, relax.const(1, "int64")))
    s = bb.emit(_T.where(minus, _T.floor_divide(total, known), s))
    return _T.reshape(data, tvm_onnx._tensor_to_shape_expr(bb, s, n, "reshape_dim"))


def expand_op(bb, inputs, attr, params, opset):
    got = _runtime_shape(inputs, params)
    if got is None:
        return None
    data, shape, n = got
    rank = len(_dims(data))
    m = max(n, rank)
    have = _left_pad(bb, _shape_tensor(bb, data), rank, m, 1)
    want = _left_pad(bb, shape, n, m, 1)
    # ONNX Expand broadcasts both ways (numpy rules): a dim of 1 in the input takes the
    # requested size; any other input dim stays (the request must then be 1 or equal).
    out = bb.emit(_T.where(_T.equal(have, relax.const(1, "int64")), want, have))
    return _T.broadcast_to(data, tvm_onnx._tensor_to_shape_expr(bb, out, m, "expand_dim"))


def constant_of_shape_op(bb, inputs, attr, params, opset):
    shape = tvm_onnx.get_constant(inputs[0], params)
    n = _length(shape) if _runtime_tensor(shape) else None
    if n is None:
        return None
    value = tvm_onnx.get_numpy(attr["value"]).reshape(()) if "value" in attr else np.array(0, np.float32)
    return _T.full(tvm_onnx._tensor_to_shape_expr(bb, shape, n, "fill_dim"), relax.const(value, str(value.dtype)),
                   str(value.dtype))


def split_op(bb, inputs, attr, params, opset):
    if opset < 13 or inputs[1] is None:
        return None
    data, sizes = inputs[0], tvm_onnx.get_constant(inputs[1], params)
    n = _length(sizes) if _runtime_tensor(sizes) else None
    if n is None:
        return None
    axis = int(attr.get("axis", 0)) % len(_dims(data))
    begin, outs = 0, []
    for size in tvm_onnx._tensor_to_shape_expr(bb, sizes, n, "split_size").values:
        outs.append(bb.emit(_T.strided_slice(data, axes=[axis], begin=[begin], end=[begin + size])))
        begin = begin + size
    return outs[0] if n == 1 else relax.Tuple(outs)


def reduce_mean_op(bb, inputs, attr, params, opset):
    """An `axes` input of static length 0 is known without its values: no axes."""
    if opset < 18 or inputs[1] is None:
        return None
    axes = tvm_onnx.get_constant(inputs[1], params)
    if not _runtime_tensor(axes) or _length(axes) != 0:
        return None
    if attr.get("noop_with_empty_axes", 0):
        return inputs[0]
    return _T.mean(inputs[0], None, bool(attr.get("keepdims", 1)))


def pow_op(bb, inputs, attr, params, opset):
    """ONNX Pow takes any exponent type (the result has the base's); Relax's power wants
    one float dtype."""
    x, y = inputs[0], inputs[1]
    if not all(isinstance(getattr(e, "ty", None), relax.TensorType) for e in (x, y)):
        return None
    dx, dy = _dtype(x), _dtype(y)
    if dx == dy and dx.startswith(("float", "bfloat")):
        return None
    if dx.startswith(("float", "bfloat")):
        return _T.power(x, _T.astype(y, dx))
    # An integer base: float64 is exact for every integer result below 2**53.
    r = _T.power(_T.astype(x, "float64"), _T.astype(y, "float64"))
    return _T.astype(_T.round(r), dx)


def clip_op(bb, inputs, attr, params, opset):
    """Clip of a float tensor by constant bounds (ReLU6: 0, 6) as Relax's clip op; TVM's converter
    emits TIR kernels (topi maximum / minimum) no Relax rewrite can see through, so a conv's
    ReLU6 stayed a kernel of its own after the conv's GEMM (conv/rewrite.py _sink_flat moves Relax
    ops only). A NaN bound is no bound (as ONNX Runtime and TVM's converter treat it)."""
    x = inputs[0]
    if not isinstance(getattr(x, "ty", None), relax.TensorType) or not _dtype(x).startswith("float"):
        return None
    if opset < 11:
        lo, hi = float(attr.get("min", -np.inf)), float(attr.get("max", np.inf))
    else:
        bounds = []
        for i, default in ((1, -np.inf), (2, np.inf)):
            b = inputs[i] if len(inputs) > i else None
            if b is None:
                bounds.append(default)
                continue
            c = tvm_onnx.get_constant(b, params)
            if not isinstance(c, tvm.ir.GenericConst) or c.value.numpy().size != 1:
                return None
            bounds.append(float(c.value.numpy().reshape(())))
        lo, hi = bounds
    lo, hi = (-np.inf if np.isnan(lo) else lo), (np.inf if np.isnan(hi) else hi)
    if lo > hi:  # ONNX: every output is max; Relax's clip (max(min(x, hi), lo)) would give min
        return None
    return _T.clip(x, lo, hi)


def einsum_op(bb, inputs, attr, params, opset):
    """A two-operand Einsum that is a batched matrix product (CvT's attention: "bhlk,bhtk->bhlt",
    "bhlt,bhtv->bhlv") as R.matmul between permute_dims / reshapes. TVM imports every Einsum as
    one opaque TE kernel, which neither the attention fuser nor the matmul rule sees: CvT's six
    attentions ran unfused on it. Each index is batch (in both operands and the output), row
    (first operand and output), column (second operand and output) or contracted (both operands,
    not the output); anything else (ellipsis, a diagonal, a one-sided sum) stays TVM's."""
    eq = attr.get("equation", b"")
    eq = (eq.decode() if isinstance(eq, bytes) else str(eq)).replace(" ", "")
    if len(inputs) != 2 or "..." in eq or eq.count("->") != 1 or eq.count(",") != 1:
        return None
    lhs, so = eq.split("->")
    sa, sb = lhs.split(",")
    a, b = inputs
    da, db = _dims(a), _dims(b)
    if any(len(set(t)) != len(t) for t in (sa, sb, so)) or len(sa) != len(da) or len(sb) != len(db) \
            or set(so) - set(sa) - set(sb) or _dtype(a) != _dtype(b):
        return None
    batch = [i for i in so if i in sa and i in sb]
    rows = [i for i in so if i in sa and i not in sb]
    cols = [i for i in so if i in sb and i not in sa]
    red = [i for i in sa if i in sb and i not in so]
    if set(sa) != set(batch + rows + red) or set(sb) != set(batch + cols + red):
        return None
    size = {**dict(zip(sa, da)), **dict(zip(sb, db))}

    def arrange(x, sub, order, groups):
        perm = [sub.index(i) for i in order]
        if perm != list(range(len(sub))):
            x = _T.permute_dims(x, perm)
        if any(len(g) != 1 for g in groups):  # each group one axis: (batch..., rows, red) etc.
            shape = [size[i] for i in batch] + [math.prod(size[i] for i in g) for g in groups]
            x = _T.reshape(x, shape)
        return x

    x = arrange(a, sa, batch + rows + red, [rows, red])
    y = arrange(b, sb, batch + red + cols, [red, cols])
    out = _T.matmul(x, y)
    got = batch + rows + cols
    if len(rows) != 1 or len(cols) != 1:
        out = _T.reshape(out, [size[i] for i in got])
    perm = [got.index(i) for i in so]
    return out if perm == list(range(len(got))) else _T.permute_dims(out, perm)


def col2im_op(bb, inputs, attr, params, opset):
    """Col2Im (opset 18; MobileViT V2's fold): columns (N, C * prod(block), L) summed back into
    the image (N, C, *image_shape). Blocks that tile the image exactly (stride = block, no
    dilation or pads: the fold of unfold's patches) are a reshape and a transpose, which the
    layout kernels take; any other geometry is one TE kernel summing the prod(block) taps that
    land on each pixel. image_shape and block_shape must be constants: the output's shape."""
    from tvm import te, tirx

    x = inputs[0]
    shapes = []
    for i, what in ((1, "image_shape"), (2, "block_shape")):
        c = tvm_onnx.get_constant(inputs[i], params)
        if not isinstance(c, tvm.ir.GenericConst):
            raise ValueError(f"Col2Im's {what} must be a constant (it is the output's shape)")
        shapes.append([int(v) for v in c.value.numpy().reshape(-1)])
    image, block = shapes
    d = len(image)
    dil = [int(v) for v in attr.get("dilations", [1] * d)]
    pads = [int(v) for v in attr.get("pads", [0] * (2 * d))]
    strides = [int(v) for v in attr.get("strides", [1] * d)]
    dims = _dims(x)
    if len(block) != d or len(dil) != d or len(strides) != d or len(pads) != 2 * d or len(dims) != 3 \
            or min(image + block + dil + strides) < 1 or min(pads) < 0:
        raise ValueError(f"Col2Im with image_shape {image}, block_shape {block}, dilations {dil}, pads {pads}, "
                         f"strides {strides} on a rank-{len(dims)} input: inconsistent")
    n_blocks = [(image[i] + pads[i] + pads[d + i] - dil[i] * (block[i] - 1) - 1) // strides[i] + 1 for i in range(d)]
    taps = int(np.prod(block))
    if not all(isinstance(v, (int, np.integer)) for v in dims[1:]) or dims[1] % taps \
            or dims[2] != int(np.prod(n_blocks)) or min(n_blocks) < 1:
        raise ValueError(f"Col2Im input of shape {dims} does not hold {taps}-tap columns of {n_blocks} blocks")
    c = dims[1] // taps
    if strides == block and dil == [1] * d and not any(pads) and all(b * k == m for b, k, m in zip(n_blocks, block, image)):
        # (N, C, k1.., b1..) -> (N, C, b1, k1, b2, k2, ..) -> (N, C, *image)
        t = _T.reshape(x, [dims[0], c, *block, *n_blocks])
        order = [0, 1] + [a for i in range(d) for a in (2 + d + i, 2 + i)]
        return _T.reshape(_T.permute_dims(t, order), [dims[0], c, *image])

    def fold(xt):
        r = [te.reduce_axis((0, k), f"k{i}") for i, k in enumerate(block)]

        def f(n, ch, *pos):
            cond, col, row = tirx.const(True, "bool"), ch, 0
            for i in range(d):
                off = pos[i] + pads[i] - r[i] * dil[i]  # where block i's tap r[i] must start
                cond = tirx.all(cond, off >= 0, off % strides[i] == 0, off // strides[i] < n_blocks[i])
                col = col * block[i] + r[i]
                row = row * n_blocks[i] + tirx.max(off, 0) // strides[i]
            return te.sum(tirx.if_then_else(cond, xt[n, col, row], tirx.const(0, xt.dtype)), axis=r)
        return te.compute([dims[0], c, *image], f, name="col2im")

    return bb.emit_te(fold, x)


def layer_norm_op(bb, inputs, attr, params, opset):
    """TVM returns 0-d zeros for LayerNormalization's Mean and InvStdDev outputs; computed
    here when the node asks for them (Y stays TVM's R.nn.layer_norm)."""
    n = int(attr["tvm_custom"]["num_outputs"])
    if n <= 1:
        return None
    y = tvm_onnx.LayerNormalization.get_converter(opset)(bb, inputs, attr, params).fields[0]
    x = inputs[0]
    rank = len(_dims(x))
    axes = list(range(int(attr.get("axis", -1)) % rank, rank))
    stash = "float32" if int(attr.get("stash_type", 1)) == 1 else _dtype(x)
    xs = x if _dtype(x) == stash else bb.emit(_T.astype(x, stash))
    mean = bb.emit(_T.mean(xs, axes, keepdims=True))  # normalized axes kept as 1
    var = bb.emit(_T.mean(_T.square(_T.subtract(xs, mean)), axes, keepdims=True))
    inv = bb.emit(_T.rsqrt(_T.add(var, relax.const(float(attr.get("epsilon", 1e-5)), stash))))
    return relax.Tuple([bb.emit(y), mean, inv][:n])


# ---------------------------------------------------------------- the importer


# op -> converter(bb, inputs, attr, params, opset): a Relax expression, or None where TVM's own
# converter handles the case.
CONVERTERS = {
    "Attention": attention_op,
    "Clip": clip_op,
    "Col2Im": col2im_op,
    "Einsum": einsum_op,
    "ConstantOfShape": constant_of_shape_op,
    "Expand": expand_op,
    "LayerNormalization": layer_norm_op,
    "Pow": pow_op,
    "ReduceMean": reduce_mean_op,
    "Reshape": reshape_op,
    "Split": split_op,
}


class _Importer(tvm_onnx.ONNXGraphImporter):
    """TVM's importer, with CONVERTERS first; it remembers the node being converted so any
    failure can name it."""

    node: onnx.NodeProto | None = None
    weights_dir = None  # where the model's external tensors are (isolate.prepare_untrusted's folder)

    shape_values: symbolic.ShapeValues | None = None

    def _shape_values(self) -> symbolic.ShapeValues:
        if self.shape_values is None:  # the inputs' dims are known once the graph inputs are parsed
            self.shape_values = symbolic.ShapeValues(
                [list(v.ty.shape.values) for v in self._inputs.values()
                 if isinstance(getattr(v, "ty", None), relax.TensorType) and isinstance(v.ty.shape, relax.ShapeExpr)])
        return self.shape_values

    def _parse_array(self, tensor_proto):
        """An external tensor is read from weights_dir into TVM a tensor at a time; onnx's
        to_array would load it into the proto itself, where it stays (the whole model twice)."""
        if self.weights_dir is not None and tensor_proto.data_location == onnx.TensorProto.EXTERNAL:
            from blockforge.graph.model_io import read_external

            return tvm.runtime.tensor(read_external(tensor_proto, self.weights_dir))
        return super()._parse_array(tensor_proto)

    def _parse_value_proto(self, value_proto):
        if isinstance(value_proto, onnx.NodeProto):  # called once per node, before converting it
            self.node = value_proto
        return super()._parse_value_proto(value_proto)

    def _check_for_unsupported_ops(self, graph) -> None:
        known = set(tvm_onnx._get_convert_map()) | set(CONVERTERS) | {"If", "Constant"}
        first: dict[str, onnx.NodeProto] = {}
        for node in graph.node:
            if node.op_type not in known:
                first.setdefault(node.op_type, node)
        if first:  # every op TVM's importer has no converter for, with the first node using it
            raise OnnxImportError("unsupported ONNX op(s): " + ", ".join(_node(n, self.opset) for n in first.values()))

    def _convert_operator(self, op_name, inputs, attrs, opset):
        node = self.node if self.node is not None and self.node.op_type == op_name else None
        if node is not None:  # shape arithmetic on symbolic dims (compile/frontend/symbolic.py)
            sv = self._shape_values()
            v = sv.evaluate(node, inputs, attrs) if len(node.output) == 1 else None
            if v is not None:
                sv.table[node.output[0]] = v
                return self.bb.normalize(sv.to_relax(self.bb, v))
            sym = symbolic.consume(sv, self.bb, node, inputs, attrs)
            if sym is not None:
                return self.bb.normalize(sym)
            inputs = symbolic.unify_broadcast(sv, self.bb, op_name, inputs)
        if op_name in CONVERTERS:
            sym = CONVERTERS[op_name](self.bb, inputs, attrs, [self._nodes, self._params], opset)
            if sym is not None:
                return self.bb.normalize(sym)
        return super()._convert_operator(op_name, inputs, attrs, opset)


def _reason(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    # TVM's native errors carry their traceback first and the cause last; Python's the cause first.
    text = lines[-1] if "Traceback" in str(e) or type(e).__module__.startswith("tvm") else lines[0]
    return f"{type(e).__name__}: {text}"[:300]


def default_opset(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return int(o.version)
    return 1


def from_onnx(model: onnx.ModelProto, dtype_dict: dict[str, str], keep_params_in_input: bool = True,
              weights_dir=None):
    """Like tvm.relax.frontend.onnx.from_onnx (the ONNX checker is the caller's), with the
    converters above. Unnamed nodes are named '#<index>' so an error can point at them.
    weights_dir: the folder of the model's external tensors (model_io.read_external)."""
    import contextlib
    import io

    if any(not n.name for n in model.graph.node):
        m = onnx.ModelProto()
        m.CopyFrom(model)
        for i, n in enumerate(m.graph.node):
            n.name = n.name or f"#{i}"
        model = m
    importer = _Importer(None, dtype_dict, keep_params_in_input=keep_params_in_input)
    importer.weights_dir = weights_dir
    opset = default_opset(model)
    try:
        # TVM prints "Error converting operator ..." on stdout before re-raising: the error says it.
        with contextlib.redirect_stdout(io.StringIO()):
            return importer.from_onnx(model.graph, opset)
    except OnnxImportError:
        raise
    except Exception as e:  # noqa: BLE001 - any importer failure becomes one line naming the node
        if importer.node is None:
            raise
        raise OnnxImportError(f"ONNX op {_node(importer.node, opset)}: {_reason(e)}") from None
