"""The int8-combine phase (compile/quant/combine.py): parallel int8 projections of one quantized
activation as one GEMM and a split. On hand-built Relax (what TVM imports for MatMulInteger +
Cast + scale + bias): exact against the parts, refused where the weights do not share one int8
range; end to end on ORT's quantize_dynamic of the seeds' per-head MHA and encoder block: one
GEMM per role, one multi-head attention call, and the same numbers as without the phase."""

from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from blockforge.compile.quant.intrin import has_vnni  # noqa: E402

ZNVER4 = '{"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "znver4", "num-cores": 2}'


def _parts_module(ws: list[np.ndarray], zps: list[int], seq, bias=True, concat=True, interleaved=False):
    """y_i = (astype(x, int32) - zp_x) @ (W_i - zp_i), z_i = astype(y_i, f32) * (s_x * s_i) + b_i,
    each part its own activation expression, as TVM's importer writes them; returned concatenated
    in reverse order through a matmul each (as the heads' concat of P V, the order the combined
    columns must follow), or as a tuple (concat False: no heads' concat to order them by).
    interleaved: each part's activations, matmul and epilogue bound before the next part's (the
    last part's activations then come after the first part's output)."""
    from tvm import relax

    rng = np.random.default_rng(0)
    k = ws[0].shape[0]
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([1, seq, k], "uint8"))
    zp = relax.Var("zp", relax.TensorType([], "uint8"))
    sx = relax.Var("sx", relax.TensorType([], "float32"))
    with bb.function("main", [x, zp, sx]):
        with bb.dataflow():
            def project(w, z):
                a32 = bb.emit(relax.op.subtract(relax.op.astype(x, "int32"), relax.op.astype(zp, "int32")))
                w32 = bb.emit(relax.op.subtract(relax.const(w.astype(np.int32)),
                                                relax.op.astype(relax.const(z, "int32"), "int32")))
                return bb.emit(relax.op.matmul(a32, w32, out_dtype="int32"))

            def epilogue(i, y, w):
                c = bb.emit(relax.op.astype(y, "float32"))
                s = bb.emit(relax.op.multiply(sx, relax.const(np.float32(0.01 * (i + 1)))))
                z = bb.emit(relax.op.multiply(c, s))
                if bias:
                    z = bb.emit(relax.op.add(z, relax.const(rng.standard_normal(w.shape[1]).astype(np.float32))))
                return z

            if interleaved:
                outs = [epilogue(i, project(w, z), w) for i, (w, z) in enumerate(zip(ws, zps))]
            else:  # every matmul, then the epilogues, as TVM's importer binds them
                ys = [project(w, z) for w, z in zip(ws, zps)]
                outs = [epilogue(i, y, w) for i, (y, w) in enumerate(zip(ys, ws))]
            if concat:  # as heads: each part through a matmul (here by the identity: exact) into the concat
                outs = [bb.emit(relax.op.matmul(z, relax.const(np.eye(w.shape[1], dtype=np.float32))))
                        for z, w in zip(outs, ws)]
            out = bb.emit_output(relax.op.concat(outs[::-1], axis=-1) if concat else relax.Tuple(outs))
        bb.emit_func_output(out)
    return bb.get()


def _run(mod, seq, seed=0):
    from tvm import relax

    from blockforge.targets import resolve

    vm = relax.VirtualMachine(tvm.compile(mod, target=resolve("host").tvm_target()), tvm.cpu())
    rng = np.random.default_rng(seed)
    k = int(mod["main"].params[0].ty.shape[-1])
    args = [rng.integers(0, 256, (1, seq, k)).astype(np.uint8), np.array(131, np.uint8), np.array(0.02, np.float32)]
    out = vm["main"](*[tvm.runtime.tensor(a) for a in args])
    return [o.numpy() for o in out] if isinstance(out, (list, tuple)) or not hasattr(out, "numpy") else [out.numpy()]


def _matmuls(mod) -> int:
    """The int32 matmuls (the parts' projections; not the float identity matmuls after them)."""
    return mod["main"].script().count('out_dtype="int32")')


