"""`blockforge quantize`, `export --quantize`, the other quantized forms' import
(QLinearMatMul, QGemm, MatMulIntegerToFloat), and precision as data: the int8 parity and
accuracy rows of the tolerance table, as verify and bench apply them."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
# The verbs in-process (their outputs and errors are under test, not the process): ~2 s of
# CPU less per call than an interpreter start and a TVM import; verify still runs its children.
from conftest import assert_user_error, run_cli_in_process as cli, save_npz
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("onnxruntime.quantization")


def _ops_feeding(model, op_types) -> set[str]:
    """Op types of the producers of `op_types` nodes' inputs."""
    producer = {o: n.op_type for n in model.graph.node for o in n.output}
    return {producer.get(i) for n in model.graph.node if n.op_type in op_types for i in n.input}


@pytest.fixture(scope="module")
def block(tmp_path_factory):
    from blockforge.graph import BlockSpec, export

    d = tmp_path_factory.mktemp("qblock")
    return export(BlockSpec(d_model=32, heads=2, d_ff=64), d / "block.onnx").model_path


@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_quantize_cli_keeps_transformer_ops_float(block, tmp_path, mode):
    out = tmp_path / f"q_{mode}.onnx"
    res = cli("quantize", str(block), "--mode", mode, "--per-channel", "-o", str(out))
    assert res.rc == 0, res.text
    q = onnx.load(str(out))
    assert "int8 GEMMs" in res.out and "kept in float: 2 layernorm, 2 softmax, 1 gelu, 2 residual add" in res.out
    assert "quantize: pre-processing" in res.err  # progress
    if mode == "static":
        assert "RANDOM batches" in res.out and "calibrating: batch 8/8" in res.err
        # nothing around LayerNorm/Softmax/Erf/residual Add is quantized: no DQ feeds them
        feeding = _ops_feeding(q, {"LayerNormalization", "Softmax", "Erf"})
        assert "DequantizeLinear" not in feeding, feeding
        matmuls = sum(n.op_type == "MatMul" for n in q.graph.node)
        assert matmuls and all(p == "DequantizeLinear" for p in _ops_feeding(q, {"MatMul"}) if p)
    else:
        assert sum(n.op_type == "MatMulInteger" for n in q.graph.node) >= 4
        assert "DynamicQuantizeLinear" not in _ops_feeding(q, {"LayerNormalization", "Softmax", "Erf"})
    props = {p.key: p.value for p in q.metadata_props}
    assert "blockforge.spec" in props and mode in props["blockforge.quantization"]


def test_bias_adds_quantizes_the_gemms_bias_add_and_nothing_else(block, tmp_path):
    """`--bias-adds` (static): the Add right after each quantized MatMul gets its QDQ pair (so
    the int8 epilogue can read gelu from its table); residual Adds, LayerNorm, Softmax and
    Gelu stay float as without it; the file says how it was quantized."""
    out = tmp_path / "q.onnx"
    res = cli("quantize", str(block), "--mode", "static", "--per-channel", "--bias-adds", "-o", str(out))
    assert res.rc == 0, res.text
    from blockforge.graph.quantize import bias_adds, float_exclusions

    src = onnx.load(str(block))
    bias, other = bias_adds(src)
    residual = float_exclusions(src)["residual add"]
    # per head q/k/v (2 heads), the output projection, fc1, fc2; the two residual Adds
    assert len(bias) == 9 and len(residual) == 2 and set(residual) <= set(other), (bias, other)
    q = onnx.load(str(out))
    users: dict = {}
    for n in q.graph.node:
        for i in n.input:
            users.setdefault(i, set()).add(n.op_type)
    added = {n.name: n.output[0] for n in q.graph.node if n.op_type == "Add"}
    assert all(users.get(added[name]) == {"QuantizeLinear"} for name in bias), {n: users.get(added[n]) for n in bias}
    assert all("QuantizeLinear" not in users.get(added[name], set()) for name in residual)
    assert "DequantizeLinear" not in _ops_feeding(q, {"LayerNormalization", "Softmax", "Erf"})
    props = {p.key: p.value for p in q.metadata_props}
    assert '"bias_adds": true' in props["blockforge.quantization"]
    assert_user_error(cli("quantize", str(block), "--mode", "dynamic", "--bias-adds", "-o", str(tmp_path / "d.onnx")),
                      "--bias-adds is for --mode static")
    assert_user_error(cli("export", "ffn", "--quantize", "dynamic", "--bias-adds", "-o", str(tmp_path / "x.onnx")),
                      "--bias-adds needs --quantize static")


