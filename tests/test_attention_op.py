"""The standard ONNX Attention op (opset 23/24): imported by compile/frontend/converters.py as the plain
Relax decomposition, and the `attention-op` export layout built on it.

All ONNX node cases of Attention run in test_onnx_backend.py (a subset by default); here: the
decomposition's shape (what the fused CPU attention kernel pattern-matches), the contrib op
left to TVM, errors, and the attention-op layout against ONNX Runtime, the oracle and the
other layouts.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from blockforge.errors import BlockforgeError
from blockforge.graph import MHASpec, build, export, reference
from blockforge.graph.model_io import random_inputs, signature

from conftest import run_cli_in_process
from test_onnx_backend import node_cases, run_case


def _bindings(mod):
    """var name -> (op name, [argument names or constant marker]) over main's bindings."""
    from tvm import relax

    out = {}
    for block in mod["main"].body.blocks:
        for b in block.bindings:
            v = b.value
            if isinstance(v, relax.Call) and hasattr(v.op, "name"):
                args = [a.name if isinstance(a, relax.Var) else "const" for a in v.args]
                out[b.var.name] = (v.op.name, args)
    return out


def _attention_chain(mod) -> dict:
    """Follow softmax back to the scores and forward to the context matmul; returns the ops."""
    calls = _bindings(mod)
    (sm,) = [n for n, (op, _) in calls.items() if op == "relax.nn.softmax"]
    add = calls[calls[sm][1][0]]
    mul = calls[add[1][0]]
    qk = calls[mul[1][0]]
    kt = calls[qk[1][1]]
    (pv,) = [n for n, (op, args) in calls.items() if op == "relax.matmul" and args[0] == sm]
    return {"add": add, "multiply": mul, "matmul": qk, "permute_dims": kt, "context": calls[pv]}


def test_decomposition_is_the_plain_pattern():
    """R.matmul(q, R.permute_dims(k)) * scale + bias -> R.nn.softmax -> R.matmul(., v): nothing
    between those, bias built from the inputs only (bool mask and causal here)."""
    from blockforge.compile.frontend.importer import import_onnx

    spec = MHASpec(d_model=32, heads=2, layout="attention-op", causal=True, mask="bool", batch=1, seq=6)
    mod = import_onnx(build(spec)[0])
    chain = _attention_chain(mod)
    assert chain["add"][0] == "relax.add" and chain["multiply"][0] == "relax.multiply"
    assert chain["multiply"][1][1] == "const"  # the scale
    assert chain["matmul"][0] == "relax.matmul" and chain["permute_dims"][0] == "relax.permute_dims"
    assert chain["context"][0] == "relax.matmul"
    ops = [op for op, _ in _bindings(mod).values()]
    assert ops.count("relax.nn.softmax") == 1 and ops.count("relax.matmul") == 6  # q, k, v, out, qk, pv


@pytest.mark.parametrize("name", [
    "test_attention_3d_diff_heads_sizes_attn_mask",
    "test_attention_4d_gqa_with_past_and_present",
    "test_attention_23_boolmask_fullymasked_row_nan_robustness",
    "test_attention_4d_causal_nonpad_attn_mask_composition",
    "test_attention_bidirectional_window",
])
def test_node_cases(name):
    run_case(node_cases()[name][1])


def _contrib_model():
    rng = np.random.default_rng(0)
    node = helper.make_node("Attention", ["x", "w", "b"], ["y"], domain="com.microsoft", num_heads=2, name="ms")
    g = helper.make_graph([node], "contrib", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, 16])],
                          [onnx.numpy_helper.from_array((rng.standard_normal((16, 48)) * 0.2).astype("float32"), "w"),
                           onnx.numpy_helper.from_array(rng.standard_normal(48).astype("float32"), "b")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 10
    return m


def test_contrib_attention_stays_with_tvms_converter():
    """com.microsoft.Attention (num_heads) is not the standard op: TVM's contrib converter."""
    import onnxruntime as ort

    from blockforge.compile.onnx_backend import BlockforgeBackend

    m = _contrib_model()
    x = np.random.default_rng(1).standard_normal((2, 5, 16)).astype("float32")
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(BlockforgeBackend.prepare(m).run([x])[0], want, rtol=1e-5, atol=1e-5)


def test_unsupported_attribute_is_one_line_naming_the_node():
    from blockforge.compile.frontend.importer import import_onnx

    q = helper.make_tensor_value_info("q", TensorProto.FLOAT, [2, 4, 16])
    node = helper.make_node("Attention", ["q", "q", "q"], ["y"], name="blk0/attn", q_num_heads=2, kv_num_heads=2,
                            qk_matmul_output_mode=7)
    m = helper.make_model(helper.make_graph([node], "g", [q], [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                                                            [2, 4, 16])]),
                          opset_imports=[helper.make_opsetid("", 23)])
    m.ir_version = 11
    with pytest.raises(BlockforgeError, match=r"ONNX op Attention \(node 'blk0/attn', opset 23\): .*"
                                              r"qk_matmul_output_mode 7") as e:
        import_onnx(m)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- the attention-op export layout


