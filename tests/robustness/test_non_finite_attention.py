"""NaN and Inf in an attention's inputs reach the output exactly where ONNX Runtime puts them,
through the fused CPU attention kernel and the standard Attention op's converter.

Before: the fused kernel's exp clamped NaN to exp(-88) ~ 0, so one NaN in `query` of a causal
MHA gave TVM 0 non-finite outputs (ORT 64), an Inf in `key` 0 (ORT 576-1024) and a NaN in an
additive mask 0 (ORT 768); the Attention op's converter clamped its mask with a max (NaN
dropped) and added the causal mask to it (a NaN/+Inf mask value at a causally masked key
became NaN, where ORT drops it). The grid is the float16 suite's (test_fp16_overflow.py):
both dtypes, per-head and attention-op layouts, causal + additive and bool masks, with fully
masked rows. Each model is built once; every injection runs on it."""

from __future__ import annotations

import numpy as np
import pytest

from blockforge.compile import attention
from blockforge.compile.pipeline import run_phases
from blockforge.compile.artifact.runtime import run_vm, tvm_device
from blockforge.compile.session import open_model
from blockforge.graph import MHASpec, export, reference
from blockforge.graph import ort as ort_runner
from blockforge.graph.model_io import random_inputs
from blockforge.graph.tolerance import tolerance_for

DIMS = {"batch": 2, "seq": 16}


def _inject(inputs: dict, what: str) -> dict:
    x = {k: v.copy() for k, v in inputs.items()}
    if what == "nan query":
        x["query"][0, 3, 5] = np.nan
    elif what == "inf key":
        x["key"][0, 7, 2] = np.inf
    elif what == "-inf key":
        x["key"][1, 9, 0] = -np.inf
    elif what == "nan mask":
        x["key_padding_mask"][0, 4] = np.nan
    elif what == "inf mask":
        x["key_padding_mask"][1, 6] = np.inf
    elif what == "fully masked rows":  # every key of batch 0 padded out
        m = x["key_padding_mask"]
        m[0, :] = False if m.dtype == np.bool_ else -np.inf
    return x


MODELS = {f"{dtype} {layout} {name}": MHASpec(d_model=64, heads=4, dtype=dtype, layout=layout, **kw)
          for dtype in ("float32", "float16") for layout in ("per-head", "attention-op")
          for name, kw in (("causal additive", dict(causal=True, mask="additive")), ("bool", dict(mask="bool")))}


@pytest.mark.parametrize("name", list(MODELS))
def test_nan_and_inf_propagate_as_in_ort(name, tmp_path):
    from tvm import relax

    spec = MODELS[name]
    res = export(spec, tmp_path / "m.onnx")
    session = open_model(res.model_path, "host", DIMS)
    if spec.dtype == "float32":  # the kernel under test is in the build (float16 + bool: unfused, README)
        fused, _ = run_phases(session.relax(), session.target, stop_after="fuse-attention")
        assert attention.kernel_specs(fused), "the build under test must use the fused kernel"
    dev = tvm_device("cpu")
    vm = relax.VirtualMachine(session.build().executable, dev)
    base = random_inputs(session.inputs, DIMS, seed=0)
    cases = ["nan query", "inf key", "-inf key", "fully masked rows"]
    cases += ["nan mask", "inf mask"] if spec.mask == "additive" else []
    tol = tolerance_for(spec.dtype, spec.kind)
    bad = []
    for what in cases:
        inputs = _inject(base, what)
        ours = run_vm(vm, dev, session.inputs, session.outputs, inputs)["output"].astype(np.float64)
        refs = {"ORT": ort_runner.run(session.model, inputs)["output"].astype(np.float64)}
        if spec.layout != "attention-op":
            # the oracle is the seed's formulas; the Attention op's own rules (a fully masked
            # row is 0, causal replaces the mask) are ORT's and ONNX's, not the seed's
            with np.errstate(invalid="ignore", over="ignore"):
                refs["oracle"] = reference(spec, res.weights, inputs)
        for who, ref in refs.items():
            for label, test in (("NaN", np.isnan), ("+Inf", np.isposinf), ("-Inf", np.isneginf)):
                if not np.array_equal(test(ours), test(ref)):
                    bad.append(f"{what}: {label} TVM {int(test(ours).sum())}, {who} {int(test(ref).sum())}")
            fin = np.isfinite(ref) & np.isfinite(ours)
            if fin.any() and not np.allclose(ours[fin], ref[fin], rtol=tol.rtol, atol=tol.atol):
                bad.append(f"{what}: vs {who} max abs diff {np.abs(ours[fin] - ref[fin]).max():.3e}")
        if what != "fully masked rows":
            assert np.isfinite(refs["ORT"]).any() and not np.isfinite(refs["ORT"]).all(), \
                f"{what}: the case must give ORT some non-finite and some finite outputs"
    assert not bad, bad
