"""Artifacts: compile -> run from a fresh process with only the artifact dir; tampering refused."""

import json
import shutil

import numpy as np
import pytest

from blockforge.graph import FFNSpec, MHASpec, export, reference

from conftest import assert_user_error, run_cli_in_process, save_npz


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("art")
    spec = MHASpec(d_model=64, heads=4, causal=True)
    res = export(spec, d / "mha.onnx")
    r = run_cli_in_process("compile", d / "mha.onnx", "--target", "host", "--shape", "batch=1", "-o", d / "art",
                           "--dump-ir", d / "ir", cwd=d)
    assert r.rc == 0, r.text
    return d, spec, res.weights


def test_manifest_contents(built):
    d, _, _ = built
    m = json.loads((d / "art" / "manifest.json").read_text())
    import hashlib

    assert m["files"]["module.so"] == hashlib.sha256((d / "art" / "module.so").read_bytes()).hexdigest()
    assert m["source_onnx"]["sha256"] == hashlib.sha256((d / "mha.onnx").read_bytes()).hexdigest()
    assert m["target"]["name"] == "host" and m["target"]["json"]["kind"] == "llvm"
    assert set(m["versions"]) == {"blockforge", "tvm", "onnx"}
    assert m["inputs"][0] == {"name": "query", "shape": [1, "seq", 64], "dtype": "float32"}
    assert m["phases"] == ["prepare", "fuse-attention", "optimize", "prepack", "legalize", "schedule", "lift-weights",
                           "lower", "finalize"]
    dumped = sorted(p.name for p in (d / "ir").iterdir())
    assert dumped == ["00-import.py", "00-prepare.json", "00-prepare.onnx", "01-fuse-attention.py", "02-optimize.py",
                      "03-prepack.py", "04-legalize.py", "05-schedule.py", "06-lift-weights.py", "07-lower.py",
                      "08-finalize.py"]
    # prepare's model is the one TVM imported: batch bound, seq left symbolic.
    import onnx

    prepared = onnx.load(str(d / "ir" / "00-prepare.onnx"))
    assert [d.dim_value or d.dim_param for d in prepared.graph.input[0].type.tensor_type.shape.dim] == [1, "seq", 64]
    assert m["prepare"]["dims"] == {"batch": 1} and m["dims"] == {"batch": 1}
    # Attention became one fused kernel; weights were packed into panels, and the CPU
    # schedule parallelised and vectorised them.
    assert "fused_attention" in (d / "ir" / "01-fuse-attention.py").read_text()
    assert "packed_matmul" in (d / "ir" / "04-legalize.py").read_text()
    scheduled = (d / "ir" / "05-schedule.py").read_text()
    assert "T.parallel" in scheduled and "T.vectorized" in scheduled
    assert "T.prim_func" in (d / "ir" / "04-legalize.py").read_text()


def test_run_in_fresh_process_matches_oracle(built, tmp_path):
    d, spec, weights = built
    moved = tmp_path / "shipped"
    shutil.copytree(d / "art", moved)  # only the artifact dir travels
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 7, 64)).astype(np.float32)
    r = run_cli_in_process("run", moved, "--inputs", save_npz(tmp_path / "in.npz", query=x, key=x, value=x),
                           "--output", tmp_path / "out.npz", cwd=tmp_path)
    assert r.rc == 0, r.text
    out = np.load(tmp_path / "out.npz")["output"]
    want = reference(spec, weights, {"query": x, "key": x, "value": x})
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)


def test_tampered_module_refused(built, tmp_path):
    d, _, _ = built
    bad = tmp_path / "bad"
    shutil.copytree(d / "art", bad)
    data = bytearray((bad / "module.so").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bad / "module.so").write_bytes(bytes(data))
    x = np.zeros((1, 3, 64), np.float32)
    npz = save_npz(tmp_path / "in.npz", query=x, key=x, value=x)
    assert_user_error(run_cli_in_process("run", bad, "--inputs", npz, "--output", tmp_path / "o.npz", cwd=tmp_path),
                      "sha256")
    assert not (tmp_path / "o.npz").exists()


