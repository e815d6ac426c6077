"""The int8 GEMM (compile/quant): the VNNI kernel's IR under a fixed target, its exact int32
results against numpy (static and ragged/symbolic M), the int8-gemm pass on hand-built
Relax (s8 activations, a weight zero point) and end to end on ONNX Runtime's
quantize_dynamic model of a blockforge FFN, against ORT running the same file."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from blockforge.compile.quant import gemm, sums  # noqa: E402
from blockforge.compile.quant.intrin import has_vnni  # noqa: E402
from llvm_ir import llvm_source, workspace_allocs  # noqa: E402

ZNVER4 = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "znver4", "num-cores": 2})
SKYLAKE = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "skylake-avx512", "num-cores": 2})


def _host():
    from blockforge.targets import resolve

    return resolve("host").tvm_target()


def _need_vnni_host():
    if not has_vnni(_host()):
        pytest.skip("this CPU has no AVX-512 VNNI (avx512_vnni): the int8 kernel cannot run here")


def test_vnni_is_read_from_the_target_not_the_build_machine():
    assert has_vnni(ZNVER4) and not has_vnni(SKYLAKE)
    assert has_vnni(tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu",
                                       "mcpu": "skylake-avx512", "mattr": ["+avx512vnni"]}))


@pytest.mark.parametrize("m", [196, 200, None])  # whole 7-row tiles (N = 128: 2 panels), a ragged last tile, symbolic
def test_kernel_is_tensorized_and_the_ragged_tile_guarded(m):
    spec = gemm.Int8GemmSpec(k=256, n=128, m=m, scale="scalar", bias=True)
    f = gemm.kernel(spec)
    text = f.script()
    assert text.count("llvm.x86.avx512.vpdpbusd.512") == 1, "the update is not on the VNNI intrinsic"
    assert "T.parallel" in text and "T.vectorized" in text
    assert gemm.default_tiles(spec).mr == 7
    ragged = m is None or m % 7
    # Past M the accumulator re-reads row M-1 (clamped) and the write-back is guarded.
    assert ("T.min(v_i_o" in text) == bool(ragged), text
    assert ("T.where" in text) == bool(ragged), text
    # and it builds (cross, no VNNI needed here) into code that uses the instruction
    lib = tvm.compile(tvm.IRModule({"main": f}), target=ZNVER4)
    assert "vpdpbusd" in lib.mod.inspect_source("asm")


def _workspace_allocs(f) -> int:
    """TVMBackendAllocWorkspace calls in the compiled kernel."""
    return sum(workspace_allocs(llvm_source(tvm.compile(tvm.IRModule({"main": f}), target=ZNVER4))).values())


def test_tile_loop_calls_no_workspace_allocator():
    """The intrinsic's A broadcast is one expression, not a 1-element local buffer (LowerTVMBuiltin
    gave that one a workspace alloc/free pair per row tile: 128x768x3072 +gelu at 6x64, one
    thread, 1.02 -> 0.90 ms); an accumulator tile under 1 KiB (kMaxStackAlloca) is on the stack."""
    spec = gemm.Int8GemmSpec(k=256, n=192, m=120, scale="scalar", bias=True, activation="gelu")
    assert _workspace_allocs(gemm.kernel(spec, gemm.GemmTiles(5, 3))) == 0  # 15 x 64 B accumulators
    assert _workspace_allocs(gemm.kernel(spec, gemm.GemmTiles(6, 4))) == 1  # 1536 B: the accumulator only
    # the untuned tiles are the stack-sized ones (3 panels, else 2: 7 rows); the ablation's are 6 x 4
    assert gemm.default_tiles(spec) == gemm.GemmTiles(5, 3) and _workspace_allocs(gemm.kernel(spec)) == 0
    two = gemm.Int8GemmSpec(k=256, n=128, m=None)
    assert gemm.default_tiles(two) == gemm.GemmTiles(7, 2, "panels") and _workspace_allocs(gemm.kernel(two)) == 0
    assert gemm.default_tiles(spec, stack=False) == gemm.GemmTiles(6, 4)


def test_stack_tiles_ablation_builds_the_6x4_tile(quantized_ffn):
    from blockforge.compile.pipeline import run_phases
    from blockforge.compile.session import open_model

    _need_vnni_host()
    s = open_model(quantized_ffn, "host", {"batch": 1, "seq": 16})

    def tiles(without):
        mod, _ = run_phases(s.relax(), s.target, stop_after="int8-gemm", without=without)
        return sorted(str(f.attrs[gemm.TILES_ATTR]) for _, f in mod.functions_items()
                      if isinstance(f, tvm.tirx.PrimFunc) and gemm.is_kernel(f))

    assert tiles(frozenset()) == ["7x32 tiles"] * 2  # N = 128 and 64: 2 panels, 7 rows
    assert tiles(frozenset({"int8-stack-tiles"})) == ["6x64 tiles"] * 2


def test_small_static_kernels_run_on_one_thread():
    """Waking the thread pool cost more than a toy GEMM's work (PARALLEL_MACS)."""
    from blockforge.compile.quant import minmax

    assert "T.parallel" not in gemm.kernel(gemm.Int8GemmSpec(k=64, n=128, m=16)).script()
    assert "T.parallel" in gemm.kernel(gemm.Int8GemmSpec(k=64, n=128, m=None)).script()
    assert "T.parallel" not in minmax.kernel(minmax.MinMaxSpec(cols=64, rows=16)).script()


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_activation_in_the_epilogue(activation):
    """relu, and gelu as the float build computes it (fast_math's fast_erf polynomial)."""
    _need_vnni_host()
    from scipy.special import erf

    rng = np.random.default_rng(5)
    spec = gemm.Int8GemmSpec(k=64, n=64, m=None, scale="column", bias=True, activation=activation)
    a = rng.integers(0, 256, (9, 64), dtype=np.uint8)
    w = rng.integers(-128, 128, (64, 64), dtype=np.int8)
    scale = rng.uniform(1e-5, 4e-5, 64).astype(np.float32)  # pre-activations of about +-3
    bias = rng.standard_normal(64).astype(np.float32)
    got, _ = _run_kernel(spec, a, w, zp_a=128, scale=scale, bias=bias)
    z = gemm.reference(gemm.Int8GemmSpec(k=64, n=64, scale="column", bias=True), a, w, 128, 0, scale, bias)
    ref = np.maximum(z, 0) if activation == "relu" else 0.5 * z * (1 + erf(z / np.sqrt(2)))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_spec_refuses_what_the_intrinsic_cannot_tile():
    with pytest.raises(ValueError, match="K % 4"):
        gemm.Int8GemmSpec(k=30, n=64)
    with pytest.raises(ValueError, match="N % 16"):
        gemm.Int8GemmSpec(k=32, n=40)


def _run_kernel(spec, a, w, zp_a, scale=None, bias=None, rowcorr=None, epilogue=gemm.Epilogue()):
    lib = tvm.compile(tvm.IRModule({"main": gemm.kernel(spec, epilogue=epilogue)}), target=_host())
    args = [a, gemm.pack_weights(w), gemm.column_sums(w), np.array(zp_a, np.int32)]
    args += [x for x in (rowcorr, scale, bias) if x is not None]
    out = tvm.runtime.tensor(np.zeros((a.shape[0], spec.n), spec.out_dtype))
    lib["main"](*[tvm.runtime.tensor(np.asarray(x)) for x in args], out)
    return out.numpy(), lib


@pytest.mark.parametrize("m", [12, 13])
def test_static_m_exact_int32(m):
    _need_vnni_host()
    rng = np.random.default_rng(m)
    spec = gemm.Int8GemmSpec(k=96, n=64, m=m)
    a = rng.integers(0, 256, (m, 96), dtype=np.uint8)  # the u8 extremes included
    a[0] = 255
    w = rng.integers(-128, 128, (96, 64), dtype=np.int8)
    w[:, 0] = -128
    got, _ = _run_kernel(spec, a, w, zp_a=131)
    np.testing.assert_array_equal(got, gemm.reference(spec, a, w, 131))


def test_symbolic_m_exact_int32_on_ragged_rows():
    _need_vnni_host()
    spec = gemm.Int8GemmSpec(k=64, n=128, m=None)
    lib = None
    rng = np.random.default_rng(0)
    w = rng.integers(-128, 128, (64, 128), dtype=np.int8)
    for m in (1, 5, 6, 7, 20):  # below, at and past one 6-row tile
        a = rng.integers(0, 256, (m, 64), dtype=np.uint8)
        if lib is None:
            got, lib = _run_kernel(spec, a, w, zp_a=7)
        else:
            out = tvm.runtime.tensor(np.zeros((m, 128), np.int32))
            lib["main"](*[tvm.runtime.tensor(x) for x in (a, gemm.pack_weights(w), gemm.column_sums(w),
                                                           np.array(7, np.int32))], out)
            got = out.numpy()
        np.testing.assert_array_equal(got, gemm.reference(spec, a, w, 7), err_msg=f"M={m}")