@pytest.mark.parametrize("bias, interleaved", [(True, False), (False, False), (True, True)])
def test_parts_become_one_gemm_and_a_split_with_the_same_numbers(bias, interleaved):
    """Three projections (n = 16, 16, 32) of one activation, concatenated in reverse: one matmul
    whose columns follow the concat, a split at 32 and 48, the output bit for bit what it was (the
    same integer sums, scales and biases)."""
    from blockforge.compile.quant.combine import int8_combine

    rng = np.random.default_rng(1)
    ws = [rng.integers(-128, 128, (32, n)).astype(np.int8) for n in (16, 16, 32)]
    mod = _parts_module(ws, [0, 0, 0], tvm.tirx.Var("seq", "int64"), bias=bias, interleaved=interleaved)
    new = int8_combine()(mod)
    assert _matmuls(mod) == 3 and _matmuls(new) == 1
    assert "R.split(" in new["main"].script()
    for seq in (1, 7):
        for got, want in zip(_run(new, seq), _run(mod, seq)):
            np.testing.assert_array_equal(got, want)


def test_weights_without_one_int8_range_stay_apart():
    """W_1 - zp in [0, 255] and W_2 - zp in [-255, 0]: as one matrix they span 511 values, which no
    int8 operand holds (the int8-gemm phase would then leave the combined matmul as int32 loops
    where each part alone takes the kernel): the module is left as it was."""
    from blockforge.compile.quant.combine import int8_combine

    rng = np.random.default_rng(2)
    w1 = rng.integers(0, 256, (32, 16)).astype(np.int32)
    w2 = rng.integers(0, 256, (32, 16)).astype(np.int32)
    mod = _parts_module([w1, w2], [0, 255], 8)
    tvm.ir.assert_structural_equal(int8_combine()(mod), mod)


def test_parts_without_a_heads_concat_stay_apart():
    """Projections of one activation whose results no concat gathers (a Hugging Face model's
    q/k/v, heads split by reshapes): left as they were (their split would cost, nothing gained)."""
    from blockforge.compile.quant.combine import int8_combine

    ws = [np.random.default_rng(5).integers(-128, 128, (32, 16)).astype(np.int8) for _ in range(3)]
    mod = _parts_module(ws, [0, 0, 0], 8, concat=False)
    tvm.ir.assert_structural_equal(int8_combine()(mod), mod)


