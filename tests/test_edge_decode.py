"""edge_app --decode N (run.sh --decode N) on the host: the C++ loop keeps the cache in
the app's memory, gives the Python loop's outputs (a blockforge block) and ORT's greedy
tokens (a tiny language model), and refuses what the Python loader refuses (a recorded
pairing that differs from the signature's, a past bound at compile time) in one line."""

from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import onnx
import pytest

from blockforge.deploy.package import PackageOptions, package_artifact
from blockforge.graph.builders import build
from blockforge.graph.spec import BlockSpec
from conftest import run_cli_in_process, save_npz
from decode_models import D, H, HOSTILE, ort_greedy, tiny_lm, with_decode_section
from test_edge import QEMU, needs_aarch64_gxx, needs_qemu

SPEC = BlockSpec(d_model=D, heads=H, d_ff=64, causal=True, kv_cache=True)

if shutil.which("g++") is None or shutil.which("make") is None:
    pytest.skip("edge_app needs make and g++ (Debian packages make, g++)", allow_module_level=True)


def _package(tmp, onnx_path, shape: str, target: str = "host"):
    art = tmp / f"a.{target}"
    res = run_cli_in_process("compile", str(onnx_path), "--target", target, "--shape", shape, "-o", str(art))
    assert res.rc == 0, res.err
    return package_artifact(PackageOptions(art, output=tmp / "pkg", app=True)).path


def _app(pkg, inputs: dict, *extra: str, emulate: bool = False) -> subprocess.CompletedProcess:
    cmd = [*QEMU, str(pkg / "bin" / "edge_app"), str(pkg)] if emulate else [str(pkg / "run.sh")]
    for n, p in inputs.items():
        cmd += ["--input", f"{n}={p}"]
    return subprocess.run(cmd + list(extra), capture_output=True, text=True, timeout=300)


def _npys(d, **arrays) -> dict:
    for n, a in arrays.items():
        np.save(d / f"{n}.npy", a)
    return {n: d / f"{n}.npy" for n in arrays}


@pytest.fixture(scope="module")
def block_pkg(tmp_path_factory):
    d = tmp_path_factory.mktemp("edge_decode")
    onnx.save(build(SPEC)[0], str(d / "b.onnx"))
    return _package(d, d / "b.onnx", "batch=1,seq=1")