@pytest.mark.parametrize("m", [37, None])  # each batch's ragged last row tile; symbolic rows (45 at run time)
def test_batched_kernel_is_each_batch_exactly(m):
    """batch > 1: every tensor but scale and bias a leading (batch,) dim, one call; each batch's
    rows its own GEMM with its own packed weights, column sums and row correction, through a
    QDQ requantize."""
    _need_vnni_host()
    b, k, n, rows = 3, 64, 48, m or 45
    spec = gemm.Int8GemmSpec(k=k, n=n, m=m, scale="scalar", rowcorr=True, batch=b, post=(("q", 0.5, 3, "int8"),))
    assert spec.describe().startswith("3 x ")
    lib = tvm.compile(tvm.IRModule({"main": gemm.kernel(spec, epilogue=gemm.epilogue_for(_host()))}), target=_host())
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, (b, rows, k), dtype=np.uint8)
    w = rng.integers(-128, 128, (b, k, n), dtype=np.int8)
    rowcorr = rng.integers(-1000, 1000, (b, rows)).astype(np.int32)
    args = [a, np.stack([gemm.pack_weights(x) for x in w]), np.stack([gemm.column_sums(x) for x in w]),
            np.array(130, np.int32), rowcorr, np.array(0.013, np.float32)]
    out = tvm.runtime.tensor(np.zeros((b, rows, n), np.int8))
    lib["main"](*[tvm.runtime.tensor(x) for x in args], out)
    one = gemm.Int8GemmSpec(k=k, n=n, m=rows, scale="scalar", rowcorr=True, post=spec.post)
    for i in range(b):  # gemm.reference is one GEMM; the row correction added to its integer sum
        want = gemm.reference(one, a[i], w[i], 130, scale=np.float32(0.013), reciprocal=True,
                              rowcorr=rowcorr[i])
        np.testing.assert_array_equal(out.numpy()[i], want, err_msg=f"batch {i}")


def test_spec_json_keeps_the_keys_of_unbatched_kernels():
    """batch is left out of a batch-1 spec's JSON (the kernel attr, so the tuning workload's
    hash, of every kernel before batches); a batch is kept and read back."""
    one = gemm.Int8GemmSpec(k=64, n=64, scale="scalar")
    assert "batch" not in json.loads(one.to_json())
    many = gemm.Int8GemmSpec(k=64, n=64, scale="scalar", batch=12)
    assert gemm.Int8GemmSpec(**json.loads(many.to_json())) == many
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="batch"):
            gemm.Int8GemmSpec(k=64, n=64, batch=bad)


@pytest.mark.parametrize("spec, shape", [
    (sums.SumSpec("rows", 512, "int8", rows=37), (37, 512)),
    (sums.SumSpec("rows", 64, "uint8"), (45, 64)),  # symbolic rows
    (sums.SumSpec("cols", 64, "int8", batch=3, n=48), (3, 64, 48)),
    (sums.SumSpec("cols", 96, "uint8", n=32), (1, 96, 32))])
def test_eight_bit_sums_are_exact(spec, shape):
    """The zero-point terms' row and column sums (compile/quant/sums.py), the extremes included."""
    rng = np.random.default_rng(4)
    lo, hi = (-128, 128) if spec.dtype == "int8" else (0, 256)
    x = rng.integers(lo, hi, shape).astype(spec.dtype)
    x[0] = hi - 1  # a whole row (and so a column's first element) at the top of the range
    want = x.astype(np.int64).sum(axis=-1 if spec.axis == "rows" else -2)
    lib = tvm.compile(tvm.IRModule({"main": sums.kernel(spec)}), target=_host())
    out = tvm.runtime.tensor(np.zeros(want.shape, np.int32))
    lib["main"](tvm.runtime.tensor(x), out)
    np.testing.assert_array_equal(out.numpy(), want)
    text = sums.kernel(spec).script()
    assert "T.vectorized" in text
    big = spec.rows is None if spec.axis == "rows" else spec.batch * spec.k * spec.n >= sums.PARALLEL_ELEMS
    assert ("T.parallel" in text) == big  # (a small tensor on one thread: cheaper than waking the pool)


def test_eight_bit_sums_refuse_what_they_cannot_vectorise():
    for bad in (dict(axis="rows", k=24), dict(axis="cols", k=64, n=40), dict(axis="rows", k=64, dtype="int32"),
                dict(axis="diag", k=64), dict(axis="cols", k=64, batch=0)):
        with pytest.raises(ValueError, match="8-bit"):
            sums.SumSpec(**bad)
    assert sums.rows_supported(64) and not sums.rows_supported(36) and not sums.rows_supported(None)


@pytest.mark.parametrize("rows", [13, None])
def test_range_kernel_is_exact(rows):
    """DynamicQuantizeLinear's max(x) / min(x), parallel and vectorised, on ragged row counts."""
    _need_vnni_host()
    from blockforge.compile.quant import minmax

    f = minmax.kernel(minmax.MinMaxSpec(cols=48, rows=rows))
    assert ("T.parallel" in f.script()) == (rows is None) and "T.vectorized" in f.script()  # 13x48: one thread
    lib = tvm.compile(tvm.IRModule({"main": f}), target=_host())
    for m in ([rows] if rows else [1, 7, 20]):
        x = np.random.default_rng(m).standard_normal((m, 48)).astype(np.float32)
        x[m - 1, 47], x[0, 0] = 9.5, -7.25  # the extremes in the last and first lanes
        mx, mn = tvm.runtime.tensor(np.zeros((), np.float32)), tvm.runtime.tensor(np.zeros((), np.float32))
        lib["main"](tvm.runtime.tensor(x), mx, mn)
        assert (float(mx.numpy()), float(mn.numpy())) == (9.5, -7.25), m


def _matmul_integer_module(act_dtype: str, w: np.ndarray, zp_w: int, seq):
    """What TVM's importer makes of MatMulInteger: int32 casts, zero points subtracted."""
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([1, seq, w.shape[0]], act_dtype))
    zp = relax.Var("zp", relax.TensorType([], act_dtype))
    with bb.function("main", [x, zp]):
        with bb.dataflow():
            a32 = bb.emit(relax.op.subtract(relax.op.astype(x, "int32"), relax.op.astype(zp, "int32")))
            w32 = bb.emit(relax.op.subtract(relax.const(w.astype(np.int32)), relax.op.astype(relax.const(zp_w, "int8"), "int32")))
            y = bb.emit_output(relax.op.matmul(a32, w32, out_dtype="int32"))
        bb.emit_func_output(y)
    return bb.get()


@pytest.mark.parametrize("act_dtype, zp_w", [("uint8", 0), ("int8", 0), ("uint8", 5), ("int8", -3)])
def test_pass_folds_zero_points_and_the_s8_shift_exactly(act_dtype, zp_w):
    """s8 activations take the +128 shift; a weight zero point the row-sum correction."""
    _need_vnni_host()
    from tvm import relax

    from blockforge.compile.quant.rewrite import int8_gemm

    rng = np.random.default_rng(1)
    lo, hi = (0, 256) if act_dtype == "uint8" else (-128, 128)
    w = rng.integers(-128, 128, (32, 48), dtype=np.int8)
    mod = _matmul_integer_module(act_dtype, w, zp_w, tvm.tirx.Var("seq", "int64"))
    with ZNVER4:
        new = int8_gemm()(mod)
    assert len(gemm.kernel_specs(new)) == 1 and gemm.kernel_specs(new)[0].rowcorr == (zp_w != 0)
    vm = relax.VirtualMachine(tvm.compile(new, target=_host()), tvm.cpu())
    for seq in (7, 12):
        x = rng.integers(lo, hi, (1, seq, 32)).astype(act_dtype)
        zp = np.array(hi - 1 if act_dtype == "uint8" else lo, act_dtype)  # extreme zero points
        got = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(zp)).numpy()
        ref = (x.astype(np.int64) - int(zp)) @ (w.astype(np.int64) - zp_w)
        np.testing.assert_array_equal(got, ref)


def test_pass_leaves_float_matmuls_alone():
    from tvm import relax

    from blockforge.compile.quant.rewrite import int8_gemm

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([1, 8, 32], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.matmul(x, relax.const(np.ones((32, 48), np.float32))))
        bb.emit_func_output(y)
    mod = bb.get()
    with ZNVER4:
        tvm.ir.assert_structural_equal(int8_gemm()(mod), mod)


def test_phase_only_on_vnni_targets_and_ablatable():
    from blockforge.compile.pipeline import phases
    from blockforge.targets import resolve

    names = lambda t, int8=True, **kw: [p.name for p in phases(resolve(t), int8=int8, **kw)]  # noqa: E731
    # float models: no phase (their phase list, manifests and dumps stay as they were)
    assert "int8-gemm" not in names('{"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "znver4"}', int8=False)
    assert "int8-gemm" in names('{"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "znver4"}')
    assert "int8-gemm" not in names('{"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "x86-64"}')  # SSE2 only: no int8 instruction
    assert "int8-gemm" not in names('{"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "znver4"}',
                                    without={"int8-gemm"})
    ps = names('{"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "znver4"}')
    assert ps.index("fuse-attention") < ps.index("int8-gemm") < ps.index("optimize")  # gelu still an op


@pytest.fixture(scope="module")
def quantized_ffn(tmp_path_factory):
    pytest.importorskip("onnxruntime.quantization")
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from blockforge.graph import FFNSpec, export

    d = tmp_path_factory.mktemp("qffn")
    fp32 = export(FFNSpec(d_model=64, d_ff=128), d / "ffn.onnx").model_path
    quantize_dynamic(str(fp32), str(d / "ffn_q.onnx"), weight_type=QuantType.QInt8)
    return d / "ffn_q.onnx"


