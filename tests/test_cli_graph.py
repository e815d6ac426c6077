"""CLI round trips (export -> inspect -> verify) and every bad-input case, as a user runs them.

The round trip and argparse's usage errors run `blockforge` as a process; the rest call the CLI
in-process (run_cli_in_process: same output and exit code, no interpreter + TVM import each)."""

import json

import numpy as np
import onnx
import pytest

from conftest import assert_user_error, run_cli, run_cli_in_process, save_npz


@pytest.fixture(scope="module")
def mha(tmp_path_factory):
    d = tmp_path_factory.mktemp("mha")
    r = run_cli_in_process("export", "mha", "--d-model", 64, "--heads", 4, "--mask", "bool", "-o", d / "mha.onnx", cwd=d)
    assert r.rc == 0, r.text
    return d / "mha.onnx"


def test_export_inspect_verify_roundtrip(tmp_path):
    r = run_cli("export", "ffn", "--d-model", 64, "--activation", "gelu", "-o", tmp_path / "f.onnx", cwd=tmp_path)
    assert r.rc == 0, r.text
    manifest = json.loads((tmp_path / "f.json").read_text())
    data = (tmp_path / "f.onnx").read_bytes()
    import hashlib

    assert manifest["sha256"] == hashlib.sha256(data).hexdigest()
    assert manifest["spec"]["activation"] == "gelu" and manifest["params"] > 2 * 64 * 256
    assert manifest["inputs"][0] == {"name": "x", "shape": ["batch", "seq", 64], "dtype": "float32"}
    r = run_cli("inspect", tmp_path / "f.onnx", cwd=tmp_path)
    assert r.rc == 0 and "Gelu x1" in r.out and "MatMul x2" in r.out, r.text
    r = run_cli("inspect", tmp_path / "f.onnx", "--json", "--shape", "batch=1,seq=10", cwd=tmp_path)
    assert json.loads(r.out)["matmul_flops"] == 2 * 2 * 10 * 64 * 256
    r = run_cli("verify", tmp_path / "f.onnx", "--shape", "batch=3,seq=5", "--json", tmp_path / "rep.json", cwd=tmp_path)
    assert r.rc == 0 and r.out.strip().endswith("PASS"), r.text
    rep = json.loads((tmp_path / "rep.json").read_text())
    assert rep["passed"] and rep["comparisons"][0]["pair"] == "ort vs oracle"


def test_export_default_path_and_fp16_block(tmp_path):
    r = run_cli_in_process("export", "block", "--d-model", 32, "--heads", 2, "--dtype", "float16", "--norm", "post", cwd=tmp_path)
    assert r.rc == 0, r.text
    files = sorted(p.name for p in (tmp_path / "artifacts").iterdir())
    assert files == ["block_d32_h2_gelu_postln_fp16.json", "block_d32_h2_gelu_postln_fp16.onnx"]
    r = run_cli_in_process("verify", tmp_path / "artifacts" / files[1], cwd=tmp_path)
    assert r.rc == 0, r.text


def test_verify_with_npz_inputs(mha, tmp_path):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 5, 64)).astype("float32")
    mask = np.ones((2, 5), bool)
    npz = save_npz(tmp_path / "in.npz", query=x, key=x, value=x, key_padding_mask=mask)
    r = run_cli_in_process("verify", mha, "--inputs", npz, cwd=tmp_path)
    assert r.rc == 0, r.text


def test_verify_detects_tampered_weights(mha, tmp_path):
    """A model whose weights no longer match its spec fails parity (exit 1)."""
    m = onnx.load(str(mha))
    w = next(t for t in m.graph.initializer if t.name == "head_1/v_proj.weight")
    arr = onnx.numpy_helper.to_array(w).copy()
    arr[0, 0] += 0.5
    w.CopyFrom(onnx.numpy_helper.from_array(arr, w.name))
    onnx.save(m, str(tmp_path / "bad.onnx"))
    r = run_cli_in_process("verify", tmp_path / "bad.onnx", cwd=tmp_path)
    assert r.rc == 1 and "FAIL" in r.out and "Traceback" not in r.text, r.text


def test_verify_reports_nan_inputs(tmp_path):
    run_cli_in_process("export", "ffn", "--d-model", 16, "-o", tmp_path / "f.onnx", cwd=tmp_path)
    x = np.ones((1, 3, 16), np.float32)
    x[0, 1, 2] = np.nan
    r = run_cli_in_process("verify", tmp_path / "f.onnx", "--inputs", save_npz(tmp_path / "n.npz", x=x), cwd=tmp_path)
    assert "NaN" in r.out and "Traceback" not in r.text, r.text


