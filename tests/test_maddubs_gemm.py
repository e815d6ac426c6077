"""The int8 GEMM on x86 without VNNI (compile/quant/isa.py "avx2", "avx512bw": VPMADDUBSW +
VPMADDWD + VPADDD; their exact fallbacks "avx2-wd", "avx512bw-wd": VPMADDWD on int16), QDQ Gemm
nodes on the int8 kernel (compile/quant/qdq.py), and float32 GEMMs where a CPU has no int8
instruction (compile/quant/as_float.py).

VPMADDUBSW adds each pair of u8 x s8 products into int16 with saturation, so that kernel is
exact only for weights whose pairs along K have |w0| + |w1| <= 128: the phase checks the
constant weights and gives any matrix that could saturate the VPMADDWD kernel. Tested here: the
instruction each target gets, the inner loop's assembly on fixed targets, exact int32 at the
bound (u8 255 against pairs summing to 128 in magnitude) and for any weights on the fallback,
the choice one past the bound, and quantized FFNs (7-bit weights: `quantize --reduce-range`,
and full-range) against ONNX Runtime on the same file."""

from __future__ import annotations

import re

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from blockforge.compile.quant import gemm  # noqa: E402
from blockforge.compile.quant.isa import ISAS, for_target  # noqa: E402
from blockforge.targets import resolve  # noqa: E402

from conftest import assert_user_error, run_cli_in_process  # noqa: E402

PRESETS = {"avx2": "x86-64-avx2", "avx512bw": "x86-64-avx512"}


def _x86(mcpu: str, **kw):
    return tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": mcpu, **kw})


def _need(preset: str):
    why = resolve(preset).run_problem()
    if why:
        pytest.skip(f"{preset} cannot run here: {why}")


def test_instruction_follows_the_target():
    isa = lambda t: getattr(for_target(t), "name", None)  # noqa: E731
    assert isa(_x86("haswell")) == "avx2" and isa(_x86("znver3")) == "avx2"  # Zen 1-3: no VNNI
    assert isa(_x86("skylake-avx512")) == "avx512bw"  # Skylake-SP
    assert isa(_x86("cascadelake")) == "vnni" and isa(_x86("znver4")) == "vnni"  # VNNI first
    assert isa(_x86("alderlake")) == "avxvnni"
    assert isa(_x86("x86-64")) is None  # SSE2: no int8 instruction, the phase stays off
    assert [isa(resolve(p).tvm_target()) for p in PRESETS.values()] == list(PRESETS)


@pytest.mark.parametrize("w0,w1,exact", [(64, 64, True), (-64, -64, True), (-128, 0, True), (127, 1, True),
                                         (127, 2, False), (-128, -1, False), (65, -64, False)])
def test_exact_for_reads_pairs_along_k(w0, w1, exact):
    """|w0| + |w1| <= 128 for rows 2i, 2i+1 of every column; VNNI (no int16 stage) takes anything."""
    w = np.zeros((8, 32), np.int8)
    w[4, 17], w[5, 17] = w0, w1
    assert ISAS["avx2"].exact_for(w) is exact and ISAS["avx512bw"].exact_for(w) is exact
    assert ISAS["vnni"].exact_for(w)
    # the same values in rows of different pairs (3 and 4) never meet in one VPMADDUBSW
    w[4, 17], w[5, 17], w[3, 17] = w1, 0, w0
    assert ISAS["avx2"].exact_for(w)


def _inner_loop(asm: str) -> list[str]:
    """The instructions of the loop that holds the VPMADDUBSWs (label to its back branch)."""
    for label, body in re.findall(r"\n(\.LBB\d+_\d+):\n((?:(?!\n\.LBB).)*?\bj\w+\t\1)", asm, re.S):
        ins = [ln.strip() for ln in body.split("\n") if ln.startswith("\t") and not ln.startswith("\t.")]
        if any(i.startswith("vpmaddubsw") for i in ins):
            return ins
    raise AssertionError("no loop with vpmaddubsw in the assembly")