@pytest.mark.parametrize("seq", [16, None])
def test_quantize_dynamic_ffn_matches_ort_on_the_int8_kernel(quantized_ffn, seq, tmp_path, monkeypatch):
    """Both MatMulIntegers run on the int8 kernel (scale and bias in its epilogue), and the
    output matches ORT on the same file within one quantization step of the output range."""
    _need_vnni_host()
    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    from tvm import relax

    from blockforge.compile.session import open_model
    from blockforge.graph import ort as ort_runner

    from blockforge.compile.pipeline import run_phases

    s = open_model(quantized_ffn, "host", {"batch": 1, **({"seq": seq} if seq else {})})
    mod, _ = run_phases(s.relax(), s.target, stop_after="int8-gemm")
    # fc1's relu is fused into its kernel's epilogue; fc2 ends at its bias
    assert sorted(sp.activation for sp in gemm.kernel_specs(mod)) == ["none", "relu"]
    res = s.build(dump_ir=tmp_path / "dump")
    assert "int8-gemm" in res.phases
    after = next((tmp_path / "dump").glob("*-int8-gemm.py")).read_text()
    assert after.count("R.call_tir(cls.int8_gemm_") == 2, after
    assert after.count("R.call_tir(cls.int8_range_") == 2, after  # both activations' ranges
    assert "R.max(" not in after.split("def main")[-1], "a serial whole-tensor max is left"
    assert "out_dtype=\"int32\"" not in after.split("def main")[-1], "an int32 matmul is left"
    vm = relax.VirtualMachine(res.executable, tvm.cpu())
    for n in ([seq] if seq else [1, 13, 16]):
        x = np.random.default_rng(n).standard_normal((1, n, 64)).astype(np.float32)
        got = vm["main"](tvm.runtime.tensor(x)).numpy()
        ref = next(iter(ort_runner.run(s.model, {"x": x}).values()))
        step = float(np.abs(ref).max()) / 255
        assert np.abs(got - ref).max() <= step, (n, np.abs(got - ref).max(), step)


def test_int8_kernels_are_not_tuning_tasks(quantized_ffn, monkeypatch):
    """tune extracts MetaSchedule tasks from the legalized module: the hand-written int8
    kernels are not a search space (as the fused attention kernels), the rest still is."""
    _need_vnni_host()
    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    from blockforge.compile.pipeline import extract_tasks, run_phases
    from blockforge.compile.session import open_model

    s = open_model(quantized_ffn, "host", {"batch": 1, "seq": 16})
    mod, names = run_phases(s.relax(), s.target, stop_after="legalize")
    assert "int8-gemm" in names
    tasks = [t.task_name for t in extract_tasks(mod, s.target)]
    assert tasks and not any("int8_gemm" in t or "int8_range" in t for t in tasks), tasks


@pytest.fixture(scope="module", params=["QInt8", "QUInt8"])
def qdq_ffn(tmp_path_factory, request):
    """ORT quantize_static, QDQ S8S8 (as issue #19) and U8S8, per-channel, after quant_pre_process."""
    return _qdq_ffn(tmp_path_factory.mktemp("qdq"), request.param, "relu")


@pytest.fixture(scope="module")
def qdq_gelu_ffn(tmp_path_factory):
    """The same, S8S8, with BERT's gelu between the matmuls."""
    return _qdq_ffn(tmp_path_factory.mktemp("qdq_gelu"), "QInt8", "gelu")


def _qdq_ffn(d: Path, act_type: str, activation: str) -> Path:
    pytest.importorskip("onnxruntime.quantization")
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from blockforge.graph import FFNSpec, export

    class Batches(CalibrationDataReader):
        def __init__(self):
            self.it = iter([{"x": np.random.default_rng(i).standard_normal((1, 16, 64)).astype(np.float32)}
                            for i in range(4)])

        def get_next(self):
            return next(self.it, None)

    fp32 = export(FFNSpec(d_model=64, d_ff=128, activation=activation), d / "ffn.onnx").model_path
    quant_pre_process(str(fp32), str(d / "pre.onnx"))
    quantize_static(str(d / "pre.onnx"), str(d / "ffn_qdq.onnx"), Batches(), quant_format=QuantFormat.QDQ,
                    activation_type=getattr(QuantType, act_type), weight_type=QuantType.QInt8,
                    per_channel=True)
    return d / "ffn_qdq.onnx"


def test_qdq_rewrite_is_the_same_model_in_ort(qdq_ffn):
    import onnx

    from blockforge.compile.quant.qdq import qdq_matmuls_as_integer
    from blockforge.graph import ort as ort_runner

    m = onnx.load(str(qdq_ffn))
    m2, n = qdq_matmuls_as_integer(m)
    assert n == 2 and sum(x.op_type == "MatMulInteger" for x in m2.graph.node) == 2
    assert not any(x.op_type == "MatMulInteger" for x in m.graph.node), "the input was modified"
    onnx.checker.check_model(m2)
    x = {"x": np.random.default_rng(3).standard_normal((1, 16, 64)).astype(np.float32)}
    a, b = (next(iter(ort_runner.run(mm, x).values())) for mm in (m, m2))
    step = float(np.abs(a).max()) / 255
    assert np.abs(a - b).max() <= step


def test_qdq_ffn_matches_ort_on_the_int8_kernel(qdq_ffn, monkeypatch):
    _need_vnni_host()
    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    from tvm import relax

    from blockforge.compile.quant.gemm import kernel_specs
    from blockforge.compile.pipeline import run_phases
    from blockforge.compile.session import open_model
    from blockforge.graph import ort as ort_runner

    s = open_model(qdq_ffn, "host", {"batch": 1})  # seq symbolic
    mod, _ = run_phases(s.relax(), s.target, stop_after="int8-gemm")
    specs = kernel_specs(mod)
    assert len(specs) == 2 and all(sp.scale == "column" for sp in specs), specs  # per-channel scales
    vm = relax.VirtualMachine(s.build().executable, tvm.cpu())
    for n in (1, 16):
        x = np.random.default_rng(n).standard_normal((1, n, 64)).astype(np.float32)
        got = vm["main"](tvm.runtime.tensor(x)).numpy()
        ref = next(iter(ort_runner.run(s.model, {"x": x}).values()))
        assert np.abs(got - ref).max() <= float(np.abs(ref).max()) / 255


# What a QDQ FFN writes after its first matmul: requantize, bias, requantize, activation, quantize.
_POST = (("qdq", 0.03, 2, "int8"), ("bias",), ("qdq", 0.04, -3, "int8"), ("relu",), ("q", 0.01, -120, "int8"))


@pytest.mark.parametrize("reciprocal", [False, True])
@pytest.mark.parametrize("m, last", [(13, ("q", 0.01, -120, "int8")), (None, ("q", 0.01, 7, "uint8")),
                                     (12, ("qdq", 0.03, 0, "int8"))])
def test_qdq_chain_in_the_epilogue_is_exact(m, last, reciprocal):
    """The POST_STEPS epilogue, bit for bit against numpy (round half to even of x / scale, + zp,
    clipped; or of x * (1 / scale), Epilogue.reciprocal), int8 or uint8 out or float after a
    last requantize; ragged, symbolic, whole tiles. The reciprocal is within one level of the
    division."""
    _need_vnni_host()
    rng = np.random.default_rng(11)
    spec = gemm.Int8GemmSpec(k=64, n=48, m=m, scale="column", bias=True, post=_POST[:-1] + (last,))
    assert spec.out_dtype == (last[3] if last[0] == "q" else "float32")
    rows = m or 9
    a = rng.integers(0, 256, (rows, 64), dtype=np.uint8)
    w = rng.integers(-128, 128, (64, 48), dtype=np.int8)
    scale = rng.uniform(2e-5, 6e-5, 48).astype(np.float32)  # pre-activations of about +-5: some clip
    bias = rng.standard_normal(48).astype(np.float32)
    got, _ = _run_kernel(spec, a, w, zp_a=128, scale=scale, bias=bias,
                         epilogue=gemm.Epilogue(reciprocal=reciprocal))
    ref = gemm.reference(spec, a, w, 128, 0, scale, bias, reciprocal=reciprocal)
    assert got.dtype == ref.dtype
    np.testing.assert_array_equal(got, ref)
    divided = gemm.reference(spec, a, w, 128, 0, scale, bias)
    # a level that moves moves by one; what follows re-rounds it onto its own grid
    value = lambda q: (q.astype(np.float64) - last[2]) * last[1] if last[0] == "q" else q  # noqa: E731
    steps = [st[1] for st in spec.post if st[0] in ("qdq", "q")]
    assert np.abs(value(got) - value(divided)).max() <= (max(steps) + last[1]) * 1.0001
    assert np.mean(got != divided) < 0.05
    if last[0] == "q":  # the clip at both ends is exercised
        lo, hi = (-128, 127) if last[3] == "int8" else (0, 255)
        assert (got == hi).any() and (got == last[2]).any(), np.unique(got)


# A QDQ gelu FFN's first epilogue (gemm.lut_tail): after the second requantize, gelu and the
# quantize of the next GEMM's input are a function of the level, read from a 256-byte table.
_GELU_POST = (("qdq", 0.03, 2, "int8"), ("bias",), ("qdq", 0.04, -3, "int8"), ("gelu",))


def _lut_spec(post, m=16, k=64, **kw):
    return gemm.Int8GemmSpec(k=k, n=48, m=m, scale="column", bias=True, post=post, **kw)


def test_lut_tail_starts_after_the_last_per_tensor_requantize():
    q8 = ("q", 0.01, 7, "uint8")
    assert gemm.lut_tail(_lut_spec(_GELU_POST + (q8,))) == 2
    assert gemm.lut_tail(_lut_spec((("qdq", 0.03, 0, "int8"), ("gelu",), q8))) == 0
    assert gemm.lut_tail(_lut_spec(_GELU_POST)) is None  # float out: not a byte table
    assert gemm.lut_tail(_lut_spec(_POST)) is None  # relu: a few instructions, no table
    assert gemm.lut_tail(_lut_spec((("qdq", 0.03, 0, "int8"), ("gelu",), ("bias",), q8))) is None  # per column
    assert gemm.lut_tail(_lut_spec(_GELU_POST + (q8,), isa="sdot")) is None  # VPERMI2B is x86's
    assert gemm.has_lut(ZNVER4) and not gemm.has_lut(SKYLAKE)  # AVX512_VBMI
    assert not gemm.has_lut(tvm.target.Target({"kind": "llvm", "mcpu": "cascadelake"}))  # VNNI, no VBMI


