"""The int8 GEMM on aarch64 SDOT (+dotprod): the target's features turn the int8-gemm phase on,
the kernel's IR and assembly on a fixed aarch64 target (SDOTs in the inner loop, no
accumulator spills), and end to end in the edge app under qemu-aarch64: exact int32 from a
MatMulInteger model (u8 activations shifted to s8, a weight zero point's row correction, a
ragged row tile), and `blockforge quantize`d FFN / MHA (dynamic and static QDQ) against ONNX
Runtime on the same file within the int8 parity row."""

from __future__ import annotations

import os
import re
import subprocess

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

tvm = pytest.importorskip("tvm")

from test_edge import QEMU, needs_aarch64_gxx, needs_qemu, run_app  # noqa: E402

from blockforge.compile.quant import gemm  # noqa: E402
from blockforge.compile.quant.isa import ISAS, for_target  # noqa: E402
from blockforge.targets import resolve  # noqa: E402

DOTPROD = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon", "+dotprod"],
                             "num-cores": 2})
SDOT = ISAS["sdot"]


def _isa(t):
    i = for_target(resolve(t).tvm_target() if isinstance(t, str) else tvm.target.Target(t))
    return i.name if i is not None else None


def test_dotprod_is_read_from_the_target():
    assert _isa("aarch64-linux-dotprod") == "sdot"
    assert _isa({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a76"}) == "sdot"
    assert _isa("aarch64-linux") is None  # plain NEON (Cortex-A53/A72): no SDOT
    assert _isa({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "znver4"}) == "vnni"
    assert _isa("x86-64-avx512") == "avx512bw"  # (no VNNI: VPMADDUBSW)
    from blockforge.compile.pipeline import phases

    names = lambda t, **kw: [p.name for p in phases(resolve(t), int8=True, **kw)]  # noqa: E731
    assert "int8-gemm" in names("aarch64-linux-dotprod")
    assert "int8-gemm" not in names("aarch64-linux")
    assert "int8-gemm" not in names("aarch64-linux-dotprod", without={"int8-gemm"})


def _inner_loop(asm: str, instruction: str = "sdot") -> list[str]:
    """The instructions of the loop that holds the `instruction`s (label to its back branch)."""
    for label, body in re.findall(r"\n(\.LBB\d+_\d+):\n((?:(?!\n\.LBB).)*?\bb\.ne\t\1)", asm, re.S):
        ins = [ln.strip() for ln in body.split("\n") if ln.startswith("\t") and not ln.startswith("\t.")]
        if any(i.startswith(instruction) for i in ins):
            return ins
    raise AssertionError(f"no loop with {instruction} in the assembly")


@pytest.mark.parametrize("m", [200, None])  # a ragged last 5-row tile, symbolic rows
def test_sdot_kernel_ir_and_assembly(m):
    spec = gemm.Int8GemmSpec(k=256, n=128, m=m, scale="scalar", bias=True, isa="sdot")
    text = gemm.kernel(spec).script()
    assert text.count('"llvm.aarch64.neon.sdot"') == 1, "the update is not on the SDOT intrinsic"
    assert text.split("def main(A:")[1].split("Wp:")[0].endswith('"int8"), '), "activations are s8 on SDOT"
    assert "T.vectorized" in text and ("T.where" in text) == (m is None or m % SDOT.mr != 0)
    asm = tvm.compile(tvm.IRModule({"main": gemm.kernel(spec)}), target=DOTPROD).mod.inspect_source("asm")
    loop = _inner_loop(asm)
    sdots = sum(i.startswith("sdot") for i in loop)
    # one k-step: MR rows x 16 columns / 4 lanes, the accumulators in registers (no stack)
    assert sdots == SDOT.mr * 16 // SDOT.lanes, loop
    assert not [i for i in loop if "[sp" in i], f"accumulators spilled: {loop}"
    assert 16 * sdots / len(loop) >= 7, f"{16 * sdots / len(loop):.1f} multiply-adds per instruction"


def int8_gemm_module(k: int, n: int, act: str = "int8"):
    """A Relax module as TVM imports MatMulInteger: (x - zp) @ W in int32, W a (k, n) constant."""
    from tvm import relax

    w = np.random.default_rng(0).integers(-128, 128, (k, n), dtype=np.int8)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([1, 8, k], act))
    zp = relax.Var("zp", relax.TensorType([], act))
    with bb.function("main", [x, zp]):
        with bb.dataflow():
            a32 = bb.emit(relax.op.subtract(relax.op.astype(x, "int32"), relax.op.astype(zp, "int32")))
            y = bb.emit_output(relax.op.matmul(a32, relax.const(w.astype(np.int32)), out_dtype="int32"))
        bb.emit_func_output(y)
    return bb.get()


def test_u8_activations_shifted_to_s8_for_sdot():
    """quantize_dynamic's u8 activations: a - 128 as int8, the zero point shifted alike."""
    from blockforge.compile.quant.rewrite import int8_gemm

    for act, shifted in (("uint8", True), ("int8", False)):
        with DOTPROD:
            new = int8_gemm("sdot")(int8_gemm_module(32, 48, act))
        assert [s.isa for s in gemm.kernel_specs(new)] == ["sdot"]
        main = new["main"].script()
        assert ("R.const(-128" in main and 'dtype="int8"' in main) == shifted, main


# --------------------------------------------------------------------------- under qemu

def _matmul_integer_model(path, act: str, w: np.ndarray, zp_a: int, zp_w: int) -> None:
    """x (float holding integers) -> Cast(act) -> MatMulInteger(., W, zp_a, zp_w) -> Cast(float):
    the int32 result, exact in float32 (|sum| < 2^24)."""
    k, n = w.shape
    to = {"uint8": TensorProto.UINT8, "int8": TensorProto.INT8}[act]
    nodes = [helper.make_node("Cast", ["x"], ["a"], to=to),
             helper.make_node("MatMulInteger", ["a", "W", "zp_a", "zp_w"], ["y32"]),
             helper.make_node("Cast", ["y32"], ["y"], to=TensorProto.FLOAT)]
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.array(zp_a, act), "zp_a"),
             numpy_helper.from_array(np.array(zp_w, np.int8), "zp_w")]
    g = helper.make_graph(nodes, "mmi", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "seq", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "seq", n])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)