def test_block_loop_matches_python_loop(block_pkg, tmp_path):
    x = np.random.default_rng(0).standard_normal((1, 1, D)).astype(np.float32)
    empty = np.zeros((1, H, 0, D // H), np.float32)
    res = _app(block_pkg, _npys(tmp_path, x=x, past_key=empty, past_value=empty), "--decode", "6",
               "--output", str(tmp_path / "last.npy"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "step 5: past     5 + 1" in res.stdout and "ms/token" in res.stdout
    py = run_cli_in_process("run", str(block_pkg), "--inputs", str(save_npz(tmp_path / "p.npz", x=x)), "--decode", "6",
                            "--output", str(tmp_path / "py.npz"))
    assert py.rc == 0, py.err
    np.testing.assert_allclose(np.load(tmp_path / "last.npy"), np.load(tmp_path / "py.npz")["output"],
                               rtol=1e-5, atol=1e-6)


def _lm_tokens_match_ort(tmp_path, target: str, emulate: bool) -> None:
    tiny_lm(tmp_path / "lm.onnx")
    pkg = _package(tmp_path, tmp_path / "lm.onnx", "batch=1", target)
    prompt = np.array([[3, 14, 15, 9]], np.int64)
    empty = np.zeros((1, 1, 0, D), np.float32)
    res = _app(pkg, _npys(tmp_path, input_ids=prompt, attention_mask=np.ones((1, 4), np.int64),
                          position_ids=np.arange(4, dtype=np.int64)[None],
                          **{"past_key_values.0.key": empty, "past_key_values.0.value": empty}), "--decode", "8",
               emulate=emulate)
    assert res.returncode == 0, res.stdout + res.stderr
    want = ort_greedy(tmp_path / "lm.onnx", prompt, 8)
    assert f"tokens[0]: {' '.join(map(str, want))}" in res.stdout, res.stdout


def test_language_model_tokens_match_ort(tmp_path):
    _lm_tokens_match_ort(tmp_path, "host", emulate=False)


@needs_aarch64_gxx
@needs_qemu
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="emulates aarch64 on an x86_64 host")
def test_language_model_tokens_match_ort_aarch64_under_qemu(tmp_path):
    # The first run cross-builds the TVM runtime (minutes), as test_edge.py's aarch64 tests.
    _lm_tokens_match_ort(tmp_path, "aarch64-linux", emulate=True)


@pytest.mark.parametrize("case", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_decode_refused(block_pkg, tmp_path, case):
    """The Python loader's table (tests/decode_models.py), refused with the same words."""
    pkg = with_decode_section(block_pkg, tmp_path / "pkg", case)
    x = np.zeros((1, 1, D), np.float32)
    empty = np.zeros((1, H, 0, D // H), np.float32)
    res = _app(pkg, _npys(tmp_path, x=x, past_key=empty, past_value=empty), "--decode", "2")
    errs = [ln for ln in res.stderr.splitlines() if ln.startswith("edge_app: error:")]
    assert res.returncode == 2 and len(errs) == 1 and case[3] in errs[0], res.stdout + res.stderr
    assert "prompt:" not in res.stdout


def test_fixed_past_refused(tmp_path):
    onnx.save(build(SPEC)[0], str(tmp_path / "b.onnx"))
    pkg = _package(tmp_path, tmp_path / "b.onnx", "batch=1,seq=1,past=3")
    three = np.zeros((1, H, 3, D // H), np.float32)
    res = _app(pkg, _npys(tmp_path, x=np.zeros((1, 1, D), np.float32), past_key=three, past_value=three),
               "--decode", "2")
    assert res.returncode == 2 and "past length is fixed at 3" in res.stderr, res.stdout + res.stderr


def test_hf_export_prompt_and_steps_one_artifact(tmp_path):
    """A Hugging Face export (Llama, dynamo) compiled with past and seq symbolic: the app runs
    the 4-token prompt and 7 steps through the one module, the cache growing in its memory;
    the tokens are ORT's greedy tokens (tests/test_decoders.py)."""
    from test_decoders import FIXTURES, SYMBOLIC_ENTRIES, batch_dims, ort_greedy_hf

    entry = next(e for e in SYMBOLIC_ENTRIES if e["model"] == "llama_past")
    path = FIXTURES / entry["file"]
    pkg = _package(tmp_path, path, ",".join(f"{k}={v}" for k, v in batch_dims(path).items()))
    prompt = np.array([[3, 14, 15, 9]], np.int64)
    empty = np.zeros((1, entry["past"]["kv_heads"], 0, entry["past"]["head_dim"]), np.float32)
    pasts = {f"past_key_values.{i}.{w}": empty for i in range(entry["past"]["layers"]) for w in ("key", "value")}
    res = _app(pkg, _npys(tmp_path, input_ids=prompt, attention_mask=np.ones((1, 4), np.int64), **pasts),
               "--decode", "8")
    assert res.returncode == 0, res.stdout + res.stderr
    want, _ = ort_greedy_hf(path, entry, prompt, 8)
    assert len(set(want)) > 1 and f"tokens[0]: {' '.join(map(str, want))}" in res.stdout, res.stdout
    # the prompt through main, the 7 steps through the step entry (compile/decode/entries.py)
    assert "calls: main 1, decode 7" in res.stdout, res.stdout
    # A prompt mask one longer than past + seq: dynamo ties its length to nothing the module
    # checks, so the app refuses it before the first call (before: it ran).
    res = _app(pkg, _npys(tmp_path, input_ids=prompt, attention_mask=np.ones((1, 5), np.int64), **pasts),
               "--decode", "2")
    errs = [ln for ln in res.stderr.splitlines() if ln.startswith("edge_app: error:")]
    assert res.returncode == 2 and len(errs) == 1, res.stdout + res.stderr
    assert "attention_mask has length 5" in errs[0] and "past + seq = 0 + 4 = 4" in errs[0], errs
    assert "tokens[0]" not in res.stdout and "prompt:" not in res.stdout


def test_step_entry_in_the_manifest(block_pkg, tmp_path):
    """An older artifact (no 'step': every call through main) gives the same tokens; a 'step'
    the module does not have is refused before the first call, in the Python loader's words."""
    import json

    from test_decoders import FIXTURES, SYMBOLIC_ENTRIES, batch_dims, ort_greedy_hf

    entry = next(e for e in SYMBOLIC_ENTRIES if e["model"] == "gpt2_past")
    path = FIXTURES / entry["file"]
    pkg = _package(tmp_path, path, ",".join(f"{k}={v}" for k, v in batch_dims(path).items()))
    manifest = json.loads((pkg / "manifest.json").read_text())
    assert manifest["step"] == {"function": "decode", "dim": "seq"}
    prompt = np.array([[3, 14, 15, 9]], np.int64)
    empty = np.zeros((1, entry["past"]["kv_heads"], 0, entry["past"]["head_dim"]), np.float32)
    pasts = {f"past_key_values.{i}.{w}": empty for i in range(entry["past"]["layers"]) for w in ("key", "value")}
    inputs = _npys(tmp_path, input_ids=prompt, attention_mask=np.ones((1, 4), np.int64), **pasts)
    want, _ = ort_greedy_hf(path, entry, prompt, 5)
    res = _app(pkg, inputs, "--decode", "5")
    assert res.returncode == 0 and "calls: main 1, decode 4" in res.stdout, res.stdout + res.stderr
    assert f"tokens[0]: {' '.join(map(str, want))}" in res.stdout, res.stdout
    (pkg / "manifest.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != "step"}))
    res = _app(pkg, inputs, "--decode", "5")
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"tokens[0]: {' '.join(map(str, want))}" in res.stdout and "calls:" not in res.stdout, res.stdout
    # a one-entry artifact (the block, seq bound) whose manifest claims a step entry
    claims = tmp_path / "claims"
    shutil.copytree(block_pkg, claims, symlinks=True)
    m = json.loads((claims / "manifest.json").read_text())
    (claims / "manifest.json").write_text(json.dumps(dict(m, step={"function": "decode", "dim": "past"})))
    x = np.zeros((1, 1, D), np.float32)
    e = np.zeros((1, H, 0, D // H), np.float32)
    res = _app(claims, _npys(tmp_path, x=x, past_key=e, past_value=e), "--decode", "2")
    errs = [ln for ln in res.stderr.splitlines() if ln.startswith("edge_app: error:")]
    assert res.returncode == 2 and len(errs) == 1, res.stdout + res.stderr
    assert "manifest.json's 'step' names function 'decode', which module.so does not have" in errs[0], errs


@pytest.mark.parametrize("model", ["gpt2_past", "llama_past"])
def test_inplace_cache_loop(tmp_path, model):
    """An artifact compiled with --kv-capacity (manifest 'inplace'): the app copies the prompt's
    cache into capacity buffers once and runs every later step through decode_inplace (each
    writes only its row); the tokens are ORT's greedy tokens and the last logits are the copying
    loop's (--copy-cache) bit for bit; a loop past the capacity is refused before the first call."""
    from test_decoders import FIXTURES, SYMBOLIC_ENTRIES, batch_dims, ort_greedy_hf

    entry = next(e for e in SYMBOLIC_ENTRIES if e["model"] == model)
    path = FIXTURES / entry["file"]
    art = tmp_path / "a.host"
    res = run_cli_in_process("compile", str(path), "--target", "host", "--shape",
                             ",".join(f"{k}={v}" for k, v in batch_dims(path).items()), "--kv-capacity", "16",
                             "-o", str(art))
    assert res.rc == 0, res.err
    pkg = package_artifact(PackageOptions(art, output=tmp_path / "pkg", app=True)).path
    prompt = np.array([[3, 14, 15, 9]], np.int64)
    empty = np.zeros((1, entry["past"]["kv_heads"], 0, entry["past"]["head_dim"]), np.float32)
    pasts = {f"past_key_values.{i}.{w}": empty for i in range(entry["past"]["layers"]) for w in ("key", "value")}
    inputs = _npys(tmp_path, input_ids=prompt, attention_mask=np.ones((1, 4), np.int64), **pasts)
    want, _ = ort_greedy_hf(path, entry, prompt, 8)
    logits = {}
    for extra, calls in (((), "calls: main 1, decode 0, decode_inplace 7"),
                         (("--copy-cache",), "calls: main 1, decode 7, decode_inplace 0")):
        out = tmp_path / f"logits{len(extra)}.npy"
        res = _app(pkg, inputs, "--decode", "8", "--output", str(out), *extra)
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"tokens[0]: {' '.join(map(str, want))}" in res.stdout and calls in res.stdout, res.stdout
        logits[extra] = np.load(out)
    np.testing.assert_array_equal(logits[()], logits[("--copy-cache",)])
    # 4 prompt positions + 12 steps = 16 fits; 13 steps would need 17
    assert _app(pkg, inputs, "--decode", "13").returncode == 0
    res = _app(pkg, inputs, "--decode", "14")
    errs = [ln for ln in res.stderr.splitlines() if ln.startswith("edge_app: error:")]
    assert res.returncode == 2 and len(errs) == 1 and "would fill 17 positions" in errs[0] \
        and "in-place capacity of 16" in errs[0], res.stdout + res.stderr
    assert "prompt:" not in res.stdout
    assert _app(pkg, inputs, "--decode", "14", "--copy-cache").returncode == 0
