"""Depthwise convolutions on compile/conv/depthwise.py's kernel (the conv-gemm phase, ablation
`conv-depthwise`): numbers against ONNX Runtime over strides, dilations, pads, crops, batches and
1-D; what the rewrite declines; the schedule as expected TIR under a fixed target (as
tests/test_schedule_ir.py); and the strided-load pass its stride-2 select relies on."""

from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
ort = pytest.importorskip("onnxruntime")
import tvm_ffi  # noqa: E402
from tvm import te, tirx  # noqa: E402
from tvm.script import tirx as T  # noqa: E402

from blockforge.compile.conv import depthwise  # noqa: E402
from blockforge.compile.conv.rewrite import ConvShape  # noqa: E402
from blockforge.compile.conv.schedule import CPUDepthwise  # noqa: E402
from blockforge.compile.frontend.importer import import_onnx  # noqa: E402
from blockforge.compile.onnx_backend import BlockforgeBackend  # noqa: E402
from blockforge.compile.passes import strided_loads  # noqa: E402
from blockforge.compile.pipeline import run_phases  # noqa: E402
from blockforge.targets import resolve  # noqa: E402
from test_conv import _conv_model  # noqa: E402

AVX512 = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "skylake-avx512", "num-cores": 2})

# (x shape, w shape, Conv attributes, options): the vision families' shapes, small, and the edges.
CASES = {
    "3x3-s1 (MobileNetV2, SegFormer's Mix-FFN)": ((1, 8, 20, 20), (8, 1, 3, 3), dict(group=8, pads=[1] * 4),
                                                  dict(act="Sigmoid")),
    "3x3-s2-even (MobileViT's downsampling)": ((1, 6, 40, 40), (6, 1, 3, 3), dict(group=6, strides=[2, 2], pads=[1] * 4),
                                               dict(act="Relu")),
    "3x3-s2-odd-no-bias": ((1, 5, 17, 23), (5, 1, 3, 3), dict(group=5, strides=[2, 2], pads=[1] * 4), dict(bias=False)),
    "7x7-p3 (ConvNeXt: 14 columns of a 16-lane row, cropped)": ((1, 4, 14, 14), (4, 1, 7, 7),
                                                              dict(group=4, pads=[3] * 4), {}),
    "7x7-p3-7x7 (ConvNeXt's last stage: one row tile of 7)": ((1, 3, 7, 7), (3, 1, 7, 7), dict(group=3, pads=[3] * 4),
                                                            dict(act="Gelu")),
    "5x5-dilated-2": ((1, 4, 19, 21), (4, 1, 5, 5), dict(group=4, dilations=[2, 2], pads=[4] * 4), {}),
    "3x3-asymmetric-pads-batch2": ((2, 4, 9, 12), (4, 1, 3, 3), dict(group=4, pads=[0, 2, 1, 0]), {}),
    "3x2-stride-(1,3)": ((1, 4, 10, 50), (4, 1, 3, 2), dict(group=4, strides=[1, 3], pads=[1, 0, 1, 1]), {}),
    "3x3-stride-(2,1)-wide": ((1, 2, 11, 70), (2, 1, 3, 3), dict(group=2, strides=[2, 1], pads=[1] * 4), {}),
    "no-padding-kernel-as-wide-as-input": ((1, 3, 6, 5), (3, 1, 3, 5), dict(group=3), {}),
    "1d-k5-s1": ((1, 12, 30), (12, 1, 5), dict(group=12, pads=[2, 2]), {}),
    "1d-k3-s2-batch2": ((2, 8, 81), (8, 1, 3), dict(group=8, strides=[2], pads=[1, 1]), dict(act="Relu")),
}


def _convs_left(model, without=frozenset()) -> tuple[int, bool]:
    """conv ops left after the conv-gemm phase, and whether a depthwise kernel is in the module."""
    mod, _ = run_phases(import_onnx(model), resolve("host"), stop_after="conv-gemm", without=without)
    text = mod.script()
    return text.count("R.nn.conv1d") + text.count("R.nn.conv2d"), f'"{depthwise.CONV_BLOCK}"' in text


