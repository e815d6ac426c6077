"""Small Relax (and TIR) expression helpers the rewrite passes share."""

from __future__ import annotations

import tvm
from tvm import relax


def op_name(e) -> str | None:
    """The op a call calls ("relax.matmul"), or None for anything else."""
    return getattr(getattr(e, "op", None), "name", None) if isinstance(e, relax.Call) else None


def static_shape(shape) -> list[int] | None:
    """A shape's dims as ints, or None when any is symbolic (or there is no shape)."""
    try:
        return [int(d) for d in shape]
    except (TypeError, ValueError):
        return None


def bound_value(mutator, e):
    """What a dataflow var is bound to in a PyExprMutator's builder (post-order: the rewritten
    value), or None (not a var, or a function parameter)."""
    if not isinstance(e, relax.Var):
        return None
    try:
        return mutator.lookup_binding(e)
    except Exception:
        return None


def const_scalar(e) -> float | None:
    """The value of a one-element constant, else None."""
    if not isinstance(e, tvm.ir.expr.GenericConst):
        return None
    v = e.value.numpy()
    return float(v.reshape(())) if v.size == 1 else None


def split_sections(split) -> int | list[int]:
    """A relax.split call's indices_or_sections as numpy.split takes them (a count or indices)."""
    sec = split.attrs.indices_or_sections
    return int(sec) if isinstance(sec, tvm.tirx.IntImm) else [int(i) for i in sec]


def users_of(func) -> dict:
    """var -> the vars of the bindings that read it, in binding order (None: the function's
    result reads it), over a Relax function's blocks."""
    users: dict = {}
    for blk in func.body.blocks:
        for b in blk.bindings:
            for v in relax.analysis.free_vars(b.value):
                users.setdefault(v, []).append(b.var)
    for v in relax.analysis.free_vars(func.body.body):
        users.setdefault(v, []).append(None)
    return users


def substitute_vars(node, pairs):
    """A TIR node with each var of `pairs` ((var, value), ...) replaced by its value."""
    import tvm_ffi

    return tvm_ffi.structural_map(node, (tvm.tirx.Var, lambda v: next((val for k, val in pairs if k.same_as(v)), v)))


def var_count(node, var) -> int:
    """How many times a TIR node refers to `var` (a loop var, a buffer's data var)."""
    import tvm_ffi

    n = [0]
    tvm_ffi.structural_walk(node, (tvm.tirx.Var, lambda v: n.__setitem__(0, n[0] + v.same_as(var))))
    return n[0]


def rewrite_functions(mod, m, plan=None, unused: bool = False, dce: bool = False):
    """The body of a module pass that rewrites with a PyExprMutator (`m`, built on `mod`): each
    Relax function visited where plan(m, func) says there is something to rewrite (it sets m's
    per-function state; None: every function); `unused`: each rewritten function's unused
    bindings removed; `dce`: the module's dead code after. `mod` itself when nothing was."""
    changed = False
    for gv, func in mod.functions_items():
        if not isinstance(func, relax.Function) or (plan is not None and not plan(m, func)):
            continue
        new = m.visit_expr(func)
        m.builder_.update_func(gv, relax.analysis.remove_all_unused(new) if unused else new)
        changed = True
    if not changed:
        return mod
    out = m.builder_.get()
    return relax.transform.DeadCodeElimination()(out) if dce else out
