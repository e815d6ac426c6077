"""Shape values: small integer tensors computed from symbolic dims, kept as TIR expressions.

TVM's importer carries a Shape output as a ShapeExpr through a few ops only (Gather, Concat,
Slice, ...); any other refuses it ("Node .../Unsqueeze_7 cannot handle ShapeExpr inputs"), and a
shape reaching Reshape/Expand as a runtime tensor gets fresh dims unrelated to the model's
("reshape_dim"), after which shapes are unknown ("Reshape expects the input tensor to have known
shape"). Decoders exported with a KV cache compute their positions and causal mask from
Shape(past_key_values.0.key)[2] (GPT-2: Range(past, past + seq), Unsqueeze, LessOrEqual; Llama:
the same through Add/Expand/Where), so a symbolic past did not import.

Here an int/bool value computed from a symbolic dim is evaluated as a numpy array of TIR
expressions (past + 1, ...), simplified with the dims' bounds (0..65536). Ops that consume a
shape (Reshape, Expand, ConstantOfShape, Range, Slice, Tile) are built from those expressions,
so their outputs have shapes in the model's own dims (a causal mask of (seq, past + seq)). The
value is also emitted as a tensor for ops that use it as data (a Gather of positions).
Only values that depend on a symbolic dim take this path: a static model imports as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
import tvm.sym
from tvm import relax, tirx

MAX_ELEMENTS = 64  # a shape value: shapes, positions of one step; a Range over past is a tensor
DIM_BOUND = 65536  # symbolic dims are bounded so (model_io.MAX_BOUND_DIM)

_INT = ("int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64")


@dataclass
class Value:
    """A small int/bool tensor whose elements are Python ints/bools or TIR expressions."""

    array: np.ndarray  # dtype object
    dtype: str  # the ONNX tensor's element type, as Relax names it

    def symbolic(self) -> bool:
        return any(_is_expr(e) for e in self.array.flat)


def _is_expr(e) -> bool:
    return not isinstance(e, (int, bool, np.generic)) and tvm.ir.is_prim_expr(e)


def _obj(a) -> np.ndarray:
    """An object array of Python ints/bools and expressions (np.frompyfunc gives a bare
    object for 0-d inputs; numpy integers become Python ones)."""
    if not isinstance(a, np.ndarray):
        out = np.empty((), dtype=object)
        out[()] = a.item() if isinstance(a, np.generic) else a
        return out
    out = np.empty(a.shape, dtype=object)
    for i, e in np.ndenumerate(a):
        out[i] = e.item() if isinstance(e, np.generic) else e
    return out


def _ints(v: Value | None) -> list | None:
    """The elements as Python ints, or None when one is an expression."""
    if v is None or v.symbolic():
        return None
    return [int(e) for e in v.array.flat]


class ShapeValues:
    """The importer's table of shape values, ONNX name -> Value."""

    def __init__(self, input_shapes):
        self.table: dict[str, Value] = {}
        self.analyzer = tvm.sym.Analyzer()
        seen = set()
        for shape in input_shapes:
            for d in shape:
                if isinstance(d, tirx.Var) and d.name not in seen:
                    seen.add(d.name)
                    self.analyzer.bind(d, tvm.ir.Range(0, DIM_BOUND + 1))

    # ------------------------------------------------------------ reading values

    def value(self, name: str, expr) -> Value | None:
        if name in self.table:
            return self.table[name]
        if isinstance(expr, tvm.ir.GenericConst):
            dt = str(expr.ty.dtype)
            a = expr.value.numpy()
            if (dt in _INT or dt == "bool") and a.size <= MAX_ELEMENTS:
                return Value(_obj(a), dt)
        if isinstance(expr, relax.ShapeExpr):
            return Value(_obj(np.array([self._elem(e) for e in expr.values], dtype=object)), "int64")
        if _is_expr(expr):  # a scalar (TVM's Gather of a ShapeExpr gives one)
            return Value(_obj(self._elem(expr)), str(expr.ty))
        return None

    def _elem(self, e):
        e = self.analyzer.simplify(e) if _is_expr(e) else e
        if isinstance(e, tirx.IntImm):
            return bool(e.value) if str(e.ty) == "bool" else int(e.value)
        return e

    def dims(self, expr) -> list | None:
        """A tensor expression's dims (ints / expressions), None when its shape is unknown."""
        ty = getattr(expr, "ty", None)
        if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
            return None
        return [self._elem(d) for d in ty.shape.values]

    # ------------------------------------------------------------ emitting

    def to_relax(self, bb, v: Value):
        """The value as a tensor of its dtype: a constant when static, else computed from the dims."""
        if not v.symbolic():
            return relax.const(np.array(v.array.tolist(), dtype=v.dtype).reshape(v.array.shape), v.dtype)
        flat = [self._as_int(e) for e in v.array.flat]
        t = bb.emit(relax.op.shape_to_tensor(relax.ShapeExpr(flat)))
        if v.array.ndim != 1:
            t = bb.emit(relax.op.reshape(t, list(v.array.shape)))
        if v.dtype != "int64":
            t = bb.emit(relax.op.astype(t, v.dtype))
        return t

    @staticmethod
    def _as_int(e):
        if isinstance(e, (bool, np.bool_)):
            return tirx.const(int(e), "int64")
        if isinstance(e, int):
            return tirx.const(e, "int64")
        if str(e.ty) == "bool":
            return tirx.Select(e, tirx.const(1, "int64"), tirx.const(0, "int64"))
        return e if str(e.ty) == "int64" else e.astype("int64")

    def simplify(self, a: np.ndarray) -> np.ndarray:
        out = np.empty(a.shape, dtype=object)
        for i, e in np.ndenumerate(a):
            out[i] = self._elem(e)
        return out

    # ------------------------------------------------------------ evaluating

    def evaluate(self, node, inputs, attrs) -> Value | None:
        """The node's output as a Value when it is a small int/bool tensor computed from a
        symbolic dim; None when not (TVM's converter, or a shape consumer, builds it)."""
        op = node.op_type
        names = list(node.input) + [""] * (len(inputs) - len(node.input))
        vals = [self.value(n, e) if e is not None else None for n, e in zip(names, inputs)]
        if op in ("Shape", "Size"):
            dims = self.dims(inputs[0])
            if dims is None or not any(_is_expr(d) for d in dims):
                return None
            if op == "Size":
                n = 1
                for d in dims:
                    n = n * d
                return Value(_obj(self._elem(n)), "int64")
            start, end = attrs.get("start", 0), attrs.get("end", None)
            return Value(_obj(np.array(dims[slice(start, end)], dtype=object)), "int64")
        if not any(v is not None and v.symbolic() for v in vals):
            return None
        fn = _EVAL.get(op)
        if fn is None:
            return None
        try:
            out = fn(self, vals, attrs, inputs)
        except (ValueError, TypeError, IndexError, KeyError, NotImplementedError):
            return None  # not a form evaluated here: TVM's converter gets it
        if out is None or out.array.size > MAX_ELEMENTS:
            return None
        out.array = self.simplify(out.array)
        return out