@pytest.mark.parametrize("mutate, fragment", [
    (lambda m: m.update(format="other/9"), "unknown manifest format"),
    (lambda m: m.pop("files"), "lacks"),
    (lambda m: m["files"].update({"../escape.so": "00"}), "outside the artifact"),
    (lambda m: m["target"].update(name="aarch64-linux"), "cannot run here"),
])
def test_bad_manifest_refused(built, tmp_path, mutate, fragment):
    d, _, _ = built
    bad = tmp_path / "bad"
    shutil.copytree(d / "art", bad)
    m = json.loads((bad / "manifest.json").read_text())
    mutate(m)
    (bad / "manifest.json").write_text(json.dumps(m))
    x = np.zeros((1, 3, 64), np.float32)
    npz = save_npz(tmp_path / "in.npz", query=x, key=x, value=x)
    assert_user_error(run_cli_in_process("run", bad, "--inputs", npz, "--output", tmp_path / "o.npz", cwd=tmp_path), fragment)


def test_corrupt_manifest_and_missing_dir(built, tmp_path):
    d, _, _ = built
    bad = tmp_path / "bad"
    shutil.copytree(d / "art", bad)
    (bad / "manifest.json").write_text("{oops")
    npz = save_npz(tmp_path / "in.npz", query=np.zeros((1, 3, 64), np.float32))
    assert_user_error(run_cli_in_process("run", bad, "--inputs", npz, "--output", tmp_path / "o.npz", cwd=tmp_path), "corrupt")
    assert_user_error(run_cli_in_process("run", tmp_path / "none", "--inputs", npz, "--output", tmp_path / "o.npz",
                              cwd=tmp_path), "not an artifact")


@pytest.mark.parametrize("arrays, fragment", [
    (dict(query=np.zeros((2, 3, 64), np.float32), key=np.zeros((2, 3, 64), np.float32),
          value=np.zeros((2, 3, 64), np.float32)), "shape"),  # batch is bound to 1
    (dict(query=np.zeros((1, 3, 64), np.float16), key=np.zeros((1, 3, 64), np.float32),
          value=np.zeros((1, 3, 64), np.float32)), "dtype"),
    (dict(query=np.zeros((1, 3, 64), np.float32)), "missing"),
])
def test_wrong_inputs_refused(built, tmp_path, arrays, fragment):
    d, _, _ = built
    npz = save_npz(tmp_path / "in.npz", **arrays)
    assert_user_error(run_cli_in_process("run", d / "art", "--inputs", npz, "--output", tmp_path / "o.npz", cwd=tmp_path),
                      fragment)


def test_compile_bad_inputs(tmp_path):
    export(FFNSpec(d_model=16), tmp_path / "f.onnx")
    assert_user_error(run_cli_in_process("compile", tmp_path / "f.onnx", "--target", "nope", cwd=tmp_path), "unknown target")
    assert_user_error(run_cli_in_process("compile", tmp_path / "f.onnx", "--target", "{bad", cwd=tmp_path), "malformed")
    assert_user_error(run_cli_in_process("compile", tmp_path / "f.onnx", "--target", "host", "--shape", "heads=2",
                              cwd=tmp_path), "symbolic dims are batch, seq")
    assert_user_error(run_cli_in_process("compile", tmp_path / "missing.onnx", "--target", "host", cwd=tmp_path), "no such file")


def test_unsupported_op_named(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("DFT", ["x"], ["y"], name="dft")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 2])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, tmp_path / "dft.onnx")
    r = run_cli_in_process("compile", tmp_path / "dft.onnx", "--target", "host", cwd=tmp_path)
    assert_user_error(r, "DFT")
    assert not (tmp_path / "artifacts").exists() or not list((tmp_path / "artifacts").glob("dft*"))


@pytest.mark.parametrize("configured", [False, True])
def test_a_library_caller_without_configure_is_told_about_the_thread_pool(built, tmp_path, configured):
    """TVM sizes its pool itself when nobody set TVM_NUM_THREADS, halving an x86 machine's
    hardware threads (one thread on a 2-vCPU VM without SMT: half the speed). load_artifact
    says so once, where the pool has fewer threads than the cores (made certain here by 64
    cores); after blockforge.configure() it does not."""
    import os
    import subprocess
    import sys

    d, _, _ = built
    code = f"""
import logging, sys
import blockforge
from blockforge import settings
settings.physical_cores = lambda: 64
if {configured}:
    blockforge.configure(redirect_native_output=False)
logging.basicConfig(stream=sys.stderr, format="%(levelname)s %(message)s")
from blockforge.compile import load_artifact
load_artifact({str(d / "art")!r}); load_artifact({str(d / "art")!r})
"""
    env = {k: v for k, v in os.environ.items() if k != "TVM_NUM_THREADS"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "blockforge.configure()" in ln]
    if configured:
        assert lines == []
    else:
        assert len(lines) == 1 and lines[0].startswith("WARNING TVM's thread pool runs ") and "64 cores" in lines[0]