def test_bias_adds_finds_only_adds_fed_by_a_gemm():
    """A decomposed LayerNorm's epsilon Add has a constant operand too, and no GEMM before it."""
    from blockforge.graph.quantize import bias_adds

    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    b = numpy_helper.from_array(np.ones(4, np.float32), "b")
    eps = numpy_helper.from_array(np.array(1e-5, np.float32), "eps")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
             helper.make_node("Add", ["b", "y"], ["yb"], name="bias"),  # the constant first: still a bias
             helper.make_node("Add", ["yb", "x"], ["r"], name="residual"),
             helper.make_node("ReduceMean", ["r"], ["m"], name="mean"),
             helper.make_node("Add", ["m", "eps"], ["me"], name="epsilon")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                          [helper.make_tensor_value_info("me", TensorProto.FLOAT, None)], [w, b, eps])
    assert bias_adds(helper.make_model(g)) == (["bias"], ["residual", "epsilon"])


def test_quantize_static_calibration_npz(block, tmp_path):
    """Batches stacked on a new axis 0; the message names the file, not random inputs."""
    x = np.random.default_rng(0).standard_normal((3, 1, 8, 32)).astype(np.float32)
    npz = save_npz(tmp_path / "cal.npz", x=x)
    res = cli("quantize", str(block), "--mode", "static", "--activation-type", "u8", "--calibration", str(npz),
              "-o", str(tmp_path / "q.onnx"))
    assert res.rc == 0, res.text
    assert "3 batch(es) from" in res.out and "RANDOM" not in res.out
    q = onnx.load(str(tmp_path / "q.onnx"))
    zps = [t for t in q.graph.initializer if t.name.endswith("zero_point") and t.data_type == TensorProto.UINT8]
    assert zps, "U8S8: activations quantized to uint8"


def test_quantize_user_errors_leave_output_untouched(block, tmp_path):
    out = tmp_path / "q.onnx"
    out.write_bytes(b"keep me")
    bad = save_npz(tmp_path / "bad.npz", y=np.zeros((1, 8, 32), np.float32))
    assert_user_error(cli("quantize", str(block), "--mode", "static", "--calibration", str(bad), "-o", str(out)),
                      "unexpected y")
    assert_user_error(cli("quantize", str(block), "--mode", "dynamic", "--calibration", str(bad), "-o", str(out)),
                      "--calibration is for --mode static")
    assert_user_error(cli("quantize", str(block), "--mode", "dynamic", "-o", str(tmp_path / "q.txt")), ".onnx")
    assert_user_error(cli("quantize", str(block), "--mode", "dynamic", "-o", str(block)))  # the input itself
    assert out.read_bytes() == b"keep me"
    assert cli("quantize", str(block), "--mode", "dynamic", "-o", str(out)).rc == 0
    assert_user_error(cli("quantize", str(out), "--mode", "dynamic", "-o", str(tmp_path / "qq.onnx")),
                      "already quantized")
    assert not (tmp_path / "qq.onnx").exists()


def test_export_quantize_writes_the_quantized_model_and_counts_its_ops(tmp_path):
    from blockforge.graph.analysis import matmul_flops

    fp = cli("export", "ffn", "--d-model", "32", "--d-ff", "64", "-o", str(tmp_path / "f.onnx"))
    res = cli("export", "ffn", "--d-model", "32", "--d-ff", "64", "--quantize", "dynamic", "-o",
              str(tmp_path / "q.onnx"))
    assert fp.rc == 0 and res.rc == 0, res.text
    import json

    man = json.loads((tmp_path / "q.json").read_text())
    assert man["quantization"]["mode"] == "dynamic" and man["ops"].get("MatMulInteger") == 2
    # MatMulInteger counts the ops it computes (it counted 0 before)
    f32 = matmul_flops(onnx.load(str(tmp_path / "f.onnx")))
    assert f32 > 0 and man["matmul_flops"] == f32
    assert_user_error(cli("export", "ffn", "--per-channel", "-o", str(tmp_path / "x.onnx")), "--quantize")


@pytest.mark.parametrize("dims, left", [(("--batch", "1", "--seq", "16"), ()), (("--seq", "16"), ("--shape", "batch=1")),
                                        (("--batch", "1"), ("--shape", "seq=16"))])
