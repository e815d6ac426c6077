"""Self-attention's per-head projections regrouped by role, so fuse-attention merges the heads.

The seeds' encoder block projects one input per head (q_i, k_i, v_i = x W^(i) + b^(i)); the
frontend's CombineParallelMatmul makes that one GEMM and a split into 3h items, in the
matmuls' order:

    z = matmul(x, W) + b            (B, S, 3 h d)        W, b constant
    z_0, ..., z_{3h-1} = split(z)   roles and heads interleaved as the importer bound them

fuse-attention merges h per-head attentions into one multi-head call only where each role's
heads are items 0..h-1 of a split of their own (match._merge_heads), so the block ran 12
attention calls, 12 K^T transposes, the split copy and a concat of the heads (BERT-base block,
seq 128: 0.24 ms of 9.2). Here such a split becomes one GEMM per role, its columns in the order
the heads' concat reads them:

    z_r = matmul(x, W[:, cols_r]) + b[cols_r];  z_r0, ..., z_r(h-1) = split(z_r)    r = q, k, v

The same products and sums per column (a column permutation of one GEMM). A role is told by the
item's path to the heads' concat (Q through Q K^T, K through its transpose, V straight into P V:
the steps to the concat and the first op), the head by its place in that concat.
"""

from __future__ import annotations

import logging

import numpy as np

from blockforge.compile.attention.match import _is_call as _call

_log = logging.getLogger("blockforge.attention")


def graph(func):
    """(values, users) of a Relax function's bindings: var -> value, var -> the binding vars
    reading it (each once, in binding order; passes/exprs.users_of without the function's
    result as a reader)."""
    from tvm import relax

    from blockforge.compile.passes.exprs import users_of

    values = {b.var: b.value for block in func.body.blocks for b in block.bindings
              if isinstance(b, relax.VarBinding)}
    users = {v: [u for u in us if u is not None] for v, us in users_of(func).items()}
    return values, {v: us for v, us in users.items() if us}


def concat_slot(values: dict, users: dict, var, depth: int = 24):
    """(concat var, field index, steps, first user's op) of the first concat reached forward
    from var through its users (a head's Q, K^T or V through its attention; a QDQ model's through
    its quantize/dequantize pairs too), else None."""
    from tvm import relax

    first = users.get(var, [])
    first_op = getattr(getattr(values.get(first[0]), "op", None), "name", None) if len(first) == 1 else None
    frontier = [var]
    for steps in range(1, depth + 1):
        nxt = []
        for v in frontier:
            for u in users.get(v, []):
                uv = values.get(u)
                if _call(uv, "relax.concat") and isinstance(uv.args[0], relax.Tuple):
                    idx = [i for i, x in enumerate(uv.args[0].fields) if x.same_as(v)]
                    return (u, idx[0], steps, first_op) if len(idx) == 1 else None
                nxt.append(u)
        frontier = nxt
    return None


def _heads_concat(values: dict, concat) -> bool:
    """A concat of attention heads: >= 2 fields, each a matmul's result (P V; in a QDQ model
    through its quantize/dequantize pair). A rotary embedding's concat (cos/sin halves) is not."""
    fields = values[concat].args[0].fields
    for x in fields:
        v = values.get(x)
        while _call(v, "relax.dequantize") or _call(v, "relax.quantize"):
            v = values.get(v.args[0])
        if not _call(v, "relax.matmul"):
            return False
    return len(fields) >= 2


def by_role(values: dict, users: dict, outs: list) -> list[list[int]] | None:
    """Indices into `outs` per role, each role's in the order of the heads' concat, when every
    out reaches one concat of heads and the roles hold the same places there; else None."""
    slots = [concat_slot(values, users, v) for v in outs]
    if any(s is None for s in slots) or len({s[0] for s in slots}) != 1 or not _heads_concat(values, slots[0][0]):
        return None
    roles: dict = {}
    for i, s in enumerate(slots):
        roles.setdefault((s[2], s[3]), []).append((s[1], i))
    places = [sorted(p for p, _ in members) for members in roles.values()]
    if any(len(set(pl)) != len(pl) or pl != places[0] for pl in places):
        return None
    return [[i for _, i in sorted(members)] for members in roles.values()]


def _const(e) -> np.ndarray | None:
    import tvm

    return e.value.numpy() if isinstance(e, tvm.ir.GenericConst) else None


