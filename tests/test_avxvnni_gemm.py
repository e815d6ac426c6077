"""The int8 GEMM on AVX-VNNI (compile/quant/isa.py "avxvnni": VEX-encoded 256-bit VPDPBUSD, the
x86-64-avxvnni preset): chosen where a target has AVX-VNNI and no AVX-512 VNNI, its assembly on a
fixed target, exact int32 and a quantized FFN against ONNX Runtime where this CPU runs it (Zen 5,
Alder Lake and newer clients)."""

from __future__ import annotations

import re

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from blockforge.compile.quant import gemm  # noqa: E402
from blockforge.compile.quant.isa import for_target  # noqa: E402
from blockforge.targets import resolve  # noqa: E402

ALDERLAKE = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "alderlake", "num-cores": 2})
PRESET = "x86-64-avxvnni"


def _x86(mcpu: str, **kw):
    return tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": mcpu, **kw})


def _need_avxvnni_host():
    why = resolve(PRESET).run_problem()
    if why:
        pytest.skip(f"{PRESET} cannot run here: {why}")


def test_instruction_follows_the_target():
    isa = lambda t: getattr(for_target(t), "name", None)  # noqa: E731
    assert isa(ALDERLAKE) == "avxvnni"
    assert isa(resolve(PRESET).tvm_target()) == "avxvnni"
    # both: the 512-bit instruction (twice the multiply-adds per instruction)
    assert isa(_x86("znver5")) == "vnni" and isa(_x86("sapphirerapids")) == "vnni"
    # no VNNI: VPMADDUBSW (tests/test_maddubs_gemm.py)
    assert isa(_x86("haswell")) == "avx2" and isa(_x86("skylake-avx512")) == "avx512bw"
    assert isa(_x86("haswell", mattr=["+avxvnni"])) == "avxvnni"


def test_phase_on_avxvnni_targets():
    from blockforge.compile.pipeline import phases

    assert "int8-gemm" in [p.name for p in phases(resolve(PRESET), int8=True)]
    assert "int8-gemm" not in [p.name for p in phases(resolve('{"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "x86-64"}'), int8=True)]


def _inner_loop_dots(asm: str) -> list[str]:
    return [" ".join(ln.split()) for ln in asm.splitlines() if "vpdpbusd" in ln]


@pytest.mark.parametrize("m", [12, None])
def test_kernel_is_vex_ymm_only(m):
    """Every VPDPBUSD is the VEX ymm form and nothing touches a zmm register (an Alder Lake has
    none); a 16-column panel is two instructions, so 6 rows x 1 panel = 12 per k-group."""
    spec = gemm.Int8GemmSpec(k=256, n=64, m=m, isa="avxvnni", scale="scalar", bias=True)
    assert gemm.default_tiles(spec) == gemm.GemmTiles(6, 1, "panels" if m is None else "tiles")
    asm = tvm.compile(tvm.IRModule({"main": gemm.kernel(spec)}), target=ALDERLAKE).mod.inspect_source("asm")
    dots = _inner_loop_dots(asm)
    assert dots and all(d.startswith("{vex} vpdpbusd") and "%ymm" in d for d in dots), dots[:4]
    assert not re.search(r"%zmm\d", asm), "a zmm register in AVX-VNNI code"
    assert len(dots) % 12 == 0 or m is None, len(dots)


def _run(spec, a, w, zp_a, lib=None):
    lib = lib or tvm.compile(tvm.IRModule({"main": gemm.kernel(spec)}), target=resolve(PRESET).tvm_target())
    out = tvm.runtime.tensor(np.zeros((a.shape[0], spec.n), np.int32))
    lib["main"](*[tvm.runtime.tensor(x) for x in (a, gemm.pack_weights(w), gemm.column_sums(w),
                                                   np.array(zp_a, np.int32))], out)
    return out.numpy(), lib


@pytest.mark.parametrize("m", [13, None])
def test_exact_int32(m):
    """Static M with a ragged last tile, and symbolic M below, at and past one 6-row tile; the
    u8 / s8 extremes included."""
    _need_avxvnni_host()
    rng = np.random.default_rng(3)
    spec = gemm.Int8GemmSpec(k=96, n=64, m=m, isa="avxvnni")
    w = rng.integers(-128, 128, (96, 64), dtype=np.int8)
    w[:, 0] = -128
    lib = None
    for rows in ([m] if m else [1, 5, 6, 7, 20]):
        a = rng.integers(0, 256, (rows, 96), dtype=np.uint8)
        a[0] = 255
        got, lib = _run(spec, a, w, 131, lib)
        np.testing.assert_array_equal(got, gemm.reference(spec, a, w, 131), err_msg=f"M={rows}")


@pytest.mark.parametrize("seq", [16, None])
def test_quantize_dynamic_ffn_matches_ort(tmp_path, monkeypatch, seq):
    """A quantize_dynamic FFN compiled for the preset: both MatMulIntegers on the 256-bit kernel,
    within one quantization step of ORT on the same file."""
    pytest.importorskip("onnxruntime.quantization")
    _need_avxvnni_host()
    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from tvm import relax

    from blockforge.compile.pipeline import run_phases
    from blockforge.compile.session import open_model
    from blockforge.graph import FFNSpec, export
    from blockforge.graph import ort as ort_runner

    fp32 = export(FFNSpec(d_model=64, d_ff=128), tmp_path / "ffn.onnx").model_path
    quantize_dynamic(str(fp32), str(tmp_path / "ffn_q.onnx"), weight_type=QuantType.QInt8)
    s = open_model(tmp_path / "ffn_q.onnx", PRESET, {"batch": 1, **({"seq": seq} if seq else {})})
    mod, _ = run_phases(s.relax(), s.target, stop_after="int8-gemm")
    assert [sp.isa for sp in gemm.kernel_specs(mod)] == ["avxvnni", "avxvnni"]
    vm = relax.VirtualMachine(s.build().executable, tvm.cpu())
    for n in ([seq] if seq else [1, 13]):
        x = np.random.default_rng(n).standard_normal((1, n, 64)).astype(np.float32)
        got = vm["main"](tvm.runtime.tensor(x)).numpy()
        ref = next(iter(ort_runner.run(s.model, {"x": x}).values()))
        step = float(np.abs(ref).max()) / 255
        assert np.abs(got - ref).max() <= step, (n, np.abs(got - ref).max(), step)