def test_lut_kernel_fills_the_table_once_and_reads_it_with_vpermi2b():
    """The table loop is the root's first statement, before the parallel tiles; the function's
    parameters are the per-element kernel's; each 16 outputs are two byte permutes (no gather,
    no gelu division per element)."""
    spec = _lut_spec(_GELU_POST + (("q", 0.01, 7, "uint8"),), m=512, k=256)  # (parallel: PARALLEL_MACS)
    plain, lut = gemm.kernel(spec), gemm.kernel(spec, epilogue=gemm.Epilogue(lut=True))
    assert len(lut.params) == len(plain.params)
    root = lut.body.block.body
    assert isinstance(root, tvm.tirx.SeqStmt) and isinstance(root[0], tvm.tirx.For), root
    assert int(root[0].extent) == 16 and "lut" in str(root[0]) and "T.parallel" not in root[0].script()
    assert "T.parallel" in root[1].script()
    asm = {name: tvm.compile(tvm.IRModule({"main": f}), target=ZNVER4).mod.inspect_source("s")
           for name, f in (("plain", plain), ("lut", lut))}
    perms = len(re.findall(r"\bvperm[it]2b\b", asm["lut"]))
    assert perms == 2 * 5 * 3, perms  # two per 16 outputs of the 5 x 3 tile
    assert "vpgather" not in asm["lut"] and "vperm" not in asm["plain"].replace("vpermq", "")
    # the table's gelu divides 256 values once; per element, two requantizes' divisions are left
    assert asm["lut"].count("vdivps") < asm["plain"].count("vdivps")


def test_reciprocal_quantize_divides_where_the_reciprocal_is_not_a_normal_float():
    """A hostile file's subnormal scale (1 / s is inf: 0 * inf a NaN the clip cannot judge) or a
    scale above 2^126 (a subnormal reciprocal): that step divides, and the kernel still agrees
    with numpy both ways."""
    assert gemm.reciprocal_scale(0.03) == np.float32(1) / np.float32(0.03)
    assert gemm.reciprocal_scale(1e-40) is None and gemm.reciprocal_scale(1e38) is None
    post = (("qdq", 1e-40, 0, "int8"), ("bias",), ("q", 0.01, 7, "uint8"))
    spec = _lut_spec(post, m=12)
    asm = tvm.compile(tvm.IRModule({"main": gemm.kernel(spec, epilogue=gemm.Epilogue(reciprocal=True))}),
                      target=ZNVER4).mod.inspect_source("s")
    assert "vdivps" in asm  # the subnormal step's division (the last step multiplies)
    _need_vnni_host()
    rng = np.random.default_rng(14)
    a = rng.integers(0, 256, (12, 64), dtype=np.uint8)
    w = rng.integers(-128, 128, (64, 48), dtype=np.int8)
    a[0] = 128  # zero rows: 0 / s and 0 * (1 / s) part ways on exactly these
    scale = rng.uniform(2e-5, 6e-5, 48).astype(np.float32)
    bias = rng.standard_normal(48).astype(np.float32)
    got, _ = _run_kernel(spec, a, w, zp_a=128, scale=scale, bias=bias, epilogue=gemm.Epilogue(reciprocal=True))
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        want = gemm.reference(spec, a, w, 128, 0, scale, bias)
        np.testing.assert_array_equal(gemm.reference(spec, a, w, 128, 0, scale, bias, reciprocal=True), want)
    np.testing.assert_array_equal(got, want)


def test_reciprocal_quantize_leaves_no_division_per_element():
    """Epilogue.reciprocal: the requantize chain multiplies (vdivps, Zen 4's slowest vector op,
    is left to the dividing kernel: three per 16 outputs of a two-requantize chain)."""
    spec = _lut_spec(_POST, m=512, k=256)
    asm = {r: tvm.compile(tvm.IRModule({"main": gemm.kernel(spec, epilogue=gemm.Epilogue(reciprocal=r))}),
                          target=ZNVER4).mod.inspect_source("s") for r in (False, True)}
    assert "vdivps" in asm[False] and "vdivps" not in asm[True]
    assert gemm.epilogue_for(ZNVER4) == gemm.Epilogue(lut=True, reciprocal=True, gelu_segments=True)
    assert gemm.epilogue_for(SKYLAKE, reciprocal=False, gelu_segments=False) == gemm.Epilogue()
    assert gemm.epilogue_for(ZNVER4, lut=False).lut is False


def test_gelu_segments_within_5e7_of_the_exact_gelu():
    """compile/quant/gelu.py in float32 as the kernel computes it, against the exact gelu: over
    the range pre-activations take and far past the last segment, both signs, the segments'
    edges (where the index rounds either way) and the clamp; the extremes stay finite or inf
    as gelu's are."""
    from scipy.special import erf

    from blockforge.compile.quant import gelu

    edges = np.arange(0, 33) * np.float32(1 / 6)
    near = [np.nextafter(np.float32(e), np.float32(s * 10)) * sg for e in edges for s in (-1, 1) for sg in (-1, 1)]
    x = np.concatenate([np.linspace(-12, 12, 400_001, dtype=np.float32),
                        np.array(near + [gelu.T_MAX, -gelu.T_MAX], np.float32)])
    exact = 0.5 * x.astype(np.float64) * (1 + erf(x.astype(np.float64) / np.sqrt(2)))
    err = np.abs(gelu.reference(x) - exact)
    assert err.max() < 5e-7, (err.max(), x[err.argmax()])
    assert gelu.coefficients().shape == (32, 4) and gelu.coefficients().dtype == np.float32
    assert gelu.reference(np.zeros(1, np.float32))[0] == 0
    with np.errstate(invalid="ignore"):
        big = gelu.reference(np.array([np.inf, -np.inf, 3e38, -3e38], np.float32))
    assert big[0] == np.inf and big[2] == np.float32(3e38) and abs(big[1]) < 1e-6 and abs(big[3]) < 1e-6


def test_gelu_segments_are_four_permutes_per_16_outputs_and_no_division():
    """Epilogue.gelu_segments: each 16 outputs read their four coefficients with VPERMI2PS (or
    its twin VPERMT2PS, LLVM's pick of which table register it overwrites) from constant tables
    (no gather, no VDIVPS); AVX-512 targets only (AVX-VNNI CPUs have no zmm permutes); on the
    host, the kernel agrees with gelu.reference on its own pre-activations."""
    spec = gemm.Int8GemmSpec(k=64, n=96, m=40, scale="column", bias=True, activation="gelu")
    tiles = gemm.default_tiles(spec)
    asm = {g: tvm.compile(tvm.IRModule({"main": gemm.kernel(spec, epilogue=gemm.Epilogue(gelu_segments=g))}),
                          target=ZNVER4).mod.inspect_source("s") for g in (False, True)}
    assert "vdivps" in asm[False] and "vdivps" not in asm[True]
    perms = {g: len(re.findall(r"\bvperm[it]2ps\b", a)) for g, a in asm.items()}
    assert perms[False] == 0 and "vgather" not in asm[True]
    assert perms[True] == 4 * tiles.mr * tiles.nv, (perms, tiles.describe())
    assert gemm.epilogue_for(SKYLAKE).gelu_segments
    alderlake = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "alderlake"})
    assert not gemm.epilogue_for(alderlake).gelu_segments
    assert not gemm.epilogue_for(ZNVER4, gelu_segments=False).gelu_segments
    _need_vnni_host()
    from blockforge.compile.quant import gelu

    rng = np.random.default_rng(8)
    a = rng.integers(0, 256, (40, 64), dtype=np.uint8)
    w = rng.integers(-128, 128, (64, 96), dtype=np.int8)
    scale = rng.uniform(1e-5, 6e-5, 96).astype(np.float32)  # pre-activations of about +-6
    bias = rng.standard_normal(96).astype(np.float32)
    got, _ = _run_kernel(spec, a, w, zp_a=128, scale=scale, bias=bias, epilogue=gemm.Epilogue(gelu_segments=True))
    z = gemm.reference(gemm.Int8GemmSpec(k=64, n=96, scale="column", bias=True), a, w, 128, 0, scale, bias)
    assert np.abs(z).max() > 16 / 3  # past the last segment too
    np.testing.assert_allclose(got, gelu.reference(z), rtol=0, atol=2e-6)


