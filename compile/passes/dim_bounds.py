"""Upper bounds on symbolic dims (`--shape seq=..1024`): static memory plans, checked in the module.

With a dim left symbolic (a decoder's prompt length and past), StaticPlanBlockMemory cannot
size an intermediate over it, so every such tensor is allocated per call at its own size and no
later intermediate reuses its storage. Given an upper bound (TVM's `tir_var_upper_bound`
function attribute, which that pass reads), it plans storage of the bound's size once and shares
it as it does for static shapes. GPT-2 small's artifact at `seq=..1024,past=..1024`: the
prompt entry's intermediates in 15 storages, all of a static size (41 MiB; unbounded: 18, 16
of them sized per call), the decode entry's in 16 (0.2 MiB; unbounded: 5 of 16 per call); its
prefill of 128 tokens ran 0.969-1.005x the unbounded build's time (median 0.978, five processes on a Zen 5:
benchmarks/results/quiet-2026-12-06i/prefill.log; 0.979-1.009x on Zen 4 with the attribute
alone, the nineteenth session's `prefill_upper_bound.log`) in a build with its weights embedded;
as a compiled artifact (weights lifted to parameters) the bounded entries time as the unbounded
ones (prompt 0.991-1.005x, decode step 0.969-1.023x: decode.log), and the bound buys a footprint
fixed at compile time (each storage one size, whatever the lengths of a call).

Planned storage is sized by the bound, so a larger value would write past it. Every entry
function that takes a bounded dim therefore first calls a check compiled into the module itself
(a PrimFunc asserting each dim <= its bound), not one in blockforge's Python: the C++ edge app
and TVM's own runtime call the module without it, and TVM's `relax.assert_op` lives in the
compiler library, which a runtime-only deployment does not ship. The check makes the entry
impure (Relax keeps the call; the function's dataflow blocks are unchanged).
"""

from __future__ import annotations

from typing import Mapping

import tvm
from tvm import relax, tirx

UPPER_BOUND_ATTR = "tir_var_upper_bound"  # what StaticPlanBlockMemory reads (name -> bound)


def _signature_vars(func: relax.Function) -> list:
    """The symbolic dims the function's parameters define, in order of first appearance."""
    seen: dict[str, tirx.Var] = {}
    for p in func.params:
        for v in relax.analysis.definable_tir_vars_in_type(p.ty):
            seen.setdefault(v.name, v)
    return list(seen.values())


def check_message(name: str, bound: int) -> str:
    """What the module raises for `name` over its bound (one line; tests and docs quote it)."""
    return (f"symbolic dim {name} exceeds {bound}, the upper bound this module was compiled with "
            f"(--shape {name}=..{bound}): its memory is planned for at most that")


def _check_func(dims: list, bounds: Mapping[str, int]) -> tirx.PrimFunc:
    """A PrimFunc of one int64 per dim that asserts each is within its bound."""
    params = [tirx.Var(v.name, "int64") for v in dims]
    # (the constructor's Python signature names (kind, condition); its FFI function takes them
    # in the other order, which is what reaches TVM)
    asserts = [tirx.AssertStmt(p <= tirx.IntImm("int64", int(bounds[p.name])), tvm.ir.StringImm("RuntimeError"),
                               [tvm.ir.StringImm(check_message(p.name, int(bounds[p.name])))]) for p in params]
    return tirx.PrimFunc(params, tirx.SeqStmt(asserts) if len(asserts) > 1 else asserts[0]) \
        .with_attr("tir.is_scheduled", True)


def bound_dims(bounds: Mapping[str, int]):
    """A module pass (before finalize's StaticPlanBlockMemory): every Relax function with a
    bounded dim in its signature gets the bound attribute and, first in its body, the check."""
    bounds = {str(k): int(v) for k, v in bounds.items()}

    @tvm.transform.module_pass(opt_level=0, name="BlockforgeDimBounds")
    def run(mod, ctx):
        if not bounds:
            return mod
        bb = relax.BlockBuilder(mod)
        updates = []
        for gv, func in list(mod.functions_items()):
            if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
                continue
            dims = [v for v in _signature_vars(func) if v.name in bounds]
            if not dims:
                continue
            check = bb.add_func(_check_func(dims, bounds), f"{gv.name_hint}_dim_bounds")
            call = bb.normalize(relax.Call(check, [relax.prim_value(v) for v in dims]))
            first = relax.BindingBlock([relax.VarBinding(relax.Var("_", call.ty), call)])
            body = relax.SeqExpr([first, *func.body.blocks], func.body.body)
            prior = dict(func.attrs[UPPER_BOUND_ATTR]) if func.attrs is not None and UPPER_BOUND_ATTR in func.attrs else {}
            new = relax.Function(func.params, body, func.ret_ty, False, func.attrs, func.span).with_attr(
                UPPER_BOUND_ATTR, {**prior, **{v.name: tirx.IntImm("int64", bounds[v.name]) for v in dims}})
            updates.append((gv, new))
        out = bb.get()
        for gv, new in updates:
            out[gv] = new
        return out
    return run