# ---------------------------------------------------------------- elementwise helpers


def _binary(f, dtype: str | None = None):
    """Elementwise with numpy broadcasting; the result has `dtype` (comparisons: bool) or the
    first operand's."""
    uf = np.frompyfunc(f, 2, 1)

    def run(sv, vals, attrs, inputs):
        a, b = vals[0], vals[1]
        if a is None or b is None:
            return None
        return Value(_obj(uf(a.array, b.array)), dtype or a.dtype)
    return run


def _compare(f):
    return _binary(f, "bool")


def _div(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return int(a / b) if b else None  # ONNX integer Div truncates
    return tirx.truncdiv(a, b)


def _mod(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a % b
    return tirx.floormod(a, b)  # fmod=0: the result has the divisor's sign


def _pe(x):
    return tirx.const(x, "int64") if isinstance(x, int) and not isinstance(x, bool) else x


def _cmp(kind):
    def f(a, b):
        if isinstance(a, (int, bool)) and isinstance(b, (int, bool)):
            return {"eq": a == b, "lt": a < b, "gt": a > b, "le": a <= b, "ge": a >= b}[kind]
        a, b = _pe(a), _pe(b)
        return {"eq": tirx.EQ, "lt": tirx.LT, "gt": tirx.GT, "le": tirx.LE, "ge": tirx.GE}[kind](a, b)
    return f


def _bool(e):
    if isinstance(e, (bool, int)):
        return tirx.const(bool(e), "bool")
    return e if str(e.ty) == "bool" else tirx.NE(e, tirx.const(0, str(e.ty)))


def _logic(kind):
    def f(a, b):
        if isinstance(a, (bool, int)) and isinstance(b, (bool, int)):
            return {"and": bool(a) and bool(b), "or": bool(a) or bool(b), "xor": bool(a) != bool(b)}[kind]
        a, b = _bool(a), _bool(b)
        return {"and": tirx.And(a, b), "or": tirx.Or(a, b), "xor": tirx.Or(tirx.And(a, tirx.Not(b)),
                                                                          tirx.And(tirx.Not(a), b))}[kind]
    return f


def _select(c, x, y):
    if isinstance(c, (bool, int)):
        return x if c else y
    return tirx.Select(_bool(c), _pe(x), _pe(y))


def _variadic(f):
    def run(sv, vals, attrs, inputs):
        if any(v is None for v in vals):
            return None
        uf = np.frompyfunc(f, 2, 1)
        acc = vals[0].array
        for v in vals[1:]:
            acc = uf(acc, v.array)
        return Value(_obj(acc), vals[0].dtype)
    return run


def _max(a, b):
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else tirx.max(_pe(a), _pe(b))


def _min(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else tirx.min(_pe(a), _pe(b))


# ---------------------------------------------------------------- structural ops


def _axes(vals, attrs, index: int) -> list | None:
    if "axes" in attrs:
        return [int(a) for a in attrs["axes"]]
    if len(vals) > index and vals[index] is not None:
        return _ints(vals[index])
    return None


def _cast(sv, vals, attrs, inputs):
    from tvm.relax.frontend.onnx.onnx_frontend import get_type

    a, to = vals[0], str(get_type(attrs["to"]))
    if to == "bool":
        return Value(_obj(np.frompyfunc(lambda e: bool(e) if isinstance(e, (int, bool)) else _bool(e), 1, 1)(a.array)),
                     "bool")
    if to not in _INT:
        return None  # a float position: computed by TVM from the materialised tensor
    conv = np.frompyfunc(lambda e: int(e) if isinstance(e, (int, bool)) else
                         (tirx.Select(e, tirx.const(1, "int64"), tirx.const(0, "int64")) if str(e.ty) == "bool" else e),
                         1, 1)
    return Value(_obj(conv(a.array)), to)


def _gather(sv, vals, attrs, inputs):
    data, idx = vals[0], _ints(vals[1]) if vals[1] is not None else None
    if data is None or idx is None:
        return None
    axis = int(attrs.get("axis", 0))
    shape = vals[1].array.shape
    ind = np.array(idx, dtype=np.int64).reshape(shape)
    n = data.array.shape[axis]
    ind = np.where(ind < 0, ind + n, ind)
    return Value(_obj(np.take(data.array, ind, axis=axis)), data.dtype)


def _unsqueeze(sv, vals, attrs, inputs):
    axes = _axes(vals, attrs, 1)
    if vals[0] is None or axes is None:
        return None
    a = vals[0].array
    rank = a.ndim + len(axes)
    for ax in sorted(x % rank for x in axes):
        a = np.expand_dims(a, ax)
    return Value(_obj(a), vals[0].dtype)


def _squeeze(sv, vals, attrs, inputs):
    a = vals[0].array
    axes = _axes(vals, attrs, 1)
    axes = tuple(x % a.ndim for x in axes) if axes else tuple(i for i, d in enumerate(a.shape) if d == 1)
    return Value(_obj(np.squeeze(a, axis=axes)), vals[0].dtype)


def _concat(sv, vals, attrs, inputs):
    if any(v is None for v in vals):
        return None
    return Value(_obj(np.concatenate([v.array for v in vals], axis=int(attrs.get("axis", 0)))), vals[0].dtype)


def _reshape(sv, vals, attrs, inputs):
    shape = _ints(vals[1])
    if vals[0] is None or shape is None:
        return None
    a = vals[0].array
    shape = [a.shape[i] if s == 0 and not attrs.get("allowzero", 0) else s for i, s in enumerate(shape)]
    return Value(_obj(a.reshape(shape)), vals[0].dtype)


def _slice(sv, vals, attrs, inputs):
    a = vals[0]
    if a is None:
        return None
    if "starts" in attrs:  # opset < 10
        starts, ends, axes, steps = list(attrs["starts"]), list(attrs["ends"]), attrs.get("axes"), None
    else:
        starts, ends = _ints(vals[1]), _ints(vals[2])
        axes = _ints(vals[3]) if len(vals) > 3 and vals[3] is not None else None
        steps = _ints(vals[4]) if len(vals) > 4 and vals[4] is not None else None
    if starts is None or ends is None:
        return None
    axes = list(range(len(starts))) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    idx = [slice(None)] * a.array.ndim
    for s, e, ax, st in zip(starts, ends, axes, steps):
        idx[ax % a.array.ndim] = slice(s, e, st)
    return Value(_obj(a.array[tuple(idx)]), a.dtype)


def _where(sv, vals, attrs, inputs):
    if any(v is None for v in vals):
        return None
    return Value(_obj(np.frompyfunc(_select, 3, 1)(vals[0].array, vals[1].array, vals[2].array)), vals[1].dtype)


def _unary(f, dtype=None):
    def run(sv, vals, attrs, inputs):
        return Value(_obj(np.frompyfunc(f, 1, 1)(vals[0].array)), dtype or vals[0].dtype)
    return run


def _range(sv, vals, attrs, inputs):
    if any(v is None or v.array.size != 1 for v in vals):
        return None
    start, limit, delta = (v.array.flat[0] for v in vals)
    if not isinstance(delta, int) or delta == 0:
        return None
    n = sv._elem(tirx.max(_pe(0), tirx.truncdiv(_pe(limit) - _pe(start) + (delta - 1 if delta > 0 else delta + 1),
                                                 _pe(delta))))
    if not isinstance(n, int) or n > MAX_ELEMENTS:
        return None
    return Value(_obj(np.array([start + i * delta for i in range(n)], dtype=object)), vals[0].dtype)


def _expand(sv, vals, attrs, inputs):
    shape = _ints(vals[1])
    if vals[0] is None or shape is None:
        return None
    a = vals[0].array
    target = np.broadcast_shapes(a.shape, tuple(shape))
    return Value(_obj(np.broadcast_to(a, target).copy()), vals[0].dtype)


_EVAL = {
    "Identity": lambda sv, vals, attrs, inputs: vals[0],
    "Cast": _cast,
    "Gather": _gather,
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Concat": _concat,
    "Reshape": _reshape,
    "Slice": _slice,
    "Expand": _expand,
    "Range": _range,
    "Add": _binary(lambda a, b: a + b),
    "Sub": _binary(lambda a, b: a - b),
    "Mul": _binary(lambda a, b: a * b),
    "Div": _binary(_div),
    "Mod": _binary(_mod),
    "Max": _variadic(_max),
    "Min": _variadic(_min),
    "Neg": _unary(lambda a: -a),
    "Abs": _unary(lambda a: abs(a) if isinstance(a, int) else tirx.abs(a)),
    "Equal": _compare(_cmp("eq")),
    "Less": _compare(_cmp("lt")),
    "Greater": _compare(_cmp("gt")),
    "LessOrEqual": _compare(_cmp("le")),
    "GreaterOrEqual": _compare(_cmp("ge")),
    "And": _compare(_logic("and")),
    "Or": _compare(_logic("or")),
    "Xor": _compare(_logic("xor")),
    "Not": _unary(lambda a: (not a) if isinstance(a, (bool, int)) else tirx.Not(_bool(a)), "bool"),
    "Where": _where,
}


# ---------------------------------------------------------------- shape consumers


def _pos(e):
    return e if _is_expr(e) else tirx.const(int(e), "int64")


def consume(sv: ShapeValues, bb, node, inputs, attrs):
    """Reshape / Expand / ConstantOfShape / Range / Slice / Tile whose shape-like input is a
    symbolic value: built from its expressions. None: not this case."""
    op = node.op_type
    names = list(node.input) + [""] * (len(inputs) - len(node.input))
    vals = [sv.value(n, e) if e is not None else None for n, e in zip(names, inputs)]
    if not any(v is not None and v.symbolic() for v in vals[1 if op not in ("ConstantOfShape", "Range") else 0:]):
        return None
    if op == "Reshape":
        dims, shape = sv.dims(inputs[0]), vals[1]
        if dims is None or shape is None:
            return None
        out = list(shape.array.flat)
        out = [dims[i] if (isinstance(s, int) and s == 0 and not attrs.get("allowzero", 0)) else s
               for i, s in enumerate(out)]
        if any(isinstance(s, int) and s == -1 for s in out):
            total, known = 1, 1
            for d in dims:
                total = total * d
            for s in out:
                if not (isinstance(s, int) and s == -1):
                    known = known * s
            out = [tirx.floordiv(_pos(total), _pos(known)) if isinstance(s, int) and s == -1 else s for s in out]
        return relax.op.reshape(inputs[0], relax.ShapeExpr([_pos(sv._elem(s)) for s in out]))
    if op == "Expand":
        dims, shape = sv.dims(inputs[0]), vals[1]
        if dims is None or shape is None:
            return None
        want = list(shape.array.flat)
        m = max(len(dims), len(want))
        have = [1] * (m - len(dims)) + dims
        want = [1] * (m - len(want)) + want
        out = []
        for h, w in zip(have, want):
            if isinstance(w, int) and w == 1:
                out.append(h)
            elif isinstance(h, int) and h == 1:
                out.append(w)
            else:  # both sized: ONNX requires them equal (or w == 1, above)
                out.append(h)
        return relax.op.broadcast_to(inputs[0], relax.ShapeExpr([_pos(d) for d in out]))
    if op == "ConstantOfShape":
        from tvm.relax.frontend.onnx.onnx_frontend import get_numpy

        value = get_numpy(attrs["value"]).reshape(()) if "value" in attrs else np.array(0, np.float32)
        return relax.op.full(relax.ShapeExpr([_pos(d) for d in vals[0].array.flat]),
                             relax.const(value, str(value.dtype)), str(value.dtype))
    if op == "Range":
        if any(v is None or v.array.size != 1 for v in vals):
            return None
        start, limit, delta = (v.array.flat[0] for v in vals)
        if not isinstance(delta, int) or delta != 1 or vals[0].dtype not in _INT:
            return None
        return relax.op.arange(_pos(start), _pos(limit), 1, vals[0].dtype)
    if op == "Slice" and "starts" not in attrs:
        dims = sv.dims(inputs[0])
        starts, ends = vals[1], vals[2]
        axes = _ints(vals[3]) if len(vals) > 3 and vals[3] is not None else list(range(starts.array.size))
        steps = _ints(vals[4]) if len(vals) > 4 and vals[4] is not None else [1] * starts.array.size
        if dims is None or starts is None or ends is None or axes is None or steps is None or any(s != 1 for s in steps):
            return None
        axes = [a % len(dims) for a in axes]
        begin, end = [], []
        for s, e, ax in zip(starts.array.flat, ends.array.flat, axes):
            d = dims[ax]
            begin.append(_clamp(sv, s, d))
            end.append(_clamp(sv, e, d))
        return relax.op.strided_slice(inputs[0], axes, [_pos(b) for b in begin], [_pos(e) for e in end],
                                      assume_inbound=True)
    if op == "Tile":
        reps = vals[1]
        if reps is None:
            return None
        return relax.op.tile(inputs[0], [_pos(r) for r in reps.array.flat])
    return None


def _clamp(sv, s, d):
    """A slice bound into [0, d] as ONNX does (negative counts from the end)."""
    if isinstance(s, int):
        if s < 0:
            s = s + d
        if isinstance(d, int):
            return max(0, min(s, d))
        if s >= 2**31:  # INT64_MAX and friends: the end
            return d
        return sv._elem(tirx.max(_pos(0), tirx.min(_pos(s), _pos(d))))
    return sv._elem(tirx.max(_pos(0), tirx.min(_pos(s), _pos(d))))


# ---------------------------------------------------------------- broadcasts of unrelated dims

BROADCASTING = {"Add", "Sub", "Mul", "Div", "Pow", "Mod", "And", "Or", "Xor", "Equal", "Less", "Greater",
                "LessOrEqual", "GreaterOrEqual", "Where", "Max", "Min", "Sum", "Mean", "BitwiseAnd",
                "BitwiseOr"}


def _bare(d) -> bool:
    return isinstance(d, tirx.Var)


def unify_broadcast(sv: ShapeValues, bb, op: str, inputs: list) -> list:
    """Operands of a broadcasting op whose dims on an axis are two symbolic sizes TVM cannot
    prove equal (a legacy export's attention_mask (batch, past_seq) against the causal mask's
    past + seq; dynamo's s53 against s15 + s70): Relax gives the result an unknown shape and
    the next Reshape fails ("Reshape expects the input tensor to have known shape"). ONNX
    broadcasting requires such sizes to be equal (neither is 1), so the operand with the
    model's own input dim is cast to the other's expression (R.match_cast: checked when it
    runs). Inputs returned unchanged when nothing needs it."""
    if op not in BROADCASTING:
        return inputs
    dims = [sv.dims(e) if e is not None else None for e in inputs]
    known = [d for d in dims if d is not None]
    if len(known) < 2:
        return inputs
    rank = max(len(d) for d in known)
    target: list = [None] * rank
    for d in known:
        for i, x in enumerate(d, rank - len(d)):
            t = target[i]
            if t is None or (isinstance(t, int) and t == 1):
                target[i] = x
            elif isinstance(x, int) and x == 1:
                continue
            elif _bare(t) and not _bare(x) and not sv.analyzer.can_prove_equal(_pos(t), _pos(x)):
                target[i] = x  # prefer the expression (past + seq) to a lone input dim (past_seq)
    out = list(inputs)
    for k, (e, d) in enumerate(zip(inputs, dims)):
        if d is None:
            continue
        new, changed = list(d), False
        for j, x in enumerate(d):
            t = target[j + rank - len(d)]
            if isinstance(x, int) and x == 1 or t is None or (isinstance(t, int) and t == 1):
                continue
            if not (isinstance(x, int) and isinstance(t, int)) and _is_expr(_pos(x)) and \
                    not sv.analyzer.can_prove_equal(_pos(x), _pos(t)) and _bare(x):
                new[j], changed = t, True
        if changed:
            out[k] = bb.match_cast(e, relax.TensorType([_pos(x) for x in new], e.ty.dtype))
    return out
