"""The `int8-combine` phase: parallel int8 projections of one activation as one int8 GEMM.

ONNX Runtime's `quantize_dynamic` quantizes an activation once (DynamicQuantizeLinear) and
gives each projection of it its own MatMulInteger, Cast and scale multiply (+ bias). On the
seeds' per-head MHA that is 36 matmuls of N = d_k = 64 over the same quantized rows; TVM
imports them as

    y_i = matmul(astype(x8, int32) - zp_x, W_i - zp_w_i, out_dtype=int32)     (B, S, n_i)
    z_i = astype(y_i, float32) * (s_x * s_w_i) [+ b_i]

and CombineParallelMatmul (the float path's combiner, frontend.embed_weights) takes none of
them: their weights are expressions, not parameters. So each head ran its own small GEMM, its
own fused attention call, its own K^T transpose, and a concat of the heads after (int8 MHA at
seq 512: 36 GEMMs 2.27 ms, concat 0.38 ms, transposes 0.17 ms of 8.2). Here, before
fuse-attention, each group becomes

    y = matmul(astype(x8, int32) - zp_x, concat_i(W_i - zp_w_i), out_dtype=int32)   (B, S, sum n_i)
    z = astype(y, float32) * concat_i(broadcast(s_x * s_w_i, n_i)) [+ concat_i(b_i)]
    z_0, ..., z_{h-1} = split(z)

which is exactly the column-wise union of the parts (each output column is the same integer
sum, times the same float scale, plus the same bias). The int8-gemm phase then puts the one
GEMM on the VNNI/SDOT kernel with a per-column scale, and fuse-attention finds the heads as
an even split of packed projections and merges them into one multi-head call (as it does for
the float seed, whose projections the frontend combines).

A group is combined only when its parts' results reach one concat (the heads'), which orders
the columns and tells self-attention's q, k and v apart; when its weights, as one matrix, still
have the int8 range the kernel takes (max - min <= 255 after the zero points); and when every
scale and bias it needs is defined before the first projection's output is used.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

_log = logging.getLogger("blockforge.quant")


@dataclass
class _Part:
    out: object  # the var the part's result is bound to: the bias add, else the scale multiply
    act: object  # the matmul's int32 activations expression (astype(x8) [- zp])
    w: np.ndarray  # (K, n) effective integer weights (zero point subtracted), int64
    scale: object  # the multiply's other operand: () or (n,) float32
    bias: object | None  # (n,) float32, or None
    pos: int  # binding index of `out`


@dataclass
class _Group:
    parts: list = field(default_factory=list)
    emitted: object = None  # the split tuple, once emitted


def _part(f, var, value) -> _Part | None:
    from blockforge.compile.quant.rewrite import _call, _dtype, _same_shape, _shape, _static

    if not _call(value, "relax.matmul") or _dtype(value) != "int32" or len(value.args) != 2:
        return None
    if f.activations(value.args[0]) is None:
        return None
    w = f.const(value.args[1])
    if w is None or w.ndim != 2 or not np.issubdtype(w.dtype, np.integer):
        return None
    shape = _shape(value)
    if shape is None or len(shape) < 2 or _static(shape[-1]) != w.shape[1]:
        return None
    cast = f.only_user(var)
    cv = f.values.get(cast)
    if cv is None or not _call(cv, "relax.astype") or _dtype(cv) != "float32":
        return None
    mul = f.only_user(cast)
    mv = f.values.get(mul)
    if mv is None or not _call(mv, "relax.multiply") or not _same_shape(mv, cv):
        return None
    scale = mv.args[1] if mv.args[0].same_as(cast) else mv.args[0] if mv.args[1].same_as(cast) else None
    sshape = None if scale is None else _shape(scale)
    if sshape is None or _dtype(scale) != "float32" or [_static(d) for d in sshape] not in ([], [w.shape[1]]):
        return None
    out, bias = mul, None
    add = f.only_user(mul)
    av = f.values.get(add)
    if av is not None and _call(av, "relax.add") and _same_shape(av, mv):
        b = av.args[1] if av.args[0].same_as(mul) else av.args[0]
        if _dtype(b) == "float32" and [_static(d) for d in (_shape(b) or [])] == [w.shape[1]]:
            out, bias = add, b
    return _Part(out, value.args[0], w.astype(np.int64), scale, bias, -1)


def _same(a, b) -> bool:
    import tvm_ffi

    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a.same_as(b) or tvm_ffi.structural_equal(a, b)


def find_groups(f) -> list[_Group]:
    """Groups of >= 2 int8 projections reading the same quantized activation (the same x8 and
    zero point), with the same leading dims, scale kind and bias presence, in binding order;
    f: the function's rewrite._Finder."""
    from blockforge.compile.quant.rewrite import _shape

    pos = {v: i for i, v in enumerate(f.values)}
    groups: list[_Group] = []
    for var, value in f.values.items():
        p = _part(f, var, value)
        if p is None:
            continue
        p.pos = pos[p.out]
        x8, zp = f.activations(p.act)
        key_zp = None if zp is None else f.value(zp)
        for g in groups:
            q = g.parts[0]
            qx8, qzp = f.activations(q.act)
            if qx8.same_as(x8) and ((qzp is None and zp is None) or (qzp is not None and zp is not None
                                                                     and _same(f.value(qzp), key_zp))) \
                    and q.w.shape[0] == p.w.shape[0] and _same(_shape(q.act)[:-1], _shape(p.act)[:-1]) \
                    and len(_shape(q.scale)) == len(_shape(p.scale)) and (q.bias is None) == (p.bias is None):
                g.parts.append(p)
                break
        else:
            groups.append(_Group([p]))
    out = []
    for g in groups:
        for sub in _by_role(f, g):
            if len(sub.parts) < 2:
                continue
            w = np.concatenate([p.w for p in sub.parts], axis=1)
            if int(w.max()) - int(w.min()) > 255:
                _log.info("int8 combine: %d projections left apart: their weights span %d values as one matrix",
                          len(sub.parts), int(w.max()) - int(w.min()) + 1)
                continue
            first = min(p.pos for p in sub.parts)  # where the group is emitted: its first output's binding
            # what the combined GEMM reads must exist there
            need = [p.scale for p in sub.parts] + [p.bias for p in sub.parts if p.bias is not None]
            if all(_ready(f, e, pos, first) for e in need):
                out.append(sub)
            else:
                _log.info("int8 combine: %d projections left apart: a scale or bias is defined after the first "
                          "projection's output", len(sub.parts))
    return out