def test_one_projection_and_float_matmuls_are_left_alone():
    from tvm import relax

    from blockforge.compile.quant.combine import int8_combine

    w = np.random.default_rng(3).integers(-128, 128, (32, 16)).astype(np.int8)
    mod = _parts_module([w], [0], 8)
    tvm.ir.assert_structural_equal(int8_combine()(mod), mod)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([1, 8, 32], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            a = bb.emit(relax.op.matmul(x, relax.const(np.ones((32, 16), np.float32))))
            b = bb.emit(relax.op.matmul(x, relax.const(np.ones((32, 16), np.float32))))
            out = bb.emit_output(relax.Tuple([a, b]))
        bb.emit_func_output(out)
    mod = bb.get()
    tvm.ir.assert_structural_equal(int8_combine()(mod), mod)


def test_phase_before_fuse_attention_on_int8_targets_and_ablatable():
    from blockforge.compile.pipeline import ABLATIONS, phases
    from blockforge.targets import resolve

    names = lambda int8=True, **kw: [p.name for p in phases(resolve(ZNVER4), int8=int8, **kw)]  # noqa: E731
    ps = names()
    assert ps.index("int8-combine") < ps.index("fuse-attention") < ps.index("int8-gemm")
    assert "int8-combine" not in names(int8=False)  # float models: their phase list as it was
    assert "int8-combine" not in names(without={"int8-combine"}) and "int8-gemm" in names(without={"int8-combine"})
    assert "int8-combine" not in names(without={"int8-gemm"})  # no int8 kernel: nothing to combine for
    assert "int8-combine" not in [p.name for p in phases(resolve('{"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "x86-64"}'), int8=True)]
    assert "int8-combine" in ABLATIONS


@pytest.fixture(scope="module", params=["mha", "block"])
def quantized_heads(tmp_path_factory, request):
    """The seeds' per-head MHA (query, key and value inputs) and encoder block (self-attention:
    q, k and v projections of one activation), 4 heads, quantize_dynamic QInt8."""
    pytest.importorskip("onnxruntime.quantization")
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from blockforge.graph import BlockSpec, MHASpec, export

    d = tmp_path_factory.mktemp("qheads")
    spec = MHASpec(d_model=64, heads=4) if request.param == "mha" else BlockSpec(d_model=64, heads=4)
    fp32 = export(spec, d / f"{request.param}.onnx").model_path
    quantize_dynamic(str(fp32), str(d / "q.onnx"), weight_type=QuantType.QInt8)
    return request.param, d / "q.onnx"


def _calls(mod, name: str) -> int:
    return mod["main"].script().count(f"R.call_tir({name}")


def test_per_head_projections_are_one_gemm_per_role_and_one_attention(quantized_heads, monkeypatch):
    if not has_vnni(tvm.target.Target(__import__("json").loads(ZNVER4))):
        pytest.skip("no VNNI target")
    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    from blockforge.compile.pipeline import run_phases
    from blockforge.compile.session import open_model

    kind, path = quantized_heads
    s = open_model(path, ZNVER4, {"batch": 1, "seq": 16})
    new, _ = run_phases(s.relax(), s.target, stop_after="int8-gemm")
    old, _ = run_phases(s.relax(), s.target, stop_after="int8-gemm", without={"int8-combine"})
    ffn = 0 if kind == "mha" else 2
    assert _calls(old, "int8_gemm_") == 3 * 4 + 1 + ffn and _calls(old, "fused_attention") == 4
    # q, k, v: one GEMM each (N = 4 heads x 16), the output projection, the FFN's two
    assert _calls(new, "int8_gemm_") == 3 + 1 + ffn and _calls(new, "fused_attention") == 1
    assert "R.concat(" not in new["main"].script().split("fused_attention")[-1]  # no concat of heads after it


def test_combined_build_matches_the_uncombined_and_ort(quantized_heads, monkeypatch):
    """The same numbers as without the phase (one int8 GEMM's columns are the parts' columns;
    the merged attention computes each head as the per-head calls did), and ORT within one
    quantization step of the output, at a static and a symbolic seq."""
    if not has_vnni(tvm.target.Target(__import__("json").loads(ZNVER4))):
        pytest.skip("no VNNI target")
    from blockforge.compile.quant.intrin import has_vnni as host_vnni
    from blockforge.targets import resolve

    if not host_vnni(resolve("host").tvm_target()):
        pytest.skip("this CPU has no AVX-512 VNNI: the int8 kernel cannot run here")
    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    from tvm import relax

    from blockforge.compile.pipeline import build
    from blockforge.compile.session import open_model
    from blockforge.graph import ort as ort_runner

    _, path = quantized_heads
    for dims, seqs in (({"batch": 1, "seq": 16}, [16]), ({"batch": 1}, [5, 16])):
        s = open_model(path, "host", dims)
        vms = [relax.VirtualMachine(build(s.relax(), s.target, without=w).executable, tvm.cpu())
               for w in (frozenset(), frozenset({"int8-combine"}))]
        for seq in seqs:
            rng = np.random.default_rng(seq)
            feeds = {i.name: rng.standard_normal((1, seq, 64)).astype(np.float32) for i in s.inputs}
            args = [tvm.runtime.tensor(feeds[i.name]) for i in s.inputs]
            got, without = (vm["main"](*args).numpy() for vm in vms)
            np.testing.assert_allclose(got, without, rtol=1e-6, atol=1e-6)
            ref = next(iter(ort_runner.run(s.model, feeds).values()))
            assert np.abs(got - ref).max() <= float(np.abs(ref).max()) / 255, (seq, np.abs(got - ref).max())