@pytest.mark.parametrize("reciprocal", [False, True])
@pytest.mark.parametrize("m, out", [(13, "uint8"), (None, "int8"), (20, "uint8")])
def test_lut_tail_is_bit_exact_with_the_per_element_epilogue(m, out, reciprocal):
    """Every level (both clips), ragged / symbolic / whole row tiles, uint8 (levels above 127
    wrap in the byte table) and int8 out: the table's bytes are the per-element floats, with
    either quantize (the division, the reciprocal)."""
    _need_vnni_host()
    if not gemm.has_lut(_host()):
        pytest.skip("this CPU has no AVX512_VBMI: the table is not built for it")
    rng = np.random.default_rng(12)
    last = ("q", 0.01, 7, "uint8") if out == "uint8" else ("q", 0.012, -20, "int8")
    spec = _lut_spec(_GELU_POST + (last,), m=m)
    rows = m or 9
    a = rng.integers(0, 256, (rows, 64), dtype=np.uint8)
    w = rng.integers(-128, 128, (64, 48), dtype=np.int8)
    scale = rng.uniform(2e-5, 6e-5, 48).astype(np.float32)  # about +-8 before the requantizes: both clip
    bias = rng.standard_normal(48).astype(np.float32)
    args = [a, gemm.pack_weights(w), gemm.column_sums(w), np.array(128, np.int32), scale, bias]
    outs = []
    for lut in (False, True):
        epilogue = gemm.Epilogue(lut=lut, reciprocal=reciprocal)
        lib = tvm.compile(tvm.IRModule({"main": gemm.kernel(spec, epilogue=epilogue)}), target=_host())
        o = tvm.runtime.tensor(np.zeros((rows, 48), out))
        lib["main"](*[tvm.runtime.tensor(x) for x in args], o)
        outs.append(o.numpy())
    np.testing.assert_array_equal(outs[1], outs[0])
    assert len(np.unique(outs[0])) > 40, np.unique(outs[0])  # many levels, not a constant


def test_post_steps_refused_where_they_cannot_be_computed():
    with pytest.raises(ValueError, match="last step"):
        gemm.Int8GemmSpec(k=64, n=64, scale="scalar", post=(("q", 0.1, 0, "int8"), ("relu",)))
    with pytest.raises(ValueError, match="post step"):
        gemm.Int8GemmSpec(k=64, n=64, scale="scalar", post=(("bias",),))  # no bias input
    for bad in (("q", 0.1, 200, "int8"), ("q", -0.1, 0, "int8"), ("q", float("nan"), 0, "int8"),
                ("q", 0.1, 0, "int16"), ("erf",), ("relu", 1)):
        with pytest.raises(ValueError, match="post step"):
            gemm.Int8GemmSpec(k=64, n=64, scale="scalar", post=(bad,))
    with pytest.raises(ValueError, match="float epilogue"):
        gemm.Int8GemmSpec(k=64, n=64, post=(("relu",),))
    sp = gemm.Int8GemmSpec(k=64, n=64, m=None, scale="column", bias=True, post=_POST)
    assert gemm.Int8GemmSpec(**json.loads(sp.to_json())) == sp  # kernel_specs reads it back (lists -> tuples)


@pytest.mark.parametrize("seq", [16, None])
def test_qdq_ffn_chain_between_the_gemms_is_in_the_kernels(qdq_gelu_ffn, seq, monkeypatch):
    """A QDQ FFN (gelu): the requantize / bias / requantize / gelu / quantize chain after the
    first GEMM runs in its epilogue, which writes the second GEMM's int8 input (no float32
    512x3072 tensor through memory at BERT's seq 512); the second GEMM's chain likewise. The
    same numbers as the unfused build (the int8-qdq-epilogue ablation) where the epilogue
    divides (the reciprocal ablation), within a step of it and of ORT as built."""
    _need_vnni_host()
    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    from tvm import relax

    from blockforge.compile.pipeline import run_phases
    from blockforge.compile.session import open_model
    from blockforge.graph import ort as ort_runner

    dims = {"batch": 1} if seq is None else {"batch": 1, "seq": seq}
    s = open_model(qdq_gelu_ffn, "host", dims)
    mod, _ = run_phases(s.relax(), s.target, stop_after="int8-gemm")
    first, second = gemm.kernel_specs(mod)
    assert [st[0] for st in first.post] == ["qdq", "bias", "qdq", "gelu", "q"], first
    assert [st[0] for st in second.post] == ["qdq", "bias", "qdq"] and second.out_dtype == "float32", second
    # the first writes the second's u8 activations itself (its s8 zero point + 128; the numbers
    # are checked against the unfused build below)
    assert first.out_dtype == "uint8", first
    text = mod["main"].script()
    # only the model input's QuantizeLinear is left as an op; no dequantize, no gelu, and one
    # s8 -> u8 shift (the input's): none between the GEMMs
    assert text.count("R.quantize(") == 1 and "R.dequantize(" not in text and "R.nn.gelu" not in text, text
    assert text.count('dtype="uint8") = R.astype(') == 1, text
    off, _ = run_phases(s.relax(), s.target, stop_after="int8-gemm", without={"int8-qdq-epilogue"})
    assert all(not sp.post for sp in gemm.kernel_specs(off)) and "R.nn.gelu" in off["main"].script()

    def tables(without):  # kernels that fill the epilogue's byte table (gemm.lut_tail)
        m, _ = run_phases(s.relax(), s.target, stop_after="int8-gemm", without=without)
        return sum('"lut"' in f.script() for _, f in m.functions_items()
                   if isinstance(f, tvm.tirx.PrimFunc) and gemm.is_kernel(f))

    assert tables(frozenset()) == (1 if gemm.has_lut(s.target.tvm_target()) else 0)
    assert tables(frozenset({"int8-lut-tail"})) == 0
    vms = [relax.VirtualMachine(s.build(without=w).executable, tvm.cpu())
           for w in (frozenset(), frozenset({"int8-qdq-epilogue"}), frozenset({"int8-lut-tail"}),
                     frozenset({"reciprocal"}))]
    for n in ((seq,) if seq else (1, 7, 16)):
        x = np.random.default_rng(n).standard_normal((1, n, 64)).astype(np.float32)
        got, unfused, no_table, divided = (vm["main"](tvm.runtime.tensor(x)).numpy() for vm in vms)
        np.testing.assert_array_equal(divided, unfused)
        np.testing.assert_array_equal(got, no_table)
        ref = next(iter(ort_runner.run(s.model, {"x": x}).values()))
        step = float(np.abs(ref).max()) / 255
        assert np.abs(got - ref).max() <= step and np.abs(got - unfused).max() <= step


def test_bias_adds_export_puts_the_first_epilogue_on_the_table(tmp_path, monkeypatch):
    """blockforge's own `export --quantize static --bias-adds`: the bias Add's requantize lets
    the first GEMM's gelu and quantize come from the 256-byte table (its default recipe keeps
    that Add float: gelu per element); the build matches ORT on the file within a step."""
    _need_vnni_host()
    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    from tvm import relax

    from blockforge.compile.pipeline import run_phases
    from blockforge.compile.session import open_model
    from blockforge.graph import FFNSpec, export
    from blockforge.graph import ort as ort_runner

    spec = FFNSpec(d_model=64, d_ff=128, activation="gelu")
    firsts = {}
    for bias in (False, True):
        path = export(spec, tmp_path / f"ffn_{bias}.onnx", quantize="static", bias_adds=bias).model_path
        s = open_model(path, "host", {"batch": 1, "seq": 16})
        mod, _ = run_phases(s.relax(), s.target, stop_after="int8-gemm")
        firsts[bias] = gemm.kernel_specs(mod)[0]
    assert [st[0] for st in firsts[False].post] == ["qdq", "bias", "gelu", "q"] and gemm.lut_tail(firsts[False]) is None
    assert [st[0] for st in firsts[True].post] == ["qdq", "bias", "qdq", "gelu", "q"]
    assert gemm.lut_tail(firsts[True]) == 2
    x = np.random.default_rng(3).standard_normal((1, 16, 64)).astype(np.float32)
    got = relax.VirtualMachine(s.build().executable, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    ref = next(iter(ort_runner.run(s.model, {"x": x}).values()))
    assert np.abs(got - ref).max() <= float(np.abs(ref).max()) / 255


@pytest.mark.parametrize("bad", [-0.04, float("nan")])  # (0: the import refuses it, one line)
def test_qdq_chain_with_a_bad_scale_stays_as_written(qdq_gelu_ffn, bad, tmp_path, monkeypatch):
    """An untrusted QDQ model whose requantize scale the kernel cannot take (negative, NaN)
    compiles: the chain stops before that quantize (no ValueError from the spec)."""
    _need_vnni_host()
    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    import onnx
    from onnx import numpy_helper

    from blockforge.compile.pipeline import run_phases
    from blockforge.compile.session import open_model

    m = onnx.load(str(qdq_gelu_ffn))
    q = [n for n in m.graph.node if n.op_type == "QuantizeLinear"][2]  # input, matmul out, then the bias add's
    t = next(t for t in m.graph.initializer if t.name == q.input[1])
    t.CopyFrom(numpy_helper.from_array(np.array(bad, np.float32), t.name))
    onnx.save(m, str(tmp_path / "bad.onnx"))
    s = open_model(tmp_path / "bad.onnx", "host", {"batch": 1, "seq": 16})
    mod, _ = run_phases(s.relax(), s.target, stop_after="int8-gemm")
    first = gemm.kernel_specs(mod)[0]
    assert [st[0] for st in first.post] in (["qdq", "bias"], []), first


def test_qdq_rewrite_reads_weights_the_child_left_on_disk(qdq_ffn, monkeypatch):
    """Isolation on, the prepared model's weights are external data in the child's folder:
    the QDQ rewrite still reads them (Session.prepared_with_weights) and imports MatMulInteger."""
    _need_vnni_host()
    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "1")
    from blockforge.compile.quant.gemm import kernel_specs
    from blockforge.compile.pipeline import run_phases
    from blockforge.compile.session import open_model

    s = open_model(qdq_ffn, "host", {"batch": 1, "seq": 16})
    assert s.weights_dir is not None
    mod, _ = run_phases(s.relax(), s.target, stop_after="int8-gemm")
    assert len(kernel_specs(mod)) == 2