@pytest.mark.parametrize("name", ["avx2", "avx512bw"])
def test_kernel_assembly(name):
    """One k-group of the micro-tile: MR rows x 16 / lanes VPMADDUBSW + VPMADDWD pairs, every
    accumulator in a register (no stack access in the loop), no VPDPBUSD, and on AVX2 no zmm."""
    isa = ISAS[name]
    spec = gemm.Int8GemmSpec(k=256, n=16 * 3 * isa.nv, m=200, isa=name, scale="scalar", bias=True)
    assert gemm.default_tiles(spec) == gemm.GemmTiles(isa.mr, isa.nv, "tiles")
    asm = tvm.compile(tvm.IRModule({"main": gemm.kernel(spec)}), target=resolve(PRESETS[name]).tvm_target()) \
        .mod.inspect_source("asm")
    loop = _inner_loop(asm)
    per_group = isa.mr * isa.nv * 16 // isa.lanes
    assert sum(i.startswith("vpmaddubsw") for i in loop) == per_group, loop
    assert sum(i.startswith("vpmaddwd") for i in loop) == per_group, loop
    assert not [i for i in loop if "(%rsp)" in i], f"accumulators spilled: {loop}"
    assert "vpdpbusd" not in asm
    if name == "avx2":
        assert not re.search(r"%zmm\d", asm), "a zmm register in AVX2 code"


def _bounded_weights(rng, k: int, n: int) -> np.ndarray:
    """Random 7-bit weights, and columns at the bound: pairs (-128, 0), (64, 64), (-64, -64), (127, 1)."""
    w = rng.integers(-64, 64, (k, n), dtype=np.int8)
    for col, (w0, w1) in enumerate([(-128, 0), (64, 64), (-64, -64), (127, 1)]):
        w[0::2, col], w[1::2, col] = w0, w1
    assert ISAS["avx2"].exact_for(w)
    return w


@pytest.mark.parametrize("name", ["avx2", "avx512bw"])
@pytest.mark.parametrize("m", [13, None])
def test_exact_int32_at_the_bound(name, m):
    """Static M with a ragged last tile, and symbolic M at and past one tile; activations at 255
    (each pair of products at +-32640, the int16 stage's largest exact sums)."""
    _need(PRESETS[name])
    rng = np.random.default_rng(5)
    spec = gemm.Int8GemmSpec(k=96, n=64 * ISAS[name].nv, m=m, isa=name)
    w = _bounded_weights(rng, 96, spec.n)
    lib = tvm.compile(tvm.IRModule({"main": gemm.kernel(spec)}), target=resolve(PRESETS[name]).tvm_target())
    for rows in ([m] if m else [1, ISAS[name].mr, ISAS[name].mr + 1, 20]):
        a = rng.integers(0, 256, (rows, 96), dtype=np.uint8)
        a[0] = 255
        out = tvm.runtime.tensor(np.zeros((rows, spec.n), np.int32))
        lib["main"](*[tvm.runtime.tensor(x) for x in (a, gemm.pack_weights(w), gemm.column_sums(w),
                                                       np.array(131, np.int32))], out)
        np.testing.assert_array_equal(out.numpy(), gemm.reference(spec, a, w, 131), err_msg=f"M={rows}")


@pytest.mark.parametrize("name", ["avx512bw", "avx512bw-wd"])
def test_avx512bw_tiles_tune_searches_fit_the_registers_and_are_exact(name):
    """tune times the zmm rows' micro-tiles as VNNI's (gemm.tile_candidates), 3 registers fewer
    (the ones vector, two temporaries); the ymm rows keep their one tile. Every candidate gives
    the default's int32 sums, a ragged static M and a symbolic one."""
    for m in (40, None):
        cands = gemm.tile_candidates(gemm.Int8GemmSpec(k=96, n=96, m=m, isa=name))
        assert len(cands) > 4 and all(t.mr * t.nv + t.nv + 4 <= gemm.ZMM for t in cands[1:])
    assert len(gemm.tile_candidates(gemm.Int8GemmSpec(k=96, n=96, m=40, isa="avx2"))) == 1
    _need("x86-64-avx512")
    rng = np.random.default_rng(7)
    w = _bounded_weights(rng, 96, 96) if name == "avx512bw" else rng.integers(-128, 128, (96, 96), dtype=np.int8)
    target = resolve("x86-64-avx512").tvm_target()
    for spec, rows in ((gemm.Int8GemmSpec(k=96, n=96, m=40, isa=name), (40,)),
                       (gemm.Int8GemmSpec(k=96, n=96, isa=name), (1, 13))):
        for t in gemm.tile_candidates(spec):
            lib = tvm.compile(tvm.IRModule({"main": gemm.kernel(spec, t)}), target=target)
            for m in rows:
                a = rng.integers(0, 256, (m, 96), dtype=np.uint8)
                wide = name.endswith("-wd")  # VPMADDWD: both operands int16, K in pairs
                ins = (a.astype(np.int16), gemm.pack_weights(w.astype(np.int16), 2)) if wide else (a, gemm.pack_weights(w))
                out = tvm.runtime.tensor(np.zeros((m, 96), np.int32))
                lib["main"](*[tvm.runtime.tensor(x) for x in (*ins, gemm.column_sums(w), np.array(131, np.int32))], out)
                np.testing.assert_array_equal(out.numpy(), gemm.reference(spec, a, w, 131),
                                              err_msg=f"{t.describe()} M={m}")


