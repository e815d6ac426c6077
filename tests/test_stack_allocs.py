"""compile/passes/stack_allocs.py: kernel-local buffers up to 64 KiB are stack allocas, not a
TVMBackendAllocWorkspace / FreeWorkspace pair per output tile (ablation `stack-allocs`)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tvm")

from blockforge.compile.pipeline import build  # noqa: E402
from blockforge.compile.session import open_model  # noqa: E402
from blockforge.graph import BlockSpec, FFNSpec, export  # noqa: E402
from blockforge.targets import resolve  # noqa: E402
from llvm_ir import llvm_source, workspace_allocs  # noqa: E402

# A fixed target: the counts do not move with the machine the tests run on.
FIXED = resolve({"kind": "llvm", "mcpu": "znver4", "mtriple": "x86_64-linux-gnu", "num-cores": 2})


@pytest.fixture(scope="module")
def block(tmp_path_factory):
    path = export(BlockSpec(d_model=96, heads=2, d_ff=384, norm="post"), tmp_path_factory.mktemp("sa") / "b.onnx").model_path
    return path


def test_gemm_tiles_call_no_workspace_allocator(block):
    s = open_model(block, FIXED, {"batch": 1, "seq": 24})
    with_pass = workspace_allocs(llvm_source(build(s.relax(), FIXED).executable))
    without = workspace_allocs(llvm_source(build(s.relax(), FIXED, without={"stack-allocs"}).executable))
    # TVM's 1 KiB rule: the 6 x 4-vector accumulator tile (1536 B) of each GEMM is a workspace
    # call inside the parallel loop over tiles; with the pass, none is left anywhere.
    assert sum(without.values()) >= 4, without
    assert with_pass == {}, with_pass


def test_outputs_equal_with_and_without(block, tmp_path):
    from tvm import relax
    import tvm

    host = resolve("host")
    s = open_model(block, host, {"batch": 1, "seq": 24})
    x = np.random.default_rng(0).standard_normal((1, 24, 96)).astype(np.float32)
    outs = []
    for without in (frozenset(), {"stack-allocs"}):
        vm = relax.VirtualMachine(build(s.relax(), host, without=without).executable, tvm.cpu())
        outs.append(vm["main"](tvm.runtime.tensor(x)).numpy())
    np.testing.assert_array_equal(outs[0], outs[1])


def test_symbolic_and_large_buffers_stay_with_the_allocator(tmp_path):
    """Only constant sizes up to STACK_LIMIT move: a symbolic-seq build still compiles and runs."""
    from tvm import relax
    import tvm

    from blockforge.graph import build as graph_build, reference

    spec = FFNSpec(d_model=64, d_ff=256, activation="gelu")
    path = export(spec, tmp_path / "f.onnx").model_path
    host = resolve("host")
    s = open_model(path, host, {"batch": 1})  # seq symbolic
    vm = relax.VirtualMachine(build(s.relax(), host).executable, tvm.cpu())
    x = np.random.default_rng(1).standard_normal((1, 37, 64)).astype(np.float32)
    got = vm["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_allclose(got, reference(spec, graph_build(spec)[1], {"x": x}), rtol=1e-4, atol=1e-4)