def test_qdq_imported_as_written_where_no_int8_instruction(qdq_ffn, monkeypatch):
    """Plain x86-64 (SSE2) has no int8 dot product: the QDQ model imports as before (no int32
    matmul, which would run as a scalar int32 loop there); Skylake (VPMADDUBSW/VPMADDWD) gets
    the MatMulInteger form."""
    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    from blockforge.compile.pipeline import has_int8_matmul
    from blockforge.compile.session import open_model

    sse2 = '{"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "x86-64"}'
    assert not has_int8_matmul(open_model(qdq_ffn, sse2, {"batch": 1, "seq": 16}).relax())
    assert has_int8_matmul(open_model(qdq_ffn, "x86-64-avx512", {"batch": 1, "seq": 16}).relax())


def test_elementwise_chains_scheduled_in_every_cpu_module():
    """CPUElementwise is the last CPU rule of float and int8 builds; the `elementwise` ablation
    takes it out of float builds only (int8 chains had it from the start: their A/Bs)."""
    from tvm import te

    from blockforge.compile.schedule.elementwise import CPUElementwise
    from blockforge.compile.pipeline import default_rules
    from blockforge.targets import resolve

    host = resolve('{"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "znver4", "num-cores": 2}')
    assert isinstance(default_rules(host)[-1], CPUElementwise)
    assert not any(isinstance(r, CPUElementwise) for r in default_rules(host, frozenset({"elementwise"})))
    assert isinstance(default_rules(host, frozenset({"elementwise"}), int8=True)[-1], CPUElementwise)
    x = te.placeholder((tvm.tirx.Var("m", "int64"), 64), "float32", name="x")
    q = te.compute(x.shape, lambda i, j: te.round(x[i, j] * 3.0).astype("int8"), name="q")
    y = te.compute(x.shape, lambda i, j: q[i, j].astype("float32") * 0.5, name="y")
    func = te.create_prim_func([x, y]).with_attr("global_symbol", "main")
    with ZNVER4:
        sch = CPUElementwise().apply(func, ZNVER4, False)
    text = sch.mod["main"].script()
    assert "T.parallel" in text and "T.vectorized(16)" in text.replace("T.int64(16)", "16"), text
    assert 'sblock("q")' not in text, "the chain was not inlined into one pass"


def test_qdq_rewrite_that_does_not_import_falls_back(qdq_ffn, monkeypatch):
    """The rewrite must never make a model uncompilable: a MatMulInteger form TVM refuses
    is dropped for the model as written (which the isolated probe already imported)."""
    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    import onnx

    import blockforge.compile.quant.qdq as qdq
    from blockforge.compile.pipeline import has_int8_matmul
    from blockforge.compile.session import open_model

    def broken(model, *_):
        m = onnx.ModelProto()
        m.CopyFrom(model)
        m.graph.node[0].op_type = "NoSuchOp"
        return m, 1

    monkeypatch.setattr(qdq, "qdq_matmuls_as_integer", broken)
    s = open_model(qdq_ffn, '{"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "znver4"}',
                   {"batch": 1, "seq": 16})
    mod = s.relax()
    assert not has_int8_matmul(mod) and mod is s.relax(int8=False)


def test_quantize_dynamic_encoder_block_matches_ort(tmp_path, monkeypatch):
    """An encoder block (attention fused as before, LayerNorm, gelu) with its quantized
    projections and FFN on the int8 kernel, against ORT on the same file."""
    _need_vnni_host()
    pytest.importorskip("onnxruntime.quantization")
    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from tvm import relax

    from blockforge.compile.pipeline import run_phases
    from blockforge.compile.session import open_model
    from blockforge.graph import BlockSpec, export
    from blockforge.graph import ort as ort_runner
    from blockforge.graph.model_io import random_inputs

    fp32 = export(BlockSpec(d_model=64, heads=4), tmp_path / "block.onnx").model_path
    quantize_dynamic(str(fp32), str(tmp_path / "block_q.onnx"), weight_type=QuantType.QInt8)
    s = open_model(tmp_path / "block_q.onnx", "host", {"batch": 1, "seq": 16})
    mod, _ = run_phases(s.relax(), s.target, stop_after="int8-gemm")
    assert len(gemm.kernel_specs(mod)) >= 3  # projections + both FFN matmuls (measured 4)
    vm = relax.VirtualMachine(s.build().executable, tvm.cpu())
    inputs = random_inputs(s.inputs, s.dims, seed=0)
    got = vm["main"](*[tvm.runtime.tensor(inputs[x.name]) for x in s.inputs]).numpy()
    ref = next(iter(ort_runner.run(s.model, inputs).values()))
    assert np.abs(got - ref).max() <= float(np.abs(ref).max()) / 255


ALDERLAKE = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "alderlake", "num-cores": 2})


