"""Self-attention's per-head projections regrouped by role (compile/attention/heads.py): the
seeds' encoder block gets one multi-head attention call instead of one per head, with the
same numbers; what it must not touch is left as it was."""

from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from blockforge.graph import BlockSpec, MHASpec, export  # noqa: E402


def _count(mod, name: str) -> int:
    return mod["main"].script().count(f"R.call_tir({name}")


@pytest.mark.parametrize("seq", [16, None])
def test_block_heads_merge_into_one_attention_with_the_same_numbers(tmp_path, seq, monkeypatch):
    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    from tvm import relax

    from blockforge.compile.pipeline import build, run_phases
    from blockforge.compile.session import open_model
    from blockforge.graph.parity import oracle_outputs

    path = export(BlockSpec(d_model=64, heads=4), tmp_path / "block.onnx").model_path
    s = open_model(path, "host", {"batch": 1, **({"seq": seq} if seq else {})})
    new, _ = run_phases(s.relax(), s.target, stop_after="fuse-attention")
    old, _ = run_phases(s.relax(), s.target, stop_after="fuse-attention", without={"attention-heads"})
    assert _count(old, "fused_attention") == 4 and "R.concat(" in old["main"].script()
    assert _count(new, "fused_attention") == 1
    assert "R.concat(" not in new["main"].script()  # no concat of the heads, no 3h-way split
    assert new["main"].script().count("R.matmul(") == old["main"].script().count("R.matmul(") + 2  # q, k, v GEMMs
    vms = [relax.VirtualMachine(build(s.relax(), s.target, without=w).executable, tvm.cpu())
           for w in (frozenset(), frozenset({"attention-heads"}))]
    for n in ([seq] if seq else [3, 16]):
        x = np.random.default_rng(n).standard_normal((1, n, 64)).astype(np.float32)
        got, without = (vm["main"](tvm.runtime.tensor(x)).numpy() for vm in vms)
        np.testing.assert_allclose(got, without, rtol=1e-5, atol=1e-5)
    x = np.random.default_rng(0).standard_normal((1, 16, 64)).astype(np.float32)
    ref = next(iter(oracle_outputs(s.model, {s.inputs[0].name: x}).values()))
    np.testing.assert_allclose(vms[0]["main"](tvm.runtime.tensor(x)).numpy(), ref, rtol=1e-4, atol=1e-4)


def test_cross_attention_and_unrelated_splits_are_left_alone(tmp_path, monkeypatch):
    """The MHA with query, key and value inputs: each split holds one role already (fuse-attention
    merges it as it is); a split whose items reach no heads' concat: untouched."""
    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    from tvm import relax

    from blockforge.compile.attention.heads import regroup_heads
    from blockforge.compile.session import open_model

    path = export(MHASpec(d_model=64, heads=4), tmp_path / "mha.onnx").model_path
    mod = open_model(path, "host", {"batch": 1, "seq": 16}).relax()
    tvm.ir.assert_structural_equal(regroup_heads()(mod), mod)

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([1, 8, 32], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            z = bb.emit(relax.op.matmul(x, relax.const(np.ones((32, 48), np.float32))))
            parts = bb.emit(relax.op.split(z, 3, axis=-1))
            a, b = bb.emit(relax.TupleGetItem(parts, 0)), bb.emit(relax.TupleGetItem(parts, 1))
            c = bb.emit(relax.TupleGetItem(parts, 2))
            out = bb.emit_output(relax.op.add(relax.op.add(a, b), c))
        bb.emit_func_output(out)
    mod = bb.get()
    tvm.ir.assert_structural_equal(regroup_heads()(mod), mod)


def test_ablation_is_known():
    from blockforge.compile.pipeline import ABLATIONS

    assert "attention-heads" in ABLATIONS
