"""A combined projection's per-part bias and scale folded into it, so its split is layout only.

The frontend combines parallel projections sharing an input into one matmul and a split
(frontend.embed_weights). Where the projections' bias structure differs (Whisper: q_proj and
v_proj with a bias, k_proj without; the query then scaled by d**-0.5), the adds stay after the split:

    x = matmul(h, W)                     (B, S, 3 N)        W constant
    q, k, v = split(x)
    q = (q + b_q) * s;  v = v + b_v      per part: add a constant row, multiply by a constant scalar

Each part is then an elementwise kernel of its own, and qkv_heads (layout-only chains) does not
take the group: Whisper-base's encoder ran a split copy, an elementwise kernel per part and a
scalar K^T transpose per layer (9.4 ms of 223, quiet Zen 5 profile). Here the constants move
into the projection, x = matmul(h, W * s_cols) + concat(b_i * s_i), the bias add fuses into the
GEMM's write-back, and each part is x's columns as they are. A power-of-two scale (d = 64: 0.125)
is exact; another rounds once more or less than as written (one float32 rounding).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from blockforge.compile.passes.exprs import op_name as _op, rewrite_functions, split_sections, static_shape as _static, users_of


def _const(e) -> np.ndarray | None:
    if not isinstance(e, tvm.ir.expr.GenericConst):
        return None
    a = e.value.numpy()
    return a if a.dtype == np.float32 and np.all(np.isfinite(a)) else None


def _other(call, var):
    """The other argument of a binary call one of whose arguments is var."""
    a, b = call.args
    return b if a.same_as(var) else a if b.same_as(var) else None


class _Plan:
    """Per split of a constant-weight float32 matmul: what each part's chain adds and scales."""

    def __init__(self, func):
        self.v2v = relax.analysis.get_var2val(func)
        self.users = users_of(func)

    def _only_user(self, var):
        u = self.users.get(var, [])
        return u[0] if len(u) == 1 and u[0] is not None else None

    def _same_shape(self, var, shape):
        """var's value when var has this (static) shape, else None (a broadcast to more dims)."""
        if var is None or shape is None or _static(getattr(var.ty, "shape", None) or []) != shape:
            return None
        return self.v2v.get(var)

    def _chain(self, part, n: int):
        """(bias (n,) or None, scale or None, the chain's last var, its vars) of part's chain."""
        bias, scale, last, chain = None, None, part, []
        shape = _static(getattr(part.ty, "shape", None) or [])
        user = self._only_user(part)
        call = self._same_shape(user, shape)
        if _op(call) == "relax.add":
            c = _const(_other(call, part))
            if c is not None and c.ndim >= 1 and c.shape[-1] == n and c.size == n:
                bias, last = c.reshape(n), user
                chain.append(user)
                user = self._only_user(user)
                call = self._same_shape(user, shape)
        if _op(call) == "relax.multiply":
            s = _const(_other(call, last))
            if s is not None and s.size == 1 and float(s.reshape(())) != 0.0:
                scale, last = float(s.reshape(())), user
                chain.append(user)
        return bias, scale, last, chain

    def plans(self) -> dict:
        """matmul var -> (W', b', {chain var: its part's index, or None for an inner step})."""
        out = {}
        for var, sp in self.v2v.items():
            if _op(sp) != "relax.split":
                continue
            x = sp.args[0]
            mm = self.v2v.get(x)
            shp = _static(getattr(x.ty, "shape", None) or [])
            if _op(mm) != "relax.matmul" or shp is None or int(sp.attrs.axis) not in (len(shp) - 1, -1) \
                    or self._only_user(x) is None or getattr(x.ty, "dtype", None) != "float32":
                continue
            w = _const(mm.args[1])
            if w is None or w.ndim != 2 or w.shape[1] != shp[-1]:
                continue
            bounds = np.split(np.arange(shp[-1]), split_sections(sp))
            parts = {}  # index -> the TupleGetItem vars
            for u in self.users.get(var, []):
                item = self.v2v.get(u) if u is not None else None
                if not isinstance(item, relax.TupleGetItem):
                    parts = None
                    break
                parts.setdefault(int(item.index), []).append(u)
            if not parts:
                continue
            cols, bias = np.ones(shp[-1], np.float32), np.zeros(shp[-1], np.float32)
            remap, changed = {}, False
            for i, vars_ in parts.items():
                if len(vars_) != 1:
                    continue
                b, s, last, chain = self._chain(vars_[0], len(bounds[i]))
                if not chain:
                    continue
                lo, hi = int(bounds[i][0]), int(bounds[i][-1]) + 1
                if b is not None:
                    bias[lo:hi] = b * np.float32(s if s is not None else 1.0)
                if s is not None:
                    cols[lo:hi] = np.float32(s)
                remap[last] = i
                for c in chain:
                    if not c.same_as(last):
                        remap[c] = None  # dropped: read only by the chain's next step
                changed = True
            if changed:
                out[x] = (w * cols[None, :], bias, remap)
        return out


@mutator
class _Fold(PyExprMutator):
    def __init__(self, mod):
        super().__init__(mod)
        self.plans: dict = {}
        self.chains: dict = {}
        self.split_of: dict = {}  # matmul var -> the split var bound from it

    def plan(self, func) -> bool:
        """This function's folds (per function: its vars); False: none."""
        self.plans = _Plan(func).plans() if isinstance(func.body, relax.SeqExpr) else {}
        self.chains = {c: (x, i) for x, (_, _, remap) in self.plans.items() for c, i in remap.items()}
        self.split_of = {}
        return bool(self.plans)

    def visit_var_binding_(self, binding):
        var, value = binding.var, binding.value
        if var in self.plans:
            w, bias, _ = self.plans[var]
            h = self.visit_expr(value.args[0])
            y = self.builder_.emit(relax.op.matmul(h, relax.const(w), out_dtype=value.attrs.out_dtype))
            new = self.builder_.emit(relax.op.add(y, relax.const(bias)))
            self.set_var_remap(var, new)
            return
        if var in self.chains:
            x, i = self.chains[var]
            if i is None:
                return  # an inner step of a folded chain
            sp = self.split_of[x]
            new = self.builder_.emit(relax.TupleGetItem(sp, i))
            self.set_var_remap(var, new)
            return
        super().visit_var_binding_(binding)
        if _op(value) == "relax.split" and value.args[0] in self.plans:
            self.split_of[value.args[0]] = self.visit_expr(var)  # the split of the new matmul


def split_affine_pass() -> tvm.transform.Pass:
    """The fold above over every Relax function, then the dead chains removed."""

    @tvm.transform.module_pass(opt_level=0, name="BlockforgeSplitAffine")
    def split_affine(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, _Fold(mod), lambda m, func: m.plan(func), dce=True)

    return split_affine