def _vnni_8x4_gemm(m=12, n=32, k=64):
    """A toy u8 x s8 GEMM on (N/8, K/4, 8, 4) packed weights, tensorized with the 256-bit intrinsic."""
    from tvm import s_tir, te

    from blockforge.compile.quant.intrin import vnni_8x4

    a = te.placeholder((m, k), "uint8", name="A")
    w = te.placeholder((n // 8, k // 4, 8, 4), "int8", name="W")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((m, n), lambda i, j: te.sum(
        a[i, r].astype("int32") * w[j // 8, r // 4, j % 8, r % 4].astype("int32"), axis=r), name="C")
    sch = s_tir.Schedule(te.create_prim_func([a, w, c]))
    b = sch.get_sblock("C")
    i, j, kk = sch.get_loops(b)
    jo, ji = sch.split(j, [None, 8])
    ko, ki = sch.split(kk, [None, 4])
    sch.reorder(i, jo, ko, ji, ki)
    sch.decompose_reduction(b, ko)
    sch.tensorize(ji, vnni_8x4())
    return sch.mod


def test_256_bit_intrinsic_is_vex_encoded_on_avxvnni_and_exact_where_it_runs():
    """AVX-VNNI (Alder Lake+, Zen 5 client): VEX-encoded ymm VPDPBUSD, checked in the assembly
    of a fixed target (this Zen 4 has no AVX-VNNI, so the VEX form cannot run here); the same
    intrinsic is EVEX on AVX512_VNNI + AVX512VL, which runs here, exact against numpy."""
    from blockforge.compile.quant.intrin import has_avxvnni

    assert has_avxvnni(ALDERLAKE) and not has_vnni(ALDERLAKE), "Alder Lake: AVX-VNNI, no AVX-512"
    assert not has_avxvnni(ZNVER4) and not has_avxvnni(SKYLAKE)
    mod = _vnni_8x4_gemm()
    vex = [ln for ln in tvm.compile(mod, target=ALDERLAKE).mod.inspect_source("asm").splitlines() if "vpdpbusd" in ln]
    assert vex and all("{vex}" in ln and "%ymm" in ln for ln in vex), vex
    evex = [ln for ln in tvm.compile(mod, target=ZNVER4).mod.inspect_source("asm").splitlines() if "vpdpbusd" in ln]
    assert evex and all("{vex}" not in ln and "%ymm" in ln for ln in evex), evex
    _need_vnni_host()
    rng = np.random.default_rng(8)
    a = rng.integers(0, 256, (12, 64), dtype=np.uint8)
    w = rng.integers(-128, 128, (64, 32), dtype=np.int8)
    packed = np.ascontiguousarray(w.reshape(16, 4, 4, 8).transpose(2, 0, 3, 1))  # (N/8, K/4, 8, 4)
    out = tvm.runtime.tensor(np.zeros((12, 32), np.int32))
    tvm.compile(mod, target=_host())["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(packed), out)
    np.testing.assert_array_equal(out.numpy(), a.astype(np.int64) @ w.astype(np.int64))


def _dq_matmul_module(a_shape, b_shape, b_dtype="int8", zp_b=3):
    """matmul(dequantize(a8), dequantize(b8)) of two runtime 8-bit tensors (a QDQ attention
    product as TVM imports it), per-tensor parameters."""
    from tvm import relax

    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType(a_shape, "int8"))
    b = relax.Var("b", relax.TensorType(b_shape, b_dtype))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            da = bb.emit(relax.op.dequantize(a, relax.const(0.03, "float32"), relax.const(-2, "int8")))
            db = bb.emit(relax.op.dequantize(b, relax.const(0.02, "float32"), relax.const(zp_b, b_dtype)))
            y = bb.emit_output(relax.op.matmul(da, db))
        bb.emit_func_output(y)
    return bb.get()


def _int8_products(mod, batched: bool = True) -> list:
    from blockforge.compile.quant.rewrite import int8_gemm

    return gemm.kernel_specs(int8_gemm("vnni", ZNVER4, batched_products=batched)(mod))


def test_attention_products_match_only_what_the_kernel_takes():
    """Q K^T / P V shapes with static K % 4, N % 16, a batch of one or the same static leading dims
    on both operands (batched heads: one batched kernel) and enough work for the
    thread pool go on the int8 kernel (a weight zero point: the row correction); a ragged N,
    broadcast heads, a symbolic N and a product under gemm.PARALLEL_MACS stay dequantize + float32."""
    from tvm import tirx

    (sp,) = _int8_products(_dq_matmul_module([1, 512, 64], [1, 64, 512]))
    assert (sp.m, sp.k, sp.n, sp.scale, sp.rowcorr, sp.batch) == (512, 64, 512, "scalar", True, 1)
    (sp,) = _int8_products(_dq_matmul_module([512, 512], [512, 64], zp_b=0))
    assert (sp.k, sp.n, sp.rowcorr) == (512, 64, False)
    heads = _dq_matmul_module([1, 12, 128, 64], [1, 12, 64, 128])  # batched heads (SDPA exports)
    assert _int8_products(heads, batched=False) == []  # the int8-batched-products ablation
    (sp,) = _int8_products(heads)
    assert (sp.batch, sp.m, sp.k, sp.n) == (12, 128, 64, 128)
    (sp,) = _int8_products(_dq_matmul_module([2, 512, 64], [2, 64, 512]), batched=True)
    assert (sp.batch, sp.m) == (2, 512)
    s = tirx.Var("s", "int64")
    for a_shape, b_shape in (([1, 512, 64], [1, 64, 500]), ([1, 512, 64], [1, 64, s]), ([1, 128, 32], [1, 32, 128]),
                             ([1, 4, 256, 64], [1, 1, 64, 256]), ([2, 512, 64], [1, 64, 512]),
                             ([1, 2, 128, 32], [1, 2, 32, 128])):
        assert _int8_products(_dq_matmul_module(a_shape, b_shape), batched=True) == [], (a_shape, b_shape)


@pytest.mark.parametrize("b_dtype, zp_b, heads", [("int8", 3, None), ("uint8", 131, None), ("int8", 0, None),
                                                 ("int8", 3, 3), ("uint8", 131, 3)])
def test_attention_product_packed_at_run_time_is_the_integer_sum(b_dtype, zp_b, heads):
    """The runtime operand packed in the graph (gemm.pack_weights' layout) and its column sums:
    the kernel computes sum((a - za)(b - zb)) * sa * sb, u8 operands shifted to s8 first; with
    heads, each head's product in one batched call (200 rows: a ragged last row tile each)."""
    _need_vnni_host()
    from tvm import relax

    from blockforge.compile.quant.rewrite import int8_gemm

    lead, m = ([1], 256) if heads is None else ([1, heads], 200)
    mod = _dq_matmul_module([*lead, m, 64], [*lead, 64, 272], b_dtype, zp_b)
    new = int8_gemm("vnni", _host(), batched_products=True)(mod)
    assert [sp.batch for sp in gemm.kernel_specs(new)] == [heads or 1]
    vm = relax.VirtualMachine(tvm.compile(new, target=_host()), tvm.cpu())
    rng = np.random.default_rng(5)
    a = rng.integers(-128, 128, (*lead, m, 64), dtype=np.int8)
    lo, hi = (-128, 128) if b_dtype == "int8" else (0, 256)
    b = rng.integers(lo, hi, (*lead, 64, 272)).astype(b_dtype)
    got = vm["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b)).numpy()
    exact = (a.astype(np.int64) + 2) @ (b.astype(np.int64) - zp_b)
    want = exact.astype(np.float32) * (np.float32(0.03) * np.float32(0.02))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_product_activations_quantized_into_the_instructions_bytes():
    """A product whose A is a per-tensor QuantizeLinear's output (P = quantize(softmax)): that
    quantize writes u8 with its zero point + 128 for VPDPBUSD, no shift pass over the bytes
    (quantize(x, s, zp) + 128 == quantize(x, s, zp + 128) into u8), exactly; batched heads."""
    _need_vnni_host()
    from tvm import relax

    from blockforge.compile.quant.rewrite import int8_gemm

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([1, 3, 200, 64], "float32"))
    b = relax.Var("b", relax.TensorType([1, 3, 64, 256], "int8"))
    with bb.function("main", [x, b]):
        with bb.dataflow():
            q = bb.emit(relax.op.quantize(x, relax.const(0.05, "float32"), relax.const(-2, "int8"), out_dtype="int8"))
            da = bb.emit(relax.op.dequantize(q, relax.const(0.05, "float32"), relax.const(-2, "int8")))
            db = bb.emit(relax.op.dequantize(b, relax.const(0.02, "float32"), relax.const(3, "int8")))
            y = bb.emit_output(relax.op.matmul(da, db))
        bb.emit_func_output(y)
    new = int8_gemm("vnni", _host(), batched_products=True)(bb.get())
    main = new.script().split("def main")[-1]
    (quantize,) = [ln for ln in main.splitlines() if "R.quantize(" in ln]
    assert 'out_dtype="uint8"' in quantize, main  # its zero point -2 + 128 (the numbers below)
    assert not [ln for ln in main.splitlines() if "R.astype(" in ln and '"uint8"' in ln], main  # no shift pass
    vm = relax.VirtualMachine(tvm.compile(new, target=_host()), tvm.cpu())
    rng = np.random.default_rng(6)
    xv = (rng.standard_normal((1, 3, 200, 64)) * 3).astype(np.float32)  # past the range: clipped levels too
    bv = rng.integers(-128, 128, (1, 3, 64, 256), dtype=np.int8)
    got = vm["main"](tvm.runtime.tensor(xv), tvm.runtime.tensor(bv)).numpy()
    levels = np.clip(np.round(xv / np.float32(0.05)) - 2, -128, 127).astype(np.int64)
    exact = (levels + 2) @ (bv.astype(np.int64) - 3)
    np.testing.assert_allclose(got, exact.astype(np.float32) * (np.float32(0.05) * np.float32(0.02)),
                               rtol=1e-6, atol=1e-6)


def test_qdq_mha_attention_products_on_the_int8_kernel(tmp_path, monkeypatch):
    """blockforge's own QDQ MHA at seq 512: Q K^T and P V per head on the int8 kernel (the
    int8-attention ablation leaves them float32), the output ORT's on the file."""
    _need_vnni_host()
    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    from tvm import relax

    from blockforge.compile.pipeline import run_phases
    from blockforge.compile.session import open_model
    from blockforge.graph import MHASpec, export
    from blockforge.graph import ort as ort_runner

    path = export(MHASpec(d_model=64, heads=2), tmp_path / "mha.onnx", quantize="static").model_path
    s = open_model(path, "host", {"batch": 1, "seq": 512})

    def products(without):
        mod, _ = run_phases(s.relax(), s.target, stop_after="int8-gemm", without=without)
        return sorted((sp.k, sp.n) for sp in gemm.kernel_specs(mod) if sp.scale == "scalar" and sp.k != 64)

    assert products(frozenset()) == [(32, 512), (32, 512), (512, 32), (512, 32)]
    assert products(frozenset({"int8-attention"})) == []
    x = {i.name: np.random.default_rng(i.name.__len__()).standard_normal((1, 512, 64)).astype(np.float32)
         for i in s.inputs}
    got = relax.VirtualMachine(s.build().executable, tvm.cpu())["main"](
        *[tvm.runtime.tensor(x[i.name]) for i in s.inputs]).numpy()
    ref = next(iter(ort_runner.run(s.model, x).values()))
    assert np.abs(got - ref).max() <= float(np.abs(ref).max()) / 255


def test_projections_feeding_the_products_stay_on_the_int8_kernel(tmp_path, monkeypatch):
    """A one-head QDQ MHA (no int8-combine split between them): the q and v projections' post
    chains end in the quantize the attention products read ("q"), so all six GEMMs run on the
    int8 kernel; before, the chains took that quantize as a "qdq" step and the two projections
    fell back to TVM's int32 matmul loops. The output is ORT's on the file."""
    _need_vnni_host()
    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    from tvm import relax

    from blockforge.compile.pipeline import run_phases
    from blockforge.compile.session import open_model
    from blockforge.graph import MHASpec, export
    from blockforge.graph import ort as ort_runner

    path = export(MHASpec(d_model=64, heads=1), tmp_path / "mha.onnx", quantize="static").model_path
    s = open_model(path, "host", {"batch": 1, "seq": 256})
    mod, _ = run_phases(s.relax(), s.target, stop_after="int8-gemm")
    main = mod.script().split("def main")[-1]
    assert len(gemm.kernel_specs(mod)) == 6 and main.count("R.call_tir(cls.int8_gemm_") == 6, main
    assert 'out_dtype="int32"' not in main.split("R.call_tir(cls.int8_gemm_")[-1]
    q_v = [sp for sp in gemm.kernel_specs(mod) if (sp.k, sp.n) == (64, 64) and sp.post[-1][0] == "q"]
    assert len(q_v) == 2, [sp.describe() for sp in gemm.kernel_specs(mod)]
    x = {i.name: np.random.default_rng(len(i.name)).standard_normal((1, 256, 64)).astype(np.float32)
         for i in s.inputs}
    got = relax.VirtualMachine(s.build().executable, tvm.cpu())["main"](
        *[tvm.runtime.tensor(x[i.name]) for i in s.inputs]).numpy()
    ref = next(iter(ort_runner.run(s.model, x).values()))
    assert np.abs(got - ref).max() <= float(np.abs(ref).max()) / 255


def test_addend_step_is_each_batch_plus_the_same_rows_exactly():
    """("add",): an (M, N) float32 input added in the epilogue, the same rows for every GEMM of a
    batch (Hugging Face's (1, 1, S, S) mask after a batched Q K^T); here before a requantize,
    so any difference from numpy would show as a level. One addend per kernel."""
    with pytest.raises(ValueError, match="one addend"):
        gemm.Int8GemmSpec(k=64, n=48, scale="scalar", post=(("add",), ("add",)))
    spec = gemm.Int8GemmSpec(k=64, n=48, m=37, scale="scalar", batch=2, post=(("add",), ("q", 0.5, 3, "int8")))
    assert spec.addend and not gemm.Int8GemmSpec(k=64, n=48, scale="scalar").addend
    assert spec.describe().endswith(">add >q(int8)")
    _need_vnni_host()
    lib = tvm.compile(tvm.IRModule({"main": gemm.kernel(spec, epilogue=gemm.epilogue_for(_host()))}), target=_host())
    rng = np.random.default_rng(12)
    a = rng.integers(0, 256, (2, 37, 64), dtype=np.uint8)
    w = rng.integers(-128, 128, (2, 64, 48), dtype=np.int8)
    mask = np.where(rng.random((37, 48)) < 0.3, np.float32(-30), np.float32(0)) + rng.standard_normal((37, 48))
    mask = mask.astype(np.float32)
    args = [a, np.stack([gemm.pack_weights(x) for x in w]), np.stack([gemm.column_sums(x) for x in w]),
            np.array(128, np.int32), np.array(0.004, np.float32), mask]
    out = tvm.runtime.tensor(np.zeros((2, 37, 48), np.int8))
    lib["main"](*[tvm.runtime.tensor(x) for x in args], out)
    one = gemm.Int8GemmSpec(k=64, n=48, m=37, scale="scalar", post=spec.post)
    for i in range(2):
        want = gemm.reference(one, a[i], w[i], 128, scale=np.float32(0.004), reciprocal=True, addend=mask)
        np.testing.assert_array_equal(out.numpy()[i], want, err_msg=f"batch {i}")


def _product_then_add(mask_shape, rows=200):
    """A batched QDQ Q K^T (3 heads) with a float add after it: the mask as an input."""
    from tvm import relax

    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType([1, 3, rows, 64], "int8"))
    b = relax.Var("b", relax.TensorType([1, 3, 64, 256], "int8"))
    mask = relax.Var("mask", relax.TensorType(mask_shape, "float32"))
    with bb.function("main", [a, b, mask]):
        with bb.dataflow():
            da = bb.emit(relax.op.dequantize(a, relax.const(0.03, "float32"), relax.const(-2, "int8")))
            db = bb.emit(relax.op.dequantize(b, relax.const(0.02, "float32"), relax.const(3, "int8")))
            y = bb.emit(relax.op.matmul(da, db))
            z = bb.emit_output(relax.op.add(y, mask))
        bb.emit_func_output(z)
    return bb.get()


@pytest.mark.parametrize("mask_shape, taken", [([1, 1, 200, 256], True), ([200, 256], True),
                                               ([1, 3, 200, 256], False), ([1, 1, 1, 256], False)])
def test_attention_mask_add_is_read_in_the_products_epilogue(mask_shape, taken):
    """A mask of the product's rows and columns, the same for every head ((1, 1, S, S), (S, S)),
    is the kernel's addend (int8-addend); a per-head one or one that broadcasts over rows stays
    an add of its own; the numbers are the product's plus the mask either way."""
    from tvm import relax

    from blockforge.compile.quant.rewrite import int8_gemm

    mod = _product_then_add(mask_shape)
    (sp,) = gemm.kernel_specs(int8_gemm("vnni", ZNVER4, batched_products=True)(mod))
    assert (("add",) in sp.post) == taken, sp.describe()
    (off,) = gemm.kernel_specs(int8_gemm("vnni", ZNVER4, batched_products=True, addends=False)(mod))
    assert ("add",) not in off.post
    _need_vnni_host()
    vm = relax.VirtualMachine(tvm.compile(int8_gemm("vnni", _host(), batched_products=True)(mod), target=_host()),
                              tvm.cpu())
    rng = np.random.default_rng(13)
    av = rng.integers(-128, 128, (1, 3, 200, 64), dtype=np.int8)
    bv = rng.integers(-128, 128, (1, 3, 64, 256), dtype=np.int8)
    mv = (rng.standard_normal(mask_shape) * 5).astype(np.float32)
    got = vm["main"](*[tvm.runtime.tensor(x) for x in (av, bv, mv)]).numpy()
    exact = (av.astype(np.int64) + 2) @ (bv.astype(np.int64) - 3)
    want = exact.astype(np.float32) * (np.float32(0.03) * np.float32(0.02)) + mv
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)


def _gemm_then(tail, n=64):
    """A dynamic-quantized-style int8 GEMM (int32 matmul, cast, column scale) into a QDQ pair and
    `tail`(bb, y): the float ops after it."""
    from tvm import relax

    rng = np.random.default_rng(2)
    w = rng.integers(-128, 128, (32, n)).astype(np.int32)
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType([1, 40, 32], "int8"))
    with bb.function("main", [a]):
        with bb.dataflow():
            a32 = bb.emit(relax.op.astype(a, "int32"))
            y = bb.emit(relax.op.matmul(a32, relax.const(w), out_dtype="int32"))
            f = bb.emit(relax.op.astype(y, "float32"))
            s = bb.emit(relax.op.multiply(f, relax.const(np.full(n, 1e-3, np.float32))))
            q = bb.emit(relax.op.quantize(s, relax.const(0.02, "float32"), relax.const(0, "int8"), out_dtype="int8"))
            dq = bb.emit(relax.op.dequantize(q, relax.const(0.02, "float32"), relax.const(0, "int8")))
            out = bb.emit_output(tail(bb, dq))
        bb.emit_func_output(out)
    return bb.get()