def _plan(values: dict, users: dict, var, value):
    """For a split binding of a constant-weight projection whose items are per-head attention
    operands: (x, W, b or None, [per role: [(item var, column start)]], width), else None."""
    from tvm import relax

    from blockforge.compile.attention.match import static_int

    if not _call(value, "relax.split") or int(value.attrs.axis) not in (-1, 2):
        return None
    z = value.args[0]
    zv = values.get(z)
    b = None
    if _call(zv, "relax.add") and len(users.get(z, [])) == 1:
        mm_var, b = zv.args
        b = _const(b)
        zv = values.get(mm_var)
        if b is None or b.ndim != 1 or len(users.get(mm_var, [])) != 1:
            return None
    elif len(users.get(z, [])) != 1:
        return None
    if not _call(zv, "relax.matmul") or len(zv.args) != 2:
        return None
    w = _const(zv.args[1])
    if w is None or w.ndim != 2 or w.dtype != np.float32 or (b is not None and b.shape != (w.shape[1],)):
        return None
    ios = value.attrs.indices_or_sections
    n = w.shape[1]
    if isinstance(ios, int) or static_int(ios) is not None:
        n_items = ios if isinstance(ios, int) else static_int(ios)
    else:  # split points (CombineParallelMatmul writes these)
        idx = [static_int(i) for i in ios]
        n_items = len(idx) + 1
        if None in idx or n % n_items or idx != [n // n_items * (k + 1) for k in range(n_items - 1)]:
            return None
    if not n_items or n % n_items:
        return None  # (an even split: the heads' widths)
    width = n // n_items
    items: dict = {}
    for u in users.get(var, []):
        uv = values.get(u)
        if not isinstance(uv, relax.TupleGetItem) or int(uv.index) in items:
            return None
        items[int(uv.index)] = u
    if sorted(items) != list(range(n_items)):
        return None
    outs = [items[i] for i in range(n_items)]
    roles = by_role(values, users, outs)
    if roles is None or len(roles) < 2:
        return None
    return zv.args[0], w, b, [[(outs[i], i * width) for i in role] for role in roles], width


def regroup_heads():
    """The pass (module pass; the first step of the fuse-attention phase)."""
    import tvm
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    @mutator
    class _Regroup(PyExprMutator):
        def __init__(self, mod):
            super().__init__(mod)
            self.plans: dict = {}  # split var -> plan
            self.items: dict = {}  # item var -> (split var, role, head)
            self.emitted: dict = {}  # split var -> [per role: the new split]
            self.done: list[str] = []

        def visit_var_binding_(self, binding):
            if binding.var in self.plans:
                x, w, b, roles, width = self.plans[binding.var]
                bb, xs, splits = self.builder_, self.visit_expr(x), []
                for role in roles:
                    cols = np.concatenate([np.arange(start, start + width) for _, start in role])
                    z = bb.emit(relax.op.matmul(xs, relax.const(np.ascontiguousarray(w[:, cols]))))
                    if b is not None:
                        z = bb.emit(relax.op.add(z, relax.const(np.ascontiguousarray(b[cols]))))
                    splits.append(bb.emit(relax.op.split(z, len(role), axis=-1)))
                self.emitted[binding.var] = splits
                self.done.append(f"{len(roles)} roles x {len(roles[0])} heads of width {width}")
                return
            item = self.items.get(binding.var)
            if item is None:
                return super().visit_var_binding_(binding)
            split, r, h = item
            item = self.builder_.normalize(relax.TupleGetItem(self.emitted[split][r], h))
            self.builder_.emit_normalized(relax.VarBinding(binding.var, item))

    @tvm.transform.module_pass(opt_level=0, name="BlockforgeRegroupHeads")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        from blockforge.compile.passes.exprs import rewrite_functions

        def plan(m, func) -> bool:
            values, users = graph(func)
            plans = {v: p for v, val in values.items() if (p := _plan(values, users, v, val)) is not None}
            m.plans = plans
            m.items = {item: (s, r, h) for s, p in plans.items() for r, role in enumerate(p[3])
                       for h, (item, _) in enumerate(role)}
            return bool(plans)

        m = _Regroup(mod)
        out = rewrite_functions(mod, m, plan, unused=True)
        for line in m.done:
            _log.info("per-head projections regrouped: %s", line)
        return out

    return _pass