def test_export_quantize_static_with_static_dims(tmp_path, dims, left):
    """A static --batch/--seq is no symbolic dim: the random calibration binds only what is left
    (it named the static ones before, and the export failed: "--shape names batch, seq, which the
    model does not have"); the export verifies against its float oracle."""
    q = tmp_path / "q.onnx"
    res = cli("export", "mha", "--d-model", "32", "--heads", "4", *dims, "--quantize", "static", "-o", str(q))
    assert res.rc == 0 and "wrote" in res.out, res.text
    import json

    assert json.loads((tmp_path / "q.json").read_text())["quantization"]["int8_gemms"] > 0
    v = cli("verify", str(q), *left)
    assert v.rc == 0 and "precision int8" in v.out, v.text


@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_verify_quantized_export_uses_accuracy_gate_against_the_oracle(tmp_path, mode):
    """The oracle is the float model: a quantized export passes by relative L2 (it failed the
    float32 row before), and a broken quantization (weights zeroed) is flagged."""
    q = tmp_path / "q.onnx"
    assert cli("export", "ffn", "--d-model", "32", "--d-ff", "64", "--quantize", mode, "-o", str(q)).rc == 0
    res = cli("verify", str(q), "--shape", "batch=1,seq=8", "--json", str(tmp_path / "r.json"))
    assert res.rc == 0 and "precision int8" in res.out and "rel L2 err" in res.out, res.text
    import json

    row = json.loads((tmp_path / "r.json").read_text())["comparisons"][0]
    assert row["precision"] == "int8" and 0 < row["rel_l2"] <= row["accuracy_gate"]
    m = onnx.load(str(q))
    w = next(t for t in m.graph.initializer if t.data_type == TensorProto.INT8 and len(t.dims) == 2)
    w.CopyFrom(numpy_helper.from_array(np.zeros(tuple(w.dims), np.int8), w.name))
    onnx.save(m, str(tmp_path / "broken.onnx"))
    res = cli("verify", str(tmp_path / "broken.onnx"), "--shape", "batch=1,seq=8")
    assert res.rc == 1 and "FAIL" in res.out and "> gate" in res.out, res.text


def test_verify_reference_for_a_foreign_quantized_model(tmp_path):
    """No spec (foreign model): --reference FP32.onnx gives the float side."""
    m, _ = _linear("MatMul")
    onnx.save(m, str(tmp_path / "f.onnx"))
    q = _qoperator(tmp_path, "MatMul", per_channel=True, act="QInt8")
    res = cli("verify", str(q), "--reference", str(tmp_path / "f.onnx"))
    assert res.rc == 0 and "ort vs reference" in res.out and "rel L2 err" in res.out, res.text
    assert_user_error(cli("verify", str(q)), "no oracle")
    other = _matmul_integer_to_float(tmp_path, False, False, False)  # input x renamed z: not the inputs verify feeds
    m2 = onnx.load(str(other))
    m2.graph.input[0].name = "z"
    m2.graph.node[0].input[0] = "z"
    onnx.save(m2, str(tmp_path / "z.onnx"))
    assert_user_error(cli("verify", str(q), "--reference", str(tmp_path / "z.onnx")), "--reference", "missing z")


# ------------------------------------------------------------------ tolerance table


def test_int8_parity_row_allows_a_few_rounding_steps_of_the_range():
    from blockforge.graph.tolerance import INT8_STEPS, compare, output_tolerance

    e = np.linspace(-2.55, 2.55, 64).astype(np.float32)
    tol = output_tolerance(np.float32, "ffn", "int8")
    assert tol.step == pytest.approx(INT8_STEPS / 255)
    one = 2.55 / 255  # one step of this output's range
    assert compare("tvm vs ort", "y", e + (INT8_STEPS - 0.1) * one, e, tol).passed
    assert not compare("tvm vs ort", "y", e + (INT8_STEPS + 0.5) * one, e, tol).passed
    assert not compare("tvm vs ort", "y", e + 0.9 * one, e, output_tolerance(np.float32, "ffn")).passed  # float row


