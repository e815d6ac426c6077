"""concat-stack (compile/passes/concat_stack.py): a last-axis concat of equal parts becomes a
stack on a new axis and a reshape, the same numbers, and its kernel reads whole vectors (no
masked gathers); what it does not take stays a concat."""

from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
from tvm import relax  # noqa: E402

from blockforge.compile.passes.concat_stack import concat_stack_pass  # noqa: E402
from blockforge.compile.pipeline import build, run_phases  # noqa: E402
from blockforge.targets import resolve  # noqa: E402

from llvm_ir import llvm_source  # noqa: E402

HOST = resolve("host")


def _concat_module(shapes, axis=-1, dtype="float32", quantize=False):
    bb = relax.BlockBuilder()
    xs = [relax.Var(f"x{i}", relax.TensorType(s, dtype)) for i, s in enumerate(shapes)]
    with bb.function("main", xs):
        with bb.dataflow():
            c = bb.emit(relax.op.concat(xs, axis=axis))
            if quantize:  # the QDQ MHA's heads: concat, then the output projection's quantize
                c = bb.emit(relax.op.quantize(c, relax.const(0.05, "float32"), relax.const(3, "int8"), axis=-1,
                                              out_dtype="int8"))
            out = bb.emit_output(c)
        bb.emit_func_output(out)
    return bb.get()


def _ops(mod) -> str:
    return mod["main"].script()


def test_equal_parts_on_the_last_axis_become_a_stack():
    mod = concat_stack_pass()(_concat_module([(1, 8, 32)] * 4))
    text = _ops(mod)
    assert "R.concat(" not in text and "R.stack(" in text and "R.reshape(" in text, text


@pytest.mark.parametrize("shapes, axis, why", [
    ([(1, 8, 32), (1, 8, 48)], -1, "parts of different widths"),
    ([(1, 8, 32)] * 3, 1, "not the last axis"),
    ([(1, 8, 8)] * 4, -1, "a part narrower than a vector"),
    ([(1, 8, 24)] * 2, -1, "not a whole number of vectors"),
])
def test_what_it_does_not_take_stays_a_concat(shapes, axis, why):
    text = _ops(concat_stack_pass()(_concat_module(shapes, axis)))
    assert "R.concat(" in text and "R.stack(" not in text, why


@pytest.mark.parametrize("quantize", [False, True])
def test_same_numbers_and_no_gathers(quantize):
    """Built through the pipeline with and without the ablation: bit-equal outputs; the
    without build's kernel reads the parts with masked gathers, the stack's with none."""
    shapes = [(1, 64, 64)] * 12
    mod = _concat_module(shapes, quantize=quantize)
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(s).astype("float32") for s in shapes]
    outs, gathers = {}, {}
    for without in (frozenset(), frozenset({"concat-stack"})):
        opt, _ = run_phases(mod, HOST, stop_after="optimize", without=without)
        assert ("R.concat(" in _ops(opt)) == bool(without)
        ex = build(mod, HOST, without=without).executable
        gathers[bool(without)] = llvm_source(ex).count("llvm.masked.gather")
        vm = relax.VirtualMachine(ex, tvm.cpu())
        outs[bool(without)] = vm["main"](*[tvm.runtime.tensor(x) for x in xs]).numpy()
    np.testing.assert_array_equal(outs[False], outs[True])
    ref = np.concatenate(xs, axis=-1)
    if not quantize:
        np.testing.assert_array_equal(outs[False], ref)
    assert gathers[False] == 0 and gathers[True] > 0, gathers


def test_symbolic_rows():
    """A symbolic seq (the parts' shapes equal as expressions): rewritten, same numbers."""
    n = tvm.tirx.Var("n", "int64")
    mod = _concat_module([(1, n, 32)] * 3)
    assert "R.stack(" in _ops(concat_stack_pass()(mod))
    vm = relax.VirtualMachine(build(mod, HOST).executable, tvm.cpu())
    xs = [np.random.default_rng(i).standard_normal((1, 5, 32)).astype("float32") for i in range(3)]
    got = vm["main"](*[tvm.runtime.tensor(x) for x in xs]).numpy()
    np.testing.assert_array_equal(got, np.concatenate(xs, axis=-1))