def _ffn(tmp_path, mode: str, reduce_range: bool, seq: int | None = None):
    """A small FFN quantized by `blockforge quantize` (transformer-safe defaults)."""
    pytest.importorskip("onnxruntime.quantization")
    from blockforge.graph import FFNSpec, export
    from blockforge.graph.quantize import QuantizeOptions, quantize

    fp32 = export(FFNSpec(d_model=64, d_ff=128, seq=seq, batch=1 if seq else None), tmp_path / "ffn.onnx").model_path
    out = tmp_path / f"ffn_{mode}{'_7' if reduce_range else ''}.onnx"
    quantize(QuantizeOptions(model=fp32, output=out, mode=mode, per_channel=mode == "static",
                             reduce_range=reduce_range, shape=None if seq else {"batch": 1, "seq": 16}))
    return out


@pytest.mark.parametrize("name", ["avx2", "avx512bw"])
@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_reduce_range_ffn_on_the_kernel_matches_ort(tmp_path, monkeypatch, name, mode):
    """7-bit weights: both GEMMs on the VPMADDUBSW kernel, within one quantization step of ORT
    on the same file, for a symbolic and a static seq (quant_pre_process makes the static
    one's MatMul + Add a Gemm)."""
    _need(PRESETS[name])
    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    from tvm import relax

    from blockforge.compile.pipeline import run_phases
    from blockforge.compile.session import open_model
    from blockforge.graph import ort as ort_runner

    for seq in (None, 16):
        d = tmp_path / f"seq{seq}"
        d.mkdir()
        model = _ffn(d, mode, reduce_range=True, seq=seq)
        s = open_model(model, PRESETS[name], {"batch": 1, "seq": 16} if seq is None else {})
        mod, _ = run_phases(s.relax(), s.target, stop_after="int8-gemm")
        assert [sp.isa for sp in gemm.kernel_specs(mod)] == [name, name], (seq, gemm.kernel_specs(mod))
        res = s.build()
        assert not res.notes, res.notes
        vm = relax.VirtualMachine(res.executable, tvm.cpu())
        x = np.random.default_rng(1).standard_normal((1, 16, 64)).astype(np.float32)
        got = vm["main"](tvm.runtime.tensor(x)).numpy()
        ref = next(iter(ort_runner.run(s.model, {"x": x}).values()))
        step = float(np.abs(ref).max()) / 127
        assert np.abs(got - ref).max() <= step, (seq, np.abs(got - ref).max(), step)


