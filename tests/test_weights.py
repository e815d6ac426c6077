"""weights.bin beside module.so (issue #18): the lift-weights phase, the file's format and its
loader. The hostile tables for both loaders (Python and the edge app) are in
tests/robustness/manifest_cases.json (ids weights-*) and test_edge_hostile.py."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import pytest

from conftest import assert_user_error, compiled_ffn, run_cli


def _tensor(a: np.ndarray):
    import tvm

    return tvm.runtime.tensor(a)


ARRAYS = {
    "f32": np.arange(15, dtype=np.float32).reshape(3, 5) / 7,
    "f16": np.linspace(-2, 2, 7).astype(np.float16),  # 14 bytes: the next offset is padded to 64
    "i8": np.arange(-12, 12, dtype=np.int8).reshape(2, 3, 4),
    "b": np.array([True, False, True, True, False]),
    "i64-scalar": np.array(-(2**40), dtype=np.int64),
    "u8-empty": np.zeros((0, 3), np.uint8),
    "f64": np.array([[np.pi, -np.e]]),
}


def _manifest(weights: dict, digest: str) -> dict:
    return {"format": "blockforge.artifact/1", "module": "module.so",
            "files": {"module.so": "0" * 64, "weights.bin": digest},
            "target": {"name": "host", "json": {"kind": "llvm"}, "arch": None, "device": "cpu"},
            "inputs": [], "outputs": [], "weights": weights}


def test_round_trip(tmp_path):
    from blockforge.compile.artifact.manifest import parse_manifest
    from blockforge.compile.artifact.weights import load_weights, write_weights
    from blockforge.compile.passes.lift_weights import LiftedWeight

    table = write_weights(tmp_path / "weights.bin", [LiftedWeight(k, _tensor(a)) for k, a in ARRAYS.items()])
    data = (tmp_path / "weights.bin").read_bytes()
    assert table["bytes"] == len(data) and table["file"] == "weights.bin"
    assert [t["name"] for t in table["tensors"]] == list(ARRAYS)
    assert all(t["offset"] % 64 == 0 for t in table["tensors"])
    f32 = table["tensors"][0]
    assert data[f32["offset"]:f32["offset"] + f32["nbytes"]] == ARRAYS["f32"].astype("<f4").tobytes()  # little-endian, C order
    m = parse_manifest(json.dumps(_manifest(table, hashlib.sha256(data).hexdigest())).encode())
    got = load_weights(tmp_path, m)
    for (name, want), a in zip(ARRAYS.items(), got):
        assert a.dtype == want.dtype and a.shape == want.shape and np.array_equal(a, want), name


def test_round_trip_bfloat16(tmp_path):
    import ml_dtypes

    from blockforge.compile.artifact.manifest import parse_manifest
    from blockforge.compile.artifact.weights import load_weights, write_weights
    from blockforge.compile.passes.lift_weights import LiftedWeight

    a = np.array([[1.5, -3.0, 1e30]], dtype=ml_dtypes.bfloat16)
    table = write_weights(tmp_path / "weights.bin", [LiftedWeight("w0", _tensor(a))])
    assert table["tensors"][0]["dtype"] == "bfloat16" and table["tensors"][0]["nbytes"] == 6
    m = parse_manifest(json.dumps(_manifest(table, hashlib.sha256((tmp_path / "weights.bin").read_bytes())
                                            .hexdigest())).encode())
    (got,) = load_weights(tmp_path, m)
    assert got.dtype == a.dtype and np.array_equal(got.astype(np.float32), a.astype(np.float32))


@pytest.fixture(scope="module")
def ffn(tmp_path_factory) -> dict:
    return compiled_ffn(tmp_path_factory.mktemp("weights"), 64, 8)


def test_weights_are_beside_module_not_in_it(ffn):
    """Before: the executable carried its weights as constants, so module.so held them
    (and the compile held them 3-4 times while exporting)."""
    art = ffn["art"]
    m = json.loads((art / "manifest.json").read_text())
    w = m["weights"]
    assert w["file"] == "weights.bin" and m["files"]["weights.bin"] == hashlib.sha256(
        (art / "weights.bin").read_bytes()).hexdigest()
    assert (art / "weights.bin").stat().st_size == w["bytes"]
    assert len(w["tensors"]) == 2 and "lift-weights" in m["phases"] and m["params_embedded"] is False
    so, data = (art / "module.so").read_bytes(), (art / "weights.bin").read_bytes()
    for t in w["tensors"]:
        chunk = data[t["offset"]:t["offset"] + 256]
        assert chunk not in so, f"{t['name']}'s bytes are in module.so"


def test_run_matches_ort(ffn, tmp_path):
    import onnxruntime as ort

    r = run_cli("run", ffn["art"], "--inputs", ffn["inputs"], "--output", tmp_path / "out.npz", cwd=tmp_path)
    assert r.rc == 0, r.text
    x = np.load(ffn["inputs"])["x"]
    want = ort.InferenceSession(str(ffn["model"])).run(None, {"x": x})[0]
    assert np.allclose(np.load(tmp_path / "out.npz")["output"], want, rtol=1e-5, atol=1e-5)


def test_truncated_weights_refused_by_run(ffn, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(ffn["art"], art)
    os.truncate(art / "weights.bin", 1000)
    m = json.loads((art / "manifest.json").read_text())
    m["files"]["weights.bin"] = hashlib.sha256((art / "weights.bin").read_bytes()).hexdigest()
    (art / "manifest.json").write_text(json.dumps(m))
    r = run_cli("run", art, "--inputs", ffn["inputs"], "--output", tmp_path / "out.npz", cwd=tmp_path)
    assert_user_error(r, "weights.bin is 1000 bytes", "truncated or replaced")
    assert not (tmp_path / "out.npz").exists()


def test_load_weights_hashes_what_it_copies(tmp_path):
    """The digest is checked over the bytes handed out: a wrong one is refused by the loader
    itself, not only by an earlier verify_files pass."""
    from blockforge.compile.artifact.manifest import parse_manifest
    from blockforge.compile.artifact.weights import load_weights, write_weights
    from blockforge.compile.passes.lift_weights import LiftedWeight
    from blockforge.errors import BlockforgeError

    table = write_weights(tmp_path / "weights.bin", [LiftedWeight(k, _tensor(a)) for k, a in ARRAYS.items()])
    m = parse_manifest(json.dumps(_manifest(table, "1" * 64)).encode())
    with pytest.raises(BlockforgeError, match="weights.bin does not match its sha256"):
        load_weights(tmp_path, m)


@pytest.mark.parametrize("name", ["weights.bin", "module.so"])
def test_file_replaced_after_the_check_is_refused(ffn, tmp_path, monkeypatch, name):
    """A file rewritten in place between the hash check and its use (same size, same name):
    before, verify_files hashed every file and the loader then opened them again, so the
    changed weights ran (wrong outputs) and a changed module.so was dlopened. Now the bytes
    used are the bytes hashed: module.so through a private copy, weights.bin as it is copied."""
    from blockforge.compile.artifact import runtime

    art = tmp_path / "art"
    shutil.copytree(ffn["art"], art)
    real = runtime.verify_files

    def check_then_tamper(artifact, manifest, **kw):
        real(artifact, manifest, **kw)
        data = bytearray((art / name).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (art / name).write_bytes(bytes(data))

    monkeypatch.setattr(runtime, "verify_files", check_then_tamper)
    from blockforge.errors import BlockforgeError

    with pytest.raises(BlockforgeError, match=f"{name} does not match its sha256"):
        runtime.load_artifact(art)


def test_arena_holds_the_file_and_the_tensors_view_it(ffn, monkeypatch):
    """The CPU loader's weights: one 2 MiB-aligned arena advised MADV_HUGEPAGE, the same bytes as
    load_weights' copies, and TVM's tensors are views of it (no copy: a change shows through)."""
    import ctypes

    from blockforge.compile.artifact.manifest import read_manifest
    from blockforge.compile.artifact.runtime import load_artifact
    from blockforge.compile.artifact.weights import HUGE_PAGE, load_weights, load_weights_arena

    m = read_manifest(ffn["art"])
    arena, arrays = load_weights_arena(ffn["art"], m)
    copies = load_weights(ffn["art"], m)
    assert len(arrays) == len(copies) > 0
    for a, b in zip(arrays, copies):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    first = ctypes.addressof(ctypes.c_char.from_buffer(arena.view))
    assert first % HUGE_PAGE == 0 and arena.nbytes == m["weights"]["bytes"]

    monkeypatch.setenv("BLOCKFORGE_HUGEPAGES", "1")
    mod = load_artifact(ffn["art"])
    assert mod.arena is not None
    t = mod.weights[0]
    view = mod.arena.array(m["weights"]["tensors"][0])
    first_value = view.reshape(-1)[0].copy()
    view.reshape(-1)[0] = first_value + 1
    assert t.numpy().reshape(-1)[0] == first_value + 1
    view.reshape(-1)[0] = first_value

    monkeypatch.setenv("BLOCKFORGE_HUGEPAGES", "0")
    plain = load_artifact(ffn["art"])
    assert plain.arena is None
    assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(mod.weights, plain.weights))


def test_arena_loader_refuses_what_load_weights_refuses(tmp_path):
    from blockforge.compile.artifact.manifest import parse_manifest
    from blockforge.compile.artifact.weights import load_weights_arena, write_weights
    from blockforge.compile.passes.lift_weights import LiftedWeight
    from blockforge.errors import BlockforgeError

    table = write_weights(tmp_path / "weights.bin", [LiftedWeight(k, _tensor(a)) for k, a in ARRAYS.items()])
    m = parse_manifest(json.dumps(_manifest(table, "1" * 64)).encode())
    with pytest.raises(BlockforgeError, match="weights.bin does not match its sha256"):
        load_weights_arena(tmp_path, m)
    good = hashlib.sha256((tmp_path / "weights.bin").read_bytes()).hexdigest()
    os.truncate(tmp_path / "weights.bin", 100)
    m = parse_manifest(json.dumps(_manifest(table, good)).encode())
    with pytest.raises(BlockforgeError, match="truncated or replaced"):
        load_weights_arena(tmp_path, m)