def test_spec_rules():
    assert MHASpec(layout="attention-op").opset == 23 and MHASpec().opset == 20
    assert MHASpec(layout="attention-op", opset=24).opset == 24
    with pytest.raises(BlockforgeError, match=r"attention-op layout needs an opset in \[23, 24\]"):
        MHASpec(layout="attention-op", opset=20)
    with pytest.raises(BlockforgeError, match=r"opset must be an integer in \[17, 21\]"):
        MHASpec(opset=23)
    from blockforge.graph import BlockSpec

    with pytest.raises(BlockforgeError, match="attention-op layout is for mha only"):
        BlockSpec(layout="attention-op")


def test_model_structure_same_weights_as_packed():
    spec = MHASpec(d_model=32, heads=4, layout="attention-op", mask="additive")
    model, w = build(spec)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Attention") == 1 and "Softmax" not in ops and ops.count("MatMul") == 4
    (attn,) = [n for n in model.graph.node if n.op_type == "Attention"]
    attrs = {a.name: helper.get_attribute_value(a) for a in attn.attribute}
    assert attrs == {"q_num_heads": 4, "kv_num_heads": 4, "is_causal": 0}
    assert model.ir_version == 11 and model.opset_import[0].version == 23
    packed, w2 = build(MHASpec(d_model=32, heads=4, layout="packed", mask="additive"))
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    for t in packed.graph.initializer:
        if t.name.endswith((".weight", ".bias")):
            np.testing.assert_array_equal(inits[t.name], onnx.numpy_helper.to_array(t))
    assert build(MHASpec(d_model=32, heads=4, layout="attention-op", opset=24))[0].ir_version == 12


@pytest.mark.parametrize("kw, dims", [
    (dict(causal=True, mask="bool"), None),  # symbolic batch/seq
    (dict(kv_seq=11, mask="additive"), "batch=2,seq=7"),
    (dict(cross=True, bias=False, dtype="float16"), "batch=1,seq=5,kv_seq=9"),
], ids=["causal-bool-symbolic", "cross-additive-bound", "cross-fp16-bound"])
def test_layout_parity_tvm_ort_oracle(workdir, kw, dims):
    from blockforge.compile import VerifyOptions, verify
    from blockforge.graph.model_io import parse_dims

    res = export(MHASpec(d_model=64, heads=4, layout="attention-op", **kw), workdir / "m.onnx")
    rep = verify(VerifyOptions(model=res.model_path, target="host", shape=parse_dims(dims), use_tuning=False))
    pairs = {c.pair: c for c in rep.comparisons}
    assert set(pairs) == {"tvm vs ort", "tvm vs oracle", "ort vs oracle"}, rep
    assert rep.passed, [c for c in rep.comparisons if not c.passed]


def test_layouts_agree_under_tvm():
    """Same weights, same inputs: attention-op and packed give the same outputs through blockforge."""
    from blockforge.compile.onnx_backend import BlockforgeBackend

    outs = {}
    for layout in ("attention-op", "packed"):
        spec = MHASpec(d_model=64, heads=4, layout=layout, causal=True, mask="bool", batch=2, seq=8)
        model, w = build(spec)
        ins, _ = signature(model)
        x = random_inputs(ins, {}, seed=3)
        outs[layout] = BlockforgeBackend.prepare(model).run([x[s.name] for s in ins])[0]
    np.testing.assert_allclose(outs["attention-op"], outs["packed"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outs["packed"], reference(spec, w, x), rtol=1e-4, atol=1e-5)


def test_export_cli_default_name(tmp_path):
    r = run_cli_in_process("export", "mha", "--d-model", 32, "--heads", 2, "--layout", "attention-op", cwd=tmp_path)
    assert r.rc == 0, r.text
    path = tmp_path / "artifacts" / "mha_d32_h2_attention-op.onnx"
    assert path.is_file()
    manifest = json.loads(path.with_suffix(".json").read_text())
    assert manifest["opset"] == 23 and manifest["ir_version"] == 11 and manifest["ops"]["Attention"] == 1


def _no_nvcc():
    from blockforge.targets import resolve

    return resolve("cuda-sm90").build_problem()


@pytest.mark.skipif(bool(_no_nvcc()), reason=f"CUDA builds need nvcc: {_no_nvcc()}")
def test_layout_builds_for_cuda(tmp_path):
    """dlight's GPU rules schedule every kernel of the decomposition, and nvcc takes the source
    (the fully-masked-row rule once hit a TVM CUDA codegen bug: ushort2 -> float2)."""
    from blockforge.compile import CompileOptions, compile_model

    path = export(MHASpec(d_model=64, heads=4, layout="attention-op", causal=True, mask="bool"),
                  tmp_path / "m.onnx").model_path
    res = compile_model(CompileOptions(model=path, target="cuda-sm90", shape={"batch": 1}, output=tmp_path / "art"))
    assert {"module.so", "kernels.cu", "device.fatbin"} <= set(res.manifest["files"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_layout_runs_on_cuda_and_matches_ort(tmp_path, dtype):
    from blockforge.compile import VerifyOptions, verify

    path = export(MHASpec(d_model=256, heads=4, layout="attention-op", causal=True, mask="bool", dtype=dtype),
                  tmp_path / "m.onnx").model_path
    rep = verify(VerifyOptions(model=path, target="cuda-sm90", shape={"batch": 2, "seq": 64}))
    assert {"tvm vs ort", "tvm vs oracle"} <= {c.pair for c in rep.comparisons}, rep.notes
    assert rep.passed, rep.to_dict()
