"""The numpy oracle (float64, seed formulas) vs ONNX Runtime, across builder variants."""

import numpy as np
import pytest

from blockforge.graph import BlockSpec, FFNSpec, MHASpec, build, reference, tolerance_for
from blockforge.graph import ort as ort_runner
from blockforge.graph.export import validate
from blockforge.graph.model_io import random_inputs, signature
from blockforge.graph.tolerance import compare

MHA_VARIANTS = {
    "self": dict(),
    "self-packed": dict(layout="packed"),
    "cross": dict(cross=True),
    "cross-static-kv-packed": dict(kv_seq=11, layout="packed"),
    "causal": dict(causal=True),
    "causal-packed": dict(causal=True, layout="packed"),
    "bool-mask": dict(mask="bool"),
    "additive-mask-packed": dict(mask="additive", layout="packed"),
    "causal-bool-mask": dict(causal=True, mask="bool"),
    "no-bias": dict(bias=False),
    "no-bias-packed-cross": dict(bias=False, layout="packed", cross=True, mask="bool"),
}
FFN_VARIANTS = {
    "relu": dict(activation="relu"),
    "gelu": dict(activation="gelu"),
    "gelu-tanh": dict(activation="gelu_tanh"),
    "gelu-erf-opset17": dict(activation="gelu", opset=17),
    "gelu-tanh-opset19": dict(activation="gelu_tanh", opset=19),
}
BLOCK_VARIANTS = {
    "pre-ln": dict(norm="pre"),
    "post-ln": dict(norm="post"),
    "pre-ln-causal-packed": dict(norm="pre", causal=True, layout="packed"),
}
DTYPES = ["float32", "float16"]


def _specs():
    for name, kw in MHA_VARIANTS.items():
        for dt in DTYPES:
            yield pytest.param(MHASpec(d_model=64, heads=4, dtype=dt, **kw), id=f"mha-{name}-{dt}")
    for name, kw in FFN_VARIANTS.items():
        for dt in DTYPES:
            yield pytest.param(FFNSpec(d_model=64, d_ff=160, dtype=dt, **kw), id=f"ffn-{name}-{dt}")
    for name, kw in BLOCK_VARIANTS.items():
        for dt in DTYPES:
            yield pytest.param(BlockSpec(d_model=64, heads=4, d_ff=128, dtype=dt, **kw), id=f"block-{name}-{dt}")


def _check(spec, dims, seed=0):
    model, weights = build(spec)
    validate(model)
    ins, _ = signature(model)
    inputs = random_inputs(ins, dims, seed)
    got = ort_runner.run(model, inputs)["output"]
    want = reference(spec, weights, inputs)
    c = compare("ort vs oracle", "output", got, want, tolerance_for(spec.dtype, spec.kind))
    assert got.dtype == np.dtype(spec.dtype)
    assert c.passed, c
    return got, want


@pytest.mark.parametrize("spec", list(_specs()))
def test_oracle_matches_ort(spec):
    _check(spec, {"batch": 2, "seq": 9, "kv_seq": 13})


@pytest.mark.parametrize("dims", [{"batch": 1, "seq": 1, "kv_seq": 1}, {"batch": 3, "seq": 17, "kv_seq": 5},
                                  {"batch": 1, "seq": 64, "kv_seq": 64}])
def test_symbolic_dims_one_model_many_shapes(dims):
    spec = MHASpec(d_model=64, heads=4, cross=True, mask="bool")
    got, _ = _check(spec, dims)
    assert got.shape == (dims["batch"], dims["seq"], 64)


def test_bert_base_mha_and_ffn():
    _check(MHASpec(d_model=768, heads=12), {"batch": 1, "seq": 128})
    _check(FFNSpec(d_model=768, d_ff=3072, activation="gelu"), {"batch": 1, "seq": 128})


def test_static_dims():
    spec = FFNSpec(d_model=32, batch=2, seq=5)
    model, _ = build(spec)
    ins, _ = signature(model)
    assert ins[0].dims == (2, 5, 32)
    _check(spec, {})


def test_masked_keys_get_no_weight():
    """A key masked out must not change the output, whatever its value."""
    spec = MHASpec(d_model=32, heads=2, mask="bool")
    model, _ = build(spec)
    ins, _ = signature(model)
    inputs = random_inputs(ins, {"batch": 1, "seq": 6})
    inputs["key_padding_mask"][:] = True
    inputs["key_padding_mask"][0, 3] = False
    a = ort_runner.run(model, inputs)["output"]
    inputs["key"][0, 3] += 100.0
    inputs["value"][0, 3] -= 50.0
    b = ort_runner.run(model, inputs)["output"]
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_causal_future_does_not_leak():
    spec = MHASpec(d_model=32, heads=2, causal=True)
    model, _ = build(spec)
    ins, _ = signature(model)
    inputs = random_inputs(ins, {"batch": 1, "seq": 8})
    a = ort_runner.run(model, inputs)["output"]
    for k in ("query", "key", "value"):
        inputs[k][0, 5:] = 7.0
    b = ort_runner.run(model, inputs)["output"]
    np.testing.assert_allclose(a[0, :5], b[0, :5], rtol=1e-5, atol=1e-6)
    assert not np.allclose(a[0, 5:], b[0, 5:])
