"""Convolutions through the conv-gemm phase (compile/conv): numbers against ONNX Runtime over a
table of configurations, the rewrite's coverage, and the schedules' structure under a fixed
target (as tests/test_schedule_ir.py)."""

from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
ort = pytest.importorskip("onnxruntime")
import onnx  # noqa: E402
import tvm_ffi  # noqa: E402
from onnx import helper as oh  # noqa: E402
from onnx import numpy_helper as nh  # noqa: E402
from tvm import te, tirx  # noqa: E402

from blockforge.compile.conv.rewrite import ConvShape, conv_gemm, conv_gemm_implicit, im2col, pad_input  # noqa: E402
from blockforge.compile.conv.schedule import CPUIm2col  # noqa: E402
from blockforge.compile.schedule.base import vector_lanes  # noqa: E402
from blockforge.compile.schedule.matmul import CPUMatmul  # noqa: E402
from blockforge.compile.frontend.importer import import_onnx  # noqa: E402
from blockforge.compile.onnx_backend import BlockforgeBackend  # noqa: E402
from blockforge.compile.pipeline import run_phases  # noqa: E402
from blockforge.targets import resolve  # noqa: E402

AVX512 = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "skylake-avx512", "num-cores": 2})


def _conv_model(x_shape, w_shape, *, bias=True, act=None, weight_input=False, dynamic=False, **attrs):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal(w_shape) * 0.2).astype(np.float32)
    inits, ins = [], ["x", "w"]
    x_dims = list(x_shape)
    if dynamic:
        x_dims[-1] = "L"
    graph_in = [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x_dims)]
    feeds = {"x": rng.standard_normal(x_shape).astype(np.float32)}
    if weight_input:
        graph_in.append(oh.make_tensor_value_info("w", onnx.TensorProto.FLOAT, list(w_shape)))
        feeds["w"] = w
    else:
        inits.append(nh.from_array(w, "w"))
    if bias:
        inits.append(nh.from_array(rng.standard_normal(w_shape[0]).astype(np.float32), "b"))
        ins.append("b")
    nodes = [oh.make_node("Conv", ins, ["c" if act else "y"], **attrs)]
    if act:
        nodes.append(oh.make_node(act, ["c"], ["y"]))
    probe = oh.make_model(oh.make_graph(nodes, "conv", graph_in, [oh.make_tensor_value_info("y", 1, None)], inits),
                          opset_imports=[oh.make_opsetid("", 20)], ir_version=10)
    sess = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, feeds)[0]
    out_dims = list(want.shape)
    if dynamic:
        out_dims[-1] = "Lo"
    model = oh.make_model(oh.make_graph(nodes, "conv", graph_in, [oh.make_tensor_value_info("y", 1, out_dims)], inits),
                          opset_imports=[oh.make_opsetid("", 20)], ir_version=10)
    return model, feeds, want


# (x shape, w shape, Conv attributes, options): Whisper's, Wav2Vec2's and the edge cases.
CASES = {
    "1d-k3-s1-gelu (whisper conv1)": ((1, 8, 40), (16, 8, 3), dict(pads=[1, 1]), dict(act="Gelu")),
    "1d-k3-s2-gelu (whisper conv2)": ((1, 16, 40), (16, 16, 3), dict(strides=[2], pads=[1, 1]), dict(act="Gelu")),
    "1d-k10-s5-nobias (wav2vec2 layer 0)": ((1, 1, 400), (32, 1, 10), dict(strides=[5]), dict(bias=False)),
    "1d-k2-s2-nobias": ((1, 32, 21), (32, 32, 2), dict(strides=[2]), dict(bias=False)),
    "1d-grouped-even-k (positional conv)": ((1, 32, 20), (32, 8, 8), dict(group=4, pads=[4, 4]), {}),
    "1d-depthwise": ((1, 12, 30), (12, 1, 5), dict(group=12, pads=[2, 2]), {}),
    "1d-pointwise": ((2, 24, 17), (40, 24, 1), {}, {}),
    "1d-dilated": ((1, 8, 50), (8, 8, 3), dict(dilations=[3], pads=[3, 3]), dict(act="Relu")),
    "1d-kernel-longer-than-input": ((1, 4, 3), (6, 4, 5), dict(pads=[2, 2]), {}),
    "1d-asymmetric-pads": ((1, 4, 11), (6, 4, 4), dict(pads=[3, 0], strides=[2]), {}),
    "1d-66-rows-200-cols (a cropped tail panel)": ((1, 64, 200), (66, 64, 3), dict(pads=[1, 1]), dict(act="Gelu")),
    "1d-stride1-dilated-grouped-asym-pads-batch2 (implicit GEMM)": ((2, 12, 37), (12, 4, 4),
                                                                     dict(group=3, dilations=[2], pads=[3, 1]), {}),
    "2d-k3-s1-p1": ((1, 3, 12, 10), (8, 3, 3, 3), dict(pads=[1, 1, 1, 1]), {}),
    "2d-asym-pads-stride-dilation": ((1, 4, 13, 9), (6, 4, 3, 2), dict(pads=[0, 1, 2, 0], strides=[2, 1],
                                                                        dilations=[2, 1]), dict(bias=False)),
    "2d-auto-pad-same-upper": ((1, 4, 9, 9), (5, 4, 4, 4), dict(auto_pad="SAME_UPPER", strides=[2, 2]), {}),
    "2d-depthwise": ((1, 6, 8, 8), (6, 1, 3, 3), dict(group=6, pads=[1, 1, 1, 1]), {}),
    "2d-grouped-4-rows": ((1, 8, 8, 8), (16, 2, 3, 3), dict(group=4, pads=[1, 1, 1, 1]), {}),
    "2d-batch2-grouped": ((2, 8, 7, 7), (12, 4, 3, 3), dict(group=2), {}),
    # strided 1-D convs long enough for panels that take conv/strided.py's contiguous loads + shuffle
    "1d-k3-s2-long (strided loads, padded first panel)": ((1, 8, 300), (8, 8, 3), dict(strides=[2], pads=[1, 1]),
                                                          dict(act="Gelu")),
    "1d-k4-s3-batch2 (strided loads)": ((2, 8, 500), (8, 8, 4), dict(strides=[3]), {}),
    "1d-grouped-dilated-s2 (strided loads)": ((1, 16, 400), (16, 4, 3), dict(group=4, strides=[2], dilations=[2]), {}),
    # kernels longer than input + padding reach: taps that read only padding are dropped (trim_taps)
    "1d-grouped-long-kernel (wav2vec2 positional conv, taps 3-20 of 24 kept)": ((1, 32, 9), (32, 8, 24),
                                                                                dict(group=4, pads=[12, 12]), {}),
    "1d-strided-dilated-long-kernel (taps 1-2 of 4 kept)": ((1, 8, 2), (8, 8, 4), dict(dilations=[3], pads=[5, 5]),
                                                             dict(act="Relu")),
    "2d-long-kernel (taps 1-4 of 6 kept)": ((1, 4, 3, 3), (8, 4, 6, 6), dict(pads=[2, 2, 2, 2]), {}),
}


