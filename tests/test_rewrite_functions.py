"""compile/passes/exprs.rewrite_functions: the module-pass body every Relax rewrite shares (the
per-function plan, what is cleaned up after, the module itself when nothing was planned)."""

from __future__ import annotations

import pytest

tvm = pytest.importorskip("tvm")
from tvm import relax  # noqa: E402
from tvm.relax.expr_functor import PyExprMutator, mutator  # noqa: E402
from tvm.script import relax as R  # noqa: E402

from blockforge.compile.passes.exprs import rewrite_functions  # noqa: E402


@tvm.script.ir_module
class TwoFunctions:
    @R.function
    def first(x: R.Tensor((4,), "float32")):
        with R.dataflow():
            y = R.add(x, x)
            dead = R.multiply(x, x)
            R.output(y)
        return y

    @R.function
    def second(x: R.Tensor((4,), "float32")):
        with R.dataflow():
            y = R.add(x, x)
            R.output(y)
        return y


@mutator
class _AddToSubtract(PyExprMutator):
    def __init__(self, mod):
        super().__init__(mod)
        self.seen: list[int] = []  # the functions' parameter counts, as plan() saw them

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if getattr(call.op, "name", None) == "relax.add":
            return relax.op.subtract(*call.args)
        return call


def _ops(func) -> list[str]:
    return [b.value.op.name for blk in func.body.blocks for b in blk.bindings if isinstance(b.value, relax.Call)]


def test_every_function_without_a_plan():
    out = rewrite_functions(TwoFunctions, _AddToSubtract(TwoFunctions))
    assert _ops(out["first"]) == ["relax.subtract", "relax.multiply"]  # nothing cleaned up
    assert _ops(out["second"]) == ["relax.subtract"]


def test_plan_picks_functions_and_sets_their_state():
    def plan(m, func) -> bool:
        m.seen.append(len(func.params))
        return "multiply" in func.script()  # only `first`

    m = _AddToSubtract(TwoFunctions)
    out = rewrite_functions(TwoFunctions, m, plan, unused=True)
    assert m.seen == [1, 1]
    assert _ops(out["first"]) == ["relax.subtract"]  # unused: the dead multiply is gone
    assert _ops(out["second"]) == ["relax.add"]  # not planned: as it was


def test_nothing_planned_is_the_module_itself():
    assert rewrite_functions(TwoFunctions, _AddToSubtract(TwoFunctions), lambda m, f: False, dce=True) is TwoFunctions


def test_dce_after_the_module():
    out = rewrite_functions(TwoFunctions, _AddToSubtract(TwoFunctions), dce=True)
    assert _ops(out["first"]) == ["relax.subtract"]