@pytest.mark.parametrize("name", list(CASES))
def test_depthwise_matches_ort(name):
    xs, ws, attrs, opts = CASES[name]
    model, feeds, want = _conv_model(xs, ws, **opts, **attrs)
    assert _convs_left(model) == (0, True), "the depthwise kernel's coverage"
    got = BlockforgeBackend.prepare(model).run(feeds)[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("xs, ws, attrs", [
    ((1, 4, 12, 40), (4, 1, 3, 3), dict(group=4, strides=[1, 5])),  # a column stride past depthwise.MAX_STRIDE
    ((1, 4, 10, 10), (8, 1, 3, 3), dict(group=4, pads=[1] * 4)),  # two output channels per input channel
    ((1, 2, 3, 10, 10), (2, 1, 3, 3, 3), dict(group=2)),  # 3-D
], ids=["column-stride-5", "channel-multiplier-2", "3d"])
def test_convs_depthwise_declines_stay_tvms_and_right(xs, ws, attrs):
    model, feeds, want = _conv_model(xs, ws, **attrs)
    left, dw = _convs_left(model)
    assert not dw and left == (1 if len(xs) < 5 else 0)  # (TVM's importer has no conv3d op name here)
    got = BlockforgeBackend.prepare(model).run(feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_ablation_keeps_tvms_conv():
    model, _, _ = _conv_model((1, 6, 8, 8), (6, 1, 3, 3), group=6, pads=[1] * 4)
    assert _convs_left(model, without={"conv-depthwise"}) == (1, False)


def test_columns_cover_every_kept_output_in_whole_vectors():
    for ow, sw, lanes in [(56, 1, 16), (64, 1, 16), (14, 1, 16), (32, 2, 16), (20, 3, 16), (7, 4, 8), (5, 3, 4)]:
        cs = ConvShape([1, 2, 9, 300], [2, 1, 1, 1], [1, sw], [0, 0, 0, 0], [1, 1], 2)
        cs.out[1] = ow
        q = depthwise.columns(cs, lanes)
        assert q % lanes == 0 and q % sw == 0 and q >= ow * sw and q - lanes * sw < ow * sw, (ow, sw, lanes, q)


# The schedule for the x86-64-avx512 preset's mcpu (16 lanes): 2 channels of 7 x 7, 3x3, stride 2,
# + bias. Per channel (the parallel loop): the 9 x 18 plane, its loops marked for LoopPartition;
# a tile of 4 rows x 1 vector (16 stride-1 columns as (j, phase)) in registers over the 9 taps
# (unrolled: 3x3 is under DW_UNROLL_TAPS); the tile's write-back; the select + bias per row tile.
def _before():
    cs = ConvShape([1, 2, 7, 7], [2, 1, 3, 3], [2, 2], [1, 1, 1, 1], [1, 1], 2)
    x = te.placeholder((1, 2, 7, 7), name="x")
    w = te.placeholder((2, 3, 3), name="w")
    b = te.placeholder((1, 2, 1, 1), name="b")
    y = depthwise.depthwise(x, w, cs, 16)
    z = te.compute(y.shape, lambda n, c, i, j: y[n, c, i, j] + b[0, c, 0, 0], name="T_add")
    return te.create_prim_func([x, w, b, z]).with_attr("global_symbol", "main")


# fmt: off
@T.prim_func(s_tir=True)
def _expected(x: T.Buffer((1, 2, 7, 7), "float32"), w: T.Buffer((2, 3, 3), "float32"), b: T.Buffer((1, 2, 1, 1), "float32"), T_add: T.Buffer((1, 2, 4, 4), "float32")):
    T.func_attr({"global_symbol": "main", "tirx.noalias": True})
    dw_pad = T.sblock_alloc_buffer((1, 2, 9, 18))
    dw_conv = T.sblock_alloc_buffer((1, 2, 4, 8, 2))
    dw_conv_local = T.sblock_alloc_buffer((1, 2, 4, 8, 2), scope="local")
    for n_c_fused in T.parallel(2):
        for ax0 in T.serial(9, annotations={"pragma_loop_partition_hint": 1}):
            for ax1 in T.serial(18, annotations={"pragma_loop_partition_hint": 1}):
                with T.sblock("dw_pad"):
                    v_n = T.axis.spatial(1, 0)
                    v_c, v_r, v_m = T.axis.remap("SSS", [n_c_fused, ax0, ax1])
                    T.reads(x[v_n, v_c, v_r - 1, v_m - 1])
                    T.writes(dw_pad[v_n, v_c, v_r, v_m])
                    dw_pad[v_n, v_c, v_r, v_m] = T.if_then_else(T.likely(1 <= v_r and v_r < 8 and 1 <= v_m and v_m < 8), x[v_n, v_c, v_r - 1, v_m - 1], T.float32(0.0))
        for i_0 in range(1):
            for j_p_fused_0 in range(1):
                for i_1_init in T.unroll(4):
                    for j_p_fused_1_init in T.unroll(1):
                        for j_p_fused_2_init in T.vectorized(16):
                            with T.sblock("dw_conv_init"):
                                v_n = T.axis.spatial(1, 0)
                                v_c = T.axis.spatial(2, n_c_fused)
                                v_i = T.axis.spatial(4, i_0 * 4 + i_1_init)
                                v_j = T.axis.spatial(8, (j_p_fused_0 * 16 + j_p_fused_1_init * 16 + j_p_fused_2_init) // 2)
                                v_p = T.axis.spatial(2, (j_p_fused_0 * 16 + j_p_fused_1_init * 16 + j_p_fused_2_init) % 2)
                                T.reads()
                                T.writes(dw_conv_local[v_n, v_c, v_i, v_j, v_p])
                                dw_conv_local[v_n, v_c, v_i, v_j, v_p] = T.float32(0.0)
                for kh in T.unroll(3):
                    for kw in T.unroll(3):
                        for i_1 in T.unroll(4):
                            for j_p_fused_1 in T.unroll(1):
                                for j_p_fused_2 in T.vectorized(16):
                                    with T.sblock("dw_conv_update"):
                                        v_n = T.axis.spatial(1, 0)
                                        v_c = T.axis.spatial(2, n_c_fused)
                                        v_i = T.axis.spatial(4, i_0 * 4 + i_1)
                                        v_j = T.axis.spatial(8, (j_p_fused_0 * 16 + j_p_fused_1 * 16 + j_p_fused_2) // 2)
                                        v_p = T.axis.spatial(2, (j_p_fused_0 * 16 + j_p_fused_1 * 16 + j_p_fused_2) % 2)
                                        v_kh, v_kw = T.axis.remap("RR", [kh, kw])
                                        T.reads(dw_conv_local[v_n, v_c, v_i, v_j, v_p], dw_pad[v_n, v_c, v_i * 2 + v_kh, v_j * 2 + v_p + v_kw], w[v_c, v_kh, v_kw])
                                        T.writes(dw_conv_local[v_n, v_c, v_i, v_j, v_p])
                                        dw_conv_local[v_n, v_c, v_i, v_j, v_p] = dw_conv_local[v_n, v_c, v_i, v_j, v_p] + dw_pad[v_n, v_c, v_i * 2 + v_kh, v_j * 2 + v_p + v_kw] * w[v_c, v_kh, v_kw]
                for ax0, ax1, ax2, ax3_ax4_fused_0 in T.grid(1, 1, 4, 1):
                    for ax3_ax4_fused_1 in T.vectorized(16):
                        with T.sblock("dw_conv_local"):
                            v0 = T.axis.spatial(1, ax0)
                            v1 = T.axis.spatial(2, n_c_fused + ax1)
                            v2 = T.axis.spatial(4, ax2)
                            v3 = T.axis.spatial(8, (ax3_ax4_fused_0 * 16 + ax3_ax4_fused_1) // 2)
                            v4 = T.axis.spatial(2, (ax3_ax4_fused_0 * 16 + ax3_ax4_fused_1) % 2)
                            T.reads(dw_conv_local[v0, v1, v2, v3, v4])
                            T.writes(dw_conv[v0, v1, v2, v3, v4])
                            dw_conv[v0, v1, v2, v3, v4] = dw_conv_local[v0, v1, v2, v3, v4]
            for ax0, ax1 in T.grid(4, 4):
                with T.sblock("T_add"):
                    v_n = T.axis.spatial(1, 0)
                    v_c, v_i, v_j = T.axis.remap("SSS", [n_c_fused, ax0, ax1])
                    T.reads(dw_conv[v_n, v_c, v_i, v_j, 0], b[0, v_c, 0, 0])
                    T.writes(T_add[v_n, v_c, v_i, v_j])
                    T_add[v_n, v_c, v_i, v_j] = dw_conv[v_n, v_c, v_i, v_j, 0] + b[0, v_c, 0, 0]
# fmt: on


def test_depthwise_schedule_ir():
    with AVX512:
        sch = CPUDepthwise().apply(_before(), AVX512, False)
    assert sch is not None
    tvm.ir.assert_structural_equal(sch.mod["main"], _expected)


def _loop_kinds(func):
    out = []
    tvm_ffi.structural_walk(func.body, [(tirx.For, lambda f: out.append((f.kind, int(f.extent))))], order="pre")
    return out


def test_big_kernels_keep_the_row_loop_of_taps():
    """7x7 at 14 x 14: a 7-row tile (one vector a row); kh stays a loop (unrolled, LLVM kept the 49
    weight broadcasts and the shared loads live and spilled: 2.4x the time), kw is unrolled."""
    cs = ConvShape([1, 2, 14, 14], [2, 1, 7, 7], [1, 1], [3, 3, 3, 3], [1, 1], 2)
    x, w = te.placeholder((1, 2, 14, 14), name="x"), te.placeholder((2, 7, 7), name="w")
    func = te.create_prim_func([x, w, depthwise.depthwise(x, w, cs, 16)]).with_attr("global_symbol", "main")
    with AVX512:
        kinds = _loop_kinds(CPUDepthwise().apply(func, AVX512, False).mod["main"])
    assert (tirx.ForKind.SERIAL, 7) in kinds and (tirx.ForKind.UNROLLED, 7) in kinds  # kh a loop; kw and rows unrolled
    assert kinds.count((tirx.ForKind.UNROLLED, 7)) >= 2 and (tirx.ForKind.PARALLEL, 2) in kinds


def test_rule_leaves_other_kernels_alone():
    x = te.placeholder((4, 32), name="x")
    func = te.create_prim_func([x, te.compute((4, 32), lambda i, j: x[i, j] * 2, name="y")])
    with AVX512:
        assert CPUDepthwise().apply(func.with_attr("global_symbol", "main"), AVX512, False) is None


# strided_loads: flattened TIR as TVM's lowering leaves it.
def _flat(n_alloc: int, stride: int, lanes: int = 16, vectors: int = 2, local: bool = True):
    """out[v*lanes : (v+1)*lanes] = acc[Ramp(v * lanes * stride, stride, lanes)] for v < vectors,
    acc an allocated buffer of n_alloc floats (or a parameter: local=False)."""
    acc = tirx.decl_buffer((n_alloc,), "float32", "acc")
    out = tirx.decl_buffer((vectors * lanes,), "float32", "out")
    v = tirx.Var("v", "int32")
    load = tirx.BufferLoad(acc, [tirx.Ramp(v * (lanes * stride), stride, lanes)])
    body = tirx.For(v, 0, vectors, tirx.ForKind.SERIAL,
                    tirx.BufferStore(out, load, [tirx.Ramp(v * lanes, 1, lanes)]))
    if local:
        body = tirx.SeqStmt([tirx.AllocBuffer(acc), body])
        params = [out]
    else:
        params = [acc, out]
    return tirx.PrimFunc(params, body)


def _shuffles(func):
    out = []
    tvm_ffi.structural_walk(func.body, [(tirx.Shuffle, out.append)], order="pre")
    return out


@pytest.mark.parametrize("stride", [2, 3, 4])
def test_strided_load_of_a_local_buffer_becomes_one_load_and_a_shuffle(stride):
    lanes, vectors = 16, 2
    func = strided_loads.rewrite(_flat(vectors * lanes * stride, stride))
    [shuf] = _shuffles(func)
    assert [int(i) for i in shuf.indices] == [k * stride for k in range(lanes)]
    [wide] = shuf.vectors
    assert int(wide.indices[0].stride) == 1 and int(wide.indices[0].lanes) == lanes * stride


@pytest.mark.parametrize("case", ["last-vector-would-read-past-the-end", "stride-5", "a-parameter"])
def test_strided_loads_that_could_fault_or_waste_are_left_alone(case):
    lanes, vectors = 16, 2
    func = {"last-vector-would-read-past-the-end": lambda: _flat(vectors * lanes * 2 - 1, 2),
            "stride-5": lambda: _flat(vectors * lanes * 5, 5),
            "a-parameter": lambda: _flat(vectors * lanes * 2, 2, local=False)}[case]()
    assert not _shuffles(strided_loads.rewrite(func))


# Pointwise (1x1) convs and the epilogues of 2-D convs (ablation `conv-pointwise`).
def _mbv2_model(h: int = 12, w: int = 10, last: str = "Relu"):
    """A MobileNetV2 block as exports write it: 1x1 expand + BN (Mul, Add per channel) + SiLU,
    3x3 depthwise + SiLU, 1x1 project, 3x3 full conv + `last` (Relu, or Clip: ReLU6, which
    frontend/converters.py imports as Relax's clip); h * w positions no panel divides or whole."""
    import onnx
    from onnx import helper as oh
    from onnx import numpy_helper as nh

    rng = np.random.default_rng(0)
    c, e = 8, 32
    inits = [nh.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), n) for n, s in [
        ("w1", (e, c, 1, 1)), ("b1", (e,)), ("bn_s", (1, e, 1, 1)), ("bn_b", (1, e, 1, 1)), ("w2", (e, 1, 3, 3)),
        ("b2", (e,)), ("w3", (c, e, 1, 1)), ("w4", (c, c, 3, 3)), ("b4", (c,))]]
    nodes = [oh.make_node("Conv", ["x", "w1", "b1"], ["c1"]),
             oh.make_node("Mul", ["c1", "bn_s"], ["m1"]), oh.make_node("Add", ["m1", "bn_b"], ["a1"]),
             oh.make_node("Sigmoid", ["a1"], ["s1"]), oh.make_node("Mul", ["a1", "s1"], ["y1"]),
             oh.make_node("Conv", ["y1", "w2", "b2"], ["c2"], group=e, pads=[1] * 4),
             oh.make_node("Sigmoid", ["c2"], ["s2"]), oh.make_node("Mul", ["c2", "s2"], ["y2"]),
             oh.make_node("Conv", ["y2", "w3"], ["c3"]),
             oh.make_node("Conv", ["c3", "w4", "b4"], ["c4"], pads=[1] * 4),
             oh.make_node("Relu", ["c4"], ["y"]) if last == "Relu" else oh.make_node("Clip", ["c4", "lo", "hi"], ["y"])]
    inits += [nh.from_array(np.array(v, np.float32), n) for n, v in [("lo", 0.0), ("hi", 6.0)]]
    g = oh.make_graph(nodes, "mbv2", [oh.make_tensor_value_info("x", 1, [1, c, h, w])],
                      [oh.make_tensor_value_info("y", 1, [1, c, h, w])], inits)
    model = oh.make_model(g, opset_imports=[oh.make_opsetid("", 20)], ir_version=10)
    feeds = {"x": rng.standard_normal((1, c, h, w)).astype(np.float32)}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    return model, feeds, want


@pytest.mark.parametrize("hw, last", [((12, 10), "Relu"), ((16, 8), "Relu"), ((16, 8), "Clip")],
                         ids=["120-positions (cropped panels)", "128-positions (whole)", "relu6"])
def test_pointwise_block_matches_ort_and_fuses_each_epilogue(hw, last):
    model, feeds, want = _mbv2_model(*hw, last=last)
    got = BlockforgeBackend.prepare(model).run(feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    text = run_phases(import_onnx(model), resolve("host"), stop_after="optimize")[0].script()
    assert "R.permute_dims" not in text and "R.matmul" not in text  # no patch conv: no tokens, no transposes back
    mod, _ = run_phases(import_onnx(model), resolve("host"), stop_after="legalize")  # (fused by then)
    names = [gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]
    # the expand's bias, BN and SiLU, and the 3x3's bias and ReLU, in their GEMM's kernel
    assert any(n.startswith("fused_conv_gemm") and "sigmoid" in n for n in names), names
    act = "relu" if last == "Relu" else "clip"
    assert any(n.startswith("fused_conv_gemm") and act in n for n in names), names
    assert not any(k in n for n in names if "conv_" not in n for k in ("sigmoid", "relu", "clip", "maximum")), names


def test_pointwise_ablation_keeps_the_patch_conv():
    model, feeds, want = _mbv2_model()
    mod, _ = run_phases(import_onnx(model), resolve("host"), stop_after="optimize", without={"conv-pointwise"})
    assert "R.permute_dims" in mod.script() or "R.matmul" in mod.script()
    got = BlockforgeBackend.prepare(model).run(feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


# Channels-last: the depthwise conv between token layouts (SegFormer's Mix-FFN).
def _mixffn_model(h=6, w=10, c=32, stride=1, extra_nchw_use=False, tokens_out=False):
    """tokens (1, h*w, 16) -> MatMul (c) -> Transpose -> Reshape (1, c, h, w) -> depthwise 3x3 Conv
    (+bias) -> Reshape (1, c, L) -> Transpose -> Gelu -> MatMul (16); extra_nchw_use: the conv's
    NCHW output also feeds a ReduceMean over the image (so that view must stay)."""
    import onnx
    from onnx import helper as oh
    from onnx import numpy_helper as nh

    rng = np.random.default_rng(0)
    oh_, ow_ = (h - 1) // stride + 1, (w - 1) // stride + 1
    inits = [nh.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), n) for n, s in [
        ("w1", (16, c)), ("wd", (c, 1, 3, 3)), ("bd", (c,)), ("w2", (c, 16))]]
    inits += [nh.from_array(np.array(v, np.int64), n) for n, v in [("img", [1, c, h, w]), ("flat", [1, c, oh_ * ow_]),
                                                                     ("axes", [2, 3])]]
    nodes = [oh.make_node("MatMul", ["x", "w1"], ["h1"]), oh.make_node("Transpose", ["h1"], ["t1"], perm=[0, 2, 1]),
             oh.make_node("Reshape", ["t1", "img"], ["im"]),
             oh.make_node("Conv", ["im", "wd", "bd"], ["cv"], group=c, pads=[1] * 4, strides=[stride] * 2),
             oh.make_node("Reshape", ["cv", "flat"], ["f1"]), oh.make_node("Transpose", ["f1"], ["t2"], perm=[0, 2, 1]),
             oh.make_node("Gelu", ["t2"], ["g"]), oh.make_node("MatMul", ["g", "w2"], ["y"])]
    if tokens_out:  # the graph's output is the tokens the conv's view is transposed back to
        nodes = nodes[:6]
    outs = [oh.make_tensor_value_info("t2", 1, [1, oh_ * ow_, c])] if tokens_out else \
        [oh.make_tensor_value_info("y", 1, [1, oh_ * ow_, 16])]
    if extra_nchw_use:
        nodes.append(oh.make_node("ReduceMean", ["cv", "axes"], ["m"], keepdims=0))
        outs.append(oh.make_tensor_value_info("m", 1, [1, c]))
    g = oh.make_graph(nodes, "mixffn", [oh.make_tensor_value_info("x", 1, [1, h * w, 16])], outs, inits)
    model = oh.make_model(g, opset_imports=[oh.make_opsetid("", 20)], ir_version=10)
    feeds = {"x": rng.standard_normal((1, h * w, 16)).astype(np.float32)}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    return model, feeds, want


@pytest.mark.parametrize("opts", [dict(), dict(h=9, w=7, stride=2), dict(c=48, extra_nchw_use=True),
                                  dict(tokens_out=True)],
                         ids=["segformer", "stride-2-odd", "nchw-view-also-used", "the-tokens-are-the-output"])
def test_tokens_depthwise_matches_ort_without_the_transposes(opts):
    model, feeds, want = _mixffn_model(**opts)
    got = BlockforgeBackend.prepare(model).run(feeds)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
    mod, _ = run_phases(import_onnx(model), resolve("host"), stop_after="conv-gemm")
    text = mod["main"].script()
    assert "conv_depthwise_tokens" in text and "R.nn.conv2d" not in text
    # the transposes to and from the image are gone; the view the mean reads stays
    assert text.count("R.permute_dims") == (1 if opts.get("extra_nchw_use") else 0), text


def test_tokens_schedule_tiles_positions_by_channel_vectors():
    cs = ConvShape([1, 64, 8, 12], [64, 1, 3, 3], [1, 1], [1, 1, 1, 1], [1, 1], 64)
    t, w = te.placeholder((1, 96, 64), name="t"), te.placeholder((3, 3, 64), name="w")
    func = te.create_prim_func([t, w, depthwise.depthwise_tokens(t, w, cs)]).with_attr("global_symbol", "main")
    from blockforge.compile.conv.schedule import CPUDepthwiseTokens

    with AVX512:
        out = CPUDepthwiseTokens().apply(func, AVX512, False).mod["main"]
    kinds = _loop_kinds(out)
    assert (tirx.ForKind.PARALLEL, 4) in kinds  # 8 rows in tiles of 2
    assert kinds.count((tirx.ForKind.UNROLLED, 3)) >= 2 and (tirx.ForKind.UNROLLED, 4) in kinds  # taps, 4 positions
    assert (tirx.ForKind.UNROLLED, 2) in kinds and (tirx.ForKind.VECTORIZED, 16) in kinds  # 2 channel vectors


def test_channels_last_ablation_keeps_the_transposes():
    model, feeds, want = _mixffn_model()
    text = run_phases(import_onnx(model), resolve("host"), stop_after="conv-gemm", without={"conv-channels-last"})[0]["main"].script()
    assert "conv_depthwise_tokens" not in text and text.count("R.permute_dims") == 2


def test_a_default_permute_is_no_tokens_view():
    """Transpose without perm (all axes reversed) around the conv: not the Mix-FFN layout; the NCHW
    kernel, and the numbers still ORT's."""
    import onnx
    from onnx import helper as oh
    from onnx import numpy_helper as nh

    rng = np.random.default_rng(0)
    inits = [nh.from_array((rng.standard_normal((16, 1, 3, 3)) * 0.3).astype(np.float32), "wd"),
             nh.from_array(np.array([1, 16, 5, 6], np.int64), "img")]
    nodes = [oh.make_node("Transpose", ["x"], ["t"]), oh.make_node("Reshape", ["t", "img"], ["im"]),
             oh.make_node("Conv", ["im", "wd"], ["y"], group=16, pads=[1] * 4)]
    g = oh.make_graph(nodes, "rev", [oh.make_tensor_value_info("x", 1, [16, 30, 1])],
                      [oh.make_tensor_value_info("y", 1, [1, 16, 5, 6])], inits)
    model = oh.make_model(g, opset_imports=[oh.make_opsetid("", 20)], ir_version=10)
    feeds = {"x": rng.standard_normal((16, 30, 1)).astype(np.float32)}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = BlockforgeBackend.prepare(model).run(feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert _convs_left(model) == (0, True)  # the NCHW depthwise kernel


@pytest.mark.parametrize("lo, hi, dtype, relax_clip", [
    (0.0, 6.0, np.float32, True), (np.nan, 1.0, np.float32, True), (-1.0, np.inf, np.float32, True),
    (0.0, 6.0, np.float16, True), (3.0, 1.0, np.float32, False), (0, 6, np.int32, False)],
    ids=["relu6", "nan-min-is-no-bound", "no-max", "float16", "min-above-max (TVM's: all max)", "int32 (TVM's)"])
def test_clip_by_constants_imports_as_relax_clip(lo, hi, dtype, relax_clip):
    """frontend/converters.py clip_op: what a conv's epilogue can take (_sink_flat moves Relax ops)."""
    import onnx
    from onnx import helper as oh
    from onnx import numpy_helper as nh

    et = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inits = [nh.from_array(np.array(lo, dtype), "lo"), nh.from_array(np.array(hi, dtype), "hi")]
    g = oh.make_graph([oh.make_node("Clip", ["x", "lo", "hi"], ["y"])], "clip", [oh.make_tensor_value_info("x", et, [2, 7])],
                      [oh.make_tensor_value_info("y", et, [2, 7])], inits)
    model = oh.make_model(g, opset_imports=[oh.make_opsetid("", 20)], ir_version=10)
    x = (np.random.default_rng(0).standard_normal((2, 7)) * 5).astype(dtype)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = BlockforgeBackend.prepare(model).run({"x": x})[0]
    np.testing.assert_array_equal(got, want)
    assert ("R.clip" in import_onnx(model).script()) == relax_clip


def test_depthwise_kernels_bound_their_buffers():
    """A hostile dilation (and the padding it allows) would make the rows a channels-last item
    copies, or a channel's NCHW plane, the whole padded image: past MAX_PLANE_BYTES both decline
    (TVM's conv is left to the model's size checks). SegFormer's stage 1 is far under."""
    seg = ConvShape([1, 128, 128, 128], [128, 1, 3, 3], [1, 1], [1, 1, 1, 1], [1, 1], 128)
    assert depthwise.tokens_applies(seg, 16) and depthwise.applies(seg)
    bomb = ConvShape([1, 64, 1, 5000], [64, 1, 3, 3], [1, 1], [5000, 1, 5000, 1], [5000, 1], 64)
    assert bomb.valid() and not depthwise.tokens_applies(bomb, 16) and not depthwise.applies(bomb)