def _by_role(f, g: _Group) -> list[_Group]:
    """The group per role, each in the order its results are concatenated (attention/heads.by_role:
    the heads' order, which fuse-attention's merge of the heads checks; TVM's importer bound an
    ORT-quantized MHA's per-head projections in reverse head order; self-attention's q, k and v
    projections all read one activation and come apart by role). Parts that do not all reach one
    concat at distinct places per role are left apart: the q/k/v projections of a Hugging Face
    BERT (each 768 wide, heads split by reshapes) gain nothing from one GEMM and pay its split
    (BERT-base int8 dynamic, whole: 1.035x slower combined, combine_ab_b3d1cb9.log)."""
    from blockforge.compile.attention.heads import by_role

    roles = by_role(f.values, f.users, [p.out for p in g.parts])
    return [] if roles is None else [_Group([g.parts[i] for i in role]) for role in roles]


def _ready(f, e, pos: dict, at: int, depth: int = 2) -> bool:
    """e can be evaluated at binding `at`: a constant, a var bound before it, or (re-emitted) a
    call of such, up to `depth` levels (the scale s_x * s_w_i is bound after the matmuls)."""
    import tvm
    from tvm import relax

    if isinstance(e, tvm.ir.GenericConst):
        return True
    if isinstance(e, relax.Var):
        if e not in pos:
            return True  # a function parameter
        if pos[e] < at:
            return True
        return depth > 0 and _ready(f, f.values[e], pos, at, depth - 1)
    if isinstance(e, relax.Call):
        return all(_ready(f, a, pos, at, depth) for a in e.args)
    if isinstance(e, relax.Tuple):
        return all(_ready(f, a, pos, at, depth) for a in e.fields)
    return False


