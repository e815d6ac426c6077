"""The `bf16-gemm` phase (`--precision bf16`): the model's constant-weight float32 matmuls
onto the bf16 kernel (compile/bf16/gemm.py).

    y = matmul(x, W)  [z = add(y, b)]  [relu/gelu(z)]     x float32 (..., K), W a (K, N) constant

becomes one call of the kernel on x (rounded to bf16 in the kernel) and W converted to bf16
and prepacked now, with the bias and the activation (when each step has that one user) in
its write-back. What stays float32 here: matmuls of two activations (no constant to convert
ahead; the attention products QK^T and PV go on VDPBF16PS inside the fused attention kernel
at bf16 instead: compile/attention/flash.py, ablation bf16-attention), and every elementwise,
softmax, LayerNorm and residual step: only the products change precision.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np

from blockforge.compile.bf16 import gemm
from blockforge.compile.passes.kernels import add_kernel

_log = logging.getLogger("blockforge.bf16")
_ACTIVATIONS = {"relax.nn.relu": "relu", "relax.nn.gelu": "gelu"}


def _op(e) -> str | None:
    return getattr(getattr(e, "op", None), "name", None)


def _ty(e, attr: str):
    return getattr(getattr(e, "ty", None), attr, None)


def _static(d) -> int | None:
    from tvm import tirx

    return int(d.value) if isinstance(d, tirx.IntImm) else None


@dataclass
class _Match:
    x: object  # float32 activations (..., K)
    w: np.ndarray  # (K, N) float32
    bias: object | None  # (N,) float32 expression
    shape: list  # the output's shape
    spec: gemm.Bf16GemmSpec


class _Finder:
    """The bindings of one Relax function, who reads each, and the matmuls to replace."""

    def __init__(self, func):
        from tvm import relax

        self.values, self.users = {}, {}
        for block in func.body.blocks:
            for b in block.bindings:
                if isinstance(b, relax.VarBinding):
                    self.values[b.var] = b.value
                    seen = []
                    relax.analysis.post_order_visit(
                        b.value, lambda e, seen=seen: seen.append(e) if isinstance(e, relax.Var) else None)
                    for v in dict.fromkeys(seen):
                        self.users.setdefault(v, []).append(b.var)
        self.dataflow = relax.DataflowVar

    def only_user(self, var):
        users = self.users.get(var, [])
        return users[0] if isinstance(var, self.dataflow) and len(users) == 1 else None

    def same_shape(self, a, b) -> bool:
        import tvm_ffi

        sa, sb = _ty(a, "shape"), _ty(b, "shape")
        return sa is not None and sb is not None and len(sa) == len(sb) and \
            all(x.same_as(y) or tvm_ffi.structural_equal(x, y) for x, y in zip(sa, sb))

    def match(self, var, value) -> tuple[object, _Match] | None:
        """(the var whose binding the kernel call replaces, the match) or None."""
        import tvm
        import tvm.sym

        if _op(value) != "relax.matmul" or len(value.args) != 2:
            return None
        x, w = value.args
        if not isinstance(w, tvm.ir.expr.GenericConst) or str(_ty(x, "dtype")) != "float32" \
                or str(_ty(value, "dtype")) != "float32":
            return None
        wt = w.value.numpy()
        shape = _ty(x, "shape")
        shape = None if shape is None else list(shape)
        if wt.ndim != 2 or wt.dtype != np.float32 or shape is None or len(shape) < 2 \
                or _static(shape[-1]) != wt.shape[0]:
            return None
        k, n = wt.shape
        m = 1
        for d in shape[:-1]:
            m = m * d
        m_static = _static(tvm.sym.Analyzer().simplify(m)) if not isinstance(m, int) else m
        out, bias = var, None
        add = self.only_user(var)
        av = self.values.get(add)
        if _op(av) == "relax.add" and self.same_shape(av, value):
            b = av.args[1] if av.args[0].same_as(var) else av.args[0]
            if str(_ty(b, "dtype")) == "float32" and [_static(d) for d in (_ty(b, "shape") or [])] == [n]:
                out, bias = add, b
        activation = "none"
        user = self.only_user(out)
        uv = self.values.get(user)
        if _op(uv) in _ACTIVATIONS and self.same_shape(uv, value):
            out, activation = user, _ACTIVATIONS[_op(uv)]
        spec = gemm.Bf16GemmSpec(k=k, n=n, m=m_static, bias=bias is not None, activation=activation)
        return out, _Match(x, wt, bias, [*shape[:-1], n], spec)


def bf16_gemm(row_fit: bool = True, gelu_segments: bool = True, target=None, database=None):
    """The `bf16-gemm` pass (CPU targets with AVX512_BF16, `--precision bf16`). row_fit=False:
    every kernel in 6 x 4 micro-tiles (ablation bf16-row-fit; gemm.Bf16GemmSpec.tile);
    gelu_segments=False: the write-back's gelu is fast_erf's (ablation bf16-gelu-segments).
    A kernel's tiles come from the tuning database (a TVM target's records) where it has a
    record for its spec (compile/bf16/tiles.py), else the defaults."""
    import tvm
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    @mutator
    class _Rewrite(PyExprMutator):
        def __init__(self, mod):
            super().__init__(mod)
            self.plan: dict = {}
            self.funcs: dict = {}
            self.applied: list[str] = []

        def kernel_gv(self, spec):
            if spec not in self.funcs:
                from blockforge.compile.bf16.tiles import tile_record

                tiles = tile_record(database, spec, target, gelu_segments) if target is not None else None
                if tiles is not None:
                    _log.info("bf16 gemm %s: tuned tiles %s", spec.describe(), tiles.describe())
                self.funcs[spec] = add_kernel(self.builder_, gemm.kernel(spec, gelu_segments, tiles),
                                              f"bf16_gemm_{len(self.funcs)}")
            return self.funcs[spec]

        def emit_call(self, mt: _Match):
            bb, sp = self.builder_, mt.spec
            x = self.visit_expr(mt.x)
            m = 1
            for d in list(_ty(x, "shape"))[:-1]:
                m = m * d
            x2 = bb.emit(relax.op.reshape(x, relax.ShapeExpr([m, sp.k])))
            args = [x2, relax.const(gemm.pack_weights(mt.w))]
            if mt.bias is not None:
                args.append(self.visit_expr(mt.bias))
            y = bb.emit(relax.call_tir(self.kernel_gv(sp), args, out_ty=relax.TensorType([m, sp.n], "float32")))
            self.applied.append(sp.describe())
            return relax.op.reshape(y, relax.ShapeExpr(mt.shape))

        def visit_var_binding_(self, binding):
            mt = self.plan.get(binding.var)
            if mt is None:
                return super().visit_var_binding_(binding)
            self.builder_.emit_normalized(relax.VarBinding(binding.var, self.builder_.normalize(self.emit_call(mt))))

    @tvm.transform.module_pass(opt_level=0, name="BlockforgeBf16Gemm")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        from blockforge.compile.passes.exprs import rewrite_functions

        def plan(r, func) -> bool:
            f = _Finder(func)
            r.plan = dict(m for v, val in f.values.items() if (m := f.match(v, val)) is not None)
            if not row_fit:
                r.plan = {v: replace(mt, spec=replace(mt.spec, row_fit=False)) for v, mt in r.plan.items()}
            return bool(r.plan)

        r = _Rewrite(mod)
        out = rewrite_functions(mod, r, plan, unused=True)
        for line in r.applied:
            _log.info("bf16 gemm: %s", line)
        return out

    return _pass
