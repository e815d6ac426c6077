"""float16 models near the top of float16's range: TVM's outputs on the CPU must have their
inf/NaN exactly where ONNX Runtime's are, and match it elsewhere (the tolerance table).

ORT's CPU provider computes float16 graphs in float32 (compile/passes/fp32_compute.py); with
float16 intermediates TVM gave all-NaN for an MHA with inputs x300 (ORT finite) and 1024
Inf for an FFN with inputs 60000 (ORT: 96, where the output itself overflows)."""

from __future__ import annotations

import numpy as np
import pytest

from blockforge.compile.pipeline import phases
from blockforge.compile.artifact.runtime import run_vm, tvm_device
from blockforge.compile.session import open_model
from blockforge.graph import FFNSpec, MHASpec, export
from blockforge.graph import ort as ort_runner
from blockforge.graph.model_io import random_inputs
from blockforge.graph.tolerance import tolerance_for
from blockforge.targets import resolve

DIMS = {"batch": 1, "seq": 16}
CASES = {
    # QK^T reaches 1.4e6 (3.6e5 after the scale): float16 scores overflow before the softmax
    "mha inputs x300": (MHASpec(d_model=64, heads=4, dtype="float16"), lambda v: v.astype(np.float32) * 300),
    "mha causal bool mask x300": (MHASpec(d_model=64, heads=4, dtype="float16", causal=True, mask="bool"),
                                  lambda v: v.astype(np.float32) * 300 if v.dtype.kind == "f" else v),
    # the hidden layer overflows float16 everywhere; the output only in some places (in ORT too)
    "ffn inputs 60000": (FFNSpec(d_model=64, dtype="float16"), lambda v: np.full(v.shape, 60000.0)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_non_finite_where_ort_has_them(name, tmp_path):
    from tvm import relax

    spec, scale = CASES[name]
    path = export(spec, tmp_path / "m.onnx").model_path
    session = open_model(path, "host", DIMS)
    inputs = {k: np.asarray(scale(v)).astype(v.dtype) for k, v in random_inputs(session.inputs, DIMS, seed=0).items()}
    dev = tvm_device("cpu")
    vm = relax.VirtualMachine(session.build().executable, dev)
    ours = run_vm(vm, dev, session.inputs, session.outputs, inputs)["output"].astype(np.float64)
    ref = ort_runner.run(session.model, inputs)["output"].astype(np.float64)
    for what, test in (("NaN", np.isnan), ("+Inf", np.isposinf), ("-Inf", np.isneginf)):
        assert np.array_equal(test(ours), test(ref)), \
            f"{what}: TVM {int(test(ours).sum())}, ORT {int(test(ref).sum())} of {ours.size}"
    fin = np.isfinite(ref)
    assert fin.any(), "the case must keep finite outputs to compare"
    tol = tolerance_for("float16", spec.kind)
    assert np.allclose(ours[fin], ref[fin], rtol=tol.rtol, atol=tol.atol), \
        f"max abs diff {np.abs(ours[fin] - ref[fin]).max():.3e}"


def test_fp16_phase_by_target():
    """CPU: float32 inside (as ORT's CPU provider); GPU: float16 storage, float32 sums (as
    ORT's CUDA provider, whose kernels are float16)."""
    assert "fp32-compute" in [p.name for p in phases(resolve("host"), fp16=True)]
    gpu = [p.name for p in phases(resolve("cuda-sm80"), fp16=True)]
    assert "fp32-accumulate" in gpu and "fp32-compute" not in gpu
