"""Vectorisable activations: gelu/erf/tanh through TVM's polynomial fast_erf/fast_tanh.

LLVM lowers TIR's erf to a scalar libm call per element, which breaks vectorisation
of the fused matmul epilogue: on the BERT-base FFN the exact gelu epilogue alone cost
~2 ms, more than ONNX Runtime's whole FFN. topi.fast_erf is a rational approximation
(max abs error ~1e-7 in float32), well inside the float32 tolerance of the parity table.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax, topi
from tvm.relax.expr_functor import PyExprMutator, mutator


def _gelu(x):
    half = tvm.tirx.const(0.5, x.dtype)
    return topi.multiply(topi.multiply(x, half),
                         topi.add(topi.fast_erf(topi.multiply(x, tvm.tirx.const(1 / math.sqrt(2), x.dtype))),
                                  tvm.tirx.const(1.0, x.dtype)))


def _gelu_tanh(x):
    c = tvm.tirx.const(math.sqrt(2 / math.pi), x.dtype)
    inner = topi.multiply(c, topi.add(x, topi.multiply(tvm.tirx.const(0.044715, x.dtype),
                                                       topi.multiply(x, topi.multiply(x, x)))))
    return topi.multiply(topi.multiply(x, tvm.tirx.const(0.5, x.dtype)),
                         topi.add(topi.fast_tanh(inner), tvm.tirx.const(1.0, x.dtype)))


@mutator
class _FastActivations(PyExprMutator):
    def visit_call_(self, call):
        call = super().visit_call_(call)
        op = getattr(call.op, "name", None)
        if op not in ("relax.nn.gelu", "relax.nn.gelu_tanh", "relax.erf", "relax.tanh", "relax.nn.softmax"):
            return call
        dtype = getattr(call.args[0].ty, "dtype", None)
        if dtype != "float32":  # the fast kernels are float32 polynomials
            return call
        if op == "relax.nn.softmax":
            # exp through a vectorisable polynomial (topi.fast_exp) instead of libm's expf.
            return self.builder_.call_te(topi.nn.fast_softmax, call.args[0], int(call.attrs.axis),
                                         primfunc_name_hint="softmax")
        fn = {"relax.nn.gelu": _gelu, "relax.nn.gelu_tanh": _gelu_tanh,
              "relax.erf": topi.fast_erf, "relax.tanh": topi.fast_tanh}[op]
        return self.builder_.call_te(fn, call.args[0], primfunc_name_hint=op.split(".")[-1])


@tvm.transform.module_pass(opt_level=0, name="BlockforgeFastActivations")
def fast_activations(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    m = _FastActivations(mod)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            m.builder_.update_func(gv, m.visit_expr(func))
    return m.builder_.get()
