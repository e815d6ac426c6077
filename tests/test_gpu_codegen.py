"""GPU code generators on a CPU-only machine: CUDA builds carry sm_XX device code; OpenCL,
Metal and WebGPU builds carry kernel source. On a GPU (marker `gpu`) CUDA builds run and match ORT."""

import inspect
import struct
import sys

import numpy as np
import pytest

from blockforge.compile import CompileOptions, VerifyOptions, compile_model, verify
from blockforge.graph import FFNSpec, MHASpec, export

from conftest import gpu_present


def _fatbin_entries(data: bytes) -> set[tuple[str, str]]:
    """(kind, sm_XX) of each fatbin entry: header u32 magic, u16 version, u16 header size,
    u64 payload size; each entry: u16 kind (1 PTX, 2 ELF/SASS), u16, u32 entry header size,
    u64 size, ..., u32 arch at offset 28."""
    magic, _, hsize, fsize = struct.unpack_from("<IHHQ", data, 0)
    assert magic == 0xBA55ED50, "not a CUDA fatbin"
    entries, off = set(), hsize
    while off < hsize + fsize:
        kind, _, ehs, size = struct.unpack_from("<HHIQ", data, off)
        arch = struct.unpack_from("<I", data, off + 28)[0]
        entries.add(({1: "ptx", 2: "sass"}.get(kind, str(kind)), f"sm_{arch}"))
        off += ehs + size
    return entries


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu")
    return {
        "mha": export(MHASpec(d_model=64, heads=4, causal=True), d / "mha.onnx").model_path,
        "ffn": export(FFNSpec(d_model=64, activation="gelu"), d / "ffn.onnx").model_path,
    }


def _no_nvcc():
    from blockforge.targets import resolve

    return resolve("cuda-sm90").build_problem()


@pytest.mark.skipif(bool(_no_nvcc()), reason=f"CUDA builds need nvcc: {_no_nvcc()}")
@pytest.mark.parametrize("kind", ["mha", "ffn"])
@pytest.mark.parametrize("preset, arch", [("cuda-sm90", "sm_90"), ("cuda-sm80", "sm_80")])
def test_cuda_build_carries_device_code(models, tmp_path, kind, preset, arch):
    res = compile_model(CompileOptions(model=models[kind], target=preset, shape={"batch": 1},
                                       output=tmp_path / "art"))
    files = res.manifest["files"]
    assert {"module.so", "kernels.cu", "device.fatbin"} <= set(files)
    src = (tmp_path / "art" / "kernels.cu").read_text()
    assert src.count("__global__") >= 3
    entries = _fatbin_entries((tmp_path / "art" / "device.fatbin").read_bytes())
    assert {("sass", arch), ("ptx", arch)} <= entries, entries
    # module.so embeds the same kernels (TVM compiles them for the GPU found at load time).
    so = (tmp_path / "art" / "module.so").read_bytes()
    assert so.count(b"__global__") == src.count("__global__")
    assert "schedule" in res.manifest["phases"]


@pytest.mark.parametrize("preset, marker", [("opencl", "__kernel"), ("metal", "kernel void"), ("webgpu", "@compute")])
def test_build_only_codegens_emit_source(models, tmp_path, preset, marker, monkeypatch):
    # dlight's MetalMatmul imports all of TVM's tensor intrinsics (~250 TVMScript parses): the
    # schedule phase imports them first with a shallow inspect.stack (compile/schedule/intrinsics.py),
    # so no full stack is walked (the full walks made this build 134 s of a clean-clone CI run).
    fresh = "tvm.s_tir.tensor_intrin" not in sys.modules
    full_stacks = []
    real_stack = inspect.stack
    monkeypatch.setattr(inspect, "stack", lambda *a, **k: full_stacks.append(1) or real_stack(*a, **k))
    res = compile_model(CompileOptions(model=models["ffn"], target=preset, shape={"batch": 1, "seq": 16},
                                       output=tmp_path / "art"))
    ext = {"opencl": "cl", "metal": "metal", "webgpu": "wgsl"}[preset]
    src = (tmp_path / "art" / f"kernels.{ext}").read_text()
    assert marker in src, src[:400]
    assert res.target.run_problem() and "build-only" in res.target.run_problem()
    if fresh:
        assert not full_stacks, f"{len(full_stacks)} inspect.stack() calls: the intrinsics imported the slow way"


@pytest.mark.skipif(bool(_no_nvcc()), reason=f"CUDA builds need nvcc: {_no_nvcc()}")
@pytest.mark.skipif(gpu_present(), reason="a GPU is present: the build runs here")
def test_verify_on_build_only_target_says_so(models):
    rep = verify(VerifyOptions(model=models["ffn"], target="cuda-sm90", shape={"batch": 1, "seq": 8}))
    assert rep.notes and "not run" in rep.notes[0] and "no CUDA GPU" in rep.notes[0], rep.notes
    assert {c.pair for c in rep.comparisons} == {"ort vs oracle"} and rep.passed


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("kind", ["mha", "ffn"])
def test_cuda_runs_and_matches_ort(tmp_path, kind, dtype):
    spec = (MHASpec(d_model=256, heads=4, causal=True, dtype=dtype) if kind == "mha"
            else FFNSpec(d_model=256, activation="gelu", dtype=dtype))
    path = export(spec, tmp_path / "m.onnx").model_path
    rep = verify(VerifyOptions(model=path, target="cuda-sm90", shape={"batch": 2, "seq": 64}))
    assert {"tvm vs ort", "tvm vs oracle"} <= {c.pair for c in rep.comparisons}, rep.notes
    assert rep.passed, rep.to_dict()


@pytest.mark.gpu
def test_cuda_artifact_runs(tmp_path):
    from blockforge.compile import load_artifact
    from blockforge.graph import build, reference

    spec = FFNSpec(d_model=128)
    path = export(spec, tmp_path / "f.onnx").model_path
    compile_model(CompileOptions(model=path, target="cuda-sm90", output=tmp_path / "art"))
    mod = load_artifact(tmp_path / "art")
    x = np.random.default_rng(0).standard_normal((2, 16, 128)).astype(np.float32)
    out = mod.run({"x": x})["output"]
    np.testing.assert_allclose(out, reference(spec, build(spec)[1], {"x": x}), rtol=1e-4, atol=1e-4)