# ------------------------------------------------------------------ bad input

@pytest.mark.parametrize("args, fragment", [
    (["export", "mha", "--d-model", "100", "--heads", "8"], "divisible"),
    (["export", "mha", "--d-model", "-4"], "positive"),
    (["export", "ffn", "--d-model", "65536", "--d-ff", "65536"], "GiB"),
    (["export", "mha", "--causal", "--kv-seq", "4"], "causal"),
    (["export", "mha", "--opset", "9"], "opset"),
    (["export", "ffn", "-o", "out.txt"], ".onnx"),
])
def test_export_bad_spec(tmp_path, args, fragment):
    r = run_cli_in_process(*args, cwd=tmp_path)
    assert_user_error(r, fragment)
    assert not list(tmp_path.glob("**/*.onnx")) and not list(tmp_path.glob("**/*.tmp"))


def test_export_refuses_directory_and_keeps_existing(tmp_path):
    (tmp_path / "d.onnx").mkdir()
    assert_user_error(run_cli_in_process("export", "ffn", "-o", tmp_path / "d.onnx", cwd=tmp_path), "directory")


def test_failed_export_leaves_existing_file(tmp_path):
    target = tmp_path / "keep.onnx"
    target.write_bytes(b"precious")
    r = run_cli_in_process("export", "mha", "--d-model", "100", "--heads", "8", "-o", target, cwd=tmp_path)
    assert r.rc == 2 and target.read_bytes() == b"precious"


@pytest.mark.parametrize("content, fragment", [
    (b"", "empty"),
    (b"\x00\xff" * 50, "not an onnx model"),
    (b"hello world, not protobuf", "not an onnx model"),
    (onnx.helper.make_tensor("t", onnx.TensorProto.FLOAT, [1], [1.0]).SerializeToString(), "not an onnx model"),
])
@pytest.mark.parametrize("verb", ["inspect", "verify"])
def test_bad_model_files(tmp_path, content, fragment, verb):
    p = tmp_path / "bad.onnx"
    p.write_bytes(content)
    assert_user_error(run_cli_in_process(verb, p, cwd=tmp_path), fragment)


def test_missing_and_truncated_model(mha, tmp_path):
    assert_user_error(run_cli_in_process("inspect", tmp_path / "nope.onnx", cwd=tmp_path), "no such file")
    data = mha.read_bytes()
    (tmp_path / "t.onnx").write_bytes(data[: len(data) // 2])
    assert_user_error(run_cli_in_process("verify", tmp_path / "t.onnx", cwd=tmp_path))
    assert_user_error(run_cli_in_process("inspect", tmp_path, cwd=tmp_path), "not a regular file")


@pytest.mark.parametrize("arrays, fragment", [
    (dict(query=np.zeros((1, 4, 64), np.float32)), "missing"),
    (dict(query=np.zeros((1, 4, 64), np.float64), key=np.zeros((1, 4, 64), np.float32),
          value=np.zeros((1, 4, 64), np.float32), key_padding_mask=np.ones((1, 4), bool)), "dtype"),
    (dict(query=np.zeros((1, 4, 32), np.float32), key=np.zeros((1, 4, 64), np.float32),
          value=np.zeros((1, 4, 64), np.float32), key_padding_mask=np.ones((1, 4), bool)), "shape"),
    (dict(query=np.zeros((1, 4, 64), np.float32), key=np.zeros((1, 5, 64), np.float32),
          value=np.zeros((1, 4, 64), np.float32), key_padding_mask=np.ones((1, 4), bool)), "seq"),
    (dict(query=np.zeros((4, 64), np.float32), key=np.zeros((1, 4, 64), np.float32),
          value=np.zeros((1, 4, 64), np.float32), key_padding_mask=np.ones((1, 4), bool)), "rank"),
    (dict(query=np.zeros((1, 4, 64), np.float32), key=np.zeros((1, 4, 64), np.float32),
          value=np.zeros((1, 4, 64), np.float32), key_padding_mask=np.ones((1, 4), bool),
          extra=np.zeros(1)), "unexpected"),
])
def test_verify_bad_npz_inputs(mha, tmp_path, arrays, fragment):
    npz = save_npz(tmp_path / "in.npz", **arrays)
    assert_user_error(run_cli_in_process("verify", mha, "--inputs", npz, cwd=tmp_path), fragment)


def test_verify_bad_npz_file_and_shape_flag(mha, tmp_path):
    (tmp_path / "x.npz").write_bytes(b"garbage")
    assert_user_error(run_cli_in_process("verify", mha, "--inputs", tmp_path / "x.npz", cwd=tmp_path), "npz")
    assert_user_error(run_cli_in_process("verify", mha, "--shape", "seq", cwd=tmp_path), "NAME=INT")
    assert_user_error(run_cli_in_process("verify", mha, "--shape", "seq=abc", cwd=tmp_path), "not an integer")
    assert_user_error(run_cli_in_process("verify", mha, "--shape", "seq=0", cwd=tmp_path), "[1,")


def test_no_stray_files_after_errors(tmp_path):
    run_cli_in_process("export", "mha", "--d-model", "100", "--heads", "8", cwd=tmp_path)
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file() and p.name != "blockforge.log"]
    assert leftovers == []


def test_verify_without_target_refuses_a_model_it_has_no_oracle_for(tmp_path):
    """A foreign model has no oracle: without --target ONNX Runtime would be compared with
    nothing (before: an empty table, then FAIL, exit 1)."""
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(tmp_path / "r.onnx"))
    assert_user_error(run_cli_in_process("verify", tmp_path / "r.onnx", cwd=tmp_path), "not a blockforge model", "target")
    r = run_cli_in_process("verify", tmp_path / "r.onnx", "--target", "host", cwd=tmp_path)
    assert r.rc == 0 and "tvm vs ort" in r.out and "PASS" in r.out, r.text