def int8_combine():
    """The `int8-combine` pass (module pass): see the module docstring."""
    import tvm
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    @mutator
    class _Combine(PyExprMutator):
        def __init__(self, mod):
            super().__init__(mod)
            self.owner: dict = {}  # out var -> (group, index)
            self.pos: dict = {}
            self.bound: set = set()
            self.combined: list[str] = []

        def inline(self, e):
            """e's value at this point: vars bound later are re-emitted from their values."""
            if isinstance(e, relax.Var) and e in self.pos and e not in self.bound:
                return self.inline(self.values[e])
            if isinstance(e, relax.Call) and any(isinstance(a, relax.Var) and a in self.pos and a not in self.bound
                                                 for a in e.args):
                return self.builder_.emit(relax.Call(e.op, [self.inline(a) for a in e.args], e.attrs))
            return self.visit_expr(e)

        def emit_group(self, g: _Group):
            from blockforge.compile.quant.rewrite import _shape

            bb = self.builder_
            ns = [p.w.shape[1] for p in g.parts]
            w = np.concatenate([p.w for p in g.parts], axis=1).astype(np.int32)
            # (the parts' activations are one expression; the earliest-bound part's is bound here)
            act = self.visit_expr(min(g.parts, key=lambda p: p.pos).act)
            y = bb.emit(relax.op.matmul(act, relax.const(w), out_dtype="int32"))
            c = bb.emit(relax.op.astype(y, "float32"))
            scales = []
            for p, n in zip(g.parts, ns):
                s = self.inline(p.scale)
                if not _shape(p.scale):  # a per-tensor scale: one value for the part's columns
                    s = bb.emit(relax.op.broadcast_to(relax.op.reshape(s, relax.ShapeExpr([1])), relax.ShapeExpr([n])))
                scales.append(s)
            z = bb.emit(relax.op.multiply(c, bb.emit(relax.op.concat(scales, axis=0))))
            if g.parts[0].bias is not None:
                z = bb.emit(relax.op.add(z, bb.emit(relax.op.concat([self.inline(p.bias) for p in g.parts], axis=0))))
            if len(set(ns)) == 1:
                sections = len(ns)
            else:
                sections = [int(x) for x in np.cumsum(ns)[:-1]]
            g.emitted = bb.emit(relax.op.split(z, sections, axis=-1))
            self.combined.append(f"{len(ns)} projections of K={w.shape[0]} -> N={w.shape[1]}")

        def visit_var_binding_(self, binding):
            own = self.owner.get(binding.var)
            if own is None:
                super().visit_var_binding_(binding)
            else:
                g, i = own
                if g.emitted is None:
                    self.emit_group(g)
                self.builder_.emit_normalized(relax.VarBinding(binding.var, relax.TupleGetItem(g.emitted, i)))
            self.bound.add(binding.var)

    @tvm.transform.module_pass(opt_level=0, name="BlockforgeInt8Combine")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        from blockforge.compile.quant.rewrite import _Finder

        from blockforge.compile.passes.exprs import rewrite_functions

        def plan(m, func) -> bool:
            f = _Finder(func)
            groups = find_groups(f)
            if not groups:
                return False
            m.values = f.values
            m.pos = {v: i for i, v in enumerate(f.values)}
            m.bound = set(func.params)
            m.owner = {p.out: (g, i) for g in groups for i, p in enumerate(g.parts)}
            return True

        m = _Combine(mod)
        out = rewrite_functions(mod, m, plan, unused=True)
        for line in m.combined:
            _log.info("int8 combine: %s", line)
        return out

    return _pass