def _chain(path, n: int, d: int = 16, parallel: bool = False):
    """x -> n x (MatMul by a d x d weight, Relu) in series (or, parallel: n MatMuls of x summed)."""
    rng = np.random.default_rng(0)
    nodes, inits, cur = [], [], "x"
    for i in range(n):
        w = f"w{i}"
        inits.append(numpy_helper.from_array((rng.standard_normal((d, d)) / 4).astype(np.float32), w))
        src = "x" if parallel else cur
        nodes += [helper.make_node("MatMul", [src, w], [f"m{i}"], name=f"layer_{i}/matmul"),
                  helper.make_node("Relu", [f"m{i}"], [f"r{i}"], name=f"layer_{i}/relu")]
        if parallel and i:
            nodes.append(helper.make_node("Add", [cur, f"r{i}"], [f"s{i}"]))
            cur = f"s{i}"
        else:
            cur = f"r{i}"
    nodes.append(helper.make_node("Identity", [cur], ["y"]))
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, d])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, d])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    onnx.save(m, str(path))
    return path


def _quantized_chain(tmp_path, n, mode="dynamic", parallel=False):
    from blockforge.graph.quantize import QuantizeOptions, quantize

    f = _chain(tmp_path / f"f{n}{parallel}.onnx", n, parallel=parallel)
    q = tmp_path / f"q{n}{mode}{parallel}.onnx"
    quantize(QuantizeOptions(model=f, output=q, mode=mode))
    return f, q


@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_quantized_depth_counts_the_gemms_in_series(tmp_path, mode):
    from blockforge.graph.parity import tolerance_kind
    from blockforge.graph.quantize import quantized_depth
    from blockforge.graph.tolerance import INT8_BLOCK_DEPTH

    for n, parallel, depth in ((3, False, 3), (INT8_BLOCK_DEPTH + 1, False, INT8_BLOCK_DEPTH + 1),
                               (INT8_BLOCK_DEPTH + 1, True, 1)):
        f, q = _quantized_chain(tmp_path, n, mode, parallel)
        m = onnx.load(str(q))
        assert quantized_depth(m) == depth, (n, parallel, mode)
        assert quantized_depth(onnx.load(str(f))) == 0
        assert tolerance_kind(m) == ("deep" if depth > INT8_BLOCK_DEPTH else None)
    assert quantized_depth(onnx.load(str(_quantized_chain(tmp_path, 2, mode)[1]))) == 2


def test_deep_int8_row_judges_the_whole_output():
    """A 12-layer int8 model's flips (measured: 12 steps of max|ORT|/255, rel L2 4.9e-2 between
    two correct engines) pass the deep row and fail the block row; a wrong scale fails both."""
    from blockforge.graph.tolerance import compare, output_tolerance

    rng = np.random.default_rng(0)
    e = rng.standard_normal((128, 768))
    step = np.abs(e).max() / 255
    steps = rng.choice([0, 1, 2, 3, 4, 8, 12], e.shape, p=[.27, .25, .18, .15, .05, .07, .03])  # 10% beyond 4
    flips = e + rng.choice([-1, 1], e.shape) * steps * step
    deep, block = output_tolerance(np.float32, "deep", "int8"), output_tolerance(np.float32, None, "int8")
    assert 3e-2 < compare("tvm vs ort", "y", flips, e, deep).rel_l2 < deep.rel_l2
    assert compare("tvm vs ort", "y", flips, e, deep).passed and not compare("tvm vs ort", "y", flips, e, block).passed
    assert not compare("tvm vs ort", "y", e * 1.25, e, deep).passed
    assert output_tolerance(np.float32, "deep") == output_tolerance(np.float32, "block")  # float: no deep row


def test_verify_deep_quantized_model_on_the_deep_row(tmp_path):
    import json

    from blockforge.graph.tolerance import INT8_BLOCK_DEPTH, TOLERANCES

    f, q = _quantized_chain(tmp_path, INT8_BLOCK_DEPTH + 2)
    res = cli("verify", str(q), "--target", "host", "--reference", str(f), "--json", str(tmp_path / "r.json"))
    assert res.rc == 0, res.text
    rows = {r["pair"]: r for r in json.loads((tmp_path / "r.json").read_text())["comparisons"]}
    assert rows["tvm vs ort"]["rel_l2_limit"] == TOLERANCES[("int8", "deep")].rel_l2 and rows["tvm vs ort"]["passed"]


def test_accuracy_gate_by_relative_l2():
    from blockforge.graph.tolerance import ACCURACY, compare_accuracy

    f = np.random.default_rng(0).standard_normal(1000)
    ok = compare_accuracy("ort vs oracle", "y", f * 1.02, f, "int8", "ffn")
    assert ok.passed and ok.rel_l2 == pytest.approx(0.02) and ok.gate == ACCURACY[("int8", "ffn")]
    assert not compare_accuracy("ort vs oracle", "y", f * 1.2, f, "int8", "ffn").passed
    assert not compare_accuracy("ort vs oracle", "y", f[:10], f, "int8", "ffn").passed  # shape