@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_full_range_weights_take_the_exact_kernel(tmp_path, monkeypatch, mode):
    """Full-range weights (ORT's default) have pairs over the bound: the GEMMs take the exact
    VPMADDWD fallback ("avx2-wd"), never the saturating kernel, and match ORT."""
    _need("x86-64-avx2")
    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    from tvm import relax

    from blockforge.compile.pipeline import run_phases
    from blockforge.compile.session import open_model
    from blockforge.graph import ort as ort_runner

    model = _ffn(tmp_path, mode, reduce_range=False)
    s = open_model(model, "x86-64-avx2", {"batch": 1, "seq": 16})
    mod, _ = run_phases(s.relax(), s.target, stop_after="int8-gemm")
    assert [sp.isa for sp in gemm.kernel_specs(mod)] == ["avx2-wd", "avx2-wd"]
    res = s.build()
    assert not res.notes, res.notes
    x = np.random.default_rng(2).standard_normal((1, 16, 64)).astype(np.float32)
    got = relax.VirtualMachine(res.executable, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    ref = next(iter(ort_runner.run(s.model, {"x": x}).values()))
    assert np.abs(got - ref).max() <= float(np.abs(ref).max()) / 127


@pytest.mark.parametrize("name", ["avx2-wd", "avx512bw-wd"])
@pytest.mark.parametrize("m", [13, None])
def test_exact_fallback_int32_any_weights(name, m):
    """The VPMADDWD rows on the 8-bit extremes (u8 255 against -128 and 127 columns), K only
    whole pairs (98: not whole 4-byte groups), static and symbolic M."""
    preset = PRESETS[name.split("-")[0]]
    _need(preset)
    isa = ISAS[name]
    assert isa.pair_bound is None and isa.kgroup == 2 and isa.act_dtype == isa.w_dtype == "int16"
    rng = np.random.default_rng(9)
    spec = gemm.Int8GemmSpec(k=98, n=16 * 3 * isa.nv, m=m, isa=name)
    w = rng.integers(-128, 128, (98, spec.n), dtype=np.int8)
    w[:, 0], w[:, 1] = -128, 127
    lib = tvm.compile(tvm.IRModule({"main": gemm.kernel(spec)}), target=resolve(preset).tvm_target())
    for rows in ([m] if m else [1, isa.mr, isa.mr + 1, 20]):
        a = rng.integers(0, 256, (rows, 98), dtype=np.uint8)
        a[0] = 255
        out = tvm.runtime.tensor(np.zeros((rows, spec.n), np.int32))
        lib["main"](*[tvm.runtime.tensor(x) for x in (a.astype(np.int16), gemm.pack_weights(w.astype(np.int16), 2),
                                                       gemm.column_sums(w), np.array(131, np.int32))], out)
        np.testing.assert_array_equal(out.numpy(), gemm.reference(spec, a, w, 131), err_msg=f"M={rows}")


def test_saturating_weights_take_the_fallback():
    """The phase's choice per GEMM: VPMADDUBSW for pair-bounded weights, VPMADDWD otherwise and
    for a B known only at run time, and for K in whole pairs but not whole 4-byte groups."""
    from blockforge.compile.quant.rewrite import _Finder

    f = _Finder.__new__(_Finder)
    f.isa = "avx2"
    bounded = np.full((8, 16), 64, np.int8)
    assert f.isa_for(8, 16, bounded) == "avx2"
    assert f.isa_for(8, 16, np.full((8, 16), 65, np.int8)) == "avx2-wd"
    assert f.isa_for(8, 16, None) == "avx2-wd"  # runtime weights
    assert f.isa_for(6, 16, bounded[:6]) == "avx2-wd"  # K % 4
    assert f.isa_for(7, 16, bounded[:7]) is None  # K odd: neither
    f.isa = "vnni"
    assert f.isa_for(8, 16, np.full((8, 16), 127, np.int8)) == "vnni" and f.isa_for(8, 16, None) == "vnni"


@pytest.mark.parametrize("target", ['{"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "x86-64"}', "aarch64-linux"])
def test_no_int8_instruction_computes_in_float_with_a_note(tmp_path, monkeypatch, target):
    """SSE2-only x86 and aarch64 without +dotprod have no int8 instruction: a dynamic model's
    MatMulIntegers become float32 GEMMs (compile/quant/as_float.py; an int32 matmul before),
    matching ORT where this machine runs the code, said in one note."""
    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    from tvm import relax

    from blockforge.compile.pipeline import has_int8_matmul
    from blockforge.compile.session import open_model
    from blockforge.graph import ort as ort_runner

    if why := resolve(target).build_problem():
        pytest.skip(f"{target} does not build here: {why}")
    model = _ffn(tmp_path, "dynamic", reduce_range=False)
    s = open_model(model, target, {"batch": 1, "seq": 16})
    assert not has_int8_matmul(s.relax())
    res = s.build()
    assert len(res.notes) == 1 and res.notes[0].startswith("2 int8 matmul(s) (128x64, 64x128, K x N) run as "
                                                           "float32 GEMMs"), res.notes
    assert s.relax(int8=False) is not s.relax() and has_int8_matmul(s.relax(int8=False))  # the ablation's import
    if resolve(target).run_problem():
        return
    x = np.random.default_rng(4).standard_normal((1, 16, 64)).astype(np.float32)
    got = relax.VirtualMachine(res.executable, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    ref = next(iter(ort_runner.run(s.model, {"x": x}).values()))
    assert np.abs(got - ref).max() <= float(np.abs(ref).max()) / 127


def _qdq_gemm_model(path, trans_b: bool, per_channel: bool):
    """x (8, 32) -> QDQ -> Gemm(DQ(x), DQ(W), DQ(bias)) [transB] -> y (8, 48), written by hand as
    ORT's QDQ quantizer writes a Gemm (int32 bias at s_x * s_w, weights' axis N's)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(11)
    k, n = 32, 48
    w = rng.integers(-127, 128, (k, n), dtype=np.int8)
    sw = (rng.uniform(0.5, 2.0, n) if per_channel else np.array(1.3)).astype(np.float32) * np.float32(0.01)
    sx = np.array(0.02, np.float32)
    bias = rng.integers(-2000, 2000, n).astype(np.int32)
    inits = [numpy_helper.from_array(np.ascontiguousarray(w.T) if trans_b else w, "w_q"),
             numpy_helper.from_array(sw, "w_s"), numpy_helper.from_array(np.zeros(sw.shape, np.int8), "w_z"),
             numpy_helper.from_array(sx, "x_s"), numpy_helper.from_array(np.array(3, np.int8), "x_z"),
             numpy_helper.from_array(bias, "b_q"), numpy_helper.from_array((sx * sw * np.ones(n)).astype(np.float32), "b_s"),
             numpy_helper.from_array(np.zeros(n, np.int32), "b_z")]
    axis = (0 if trans_b else 1) if per_channel else 1
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_s", "x_z"], ["x_q"]),
             helper.make_node("DequantizeLinear", ["x_q", "x_s", "x_z"], ["x_dq"]),
             helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["w_dq"], axis=axis),
             helper.make_node("DequantizeLinear", ["b_q", "b_s", "b_z"], ["b_dq"], axis=0),
             helper.make_node("Gemm", ["x_dq", "w_dq", "b_dq"], ["y"], transB=int(trans_b))]
    g = helper.make_graph(nodes, "qdq_gemm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, n])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    onnx.save(m, str(path))
    return path


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("per_channel", [False, True])
def test_qdq_gemm_on_the_int8_kernel(tmp_path, monkeypatch, trans_b, per_channel):
    """A QDQ Gemm (what quant_pre_process + quantize_static make of a static-shape MatMul + Add)
    is rewritten to MatMulInteger + scale + bias, so it reaches the int8 kernel (it ran as
    dequantize + fp32 before: the static-shape BERT-base FFN 2.61 ms, 1.25-1.35 ms now on Zen 5)."""
    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    import onnx

    from blockforge.compile.quant.qdq import qdq_matmuls_as_integer

    model = _qdq_gemm_model(tmp_path / "g.onnx", trans_b, per_channel)
    out, count = qdq_matmuls_as_integer(onnx.load(str(model)))
    assert count == 1 and [n.op_type for n in out.graph.node if n.op_type in ("Gemm", "MatMulInteger", "Add")] == \
        ["MatMulInteger", "Add"]
    # alpha != 1 or transA: not a plain Gemm, left as written
    m = onnx.load(str(model))
    gemm_node = next(n for n in m.graph.node if n.op_type == "Gemm")
    gemm_node.attribute.append(onnx.helper.make_attribute("alpha", 0.5))
    assert qdq_matmuls_as_integer(m)[1] == 0

    from tvm import relax

    from blockforge.compile.pipeline import run_phases
    from blockforge.compile.session import open_model
    from blockforge.graph import ort as ort_runner

    for target in [t for t in ("host", "x86-64-avx2") if resolve(t).run_problem() is None]:
        s = open_model(model, target)
        isa = for_target(s.target.tvm_target())
        if isa is None:
            continue
        mod, _ = run_phases(s.relax(), s.target, stop_after="int8-gemm")
        x = np.random.default_rng(3).standard_normal((8, 32)).astype(np.float32)
        ref = ort_runner.run(s.model, {"x": x})["y"]
        # full-range weights: on VNNI, or VPMADDUBSW's exact fallback
        assert [sp.isa for sp in gemm.kernel_specs(mod)] == [isa.fallback if isa.pair_bound else isa.name], target
        got = relax.VirtualMachine(s.build().executable, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
        assert np.abs(got - ref).max() <= float(np.abs(ref).max()) / 127, target


def test_cli_reduce_range(workdir):
    """`quantize --reduce-range` writes 7-bit weights and records it; `export --reduce-range`
    without --quantize is one line and exit 2; compile says when int8 matmuls run in float32."""
    pytest.importorskip("onnxruntime.quantization")
    import json

    import onnx
    from onnx import numpy_helper

    r = run_cli_in_process("export", "ffn", "--d-model", "64", "--reduce-range", "-o", workdir / "f.onnx")
    assert_user_error(r, "--reduce-range needs --quantize")
    r = run_cli_in_process("export", "ffn", "--d-model", "64", "--batch", "1", "--seq", "16", "-o", workdir / "f.onnx")
    assert r.rc == 0, r.err
    r = run_cli_in_process("quantize", workdir / "f.onnx", "--mode", "dynamic", "--reduce-range", "-o", workdir / "q7.onnx")
    assert r.rc == 0, r.err
    m = onnx.load(str(workdir / "q7.onnx"))
    ws = [numpy_helper.to_array(t) for t in m.graph.initializer if t.name.endswith("weight_quantized")]
    assert len(ws) == 2 and all(-64 <= int(w.min()) and int(w.max()) <= 64 for w in ws)
    meta = {p.key: p.value for p in m.metadata_props}
    assert json.loads(meta["blockforge.quantization"])["reduce_range"] is True
    sse2 = '{"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "x86-64"}'
    r = run_cli_in_process("compile", workdir / "q7.onnx", "--target", sse2, "-o", workdir / "a8")
    assert r.rc == 0 and "warning: 2 int8 matmul(s)" in r.err and "run as float32 GEMMs" in r.err, r.err
    assert "no int8 dot-product instruction" in json.loads((workdir / "a8" / "manifest.json").read_text())["notes"][0]
    if resolve("x86-64-avx2").run_problem() is None:
        r = run_cli_in_process("compile", workdir / "q7.onnx", "--target", "x86-64-avx2", "-o", workdir / "a7")
        assert r.rc == 0 and "warning" not in r.err, r.err
        assert "notes" not in json.loads((workdir / "a7" / "manifest.json").read_text())


def test_qdq_attention_products_take_the_exact_kernel(tmp_path, monkeypatch):
    """A QDQ MHA's Q K^T and P V have their B at run time, so no weight check can clear them for
    VPMADDUBSW: they run on VPMADDWD with B widened to int16 as it is packed, within one output
    step of ORT (and equal to the VNNI build's output where this CPU has VNNI)."""
    _need("x86-64-avx2")
    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    from tvm import relax

    from blockforge.compile.pipeline import run_phases
    from blockforge.compile.session import open_model
    from blockforge.graph import ort as ort_runner
    from blockforge.graph.model_io import random_inputs

    q = tmp_path / "mha.onnx"
    r = run_cli_in_process("export", "mha", "--d-model", "128", "--heads", "2", "--batch", "1", "--seq", "256",
                           "--quantize", "static", "-o", q)
    assert r.rc == 0, r.err
    outs = {}
    for target in ("x86-64-avx2", "host"):
        s = open_model(q, target)
        mod, _ = run_phases(s.relax(), s.target, stop_after="int8-gemm")
        specs = gemm.kernel_specs(mod)
        products = [sp for sp in specs if sp.k in (64, 256) and sp.n in (64, 256) and sp.rowcorr]
        if target == "x86-64-avx2":
            assert len(products) == 4 and {sp.isa for sp in specs} == {"avx2-wd"}, [sp.describe() for sp in specs]
        elif for_target(s.target.tvm_target()) is None or for_target(s.target.tvm_target()).pair_bound:
            break
        ins = random_inputs(s.inputs, {}, seed=0)
        got = relax.VirtualMachine(s.build().executable, tvm.cpu())["main"](*[tvm.runtime.tensor(ins[i.name])
                                                                             for i in s.inputs])
        outs[target] = got.numpy()
        ref = next(iter(ort_runner.run(s.model, ins).values()))
        assert np.abs(outs[target] - ref).max() <= float(np.abs(ref).max()) / 127, target
    if "host" in outs:
        np.testing.assert_array_equal(outs["x86-64-avx2"], outs["host"])