def _package_and_run(model, tmp_path, dims, inputs: dict, target: str = "aarch64-linux-dotprod",
                     instruction: str = "sdot"):
    """Compile for `target`, package with the edge app, run under qemu (its default CPU, `max`,
    has dotprod and i8mm): (output, GEMMs on `instruction` in the module, package)."""
    from blockforge.compile import CompileOptions, compile_model
    from blockforge.deploy.package import PackageOptions, package_artifact

    res = compile_model(CompileOptions(model=model, target=target, shape=dims,
                                       output=tmp_path / "art", use_tuning=False, dump_ir=tmp_path / "dump"))
    assert "int8-gemm" in res.manifest["phases"]
    pkg = package_artifact(PackageOptions(res.artifact, output=tmp_path / "pkg", app=True)).path
    for name, a in inputs.items():
        np.save(tmp_path / f"{name}.npy", a)
    out = tmp_path / "out.npy"
    r = run_app(pkg, {n: tmp_path / f"{n}.npy" for n in inputs}, out, emulate=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return np.load(out), _gemms_on(tmp_path / "dump", instruction), pkg


def _gemms_on(dump, instruction: str = "sdot") -> int:
    """How many matmuls the int8-gemm phase put on the int8 kernel (its IR dump), every kernel
    on `instruction` (llvm.aarch64.neon.<instruction>)."""
    after = next(dump.glob("*-int8-gemm.py")).read_text()
    kernels = [k for k in after.split("@T.prim_func")[1:] if re.search(r"def int8_gemm_\d+\(", k)]
    assert kernels and "vpdpbusd" not in after
    assert all(f"llvm.aarch64.neon.{instruction}" in k for k in kernels), f"not every int8 kernel on {instruction}"
    return after.split("def main")[-1].count("R.call_tir(cls.int8_gemm_")


def _qemu_marks(f):
    return pytest.mark.slow(needs_aarch64_gxx(needs_qemu(f)))


def exact_int32_under_qemu(tmp_path, act: str, zp_a: int, zp_w: int, k: int = 64,
                           target: str = "aarch64-linux-dotprod", instruction: str = "sdot") -> None:
    """A MatMulInteger model (K x 48 weights, 13 rows: whole row tiles and a ragged one, the
    activations' extremes in both) compiled for `target`, its one GEMM on `instruction`, run in
    the edge app under qemu: the int32 result exactly numpy's and ORT's."""
    from blockforge.graph import ort

    rng = np.random.default_rng(3)
    n, seq = 48, 13
    w = rng.integers(-128, 128, (k, n), dtype=np.int8)
    w[:, 0] = -128  # with zp_w = 3, W - zp_w leaves int8: the row-sum correction
    lo, hi = (0, 256) if act == "uint8" else (-128, 128)
    x = rng.integers(lo, hi, (1, seq, k)).astype(np.float32)
    x[0, 0] = lo
    x[0, -1] = hi - 1  # the extremes, in the ragged tile too
    model = tmp_path / "mmi.onnx"
    _matmul_integer_model(model, act, w, zp_a, zp_w)
    got, gemms, _ = _package_and_run(model, tmp_path, {"seq": seq}, {"x": x}, target, instruction)
    assert gemms == 1
    ref = (x.astype(np.int64) - zp_a) @ (w.astype(np.int64) - zp_w)
    np.testing.assert_array_equal(got, ref.astype(np.float32))
    np.testing.assert_array_equal(got, ort.run(onnx.load(model), {"x": x})["y"])


@_qemu_marks
@pytest.mark.parametrize("act, zp_a, zp_w", [("uint8", 131, 3), ("int8", -7, 0)])
def test_exact_int32_in_the_edge_app_under_qemu(tmp_path, act, zp_a, zp_w):
    exact_int32_under_qemu(tmp_path, act, zp_a, zp_w)  # 13 rows: two whole 5-row tiles and a ragged one


def quantized_block_matches_ort(tmp_path, kind: str, mode: str, seq: int = 16, heads: int = 4,
                                target: str = "aarch64-linux-dotprod", instruction: str = "sdot") -> tuple:
    """blockforge's d_model 64 FFN or MHA, `blockforge quantize`d (`mode`), compiled for `target`,
    run in the edge app under qemu and compared with ORT on the same file within the int8 parity
    row: (int8 GEMMs in the module, package, inputs) for the caller's own checks."""
    from conftest import run_cli_in_process

    from blockforge.graph import FFNSpec, MHASpec, export, ort
    from blockforge.graph.tolerance import compare, output_tolerance

    spec = FFNSpec(d_model=64, d_ff=128, activation="gelu") if kind == "ffn" else MHASpec(d_model=64, heads=heads)
    fp32 = export(spec, tmp_path / f"{kind}.onnx").model_path
    q = tmp_path / f"{kind}_{mode}.onnx"
    args = ["--mode", mode] + (["--per-channel", "--shape", f"batch=1,seq={seq}"] if mode == "static" else [])
    r = run_cli_in_process("quantize", fp32, *args, "-o", q, cwd=tmp_path)
    assert r.rc == 0, r.err
    model = onnx.load(q)
    rng = np.random.default_rng(1)
    inputs = {i.name: rng.standard_normal([1, seq, 64]).astype(np.float32) for i in model.graph.input}
    got, gemms, pkg = _package_and_run(q, tmp_path, {"batch": 1, "seq": seq}, inputs, target, instruction)
    ref = next(iter(ort.run(model, inputs).values()))
    c = compare("edge vs ort", "output", got, ref, output_tolerance(np.float32, kind, "int8"))
    print(f"{kind} {mode}: max |edge - ort| {c.max_abs:.3g}, {c.tol_used:.2f} of the int8 allowance")
    assert c.passed, c
    return gemms, pkg, inputs


def dies_without_the_instruction(tmp_path, pkg, inputs, cpu: str) -> None:
    """The package under `qemu-aarch64 -cpu CPU` (a core without the kernel's instruction) stops
    on SIGILL: the instruction is what runs. And it leaves nothing in TMPDIR (its private
    copy of module.so is removed once loaded: this killed run left one in /tmp per CI run)."""
    cmd = [QEMU[0], "-cpu", cpu, *QEMU[1:], str(pkg / "bin" / "edge_app"), str(pkg)]
    for n in inputs:
        cmd += ["--input", f"{n}={tmp_path / (n + '.npy')}"]
    cmd += ["--output", str(tmp_path / f"{cpu}.npy")]
    tmpdir = tmp_path / f"tmpdir-{cpu}"
    tmpdir.mkdir()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(tmpdir)})
    assert r.returncode in (-4, 132) and "Illegal instruction" in r.stderr + r.stdout, (r.returncode, r.stderr)
    assert sorted(p.name for p in tmpdir.rglob("*")) == []


@_qemu_marks
@pytest.mark.parametrize("kind, mode", [("ffn", "dynamic"), ("ffn", "static"), ("mha", "dynamic"), ("mha", "static")])
def test_quantized_blocks_match_ort_under_qemu(tmp_path, kind, mode):
    gemms, pkg, inputs = quantized_block_matches_ort(tmp_path, kind, mode)
    # fc1, fc2; the projections: the MHA builder's per-head q, k and v each one GEMM over the heads
    # (the int8-combine phase; QDQ's are the same integer sums once imported), and out: 4
    assert gemms == (2 if kind == "ffn" else 4), gemms
    if (kind, mode) == ("ffn", "dynamic"):
        dies_without_the_instruction(tmp_path, pkg, inputs, "cortex-a53")  # no dotprod