# ------------------------------------------------------------------ the other quantized forms


def _linear(op: str, bias: bool = True):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((32, 32)) * 0.2).astype(np.float32)
    b = rng.standard_normal(32).astype(np.float32)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 32])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 32])
    if op == "Gemm":  # transB, as torch.nn.Linear exports
        inits = [numpy_helper.from_array(w.T.copy(), "W")] + ([numpy_helper.from_array(b, "b")] if bias else [])
        nodes = [helper.make_node("Gemm", ["x", "W"] + (["b"] if bias else []), ["h"], transB=1)]
    else:
        inits = [numpy_helper.from_array(w, "W")]
        nodes = [helper.make_node("MatMul", ["x", "W"], ["h"])]
    nodes.append(helper.make_node("Relu", ["h"], ["y"]))
    g = helper.make_graph(nodes, "g", [x], [y], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), w


def _qoperator(d, op, per_channel, act, bias=True):
    """ORT's QOperator format: QLinearMatMul for MatMul, com.microsoft QGemm for Gemm."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class R(CalibrationDataReader):
        def __init__(self):
            self.it = iter([{"x": np.random.default_rng(i).standard_normal((4, 32)).astype(np.float32)}
                            for i in range(4)])

        def get_next(self):
            return next(self.it, None)

    m, _ = _linear(op, bias)
    src, out = d / f"{op}{bias}.onnx", d / f"{op}_{per_channel}_{act}_{bias}.onnx"
    onnx.save(m, str(src))
    quantize_static(str(src), str(out), R(), quant_format=QuantFormat.QOperator, per_channel=per_channel,
                    activation_type=getattr(QuantType, act), weight_type=QuantType.QInt8)
    return out


def _matmul_integer_to_float(d, per_channel: bool, bias: bool, signed_a: bool):
    """com.microsoft MatMulIntegerToFloat after DynamicQuantizeLinear (u8) or a static int8 quantize."""
    rng = np.random.default_rng(1)
    w = rng.integers(-127, 128, (32, 32)).astype(np.int8)
    sb = (rng.random(32 if per_channel else 1) * 0.01 + 0.001).astype(np.float32).reshape(-1 if per_channel else ())
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(sb, "sb")]
    if signed_a:
        inits += [numpy_helper.from_array(np.float32(0.03), "sa"), numpy_helper.from_array(np.int8(3), "za")]
        nodes = [helper.make_node("QuantizeLinear", ["x", "sa", "za"], ["xq"])]
    else:
        nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "sa", "za"])]
    args = ["xq", "W", "sa", "sb", "za", ""]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(32).astype(np.float32), "bias"))
        args.append("bias")
    nodes.append(helper.make_node("MatMulIntegerToFloat", args, ["y"], domain="com.microsoft"))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 32])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 32])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                          ir_version=8)
    path = d / f"mitf_{per_channel}_{bias}_{signed_a}.onnx"
    onnx.save(m, str(path))
    return path


_FORMS = [("MatMul", pc, act, True) for pc in (False, True) for act in ("QUInt8", "QInt8")] + \
         [("Gemm", pc, act, b) for pc, act, b in ((False, "QUInt8", True), (True, "QInt8", True), (False, "QInt8", False))]


@pytest.mark.parametrize("op,per_channel,act,bias", _FORMS)
def test_qoperator_forms_rewrite_is_the_same_model_in_ort(tmp_path, op, per_channel, act, bias):
    from blockforge.compile.quant.forms import standard_forms
    from blockforge.graph import ort as ort_runner

    q = onnx.load(str(_qoperator(tmp_path, op, per_channel, act, bias)))
    want = "QLinearMatMul" if op == "MatMul" else "QGemm"
    assert any(n.op_type == want for n in q.graph.node)
    m2, n = standard_forms(q)
    assert n == 1 and not any(x.op_type == want for x in m2.graph.node)
    onnx.checker.check_model(m2)
    x = {"x": np.random.default_rng(9).standard_normal((4, 32)).astype(np.float32)}
    a, b = ort_runner.run(q, x)["y"], ort_runner.run(m2, x)["y"]
    assert np.abs(a - b).max() <= np.abs(a).max() / 255


@pytest.mark.parametrize("per_channel,bias,signed_a", [(False, False, False), (True, True, False), (False, True, True)])
def test_matmul_integer_to_float_rewrite_is_the_same_model_in_ort(tmp_path, per_channel, bias, signed_a):
    from blockforge.compile.quant.forms import standard_forms
    from blockforge.graph import ort as ort_runner

    q = onnx.load(str(_matmul_integer_to_float(tmp_path, per_channel, bias, signed_a)))
    m2, n = standard_forms(q)
    assert n == 1 and "MatMulIntegerToFloat" not in {x.op_type for x in m2.graph.node}
    x = {"x": np.random.default_rng(9).standard_normal((4, 32)).astype(np.float32)}
    a, b = ort_runner.run(q, x)["y"], ort_runner.run(m2, x)["y"]
    assert np.abs(a - b).max() <= 1e-5 * max(1.0, float(np.abs(a).max()))


def test_quantized_forms_count_their_ops(tmp_path):
    from blockforge.graph.analysis import matmul_flops

    want = 2 * 4 * 32 * 32
    assert matmul_flops(onnx.load(str(_qoperator(tmp_path, "MatMul", False, "QUInt8")))) == want
    assert matmul_flops(onnx.load(str(_qoperator(tmp_path, "Gemm", True, "QInt8")))) == want
    assert matmul_flops(onnx.load(str(_matmul_integer_to_float(tmp_path, True, True, False)))) == want


@pytest.mark.parametrize("form", ["qlinear-matmul", "qgemm", "matmul-integer-to-float"])
def test_quantized_forms_compile_on_the_int8_kernel_and_match_ort(tmp_path, monkeypatch, form):
    """TVM's importer has no converter for any of the three: they failed to import before."""
    from test_int8_gemm import _need_vnni_host

    _need_vnni_host()
    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    import tvm
    from tvm import relax

    from blockforge.compile.pipeline import run_phases
    from blockforge.compile.quant.gemm import kernel_specs
    from blockforge.compile.session import open_model
    from blockforge.graph import ort as ort_runner

    path = {"qlinear-matmul": lambda: _qoperator(tmp_path, "MatMul", True, "QUInt8"),
            "qgemm": lambda: _qoperator(tmp_path, "Gemm", True, "QInt8"),
            "matmul-integer-to-float": lambda: _matmul_integer_to_float(tmp_path, True, True, False)}[form]()
    s = open_model(path, "host", {})
    mod, _ = run_phases(s.relax(), s.target, stop_after="int8-gemm")
    assert len(kernel_specs(mod)) == 1
    vm = relax.VirtualMachine(s.build().executable, tvm.cpu())
    x = np.random.default_rng(4).standard_normal((4, 32)).astype(np.float32)
    got = vm["main"](tvm.runtime.tensor(x)).numpy()
    ref = ort_runner.run(s.model, {"x": x})["y"]
    from blockforge.graph.tolerance import compare, output_tolerance

    assert compare("tvm vs ort", "y", got, ref, output_tolerance(np.float32, None, "int8")).passed