def _gelu_spelled(order, c=math.sqrt(2)):
    from tvm import relax

    def tail(bb, x):
        f = lambda v: relax.const(v, "float32")  # noqa: E731
        scaled = relax.op.divide(x, f(c)) if order != "mul-scale" else relax.op.multiply(x, f(1 / c))
        e = bb.emit(relax.op.add(bb.emit(relax.op.erf(bb.emit(scaled))), f(1.0)))
        if order == "hf":  # 0.5 * (1 + erf), then x * that (Hugging Face BERT)
            return relax.op.multiply(x, bb.emit(relax.op.multiply(f(0.5), e)))
        if order == "half-first":  # (x * 0.5) * (1 + erf)
            return relax.op.multiply(bb.emit(relax.op.multiply(x, f(0.5))), e)
        return relax.op.multiply(bb.emit(relax.op.multiply(x, e)), f(0.5))  # x * (1 + erf), then * 0.5
    return tail


@pytest.mark.parametrize("order", ["hf", "half-first", "half-last", "mul-scale"])
def test_gelu_spelled_out_in_ops_is_the_epilogues_gelu(order):
    """x * 0.5 * (1 + erf(x / sqrt 2)) in the orders exporters write it is one ("gelu",) post
    step (int8-gelu-ops), and the module computes gelu; erf(x / 2) is not gelu: left alone."""
    from scipy.special import erf
    from tvm import relax

    from blockforge.compile.quant.rewrite import int8_gemm

    mod = _gemm_then(_gelu_spelled(order))
    (sp,) = gemm.kernel_specs(int8_gemm("vnni", ZNVER4)(mod))
    assert sp.post[-1] == ("gelu",), sp.describe()
    (off,) = gemm.kernel_specs(int8_gemm("vnni", ZNVER4, gelu_ops=False)(mod))
    assert ("gelu",) not in off.post
    (other,) = gemm.kernel_specs(int8_gemm("vnni", ZNVER4)(_gemm_then(_gelu_spelled(order, c=2.0))))
    assert ("gelu",) not in other.post
    _need_vnni_host()
    rng = np.random.default_rng(3)
    av = rng.integers(-128, 128, (1, 40, 32), dtype=np.int8)
    new = int8_gemm("vnni", _host(), epilogue=gemm.epilogue_for(_host()))(mod)
    got = relax.VirtualMachine(tvm.compile(new, target=_host()), tvm.cpu())["main"](tvm.runtime.tensor(av)).numpy()
    w = np.random.default_rng(2).integers(-128, 128, (32, 64)).astype(np.int64)
    v = (av.astype(np.int64) @ w).astype(np.float32) * np.float32(1e-3)
    x = np.clip(np.round(v * gemm.reciprocal_scale(0.02)), -128, 127).astype(np.float32) * np.float32(0.02)
    np.testing.assert_allclose(got, 0.5 * x * (1 + erf(x / np.sqrt(2))), rtol=0, atol=2e-6)


def test_hugging_face_qdq_bert_gelu_and_residuals_in_the_epilogues(tmp_path, monkeypatch):
    """Hugging Face's BERT (dynamo SDPA export) quantized static by `blockforge quantize`: the
    gelu it spells out in ops after the FFN's first GEMM and the residual adds after the output
    projections are steps of those kernels' epilogues (the ablations leave them out), and the
    build matches ONNX Runtime on the file."""
    _need_vnni_host()
    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    from conftest import run_cli_in_process as cli

    from blockforge.compile.pipeline import run_phases
    from blockforge.compile.session import open_model

    q = tmp_path / "bert_qdq.onnx"
    fixture = Path(__file__).parent / "fixtures" / "models" / "bert_sdpa_dynamo_op18.onnx"
    res = cli("quantize", str(fixture), "--mode", "static", "--per-channel", "--shape", "s33=1,s50=64,s6=1",
              "-o", str(q))
    assert res.rc == 0, res.text
    s = open_model(q, "host", {"s33": 1, "s50": 64, "s6": 1})
    posts = {}
    for without in (frozenset(), frozenset({"int8-gelu-ops", "int8-addend"})):
        mod, _ = run_phases(s.relax(), s.target, stop_after="int8-gemm", without=without)
        posts[bool(without)] = [sp.post for sp in gemm.kernel_specs(mod)]
    steps = lambda kind, w: sum((kind,) in p for p in posts[w])  # noqa: E731
    assert steps("gelu", False) == 2 and steps("add", False) == 4, posts[False]  # 2 layers
    assert steps("gelu", True) == 0 and steps("add", True) == 0, posts[True]
    res = cli("verify", str(q), "--shape", "s33=1,s50=64,s6=1", "--target", "host")
    assert res.rc == 0 and "tvm vs ort" in res.out and "PASS" in res.out, res.text
