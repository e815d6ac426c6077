"""Graph structure: the seed's ops, meaningful names, opsets, layouts agree."""

import collections

import numpy as np
import onnx
import pytest

from blockforge.graph import FFNSpec, MHASpec, BlockSpec, build
from blockforge.graph import ort as ort_runner
from blockforge.graph.analysis import analyze
from blockforge.graph.builders import IR_VERSION
from blockforge.graph.model_io import random_inputs, signature


def _ops(model):
    return collections.Counter(n.op_type for n in model.graph.node)


def test_per_head_mha_is_the_seed():
    spec = MHASpec(d_model=64, heads=4)
    model, _ = build(spec)
    ops = _ops(model)
    # 3 projections + QK^T + PV per head, plus W_O.
    assert ops["MatMul"] == 4 * 5 + 1
    assert ops["Div"] == 4 and ops["Softmax"] == 4 and ops["Concat"] == 1 and ops["Transpose"] == 4
    names = {n.name for n in model.graph.node}
    for i in range(4):
        for part in ("q_proj", "k_proj", "v_proj", "scores", "scale", "softmax", "context"):
            assert f"head_{i}/{part}" in names
    assert {"concat_heads", "out_proj"} <= names
    inits = {t.name: t for t in model.graph.initializer}
    assert list(inits["head_2/q_proj.weight"].dims) == [64, 16]  # W_Q^(i): d_model x d_k
    assert list(inits["out_proj.weight"].dims) == [64, 64]  # W_O: h d_k x d_model
    scale = onnx.numpy_helper.to_array(inits["sqrt_d_k"])
    assert scale == pytest.approx(4.0)
    assert [i.name for i in model.graph.input] == ["query", "key", "value"]


def test_packed_mha_one_gemm_per_projection():
    model, _ = build(MHASpec(d_model=64, heads=4, layout="packed"))
    ops = _ops(model)
    assert ops["MatMul"] == 3 + 2 + 1 and ops["Softmax"] == 1 and ops["Div"] == 1


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(cross=True, mask="additive", bias=False),
                                dict(mask="bool", dtype="float16")])
def test_per_head_and_packed_agree(kw):
    per_head, w = build(MHASpec(d_model=64, heads=4, **kw))
    packed, w2 = build(MHASpec(d_model=64, heads=4, layout="packed", **kw))
    for k in w:
        np.testing.assert_array_equal(w[k], w2[k])
    inputs = random_inputs(signature(per_head)[0], {"batch": 2, "seq": 7, "kv_seq": 5})
    a = ort_runner.run(per_head, inputs)["output"]
    b = ort_runner.run(packed, inputs)["output"]
    tol = 1e-5 if kw.get("dtype", "float32") == "float32" else 2e-3
    np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=tol, atol=tol)


def test_gelu_op_at_opset20_and_erf_below():
    m20, _ = build(FFNSpec(d_model=32, activation="gelu", opset=20))
    assert _ops(m20)["Gelu"] == 1
    gelu = next(n for n in m20.graph.node if n.op_type == "Gelu")
    assert gelu.name == "ffn/gelu"
    assert m20.opset_import[0].version == 20
    m17, _ = build(FFNSpec(d_model=32, activation="gelu", opset=17))
    assert _ops(m17)["Gelu"] == 0 and _ops(m17)["Erf"] == 1
    tanh, _ = build(FFNSpec(d_model=32, activation="gelu_tanh"))
    g = next(n for n in tanh.graph.node if n.op_type == "Gelu")
    assert onnx.helper.get_attribute_value(g.attribute[0]) == b"tanh"


def test_ir_version_and_metadata():
    model, _ = build(BlockSpec(d_model=32, heads=2))
    assert model.ir_version == IR_VERSION <= 13
    props = {p.key: p.value for p in model.metadata_props}
    assert "blockforge.spec" in props and "blockforge.version" in props
    assert _ops(model)["LayerNormalization"] == 2


def test_weights_deterministic_and_scaled():
    _, a = build(MHASpec(d_model=128, heads=4, seed=3))
    _, b = build(MHASpec(d_model=128, heads=4, seed=3))
    _, c = build(MHASpec(d_model=128, heads=4, seed=4))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["W_Q"], c["W_Q"])
    assert a["W_Q"].std() == pytest.approx(1 / np.sqrt(128), rel=0.1)


def test_flop_count_matches_formula():
    d, h, s, b = 64, 4, 10, 2
    model, _ = build(MHASpec(d_model=d, heads=h))
    facts = analyze(model, {"batch": b, "seq": s})
    expected = 2 * b * s * d * d * 4 + 2 * 2 * b * s * s * d  # 4 projections + QK^T + PV
    assert facts.flops == expected
    ffn, _ = build(FFNSpec(d_model=d, d_ff=3 * d))
    assert analyze(ffn, {"batch": b, "seq": s}).flops == 2 * 2 * b * s * d * 3 * d