def test_bench_times_quantized_model_against_ort_on_the_same_file(tmp_path):
    """It refused every contender before (all compared with the float oracle)."""
    q = tmp_path / "q.onnx"
    assert cli("export", "ffn", "--d-model", "32", "--d-ff", "64", "--quantize", "static", "-o", str(q)).rc == 0
    res = cli("bench", str(q), "--against", "ort,untuned", "--shape", "batch=1,seq=8", "--repeat", "3")
    assert res.rc == 0, res.text
    assert "GOP (int8)" in res.out and "| untuned | blockforge |" in res.out and "| ort | peer |" in res.out


def test_quantize_leaves_nothing_in_the_current_directory(tmp_path):
    """ORT's quant_pre_process wrote sym_shape_infer_temp.onnx and a <uuid>.data copy of the
    weights into the cwd and left them (found after quantizing GPT-2 / BERT-base: 435 MB each)."""
    from pathlib import Path

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    fixture = Path(__file__).parent / "fixtures" / "models" / "bert_legacy_op17.onnx"  # pre-processing falls back
    res = cli("quantize", str(fixture), "--mode", "dynamic", "-o", str(tmp_path / "q.onnx"), cwd=cwd)
    assert res.rc == 0, res.text
    assert sorted(p.name for p in cwd.iterdir() if p.name != "blockforge.log") == []  # (the CLI's own log)