def _convs_left(model) -> int:
    mod, _ = run_phases(import_onnx(model), resolve("host"), stop_after="conv-gemm")
    text = mod.script()
    return text.count("R.nn.conv1d") + text.count("R.nn.conv2d")


@pytest.mark.parametrize("name", list(CASES))
def test_conv_matches_ort(name):
    xs, ws, attrs, opts = CASES[name]
    model, feeds, want = _conv_model(xs, ws, **opts, **attrs)
    # depthwise (one output channel per group): conv/depthwise.py's kernel (tests/test_depthwise.py)
    assert _convs_left(model) == 0, "the conv-gemm phase's coverage"
    got = BlockforgeBackend.prepare(model).run(feeds)[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("opts", [dict(weight_input=True), dict(dynamic=True)], ids=["runtime-weight", "symbolic-length"])
def test_convs_the_rewrite_declines_keep_their_numbers(opts):
    """A weight given at run time, or a symbolic length: TVM's own conv, still right."""
    model, feeds, want = _conv_model((1, 4, 16), (6, 4, 3), pads=[1, 1], **opts)
    assert _convs_left(model) == 1
    got = BlockforgeBackend.prepare(model).run(feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_conv_whose_columns_would_not_fit_stays_direct():
    """1x64x2048x2048, k7, stride 2: 12 GiB of im2col workspace (the weight is 800 KB). At stride 1
    the wide implicit GEMM needs no columns (its padded copy of x: the input's size), so it takes
    the conv. Only the phases up to conv-gemm run: no input is allocated."""
    rng = np.random.default_rng(0)
    w = nh.from_array((rng.standard_normal((64, 64, 7, 7)) * 0.01).astype(np.float32), "w")
    for stride, left in ((2, 1), (1, 0)):
        out = 2048 // stride
        g = oh.make_graph([oh.make_node("Conv", ["x", "w"], ["y"], pads=[3, 3, 3, 3], strides=[stride, stride])], "big",
                          [oh.make_tensor_value_info("x", 1, [1, 64, 2048, 2048])],
                          [oh.make_tensor_value_info("y", 1, [1, 64, out, out])], [w])
        model = oh.make_model(g, opset_imports=[oh.make_opsetid("", 20)], ir_version=10)
        assert _convs_left(model) == left, stride


def test_used_taps_match_a_direct_count():
    """Wav2Vec2-base's positional conv (768 ch, k=128, groups 16, pads 64, 49 frames): the taps
    that read a frame for some output are 15-112; a stride and dilation leave gaps a direct
    count sees; a conv whose every tap reads padding has none."""
    assert ConvShape([1, 768, 49], [768, 48, 128], [1], [64, 64], [1], 16).used_taps() == [(15, 112)]
    cs = ConvShape([1, 8, 2], [8, 8, 4], [1], [5, 5], [3], 1)
    assert cs.used_taps() == [(1, 2)]
    t = cs.trimmed(cs.used_taps())
    assert (t.kernel, t.pad_begin, t.pad_end, t.out, t.kg) == ([2], [2], [2], cs.out, 16)
    assert ConvShape([1, 4, 1], [4, 4, 1], [5], [2, 2], [1], 1).used_taps() is None
    for size, k, st, dl, pb, pe in [(9, 24, 1, 1, 12, 12), (5, 12, 2, 1, 7, 7), (7, 5, 3, 2, 9, 1), (3, 6, 1, 1, 2, 2)]:
        cs = ConvShape([1, 4, size], [4, 4, k], [st], [pb, pe], [dl], 1)
        used = [t for t in range(k) if any(0 <= p * st + t * dl - pb < size for p in range(cs.out[0]))]
        assert cs.used_taps() == [(used[0], used[-1])]


def test_trimmed_taps_shrink_the_gemm_and_the_ablation_keeps_them():
    model, _, _ = _conv_model((1, 32, 9), (32, 8, 24), group=4, pads=[12, 12])
    for without, kept in [(set(), 18), ({"conv-trim-taps"}, 24)]:
        mod, _ = run_phases(import_onnx(model), resolve("host"), stop_after="conv-gemm", without=without)
        assert f"A: T.Buffer((T.int64(4), T.int64(8), T.int64({8 * kept}))" in mod.script(), without


def test_conv_gemm_ablation_keeps_the_conv():
    model, _, _ = _conv_model((1, 4, 16), (6, 4, 3), pads=[1, 1])
    mod, names = run_phases(import_onnx(model), resolve("host"), stop_after="legalize", without={"conv-gemm"})
    assert "conv-gemm" not in names and "conv1d" in mod.script()
    _, names = run_phases(import_onnx(model), resolve("host"), stop_after="legalize")
    assert "conv-gemm" in names


def test_phase_list_of_models_without_convolutions_is_unchanged():
    from blockforge.compile.pipeline import phases

    assert "conv-gemm" not in [p.name for p in phases(resolve("host"))]


# Schedules, structurally, for the x86-64-avx512 preset's mcpu (16 lanes, NR = 64).
def _scheduled(rule, func):
    func = func.with_attr("global_symbol", "main")
    with AVX512:
        sch = rule.apply(func, AVX512, False)
    assert sch is not None, f"{type(rule).__name__} did not apply"
    return sch.mod["main"]


def _loops(func):
    out = []
    tvm_ffi.structural_walk(func.body, [(tirx.For, out.append)], order="pre")
    return out


def _blocks(func):
    out = {}

    def visit(r):
        out[r.block.name_hint] = r

    tvm_ffi.structural_walk(func.body, [(tvm.s_tir.stmt.SBlockRealize, visit)])
    return out


CS = ConvShape([1, 16, 200], [66, 16, 3], [1], [1, 1], [1], 1)  # L = 200: 4 panels of 64, the last cropped


def test_im2col_schedule_parallel_panels_vectorised_rows():
    x = te.placeholder((1, 16, 200), "float32", name="x")
    func = te.create_prim_func([x, im2col(x, CS, 64)])
    kinds = [(lp.kind, int(lp.extent)) for lp in _loops(_scheduled(CPUIm2col(), func))]
    assert (tirx.ForKind.PARALLEL, 4 * CS.kg) in kinds  # batch x group x 4 panels x k, fused
    assert (tirx.ForKind.VECTORIZED, 16) in kinds


def test_conv_gemm_schedule_full_panels_unguarded_crop_guarded():
    """The GEMM runs whole 64-wide panels with no predicate (a guard in its vector loop
    scalarised it: 60x slower); only the cropped write-back of the tail panel is guarded."""
    w = te.placeholder((1, 66, CS.kg), "float32", name="w")
    cols = te.placeholder((1, 1, 4, CS.kg, 64), "float32", name="cols")
    func = te.create_prim_func([w, cols, conv_gemm(w, cols, CS)])
    out = _scheduled(CPUMatmul(), func)
    blocks = _blocks(out)
    assert isinstance(blocks["packed_matmul_update"].predicate, tirx.IntImm)  # no tail guard
    crop = blocks["conv_crop"]
    assert not isinstance(crop.predicate, tirx.IntImm) and "200" in str(crop.predicate)
    kinds = [(lp.kind, int(lp.extent)) for lp in _loops(out)]
    assert (tirx.ForKind.VECTORIZED, 64) in kinds and any(k == tirx.ForKind.PARALLEL for k, _ in kinds)


# (x shape, its valid length, w shape, stride, pads, dilation, groups): Wav2Vec2's layers 2 and 5,
# Whisper's conv2, and a previous conv's whole panels (x wider than the conv's input, NaN past it).
STRIDED = {
    "wav2vec2-layer2": ((1, 512, 1599), 1599, (512, 512, 3), 2, [0, 0], 1, 1),
    "wav2vec2-layer5": ((1, 512, 199), 199, (512, 512, 2), 2, [0, 0], 1, 1),
    "whisper-conv2": ((1, 64, 3000), 3000, (64, 64, 3), 2, [1, 1], 1, 1),
    "panels-past-the-input": ((2, 8, 320), 301, (12, 4, 3), 3, [2, 1], 2, 2),
}


def _shuffles(func):
    out = []
    tvm_ffi.structural_walk(func.body, [(tirx.Shuffle, out.append)], order="pre")
    return out


@pytest.mark.parametrize("name", list(STRIDED))
def test_strided_im2col_matches_the_gather(name):
    """conv/strided.py's loads + shuffle write the gather's columns (every position < L; the
    tail past L is never read by the GEMM), and never read x past the conv's input length."""
    from blockforge.compile.conv.strided import applies, strided_im2col

    xs, size, ws, st, pads, dl, groups = STRIDED[name]
    cs = ConvShape([*xs[:2], size], ws, [st], pads, [dl], groups)
    assert applies(cs, 16, 64)
    # one panel of outputs (layer 6, L = 49), stride 1 or 5: the gather
    assert not any(applies(ConvShape(*g), 16, 64) for g in [([1, 512, 99], [512, 512, 2], [2], [0, 0], [1], 1),
                                                             ([1, 8, 300], [8, 8, 3], [1], [1, 1], [1], 1),
                                                             ([1, 1, 16000], [512, 1, 10], [5], [0, 0], [1], 1)])
    x = te.placeholder((*xs[:2], size), "float32", name="x")
    ref = tvm.compile(tvm.IRModule({"main": _scheduled(CPUIm2col(), te.create_prim_func([x, im2col(x, cs, 64)]))}),
                      target=AVX512).mod
    func = strided_im2col(list(xs), cs, 64, 16).with_attr("global_symbol", "main")
    assert _shuffles(func) and any(lp.kind == tirx.ForKind.PARALLEL for lp in _loops(func))
    got = tvm.compile(tvm.IRModule({"main": func}), target=AVX512).mod
    rng = np.random.default_rng(1)
    xn = rng.standard_normal(xs).astype(np.float32)
    xn[..., size:] = np.nan
    nb = -(-cs.length // 64)
    outs = [tvm.runtime.tensor(np.zeros((cs.n, groups, nb, cs.kg, 64), np.float32)) for _ in range(2)]
    ref(tvm.runtime.tensor(np.ascontiguousarray(xn[..., :size])), outs[0])
    got(tvm.runtime.tensor(xn), outs[1])
    a, b = (o.numpy().transpose(0, 1, 3, 2, 4).reshape(cs.n, groups, cs.kg, -1)[..., :cs.length] for o in outs)
    np.testing.assert_array_equal(b, a)


def test_strided_loads_ablation_keeps_the_gather():
    model, _, _ = _conv_model((1, 8, 300), (8, 8, 3), strides=[2], pads=[1, 1])
    for without, shuffled in [(set(), True), ({"conv-strided-loads"}, False)]:
        mod, _ = run_phases(import_onnx(model), resolve("host"), stop_after="conv-gemm", without=without)
        funcs = [f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]
        assert any(_shuffles(f) for f in funcs) == shuffled, without


# Chains: a 1-D conv's output stays in whole NR panels through its elementwise consumers
# (rewrite._sink), the crop moves after them, and a next conv's im2col reads the panels.
def _chain_model(x_shape, steps):
    """steps: ("conv", (cout, k, attrs)) | (op, extra) with op an ONNX op taking the current
    value (and, for binary ops, `extra`: "x" (the graph input) or a constant's shape)."""
    rng = np.random.default_rng(0)
    inits, nodes, cur, c = [], [], "x", x_shape[1]
    for i, (op, arg) in enumerate(steps):
        out = f"t{i}"
        if op == "conv":
            cout, k, attrs = arg
            attrs = dict(attrs)
            bias = attrs.pop("bias", True)  # Wav2Vec2's extractor convs have none
            g = attrs.get("group", 1)
            inits += [nh.from_array((rng.standard_normal((cout, c // g, k)) * 0.3).astype(np.float32), f"w{i}"),
                      nh.from_array(rng.standard_normal(cout).astype(np.float32), f"b{i}")][:2 if bias else 1]
            nodes.append(oh.make_node("Conv", [cur, f"w{i}"] + ([f"b{i}"] if bias else []), [out], **attrs))
            c = cout
        elif op == "InstanceNormalization":  # arg "affine": random scale and shift (else ones, zeros)
            scale, shift = (rng.standard_normal((2, c)).astype(np.float32) + [[1], [0]]) if arg == "affine" else \
                (np.ones(c, np.float32), np.zeros(c, np.float32))
            inits += [nh.from_array(scale.astype(np.float32), f"s{i}"), nh.from_array(shift.astype(np.float32), f"z{i}")]
            nodes.append(oh.make_node(op, [cur, f"s{i}", f"z{i}"], [out]))
        elif arg is None:
            nodes.append(oh.make_node(op, [cur], [out]))
        else:
            other = arg if arg == "x" else f"c{i}"
            if arg != "x":
                inits.append(nh.from_array((rng.standard_normal(arg) + 2).astype(np.float32), other))
            nodes.append(oh.make_node(op, [cur, other], [out]))
        cur = out
    g = oh.make_graph(nodes, "chain", [oh.make_tensor_value_info("x", 1, list(x_shape))],
                      [oh.make_tensor_value_info(cur, 1, None)], inits)
    model = oh.make_model(g, opset_imports=[oh.make_opsetid("", 20)], ir_version=10)
    feeds = {"x": rng.standard_normal(x_shape).astype(np.float32)}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    model.graph.output[0].CopyFrom(oh.make_tensor_value_info(cur, 1, list(want.shape)))
    return model, feeds, want


K3 = (16, 3, dict(pads=[1, 1]))
CHAINS = {
    # Whisper's front end at a length no panel divides (L = 70, then 35)
    "gelu-conv-s2-gelu": ((1, 8, 70), [("conv", K3), ("Gelu", None), ("conv", (16, 3, dict(strides=[2], pads=[1, 1]))),
                                        ("Gelu", None)]),
    # bias-like constants (per channel), a scalar, a clip, then a strided dilated conv on odd lengths
    "mul-add-relu-dilated-s3": ((1, 8, 67), [("conv", K3), ("Mul", (16, 1)), ("Add", (1,)), ("Relu", None),
                                              ("conv", (12, 3, dict(strides=[3], dilations=[2], pads=[2, 1])))]),
    # Wav2Vec2's layer 0: a norm (a reduction over L) is no elementwise consumer: cropped before it
    "instance-norm-gelu-conv": ((1, 1, 203), [("conv", (16, 10, dict(strides=[5]))), ("InstanceNormalization", None),
                                               ("Gelu", None), ("conv", (16, 3, dict(strides=[2])))]),
    # Wav2Vec2's layers 0 and 1 as exported: no conv bias (layer 0's crop is a slice the norm reads)
    "w2v-layer0-no-bias": ((1, 1, 203), [("conv", (16, 10, dict(strides=[5], bias=False))),
                                          ("InstanceNormalization", "affine"), ("Gelu", None),
                                          ("conv", (16, 3, dict(strides=[2], bias=False))), ("Gelu", None)]),
    # the norm on a graph input (no conv): the rewrite's plain form
    "instance-norm-alone": ((2, 6, 50), [("Add", (1,)), ("InstanceNormalization", "affine")]),
    # a residual with the conv's input varies along L: no sinking past it
    "residual-add": ((1, 16, 45), [("conv", K3), ("Sigmoid", None), ("Add", "x"), ("Tanh", None)]),
    # the grouped positional conv (even kernel: L + 1 outputs) then GELU, at batch 2
    "grouped-even-k-gelu": ((2, 32, 13), [("conv", (32, 8, dict(group=4, pads=[4, 4]))), ("Gelu", None)]),
}


@pytest.mark.parametrize("name", list(CHAINS))
def test_conv_chain_matches_ort(name):
    model, feeds, want = _chain_model(*CHAINS[name])
    assert _convs_left(model) == 0
    got = BlockforgeBackend.prepare(model).run(feeds)[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_conv_chain_stays_in_whole_panels():
    """Whisper's front end at L = 70 (two panels of 64): bias and GELU run on the 128-wide
    panels, the second conv's gather reads them, and the crops are left for the end; in the
    scheduled GEMM the epilogue folds into the unguarded write-back (no crop block left,
    whose tail guard made GELU scalar). Without the ablation's step: the crop in the tile."""
    model, _, _ = _chain_model(*CHAINS["gelu-conv-s2-gelu"])
    mod, _ = run_phases(import_onnx(model), resolve("host"), stop_after="conv-gemm")
    text = mod["main"].script()
    assert "R.Tensor((1, 16, 128)" in text and "R.call_tir(gelu" not in text  # gelu still an op here
    gelus = [ln for ln in text.splitlines() if "R.nn.gelu(" in ln]
    assert len(gelus) == 2 and all("(1, 16, 128)" in ln or "(1, 16, 64)" in ln for ln in gelus), gelus
    assert text.count("R.call_tir(conv_crop") == 1  # only the graph's output is cropped
    sched, _ = run_phases(import_onnx(model), resolve("host"), stop_after="schedule")
    gemms = [f for gv, f in sched.functions_items() if gv.name_hint.startswith("fused_conv_gemm")]
    assert len(gemms) == 2


    def epilogue_blocks(f):  # blocks besides the GEMM's init, update and write-back
        return [k for k in _blocks(f) if k != "root" and not k.startswith("packed_matmul")]

    def column_guards(f):  # a predicate on the output positions (j_0 * 64 + ...)
        return [str(r.predicate) for r in _blocks(f).values() if "T.int64(64) +" in str(r.predicate)]

    for f in gemms:
        assert epilogue_blocks(f) == [] and column_guards(f) == [], (epilogue_blocks(f), column_guards(f))
    old, _ = run_phases(import_onnx(model), resolve("host"), stop_after="schedule", without={"conv-panels"})
    old = [f for gv, f in old.functions_items() if gv.name_hint.startswith("fused_conv_gemm")]
    assert all(epilogue_blocks(f) for f in old) and any(column_guards(f) for f in old)


@pytest.mark.parametrize("chain", ["w2v-layer0-no-bias", "instance-norm-gelu-conv", "instance-norm-alone"])
def test_instance_norm_is_one_row_kernel(chain):
    """InstanceNormalization (Wav2Vec2's GroupNorm) after a conv: one row kernel that reads the
    conv's whole panels (no crop kernel before it: the slice after a bias-free GEMM, the
    conv_crop copy after a bias) and has the affine and GELU fused in; its two reductions
    vectorised rfactors in the one parallel loop over the channels. Without the rewrite: a
    variance kernel, a mean + normalize kernel and the crop (3 passes over the tensor)."""
    model, _, _ = _chain_model(*CHAINS[chain])

    def kernels(without=frozenset()):
        mod, _ = run_phases(import_onnx(model), resolve("host"), stop_after="schedule", without=without)
        return {gv.name_hint: f for gv, f in mod.functions_items() if gv.name_hint != "main"}

    got = kernels()
    norms = [n for n in got if "instance_norm" in n]
    assert len(norms) == 1 and not any("variance" in n or "mean" in n for n in got), sorted(got)
    if chain != "instance-norm-alone":
        assert "gelu" in norms[0], norms  # the activation after the norm is in the row loop
        crops = [n for n in got if "crop" in n or "strided_slice" in n]
        assert len(crops) == 1, sorted(got)  # the graph output's only
    c = CHAINS[chain][0][1] if chain == "instance-norm-alone" else 16
    par = [lp for lp in _loops(got[norms[0]]) if lp.kind == tirx.ForKind.PARALLEL]
    assert [int(lp.extent) for lp in par] == [CHAINS[chain][0][0] * c], "one parallel loop over the rows"
    rf = [b for b in _blocks(got[norms[0]]) if b.endswith("_rf") or b.endswith("_rf_update")]
    assert len(rf) == 2, sorted(_blocks(got[norms[0]]))
    vec = [lp for lp in _loops(got[norms[0]]) if lp.kind == tirx.ForKind.VECTORIZED]
    lanes = vector_lanes(resolve("host").tvm_target())
    assert vec and all(int(lp.extent) == lanes for lp in vec)
    old = kernels({"instance-norm"})
    assert any("variance" in n for n in old) and not any("instance_norm" in n for n in old)


def test_stride1_conv_is_an_implicit_gemm():
    """A stride-1 1-D conv reads its padded input inside the GEMM (rewrite.conv_gemm_implicit):
    no im2col columns (k x the input's size, written then read back); the GEMM's B operand is
    x itself, a contiguous 64-wide vector per (channel, tap); strided convs keep their columns.
    Under the fixed target: the scheduled GEMM's update reads x_padded at j + t."""
    model, _, _ = _chain_model(*CHAINS["gelu-conv-s2-gelu"])
    text = run_phases(import_onnx(model), resolve("host"), stop_after="conv-gemm")[0]["main"].script()
    assert text.count("R.call_tir(conv_pad") == 1 and text.count("R.call_tir(conv_im2col") == 1  # conv 2: stride 2
    old = run_phases(import_onnx(model), resolve("host"), stop_after="conv-gemm", without={"conv-implicit"})[0]
    assert "conv_pad" not in old["main"].script()
    cs = ConvShape([1, 16, 200], [66, 16, 3], [1], [1, 1], [1], 1)
    w = te.placeholder((1, 66, cs.kg), "float32", name="w")
    x = te.placeholder((1, 16, 200), "float32", name="x")
    xp = pad_input(x, cs, 64, 16)
    assert [int(d) for d in xp.shape] == [1, 16, 1, 272]  # 4 panels + 2 taps, whole vectors
    xq = te.placeholder(xp.shape, "float32", name="xp")
    out = _scheduled(CPUMatmul(), te.create_prim_func([w, xq, conv_gemm_implicit(w, xq, cs, 64)]))
    update = _blocks(out)["packed_matmul_update"].block
    assert [r.source.name for r in update.reads][-1] == "xp"
    kinds = [(lp.kind, int(lp.extent)) for lp in _loops(out)]
    assert (tirx.ForKind.VECTORIZED, 64) in kinds and any(k == tirx.ForKind.PARALLEL for k, _ in kinds)


def test_implicit_gemm_phases_match_ort_at_stride_3():
    """pad_input's stride phases (the build keeps strided convs on im2col, measured: the
    kernels stay exact for them): a stride-3, dilation-2, grouped conv against ORT."""
    model, feeds, want = _conv_model((1, 6, 29), (8, 3, 4), bias=False, group=2, strides=[3], dilations=[2],
                                     pads=[2, 1])
    cs = ConvShape([1, 6, 29], [8, 3, 4], [3], [2, 1], [2], 2)
    x = te.placeholder((1, 6, 29), "float32", name="x")
    w = te.placeholder((2, 4, cs.kg), "float32", name="w")
    xp = pad_input(x, cs, 16, 16)
    y = conv_gemm_implicit(w, xp, cs, 16)
    lib = tvm.compile(te.create_prim_func([x, w, y]), target="llvm")
    wt = nh.to_array(model.graph.initializer[0]).reshape(2, 4, cs.kg)
    out = tvm.runtime.tensor(np.zeros([int(d) for d in y.shape], np.float32))
    lib(tvm.runtime.tensor(feeds["x"]), tvm.runtime.tensor(wt), out)
    np.testing.assert_allclose(out.numpy()[..., :cs.length], want, rtol=1e-4, atol=1e-4)


# 2-D convs whose output rows hold whole vectors: strided.im2col_2d's row loads (+ shuffle at
# column strides 2-4) against the gather, column by column. (x shape, w shape, strides, pads
# (begin h, begin w, end h, end w), dilation, groups)
ROWS_2D = {
    "3x3-s1-p1-40-wide (a vector straddles rows)": ((1, 4, 9, 40), (8, 4, 3, 3), [1, 1], [1, 1, 1, 1], [1, 1], 1),
    "3x3-s2-p1-70-wide (shuffle; odd output width 35)": ((1, 3, 11, 70), (8, 3, 3, 3), [2, 2], [1, 1, 1, 1], [1, 1], 1),
    "7x7-s4-p3 (SegFormer's patch embed)": ((1, 3, 70, 70), (8, 3, 7, 7), [4, 4], [3, 3, 3, 3], [1, 1], 1),
    "2x3-s(1,3)-asym-pads-dilated": ((1, 4, 8, 100), (8, 4, 2, 3), [1, 3], [0, 2, 1, 0], [2, 2], 1),
    "3x3-grouped-batch2": ((2, 8, 6, 33), (8, 2, 3, 3), [1, 1], [1, 1, 1, 1], [1, 1], 4),
}


@pytest.mark.parametrize("name", list(ROWS_2D))
def test_im2col_2d_row_loads_match_the_gather(name):
    from blockforge.compile.conv.strided import applies_2d, im2col_2d

    xs, ws, st, pads, dl, groups = ROWS_2D[name]
    cs = ConvShape(list(xs), list(ws), st, pads, dl, groups)
    assert applies_2d(cs, 16, 64)
    func = im2col_2d(list(xs), cs, 64, 16).with_attr("global_symbol", "main")
    assert bool(_shuffles(func)) == (st[1] > 1)
    _assert_columns_are_the_gathers(func, xs, cs)


def _assert_columns_are_the_gathers(func, xs, cs: ConvShape) -> None:
    """A parallel im2col PrimFunc writes exactly the columns rewrite.im2col's gather does (CPUIm2col
    scheduled), the panel's tail past L included (zeros; the outputs start as NaN)."""
    assert any(lp.kind == tirx.ForKind.PARALLEL for lp in _loops(func))
    x = te.placeholder(xs, "float32", name="x")
    ref = tvm.compile(tvm.IRModule({"main": _scheduled(CPUIm2col(), te.create_prim_func([x, im2col(x, cs, 64)]))}),
                      target=AVX512).mod
    got = tvm.compile(tvm.IRModule({"main": func}), target=AVX512).mod
    xn = np.random.default_rng(1).standard_normal(xs).astype(np.float32)
    outs = [tvm.runtime.tensor(np.full(cs.cols_shape(64), np.nan, np.float32)) for _ in range(2)]
    ref(tvm.runtime.tensor(xn), outs[0])
    got(tvm.runtime.tensor(xn), outs[1])
    np.testing.assert_array_equal(outs[1].numpy(), outs[0].numpy())


def test_im2col_2d_not_for_narrow_outputs():
    from blockforge.compile.conv.strided import applies_2d

    assert not applies_2d(ConvShape([1, 4, 8, 8], [8, 4, 3, 3], [1, 1], [1, 1, 1, 1], [1, 1], 1), 16, 64)  # OW 8
    assert not applies_2d(ConvShape([1, 4, 8, 200], [8, 4, 3, 3], [1, 5], [1, 1, 1, 1], [1, 1], 1), 16, 64)  # stride 5


# 2-D convs whose output rows are narrower than a vector: strided.im2col_narrow's (oh, ow) loops
# against the gather, and inside a model against ORT (ablation conv-narrow-rows).
NARROW_2D = {
    "3x3-s1-p1-14x14 (ResNet-50's stage 3)": ((1, 16, 14, 14), (8, 16, 3, 3), [1, 1], [1, 1, 1, 1], [1, 1], 1),
    "3x3-s2-p1-odd (7 x 7 out of 13 x 13)": ((1, 4, 13, 13), (8, 4, 3, 3), [2, 2], [1, 1, 1, 1], [1, 1], 1),
    "1x1-s2 (ResNet's downsample at 7 x 7)": ((1, 8, 14, 14), (8, 8, 1, 1), [2, 2], [0, 0, 0, 0], [1, 1], 1),
    "2x3-asym-pads-dilated-grouped-batch2": ((2, 8, 9, 11), (8, 2, 2, 3), [1, 2], [0, 2, 1, 0], [2, 2], 4),
    "5x5-p2-one-panel-exactly (8 x 8 = 64)": ((1, 3, 8, 8), (4, 3, 5, 5), [1, 1], [2, 2, 2, 2], [1, 1], 1),
    "3x3-s2-28-wide (ResNet-50's stride-2 3x3: rows of 28, no whole vectors)":
        ((1, 4, 56, 56), (8, 4, 3, 3), [2, 2], [1, 1, 1, 1], [1, 1], 1),
}


@pytest.mark.parametrize("name", list(NARROW_2D))
def test_im2col_narrow_matches_the_gather(name):
    from blockforge.compile.conv.strided import applies_narrow, im2col_narrow

    xs, ws, st, pads, dl, groups = NARROW_2D[name]
    cs = ConvShape(list(xs), list(ws), st, pads, dl, groups)
    assert applies_narrow(cs, 16)
    _assert_columns_are_the_gathers(im2col_narrow(list(xs), cs, 64).with_attr("global_symbol", "main"), xs, cs)


@pytest.mark.parametrize("name", list(NARROW_2D))
def test_conv_2d_narrow_matches_ort(name):
    xs, ws, st, pads, dl, groups = NARROW_2D[name]
    model, feeds, want = _conv_model(xs, ws, strides=st, pads=pads, dilations=dl, group=groups, act="Relu")
    got = BlockforgeBackend.prepare(model).run(feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_narrow_rows_is_the_ablation():
    """conv-narrow-rows off: the same conv on the gather (one im2col kernel either way)."""
    model, _, _ = _conv_model((1, 16, 28, 28), (8, 16, 3, 3), strides=[2, 2], pads=[1, 1, 1, 1])
    for without, row_loops in ((set(), True), ({"conv-narrow-rows"}, False)):
        mod, _ = run_phases(import_onnx(model), resolve("host"), stop_after="conv-gemm", without=without)
        im2col = [f for gv, f in mod.functions_items() if "im2col" in gv.name_hint]
        assert len(im2col) == 1 and ("T.sblock" not in im2col[0].script()) == row_loops


@pytest.mark.parametrize("name", list(ROWS_2D))
def test_conv_2d_on_row_loads_matches_ort(name):
    xs, ws, st, pads, dl, groups = ROWS_2D[name]
    model, feeds, want = _conv_model(xs, ws, strides=st, pads=pads, dilations=dl, group=groups, act="Relu")
    got = BlockforgeBackend.prepare(model).run(feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


# One-group 1x1 unpadded convs whose positions fill their 64-wide column panels badly (ResNet's 7 x 7
# and 14 x 14 stages: 77%) run the transposed GEMM, positions in 6-row tiles, x read in place at
# the stride (rewrite.conv_gemm_rows). (x shape, w shape, Conv attributes, activation)
ROWS = {
    "1x1-s1-14x14 (rows past 196 re-read position 195)": ((1, 64, 14, 14), (128, 64, 1, 1), {}, "Relu"),
    "1x1-s2-batch2 (the downsample: 28 x 28 read at 14 x 14)": ((2, 32, 28, 28), (48, 32, 1, 1), dict(strides=[2, 2]),
                                                               None),
    "1x1-s1-9x9-batch2 (81 positions: 84 rows)": ((2, 16, 9, 9), (32, 16, 1, 1), {}, "Relu"),
    "1x1-strides-2x3-non-square (14 x 7 of 28 x 21)": ((1, 16, 28, 21), (32, 16, 1, 1), dict(strides=[2, 3]), None),
    "1d-k1-s2-L98 (a strided 1-D 1x1)": ((1, 32, 195), (32, 32, 1), dict(strides=[2]), "Gelu"),
}


def _conv_gemm_rows_extents(model, without=frozenset()) -> list[tuple[int, ...]]:
    """The packed_matmul blocks' data-parallel extents of the model's conv GEMMs after conv-gemm."""
    mod, _ = run_phases(import_onnx(model), resolve("host"), stop_after="conv-gemm", without=without)
    out = []
    for gv, f in mod.functions_items():
        if gv.name_hint.startswith("conv_gemm"):
            mm = [r.block for r in _blocks(f).values() if r.block.name_hint == "packed_matmul"]
            out += [tuple(int(iv.dom.extent) for iv in b.iter_vars[:-1]) for b in mm]
    return out


@pytest.mark.parametrize("name", list(ROWS))
def test_conv_on_position_rows_matches_ort(name):
    xs, ws, attrs, act = ROWS[name]
    model, feeds, want = _conv_model(xs, ws, act=act, **attrs)
    (extents,) = _conv_gemm_rows_extents(model)
    length = int(np.prod(want.shape[2:]))
    assert extents == (xs[0], -(-length // 6) * 6, ws[0]), "the transposed GEMM: (batch, whole row tiles, channels)"
    got = BlockforgeBackend.prepare(model).run(feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_rows_applies_where_column_panels_are_poorly_filled():
    from blockforge.compile.conv.rewrite import rows_applies, rows_panel

    def cs(c, o, hw, groups=1):
        return ConvShape([1, c, hw, hw], [o, c // groups, 1, 1], [1, 1], [0, 0, 0, 0], [1, 1], groups)

    assert rows_applies(cs(64, 64, 14), 64, 16) and rows_applies(cs(64, 64, 9), 64, 16)  # 196 / 256, 81 / 128
    assert not rows_applies(cs(64, 64, 28), 64, 16)  # 784 / 832 = 94%
    assert not rows_applies(cs(64, 64, 7), 64, 16)  # 49 / 64: one panel (measured slower as rows)
    assert not rows_applies(cs(64, 64, 56), 64, 16) and not rows_applies(cs(64, 64, 8), 64, 16)  # whole panels
    assert not rows_applies(cs(64, 40, 7), 64, 16)  # channels in no whole vector
    assert not rows_applies(cs(64, 64, 7, groups=2), 64, 16)  # grouped: the column GEMM's group index
    k3 = ConvShape([1, 64, 7, 7], [64, 64, 3, 3], [1, 1], [1, 1, 1, 1], [1, 1], 1)
    assert not rows_applies(k3, 64, 16)  # columns needed: measured slower so, they keep the column panels
    padded = ConvShape([1, 64, 5, 5], [64, 64, 1, 1], [1, 1], [1, 1, 1, 1], [1, 1], 1)
    assert not rows_applies(padded, 64, 16)
    assert (rows_panel(2048, 64, 16), rows_panel(96, 64, 16), rows_panel(48, 64, 16)) == (64, 32, 16)


def test_conv_rows_is_the_ablation():
    """conv-rows off: the positions are the GEMM's columns again, in whole 64-wide panels."""
    model, _, _ = _conv_model((1, 32, 28, 28), (64, 32, 1, 1), strides=[2, 2])
    assert _conv_gemm_rows_extents(model) == [(1, 198, 64)]
    assert _conv_gemm_rows_extents(model, {"conv-rows"}) == [(1, 64, 256)]


def test_conv_gemm_rows_schedule_vector_channels_transposed_write_at_the_tile():
    """The transposed GEMM is CPUMatmul's prepacked path (6 rows x 64 channels, vectorised along the
    channels, unguarded: whole row tiles); the transposed write-back of its L real positions runs at
    each tile, inside the parallel loop, guarded at the last tile's rows past L."""
    from blockforge.compile.conv.rewrite import conv_gemm_rows

    cs = ConvShape([1, 32, 7, 7], [128, 32, 1, 1], [1, 1], [0, 0, 0, 0], [1, 1], 1)
    x = te.placeholder((1, 32, 7, 7), "float32", name="x")
    wp = te.placeholder((2, 32, 64), "float32", name="wp")
    y = conv_gemm_rows(x, wp, cs, 6)
    out = _scheduled(CPUMatmul(), te.create_prim_func([x, wp, y]))
    blocks = _blocks(out)
    assert isinstance(blocks["packed_matmul_update"].predicate, tirx.IntImm)
    kinds = [(lp.kind, int(lp.extent)) for lp in _loops(out)]
    assert (tirx.ForKind.VECTORIZED, 64) in kinds and (tirx.ForKind.UNROLLED, 6) in kinds
    assert (tirx.ForKind.PARALLEL, 2 * 9) in kinds  # 2 channel panels x 9 row tiles
    crop = blocks["conv_crop"]
    assert not isinstance(crop.predicate, tirx.IntImm) and "49" in str(crop.predicate)
    parallel = next(lp for lp in _loops(out) if lp.kind == tirx.ForKind.PARALLEL)
    inside = []
    tvm_ffi.structural_walk(parallel.body, [(tvm.s_tir.stmt.SBlockRealize, lambda r: inside.append(r.block.name_hint))])
    assert "conv_crop" in inside


# Stride-1 2-D convs as the wide implicit GEMM over the padded image (rewrite.conv_gemm_wide): no
# im2col columns. (x shape, w shape, Conv attributes, activation)
WIDE = {
    "3x3-p1-7x7 (ResNet-50's stage 4: Wp 9, 63 wide positions in one panel)": ((1, 32, 7, 7), (64, 32, 3, 3),
                                                                                dict(pads=[1, 1, 1, 1]), "Relu"),
    "3x3-p1-14x14-batch2": ((2, 16, 14, 14), (16, 16, 3, 3), dict(pads=[1, 1, 1, 1]), "Relu"),
    "3x3-p2-dilated-2 (taps 2 rows / columns apart)": ((1, 8, 30, 30), (8, 8, 3, 3), dict(pads=[2, 2, 2, 2],
                                                                                           dilations=[2, 2]), None),
    "3x2-asymmetric-pads": ((1, 8, 10, 9), (12, 8, 3, 2), dict(pads=[0, 1, 2, 0]), "Relu"),
    "3x3-valid (no padding)": ((1, 8, 30, 30), (8, 8, 3, 3), {}, None),
}


def _wide_gemms(model, without=frozenset()) -> int:
    """How many conv GEMMs after conv-gemm read a tap table (the wide GEMM's third operand)."""
    mod, _ = run_phases(import_onnx(model), resolve("host"), stop_after="conv-gemm", without=without)
    return sum(1 for gv, f in mod.functions_items() if gv.name_hint.startswith("conv_gemm")
               and any(len(r.block.reads) == 3 and "conv_panel_width" in r.block.annotations for r in _blocks(f).values()))


@pytest.mark.parametrize("name", list(WIDE))
def test_conv_as_wide_implicit_gemm_matches_ort(name):
    xs, ws, attrs, act = WIDE[name]
    model, feeds, want = _conv_model(xs, ws, act=act, **attrs)
    assert _wide_gemms(model) == 1 and _convs_left(model) == 0
    got = BlockforgeBackend.prepare(model).run(feeds)[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_wide_applies_and_its_tap_table():
    from blockforge.compile.conv.rewrite import wide_applies, wide_taps, wide_width

    def cs(hw, k, stride=1, pad=1, groups=1, o=16, c=16):
        return ConvShape([1, c, *hw], [o, c // groups, *k], [stride, stride], [pad] * 4, [1, 1], groups)

    assert wide_applies(cs((56, 56), (3, 3)), 64) and wide_applies(cs((7, 7), (3, 3)), 64)
    assert not wide_applies(cs((14, 14), (3, 3), stride=2), 64)  # strided: the taps' runs are no runs
    assert not wide_applies(cs((14, 14), (1, 1), pad=0), 64)  # 1x1: the pointwise path
    assert not wide_applies(cs((14, 14), (3, 3), groups=2), 64)
    assert not wide_applies(cs((14, 14), (3, 3), o=2), 64)  # a row per group: not a GEMM
    assert not wide_applies(cs((16, 2), (3, 3), pad=3), 64)  # 6 of 8 per row kept: 3 panels for 2
    assert wide_applies(cs((2048, 2048), (3, 3), c=64), 64)
    assert not wide_applies(cs((2048, 2048), (3, 3), c=512), 64)  # 2.1e9 floats: past the tap table's int32
    c = cs((5, 6), (2, 3), pad=1, o=4, c=2)
    wp, rows = wide_width(c), 9
    assert wp == 8 and list(wide_taps(c, rows)) == [ch * rows * wp + th * wp + tw
                                                    for ch in range(2) for th in range(2) for tw in range(3)]


def test_conv_wide_is_the_ablation():
    """conv-wide off: the stride-1 3x3 writes its im2col columns again."""
    model, _, _ = _conv_model((1, 16, 28, 28), (16, 16, 3, 3), pads=[1, 1, 1, 1])
    for without, wide in ((set(), 1), ({"conv-wide"}, 0)):
        mod, _ = run_phases(import_onnx(model), resolve("host"), stop_after="conv-gemm", without=without)
        names = [gv.name_hint for gv, _ in mod.functions_items()]
        assert _wide_gemms(model, without) == wide and any("im2col" in n for n in names) == (not wide)


def test_conv_gemm_wide_schedule_whole_panels_vector_loads_at_the_tap():
    """CPUMatmul's implicit-GEMM path: 6 rows x 64 positions, vectorised, unguarded (whole panels),
    the tap's start read from the table once per k step (no division by the kernel's size)."""
    from blockforge.compile.conv.rewrite import conv_gemm_wide

    cs = ConvShape([1, 16, 14, 14], [12, 16, 3, 3], [1, 1], [1, 1, 1, 1], [1, 1], 1)
    w = te.placeholder((1, 12, cs.kg), "float32", name="w")
    xp = te.placeholder((1, 16 * 20 * 16), "float32", name="xp")
    taps = te.placeholder((cs.kg,), "int32", name="taps")
    out = _scheduled(CPUMatmul(), te.create_prim_func([w, xp, taps, conv_gemm_wide(w, xp, taps, cs, 64)]))
    update = _blocks(out)["packed_matmul_update"]
    assert isinstance(update.predicate, tirx.IntImm)
    kinds = [(lp.kind, int(lp.extent)) for lp in _loops(out)]
    assert (tirx.ForKind.VECTORIZED, 64) in kinds and (tirx.ForKind.UNROLLED, 6) in kinds
    assert (tirx.ForKind.PARALLEL, 4 * 2) in kinds  # 224 wide positions: 4 panels x 2 row tiles
    text = str(update.block.body)
    assert "taps[" in text and "//" not in text and "%" not in text