@pytest.mark.parametrize("argv", [["verify", "{m}", "--inputs", ""], ["verify", "{m}", "--tuning-db", ""],
                                  ["compile", "{m}", "--target", "host", "--tuning-db", "", "-o", "{d}/art"],
                                  ["bench", "{m}", "--tuning-db", ""]])
def test_an_empty_optional_path_is_refused(argv, mha, tmp_path):
    """An empty --inputs once meant random inputs, an empty --tuning-db the default database."""
    args = [a.format(m=mha, d=tmp_path) for a in argv]
    assert_user_error(run_cli_in_process(*args, cwd=tmp_path), argv[argv.index("") - 1], "the path is empty")


@pytest.mark.parametrize("argv", [["compile", "x.onnx"], ["frobnicate"], ["verify", "m.onnx", "--shape"],
                                  ["export", "ffn", "--d-model", "many"]])
def test_a_usage_mistake_is_one_error_line(argv, tmp_path):
    """argparse's own errors (before: a usage block, then `blockforge compile: error:`)."""
    r = run_cli(*argv, cwd=tmp_path)
    assert_user_error(r, "--help")
    assert r.err.count("\n") == 1 and not r.out, r.text


def test_each_verb_builds_only_its_own_parser():
    """A process builds the parser of the verb it runs (all twelve: 4.7 s of every start,
    tune's budget table importing TVM); each verb's parser stands alone, and anything else
    (no verb, a misspelt one, --help) gets the whole parser, so argparse lists every verb."""
    from blockforge.cli import VERB_NAMES, build_parser

    def verbs(p):
        return list(next(a for a in p._actions if a.dest == "command").choices)

    for verb in VERB_NAMES:
        p = build_parser([verb, "--x"])
        assert verbs(p) == [verb], verb
        with pytest.raises(SystemExit):  # its --help through its own parser alone
            p.parse_args([verb, "--help"])
    for argv in ([], ["frobnicate"], ["--help"], ["--version"]):
        assert verbs(build_parser(argv)) == list(VERB_NAMES), argv


def test_verbs_that_build_nothing_never_import_tvm(tmp_path):
    """export and inspect as a user runs them, in a fresh interpreter: TVM's import (3-4 s)
    is paid only by verbs that compile or run."""
    code = """
import json, sys
from blockforge.cli import main
rcs = [main(["export", "ffn", "--d-model", "16", "-o", "f.onnx"]), main(["inspect", "f.onnx"]),
       main(["verify", "f.onnx", "--shape", "batch=1,seq=4"])]
print(json.dumps({"rcs": rcs, "tvm": sorted(m for m in sys.modules if m == "tvm" or m.startswith("tvm."))}))
"""
    import os
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                       env={**os.environ, "BLOCKFORGE_LOG": str(tmp_path / "log")})
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res == {"rcs": [0, 0, 0], "tvm": []}, res
