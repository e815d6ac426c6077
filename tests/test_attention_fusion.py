"""The fused CPU attention kernel and its Relax pass: what matches (and what must not),
the kernel against a float64 numpy reference (masks, causal skipping, fully masked rows,
ragged tiles, layouts, float16), tile records in the tuning database, and end-to-end
parity of the fused builds against ONNX Runtime and the oracle."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
import pytest

tvm = pytest.importorskip("tvm")
from tvm import relax  # noqa: E402

from blockforge.compile import VerifyOptions, attention, verify  # noqa: E402
from blockforge.compile.frontend.importer import import_onnx  # noqa: E402
from blockforge.compile.schedule.base import vector_lanes  # noqa: E402
from blockforge.compile.pipeline import build, run_phases  # noqa: E402
from blockforge.compile.session import open_model  # noqa: E402
from blockforge.graph import MHASpec, export  # noqa: E402
from blockforge.graph.model_io import random_inputs  # noqa: E402
from blockforge.targets import resolve  # noqa: E402

HOST = resolve("host")
TARGET = HOST.tvm_target()
LANES = vector_lanes(TARGET)


def _fuse(mod):
    with TARGET:
        return attention.fuse_attention(TARGET)(mod)


def _calls(mod) -> list:
    """The fused kernels a module calls, as specs (with their tiles)."""
    out = []
    for _, f in mod.functions_items():
        if isinstance(f, tvm.tirx.PrimFunc) and attention.is_kernel(f):
            out.append(attention.AttentionSpec.from_json(str(f.attrs[attention.KERNEL_ATTR])))
    return out


def pipeline_kernel_script(seq: int, d: int, without=frozenset()) -> str:
    """The fused kernel's TVMScript for softmax(q k^T) v over (1, 2, seq, d), through the pipeline
    up to fuse-attention with the ablations in `without` (where a kernel ablation must reach)."""
    bb = relax.BlockBuilder()
    q, v = (relax.Var(n, relax.TensorType((1, 2, seq, d), "float32")) for n in ("q", "v"))
    kt = relax.Var("kt", relax.TensorType((1, 2, d, seq), "float32"))
    with bb.function("main", [q, kt, v]):
        with bb.dataflow():
            p = bb.emit(relax.op.nn.softmax(bb.emit(relax.op.matmul(q, kt)), axis=-1))
            o = bb.emit_output(relax.op.matmul(p, v))
        bb.emit_func_output(o)
    mod, _ = run_phases(bb.get(), HOST, stop_after="fuse-attention", without=set(without))
    (text,) = [f.script() for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc) and attention.is_kernel(f)]
    return text


def _ops(mod) -> list[str]:
    names = []
    for b in mod["main"].body.blocks:
        for bd in b.bindings:
            op = getattr(getattr(bd.value, "op", None), "name", None)
            if op:
                names.append(op)
    return names


def _model(tmp_path: Path, **kw) -> Path:
    path = tmp_path / "m.onnx"
    export(MHASpec(d_model=64, heads=4, **kw), path)
    return path


# ---------------------------------------------------------------- matching (Relax level)

@pytest.mark.parametrize("kw, want", [
    (dict(), dict(q="bshd", k="bhds", v="bshd", o="bshd", heads=4, causal=False, add=None, keep=None)),
    (dict(layout="packed"), dict(q="bshd", k="bhds", v="bshd", o="bshd", heads=4)),
    (dict(layout="packed", causal=True, mask="bool"), dict(causal=True, keep=("b", "1", "1", "k"))),
    (dict(mask="additive"), dict(add=("b", "1", "k"), keep=None)),
    (dict(causal=True), dict(causal=True, keep=None)),
    (dict(cross=True, layout="packed"), dict(same_len=False, sq=None, skv=None)),
])
def test_builder_forms_fuse_into_one_multi_head_call(tmp_path, kw, want):
    """Per-head (h attentions over split projections, concatenated) and packed layouts,
    masks and causal, symbolic seq: one kernel call, no softmax, no scores left."""
    mod = _fuse(import_onnx(onnx.load(_model(tmp_path, **kw))))
    specs = _calls(mod)
    assert len(specs) == 1, specs
    ops = _ops(mod)
    assert "relax.nn.softmax" not in ops and "relax.concat" not in ops and "relax.split" not in ops, ops
    assert ops.count("relax.call_tir") == 1 and ops.count("relax.permute_dims") == 1  # K^T only
    spec = specs[0]
    for k, v in want.items():
        assert getattr(spec, k) == v, (k, spec)
    assert math.isclose(spec.scale, 1 / 4)  # 1/sqrt(d_k), d_k = 16


def test_static_causal_constant_is_recognised(tmp_path):
    """With seq bound, the importer folds the causal mask into a (S, S) constant."""
    path = _model(tmp_path, causal=True, mask="bool", layout="packed")
    mod = _fuse(import_onnx(onnx.load(path), {"batch": 2, "seq": 16}))
    (spec,) = _calls(mod)
    assert spec.causal and spec.keep == ("b", "1", "1", "k") and spec.sq == spec.skv == 16


def _decomposed(q_shape, k_shape, v_shape, *, scale=0.125, mask=None, mask_shape=None, softmax_axis=-1,
                extra_use=False, where=None, scale_tensor=False, self_add=False, biases=()):
    """The plain decomposition of ONNX Attention: matmul(q, permute_dims(k)) * scale (+ mask) ->
    softmax -> matmul(., v), with knobs for the near misses. biases: shapes of float32 inputs
    added to the scores one by one before the mask (MPNet's relative-position bias)."""
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType(q_shape, "float32"))
    k = relax.Var("k", relax.TensorType(k_shape, "float32"))
    v = relax.Var("v", relax.TensorType(v_shape, "float32"))
    params = [q, k, v]
    bias_vars = [relax.Var(f"bias{i}", relax.TensorType(shape, "float32")) for i, shape in enumerate(biases)]
    params += bias_vars
    m = None
    if mask is not None:
        m = relax.Var("m", relax.TensorType(mask_shape, mask))
        params.append(m)
    with bb.function("main", params):
        with bb.dataflow():
            kt = bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2]))
            s = bb.emit(relax.op.matmul(q, kt))
            shape = {False: (1,), True: (q_shape[-2], 1), "heads": (q_shape[1], 1, 1)}[scale_tensor]
            c = relax.const(np.full(shape, scale, "float32"))
            s = bb.emit(relax.op.multiply(s, c))
            for bv in bias_vars:
                s = bb.emit(relax.op.add(s, bv))
            if mask == "float32":
                s = bb.emit(relax.op.add(s, m))
            if self_add:
                s = bb.emit(relax.op.add(s, s))
            if mask == "bool":
                fill = relax.const(np.float32(-1e30))
                s = bb.emit(relax.op.where(m, fill, s) if where == "inverted" else relax.op.where(m, s, fill))
            p = bb.emit(relax.op.nn.softmax(s, softmax_axis))
            o = bb.emit(relax.op.matmul(p, v))
            out = bb.emit_output(relax.Tuple([o, p]) if extra_use else o)
        bb.emit_func_output(out)
    return bb.get()


B, H, S, D = 2, 4, 24, 16


def test_onnx_attention_decomposition_fuses():
    mod = _decomposed((B, H, S, D), (B, H, S, D), (B, H, S, D), mask="float32", mask_shape=(S, S))
    (spec,) = _calls(_fuse(mod))
    assert (spec.q, spec.k, spec.v, spec.o) == ("bhsd", "bhds", "bhsd", "bhsd")
    assert spec.add == ("q", "k") and spec.scale == 0.125 and (spec.batch, spec.sq, spec.skv) == (B, S, S)


@pytest.mark.parametrize("near_miss", [
    dict(softmax_axis=2),  # softmax over the queries
    dict(extra_use=True),  # the probabilities are an output too: the scores must exist
    dict(mask="bool", mask_shape=(B, 1, 1, S), where="inverted"),  # where(mask, fill, scores)
    dict(scale_tensor=True),  # a per-row scale, not a scalar
    dict(self_add=True),  # scores + scores: not a mask
])
def test_near_misses_do_not_fuse(near_miss):
    mod = _decomposed((B, H, S, D), (B, H, S, D), (B, H, S, D), **near_miss)
    fused = _fuse(mod)
    assert _calls(fused) == [] and "relax.nn.softmax" in _ops(fused)


def test_scores_plus_bias_plus_mask_fuse_with_one_summed_mask():
    """((s * c + bias) + mask): the addends are summed into the kernel's one additive mask,
    ahead of the call (MPNet's attention was left unfused: "an add before softmax whose scores
    side is not Q K^T")."""
    mod = _decomposed((B, H, S, D), (B, H, S, D), (B, H, S, D), mask="float32", mask_shape=(B, 1, 1, S),
                      biases=[(1, H, S, S)])
    fused = _fuse(mod)
    (spec,) = _calls(fused)
    assert spec.add == ("b", "h", "q", "k"), "the summed mask's shape: the bias's heads and the mask's batch"
    assert "relax.nn.softmax" not in _ops(fused) and _ops(fused).count("relax.add") == 1


def test_layers_sharing_bias_and_mask_sum_them_once():
    """MPNet's 12 layers add one constant (1, h, S, S) bias and one mask: one sum for all the
    layers' kernels (each sum reads and writes the whole bias: 12.6 MB a layer at seq 512)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((B, H, S, D), "float32"))
    m = relax.Var("m", relax.TensorType((B, 1, 1, S), "float32"))
    bias_np = np.random.default_rng(0).standard_normal((1, H, S, S)).astype(np.float32)
    bias = relax.const(bias_np)
    with bb.function("main", [x, m]):
        with bb.dataflow():
            h = x
            for _ in range(3):
                s = bb.emit(relax.op.matmul(h, bb.emit(relax.op.permute_dims(h, [0, 1, 3, 2]))))
                s = bb.emit(relax.op.add(bb.emit(relax.op.add(bb.emit(relax.op.multiply(s, relax.const(np.float32(0.25)))),
                                                              bias)), m))
                h = bb.emit(relax.op.matmul(bb.emit(relax.op.nn.softmax(s)), h))
            out = bb.emit_output(h)
        bb.emit_func_output(out)
    fused = _fuse(bb.get())
    assert _ops(fused).count("relax.add") == 1 and _ops(fused).count("relax.call_tir") == 3
    rng = np.random.default_rng(1)
    xs, ms = rng.standard_normal((B, H, S, D)).astype(np.float32), np.where(rng.random((B, 1, 1, S)) < 0.8, 0, -1e9)
    vm = relax.VirtualMachine(build(fused, HOST).executable, tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(xs), tvm.runtime.tensor(ms.astype(np.float32))).numpy()
    want = xs.astype(np.float64)
    for _ in range(3):
        sc = want @ want.transpose(0, 1, 3, 2) * 0.25 + bias_np + ms
        e = np.exp(sc - sc.max(-1, keepdims=True))
        want = e / e.sum(-1, keepdims=True) @ want
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_addends_past_the_limit_do_not_fuse():
    from blockforge.compile.attention.match import MAX_ADDENDS

    shapes = [(S, S)] * MAX_ADDENDS
    assert len(_calls(_fuse(_decomposed((B, H, S, D), (B, H, S, D), (B, H, S, D), biases=shapes)))) == 1
    mod = _decomposed((B, H, S, D), (B, H, S, D), (B, H, S, D), biases=shapes + [(S, S)])
    assert _calls(_fuse(mod)) == []


def _softcapped(cap=50.0, divide=True, cap_out=None):
    """Gemma 2's scores: tanh(Q K^T * 0.0625 / cap) * cap, + an additive mask."""
    bb = relax.BlockBuilder()
    q, k, v = (relax.Var(n, relax.TensorType((B, H, S, D), "float32")) for n in "qkv")
    m = relax.Var("m", relax.TensorType((B, 1, 1, S), "float32"))
    f32 = lambda x: relax.const(np.float32(x))  # noqa: E731
    with bb.function("main", [q, k, v, m]):
        with bb.dataflow():
            s = bb.emit(relax.op.multiply(bb.emit(relax.op.matmul(q, bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2])))),
                                          f32(0.0625)))
            s = bb.emit(relax.op.divide(s, f32(cap)) if divide else relax.op.multiply(s, f32(1 / cap)))
            s = bb.emit(relax.op.multiply(bb.emit(relax.op.tanh(s)), f32(cap if cap_out is None else cap_out)))
            p = bb.emit(relax.op.nn.softmax(bb.emit(relax.op.add(s, m))))
            out = bb.emit_output(bb.emit(relax.op.matmul(p, v)))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("divide", [True, False])
def test_softcapped_scores_fuse(divide):
    """Gemma 2's logit soft-capping was left unfused ("the scores come from relax.tanh"): the
    kernel's softcap * tanh(Q K^T * scale) takes it, the inner 1 / cap folded into the scale."""
    fused = _fuse(_softcapped(divide=divide))
    (spec,) = _calls(fused)
    assert spec.softcap == 50.0 and spec.scale == pytest.approx(0.0625 / 50) and spec.add == ("b", "1", "1", "k")
    assert "relax.tanh" not in _ops(fused) and "softcap=50" in spec.describe()


def test_onnx_attention_op_softcap_fused_matches_ort(tmp_path, monkeypatch):
    """The ONNX Attention op's softcap (its converter writes softcap * tanh(scores / softcap)),
    causal: one fused kernel, ORT's output."""
    from blockforge.graph import ort as ort_runner

    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    vi = helper.make_tensor_value_info
    ins = [vi(x, TensorProto.FLOAT, [2, 2, 70, 16]) for x in ("q", "k", "v")]
    node = helper.make_node("Attention", ["q", "k", "v"], ["y"], softcap=2.0, is_causal=1)
    m = helper.make_model(helper.make_graph([node], "g", ins, [vi("y", TensorProto.FLOAT, [2, 2, 70, 16])]),
                          opset_imports=[helper.make_opsetid("", 23)])
    m.ir_version = 10
    onnx.save(m, tmp_path / "a.onnx")
    session = open_model(tmp_path / "a.onnx", HOST, {})
    mod, _ = run_phases(session.relax(), HOST, stop_after="fuse-attention")
    (spec,) = attention.kernel_specs(mod)
    assert spec.softcap == 2.0 and spec.add == ("q", "k"), "the causal mask: the converter's additive bias"
    inputs = {k: 3 * v for k, v in random_inputs(session.inputs, {}, seed=4).items()}  # some scores past the cap
    want = ort_runner.run(session.model, inputs)["y"]
    vm = relax.VirtualMachine(build(session.relax(), HOST).executable, tvm.cpu())
    got = vm["main"](*[tvm.runtime.tensor(inputs[s.name]) for s in session.inputs]).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_softcap_of_a_negative_cap_does_not_fuse():
    assert _calls(_fuse(_softcapped(cap=-50.0))) == []


@pytest.mark.parametrize("sq, skv, causal", [(70, 70, False), (150, 150, True), (9, 40, False)])
def test_kernel_softcap_matches_numpy(sq, skv, causal):
    """The kernel's softcap (flash.fast_tanh: a rational minimax form, no cancellation near 0)
    against float64 numpy, scores large enough to saturate the tanh and small enough to be linear."""
    spec = _spec(scale=0.5, softcap=3.0, causal=causal, fill=0.0 if causal else None)
    got, want = _run_kernel(spec, (64, 4 * LANES), 2, sq, skv)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dv, causal", [(36, False), (48, True), (60, False), (24, True)])
def test_kernel_head_sizes_off_powers_of_two(dv, causal):
    """MobileViT's heads (36, 48, 60 wide): P V's rows as whole vectors and power-of-two tails
    (flash.vec_chunks), not one loop dv wide, which LLVM scalarised (15x slower); the causal
    fix-up's rows too."""
    from blockforge.compile.attention.flash import vec_chunks

    spec = _spec(d=dv, dv=dv, causal=causal, fill=0.0 if causal else None)
    got, want = _run_kernel(spec, (64, 4 * LANES), 2, 70, 70)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    widths = {int(w) for w in re.findall(r"T\.vectorized\(T\.int64\((\d+)\)\)", attention.kernel(spec, (64, 4 * LANES), LANES).script())}
    assert widths and all(w & (w - 1) == 0 for w in widths), widths
    assert sum(w for _, w in vec_chunks(dv, LANES)) == dv


def test_fast_tanh_matches_numpy():
    from tvm import te, tirx

    from blockforge.compile.attention.flash import fast_tanh

    a = np.concatenate([np.linspace(-10, 10, 4001, dtype=np.float32), np.float32([1e-6, -3e-4, 1e-30]),
                        np.float32([np.inf, -np.inf, np.nan])])
    x = te.placeholder((tirx.const(a.size, "int64"),), "float32", name="x")
    y = te.compute(x.shape, lambda i: fast_tanh(x[i]), name="y")
    lib = tvm.compile(tvm.IRModule({"main": te.create_prim_func([x, y])}), target=TARGET)
    out = tvm.runtime.tensor(np.zeros(a.shape, np.float32))
    lib["main"](tvm.runtime.tensor(a), out)
    got = out.numpy()
    np.testing.assert_allclose(got[:-3], np.tanh(a[:-3].astype(np.float64)), rtol=4e-7, atol=0)
    assert abs(got[-3] - 1) < 4e-7 and abs(got[-2] + 1) < 4e-7 and np.isnan(got[-1])


def test_broadcast_batch_does_not_fuse():
    mod = _decomposed((B, H, S, D), (1, H, S, D), (B, H, S, D))
    assert _calls(_fuse(mod)) == []


# ---------------------------------------------------------------- the kernel against numpy

def _reference(q, kt, v, spec, add=None, keep=None):
    """float64 softmax(q k^T * scale (+ add), where keep/causal else fill) v, in (b, h, s, d)."""
    s = np.einsum("bhsd,bhdk->bhsk", q.astype(np.float64), kt.astype(np.float64)) * spec.scale
    if spec.softcap:
        s = spec.softcap * np.tanh(s)
    if add is not None:
        s = s + add.astype(np.float64)
    allowed = None if keep is None else np.broadcast_to(keep, s.shape)
    if spec.causal:
        c = np.tril(np.ones(s.shape[-2:], bool))
        allowed = c if allowed is None else (allowed & c)
    if allowed is not None:
        s = np.where(allowed, s, spec.fill)
    with np.errstate(invalid="ignore"):
        e = np.exp(s - s.max(-1, keepdims=True))
        return np.einsum("bhsk,bhkd->bhsd", e / e.sum(-1, keepdims=True), v.astype(np.float64))


def _run_kernel(spec, tiles, b, sq, skv, *, keep_fn=None, add_fn=None, seed=0):
    rng = np.random.default_rng(seed)
    h, d = spec.heads, spec.d
    q = rng.standard_normal((b, h, sq, d)).astype(spec.dtype)
    k = rng.standard_normal((b, h, skv, d)).astype(spec.dtype)
    v = rng.standard_normal((b, h, skv, spec.dv)).astype(spec.dtype)
    kt = np.ascontiguousarray(k.transpose(0, 1, 3, 2))
    lay = {"bhsd": lambda x: x, "bshd": lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3))}
    args = [lay[spec.q](q), k if spec.k in attention.KEY_ROWS else kt, lay[spec.v](v)]
    add = keep = None
    if spec.add:
        add = add_fn(rng, (b, 1, 1, skv)).astype(spec.add_dtype)
        args.append(add)
    if spec.keep:
        keep = keep_fn(rng, (b, 1, 1, skv))
        args.append(keep)
    lib = tvm.compile(tvm.IRModule({"main": attention.kernel(spec, tiles, LANES)}), target=TARGET)
    out = tvm.runtime.tensor(np.zeros((b, sq, h, spec.dv) if spec.o == "bshd" else (b, h, sq, spec.dv), spec.dtype))
    lib["main"](*[tvm.runtime.tensor(a) for a in args], out)
    got = out.numpy()
    if spec.o == "bshd":
        got = got.transpose(0, 2, 1, 3)
    return got, _reference(q, kt, v, spec, add, keep)


def _spec(**kw):
    base = dict(dtype="float32", q="bshd", k="bhds", v="bshd", o="bshd", heads=2, d=16, dv=16, scale=0.25)
    return attention.AttentionSpec(**{**base, **kw})


def _padding(rng, shape):
    m = rng.random(shape) < 0.7
    m[1] = False  # batch 1: every key masked out
    return m


@pytest.mark.parametrize("sq, skv, qt, kvecs", [(150, 150, 64, 4), (64, 64, 32, 4), (9, 9, 64, 4),
                                                (130, 70, 48, 8), (20, 70, 32, 4)])
def test_kernel_ragged_tiles(sq, skv, qt, kvecs):
    got, want = _run_kernel(_spec(), (qt, kvecs * LANES), 2, sq, skv)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_kernel_static_ragged_keys_read_k_unclamped(causal):
    """A static key length that is no multiple of the key tile (Whisper's 1500): the last
    tile ends at Skv, overlapping the one before, so every K^T / V read is at an affine
    index; a clamped min(k, Skv - 1) index turns the tail's vector loads into gathers."""
    spec = _spec(sq=150, skv=150, causal=causal, fill=0.0 if causal else None)
    text = attention.kernel(spec, (64, 4 * LANES), LANES).script()
    clamped = []
    for name in ("k_t[", " v["):
        at = text.find(name)
        while at >= 0:
            end, depth = at + len(name), 1
            while depth:  # the subscript up to its matching bracket
                depth += {"[": 1, "]": -1}.get(text[end], 0)
                end += 1
            if "T.min(" in text[at:end]:
                clamped.append(text[at:end])
            at = text.find(name, end)
    assert "k_t[" in text
    assert not clamped


@pytest.mark.parametrize("sq, skv, causal", [(150, 150, False), (150, 150, True), (70, 70, False), (40, 100, False)])
def test_kernel_static_ragged_tail_reads_only_the_vectors_it_needs(sq, skv, causal):
    """Static Skv = n * kt + rest: the last tile is the fewest whole vectors that cover rest,
    ending at Skv (Whisper's 1500 = 23 * 64 + 28: a 32-key tile overlapping 4 keys, where a
    64-key one visited 36 keys twice, 2.3% of the kernel's work), and still exact."""
    kt = 4 * LANES
    rest = skv % kt
    kw = -(-rest // LANES) * LANES
    spec = _spec(sq=sq, skv=skv, batch=2, causal=causal, fill=0.0 if causal else None)
    text = attention.kernel(spec, (64, kt), LANES).script()
    starts = {int(x) for a in _call_args(text, "k_t[", "]") for x in re.findall(r"T\.int64\((\d+)\) \+", a)}
    assert skv - kw in starts and skv - kt not in starts, (sorted(starts), skv - kw)
    got, want = _run_kernel(spec, (64, kt), 2, sq, skv)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def _call_args(text: str, call: str, close: str = ")") -> list[str]:
    """The text inside each `call(...)` (or `name[...]`) in text, to its matching bracket."""
    opener = call[-1]
    out, at = [], text.find(call)
    while at >= 0:
        end, depth = at + len(call), 1
        while depth:
            depth += {opener: 1, close: -1}.get(text[end], 0)
            end += 1
        out.append(text[at + len(call):end - 1])
        at = text.find(call, end)
    return out


def _innermost_loops(text: str, needle: str) -> list[str]:
    """For each line of a TIR script containing needle: the header of its innermost loop."""
    out, lines = [], text.splitlines()
    for n, line in enumerate(lines):
        if needle in line:
            indent = len(line) - len(line.lstrip())
            for up in reversed(lines[:n]):
                head = up.lstrip()
                if len(up) - len(head) < indent and head.startswith("for "):
                    out.append(head)
                    break
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_kernel_row_work_in_whole_vectors(causal):
    """Whisper's 1500-key kernel, its row work as vectors (measured, 1 thread: 0.89x of the
    time before): the scores accumulate in vector-wide pieces (kt-wide accumulators read
    back as vectors made LLVM rebuild them lane by lane), the row max / sum reduce in
    registers (no halving loops narrower than a vector), and the rescale factor's exp runs
    across rows as a vector, not once per row as scalar code."""
    spec = _spec(sq=150, skv=150, d=32, dv=32, causal=causal, fill=0.0 if causal else None)
    text = attention.kernel(spec, (64, 4 * LANES), LANES).script()
    widths = {int(w) for w in re.findall(r"in T\.vectorized\(T\.int64\((\d+)\)\)", text)}
    assert widths == {LANES, 32}, widths  # vectors and the Dv-wide P V rows; no kt-wide, no halves
    exp_loops = _innermost_loops(text, "T.floor(")  # fast_exp: the scores' and alpha's
    assert len(exp_loops) >= 2 and all("T.vectorized" in h for h in exp_loops), exp_loops
    assert "T.Shuffle" in text  # the in-register reductions


@pytest.mark.parametrize("skv, kw", [(1, {}), (17, dict(add=("b", "1", "1", "k"))), (70, dict(keep=("b", "1", "1", "k"),
                                      fill=-1e4)), (129, dict(nan_rows_zero=True))])
def test_kernel_key_rows_one_query(skv, kw):
    """K read as (B, H, S, d) (a decode step's cache, no K^T copy): dot products along d,
    full and ragged key tiles, with each mask form."""
    rng = lambda r, shape: r.standard_normal(shape)  # noqa: E731
    got, want = _run_kernel(_spec(q="bhsd", k="bhsd", v="bhsd", o="bhsd", sq=1, **kw), None, 2, 1, skv,
                            add_fn=rng, keep_fn=_padding)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_kernel_causal_with_padding_skips_tiles_and_fixes_fully_masked_rows():
    """Causal tiles right of the diagonal are skipped; a row whose every key is padded
    out still spreads uniformly over all keys (as where(mask, s, min) then softmax does),
    skipped tiles included."""
    spec = _spec(causal=True, keep=("b", "1", "1", "k"), fill=float(np.finfo(np.float32).min), same_len=True)
    got, want = _run_kernel(spec, (32, 4 * LANES), 2, 150, 150, keep_fn=_padding)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_kernel_additive_mask_fully_masked_row_is_nan_like_softmax():
    """-inf on every key: softmax of the row is NaN (0/0) in ONNX Runtime and numpy; so here."""
    def add(rng, shape):
        a = np.where(rng.random(shape) < 0.7, 0.0, -np.inf)
        a[..., 0] = 0.0
        a[1] = -np.inf
        return a
    got, want = _run_kernel(_spec(add=("b", "1", "1", "k")), None, 2, 80, 80, add_fn=add)
    assert np.isnan(got[1]).all() and np.isnan(want[1]).all()
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-5)


def test_kernel_float16_accumulates_in_float32():
    spec = _spec(dtype="float16", d=64, dv=64, scale=0.125, q="bhsd", v="bhsd", o="bhsd")
    got, want = _run_kernel(spec, None, 1, 100, 100)
    assert got.dtype == np.float16
    # one float16 rounding of the output (the inputs are float16 already in the reference)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=2e-3, atol=2e-3)


# ---------------------------------------------------------------- tile records

def test_tile_choice_round_trips_through_a_tuning_database(tmp_path):
    from tvm.s_tir import meta_schedule as ms

    mod = _decomposed((1, 2, 64, 16), (1, 2, 64, 16), (1, 2, 64, 16), scale=0.25)
    (spec,) = _calls(_fuse(mod))
    db = ms.database.JSONDatabase(work_dir=str(tmp_path))
    wl = db.commit_workload(attention.workload(spec, LANES))
    cands = attention.tile_candidates(LANES)
    for tiles, secs in ((cands[2], 3e-5), (cands[0], 1e-5), (cands[-1], 2e-5)):
        trace = attention.tile_trace(spec, LANES, tiles)
        assert attention.tiles_from_trace(trace) == tiles
        db.commit_tuning_record(ms.database.TuningRecord(trace, wl, [secs], TARGET, None))
    reread = ms.database.JSONDatabase(work_dir=str(tmp_path))
    assert attention.tile_record(reread, spec, TARGET) == cands[0], "the fastest record wins"
    assert attention.tile_record(reread, dataclasses.replace(spec, causal=True), TARGET) is None
    # a record of tiles tune never times (here 1x9999, recorded fastest) picks nothing
    db.commit_tuning_record(ms.database.TuningRecord(
        attention.tile_trace(spec, LANES, (1, 9999), [(1, 9999), *cands]), wl, [1e-6], TARGET, None))
    assert attention.tile_record(db, spec, TARGET) is None
    # the fuse pass applies it: the emitted kernel carries the recorded tiles
    with TARGET:
        fused = attention.fuse_attention(TARGET, reread)(mod)
    (f,) = [f for _, f in fused.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert str(f.attrs[attention.KERNEL_ATTR + ".tiles"]) == "%dx%d" % cands[0]


def test_tune_times_the_tile_candidates_and_compile_applies_the_winner(tmp_path, monkeypatch):
    """tune's tile search with the job's own builder and runner: every candidate recorded,
    the ledger notes the times, and coverage counts the kernel as tuned."""
    from blockforge.tune.attention_tiles import tune_attention_tiles
    from blockforge.tune.database import DeviceDB
    from blockforge.tune.jobs import TuneOptions, make_builder, make_runner
    from blockforge.compile.records.reader import load_database
    from blockforge.compile.pipeline import tuning_coverage

    from blockforge.compile.attention import tiles as attention_tiles

    two = ((32, 4 * LANES), (64, 4 * LANES))
    monkeypatch.setattr(attention_tiles, "candidates", lambda spec, lanes, bf16=False: two)
    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")  # the tile search is under test, not the isolation child
    session = open_model(_model(tmp_path, layout="packed"), HOST, {"batch": 1, "seq": 64})
    db = DeviceDB(tmp_path / "db", HOST, create=True, cpu="cpu-a")
    mod, _ = run_phases(session.relax(), HOST, stop_after="fuse-attention")
    builder = make_builder(HOST, str(tmp_path))
    runner = make_runner(TuneOptions(model=Path("m.onnx")), HOST, 0)
    lines = []
    assert tune_attention_tiles(mod, db, HOST, builder, runner, session.dims, "t", say=lines.append) == 1
    (entry,) = [e for e in db.ledger().values() if "attention_tiles" in e]
    assert set(entry["attention_tiles"]) == {f"{q}x{k}" for q, k in two} and lines
    assert tune_attention_tiles(mod, db, HOST, builder, runner, session.dims, "t") == 0, "reused"
    ms_db, _ = load_database(db.path)
    timed = entry["attention_tiles"]
    legal, _ = run_phases(session.relax(), HOST, database=ms_db, stop_after="legalize")
    (tiles,) = {str(f.attrs[attention.KERNEL_ATTR + ".tiles"]) for _, f in legal.functions_items()
                if isinstance(f, tvm.tirx.PrimFunc) and attention.is_kernel(f)}
    assert timed[tiles] == min(timed.values()), (tiles, timed)  # the fastest (the ledger rounds: ties)
    n, missing = tuning_coverage(legal, HOST, ms_db)
    assert not any(m.startswith("fused_attention") for m in missing)

    # tune's last A/B (the tuned build against the untuned one) covers these records: when
    # the tuned build loses, they are marked to keep the default on this CPU (before, they were
    # left out of it, applied anyway, and tune reported tuned = untuned)
    from test_int8_tiles import tuned_build_loses

    summary = tuned_build_loses(monkeypatch, session, db)
    assert [n for n in summary.kept_default if n.startswith("fused_attention (")] == [entry["task"]]
    ms_db, _ = load_database(db.path, cpu="cpu-a")
    legal, _ = run_phases(session.relax(), HOST, database=ms_db, stop_after="fuse-attention")
    assert {str(f.attrs[attention.KERNEL_ATTR + ".tiles"]) for _, f in legal.functions_items()
            if isinstance(f, tvm.tirx.PrimFunc) and attention.is_kernel(f)} == {"%dx%d" % attention.default_tiles(LANES)}


# ---------------------------------------------------------------- end to end

# (test_compile_host runs every MHA variant through the default, fused, pipeline too;
# these add lengths past one tile and check the build under test is the fused one)
@pytest.mark.parametrize("kw, dims", [
    (dict(), "batch=2,seq=70"),
    (dict(causal=True, layout="packed", mask="additive"), "batch=1,seq=150"),
    (dict(mask="bool", causal=True), None),
    (dict(dtype="float16", mask="bool", layout="packed"), "batch=1,seq=40"),
])
def test_fused_builds_match_ort_and_oracle(tmp_path, kw, dims, monkeypatch):
    from blockforge.graph.model_io import parse_dims

    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")  # the fused numerics are under test, not the child (~3 s CPU a call)
    path = _model(tmp_path, **kw)
    d = parse_dims(dims)
    mod, _ = run_phases(open_model(path, HOST, d).relax(), HOST, stop_after="fuse-attention")
    # float16 models are computed in float32 first (fp32-compute, as ORT's CPU provider does:
    # fused in float16 the scores overflowed); the pass does not yet see through the casts
    # that leaves around a bool mask, so that build is the unfused one. Known gap (README).
    fused = kw.get("dtype", "float32") == "float32"
    assert len(attention.kernel_specs(mod)) == (1 if fused else 0), "the build under test is the expected one"
    rep = verify(VerifyOptions(model=path, target="host", shape=d, use_tuning=False))
    assert {c.pair for c in rep.comparisons} == {"tvm vs ort", "tvm vs oracle", "ort vs oracle"}
    assert rep.passed, [c for c in rep.comparisons if not c.passed]


def test_fully_masked_rows_match_ort(tmp_path, monkeypatch):
    """A batch whose every key is padded out: ORT (Where with the dtype's min, then
    Softmax) spreads it uniformly; the fused causal build must too, skipped tiles included."""
    from blockforge.graph import ort as ort_runner

    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")  # numerics under test, not the isolation child
    path = _model(tmp_path, mask="bool", causal=True, layout="packed")
    session = open_model(path, HOST, {"batch": 2, "seq": 100})
    inputs = random_inputs(session.inputs, {}, seed=1)
    inputs["key_padding_mask"][1, :] = False
    want = ort_runner.run(session.model, inputs)["output"]
    vm = relax.VirtualMachine(build(session.relax(), HOST).executable, tvm.cpu())
    got = vm["main"](*[tvm.runtime.tensor(inputs[s.name]) for s in session.inputs]).numpy()
    assert np.isfinite(got).all() and np.isfinite(want).all()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def _bias_mask_model(path: Path, b: int, h: int, s: int, d: int) -> Path:
    """MPNet's attention as the legacy exporter writes it: Q K^T / sqrt(d) + a relative-position
    bias (a constant: it depends only on the positions) + a padding mask computed from a 0/1
    input, softmax, P V."""
    rng = np.random.default_rng(0)
    f32, n = TensorProto.FLOAT, helper.make_node
    inits = [numpy_helper.from_array(rng.standard_normal((1, h, s, s)).astype(np.float32), "bias"),
             numpy_helper.from_array(np.array(np.sqrt(d), np.float32), "sqrt_d"),
             numpy_helper.from_array(np.array(0, np.float32), "zero"),
             numpy_helper.from_array(np.array(np.finfo(np.float32).min, np.float32), "lowest")]
    nodes = [n("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), n("MatMul", ["q", "kt"], ["qk"]),
             n("Div", ["qk", "sqrt_d"], ["sc"]), n("Add", ["sc", "bias"], ["sb"]),
             n("Where", ["keep", "zero", "lowest"], ["addmask"]), n("Add", ["sb", "addmask"], ["sm"]),
             n("Softmax", ["sm"], ["p"], axis=-1), n("MatMul", ["p", "v"], ["output"])]
    vi = helper.make_tensor_value_info
    ins = [vi(x, f32, [b, h, s, d]) for x in ("q", "k", "v")] + [vi("keep", TensorProto.BOOL, [b, 1, 1, s])]
    m = helper.make_model(helper.make_graph(nodes, "bias_mask", ins, [vi("output", f32, [b, h, s, d])], inits),
                          opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, path)
    return path


def test_bias_and_mask_fused_match_ort(tmp_path, monkeypatch):
    """The summed bias + mask through the fused kernel against ORT, a batch row whose every
    key is masked included (ORT: softmax of bias + lowest, i.e. of the bias alone)."""
    from blockforge.graph import ort as ort_runner

    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    path = _bias_mask_model(tmp_path / "m.onnx", 2, 4, 70, 16)
    session = open_model(path, HOST, {})
    mod, _ = run_phases(session.relax(), HOST, stop_after="fuse-attention")
    assert [s.add for s in attention.kernel_specs(mod)] == [("b", "h", "q", "k")]
    inputs = random_inputs(session.inputs, {}, seed=2)
    inputs["keep"] = np.ones_like(inputs["keep"])
    inputs["keep"][0, ..., 50:] = False
    inputs["keep"][1] = False
    want = ort_runner.run(session.model, inputs)["output"]
    vm = relax.VirtualMachine(build(session.relax(), HOST).executable, tvm.cpu())
    got = vm["main"](*[tvm.runtime.tensor(inputs[s.name]) for s in session.inputs]).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def _head_scale_model(path: Path, b: int, h: int, s: int, d: int, scale: np.ndarray, op: str = "Mul") -> Path:
    """Swin V2's cosine attention: Q and K normalised along d, Q K^T times a learnt scale per
    head (h, 1, 1), plus a bias; Q and V given as (B, S, H, d) and transposed (the kernel reads
    them so: its "bshd" layout)."""
    rng = np.random.default_rng(0)
    f32, n = TensorProto.FLOAT, helper.make_node
    inits = [numpy_helper.from_array(scale.reshape(h, 1, 1).astype(np.float32), "head_scale"),
             numpy_helper.from_array(rng.standard_normal((h, s, s)).astype(np.float32), "bias"),
             numpy_helper.from_array(np.array([-1], np.int64), "last")]
    nodes = [n("ReduceL2", ["q", "last"], ["qn"], keepdims=1), n("Div", ["q", "qn"], ["qs"]),
             n("Transpose", ["qs"], ["qu"], perm=[0, 2, 1, 3]), n("Transpose", ["v"], ["vh"], perm=[0, 2, 1, 3]),
             n("ReduceL2", ["k", "last"], ["kn"], keepdims=1), n("Div", ["k", "kn"], ["ku"]),
             n("Transpose", ["ku"], ["kt"], perm=[0, 1, 3, 2]), n("MatMul", ["qu", "kt"], ["qk"]),
             n(op, ["qk", "head_scale"], ["sc"]), n("Add", ["sc", "bias"], ["sb"]),
             n("Softmax", ["sb"], ["p"], axis=-1), n("MatMul", ["p", "vh"], ["output"])]
    vi = helper.make_tensor_value_info
    ins = [vi("q", f32, [b, s, h, d]), vi("k", f32, [b, h, s, d]), vi("v", f32, [b, s, h, d])]
    m = helper.make_model(helper.make_graph(nodes, "head_scale", ins, [vi("output", f32, [b, h, s, d])], inits),
                          opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    onnx.save(m, path)
    return path


@pytest.mark.parametrize("op", ["Mul", "Div"])
def test_scale_per_head_fused_matches_ort(tmp_path, monkeypatch, op):
    """A scale per head (Swin V2's attention was left unfused) is applied to Q's rows of each
    head at the call; the kernel's scalar scale stays 1."""
    from blockforge.graph import ort as ort_runner

    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    scale = np.array([10.0, 3.0, 0.5, 25.0])
    path = _head_scale_model(tmp_path / "m.onnx", 2, 4, 40, 16, scale, op)
    session = open_model(path, HOST, {})
    mod, _ = run_phases(session.relax(), HOST, stop_after="fuse-attention")
    (spec,) = attention.kernel_specs(mod)
    assert spec.scale == 1.0 and spec.q == "bshd" and spec.add == ("h", "q", "k")
    inputs = random_inputs(session.inputs, {}, seed=3)
    want = ort_runner.run(session.model, inputs)["output"]
    vm = relax.VirtualMachine(build(session.relax(), HOST).executable, tvm.cpu())
    got = vm["main"](*[tvm.runtime.tensor(inputs[s.name]) for s in session.inputs]).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_scale_one_value_for_every_head_is_the_kernels_scalar():
    """A per-head tensor whose heads all hold one value (Swin V2 at initialisation) is a scalar."""
    mod = _decomposed((B, H, S, D), (B, H, S, D), (B, H, S, D), scale=0.25, scale_tensor="heads")
    (spec,) = _calls(_fuse(mod))
    assert spec.scale == 0.25


def test_setting_turns_the_phase_off(monkeypatch):
    from blockforge import settings
    from blockforge.compile.pipeline import phases

    assert "fuse-attention" in [p.name for p in phases(HOST)]
    monkeypatch.setenv(settings.FUSE_ATTENTION, "0")
    assert "fuse-attention" not in [p.name for p in phases(HOST)]
    monkeypatch.delenv(settings.FUSE_ATTENTION)
    assert "fuse-attention" not in [p.name for p in phases(HOST, default_schedules=False)], "naive baseline stays naive"
    assert "fuse-attention" not in [p.name for p in phases(HOST, fuse_attention=False)]


def _four_variant_model(path: Path, negated: bool = False) -> Path:
    """Four distinct attentions in one model (onnx.helper, static shapes), as Swin and
    encoder-decoders have them: window attention (4 windows of 4 tokens, 2 heads), shifted-
    window attention with its (windows, 1, N, N) additive mask, causal decoder self-attention
    (4 heads) and cross-attention over a 12-token memory with a bool padding mask. negated: the
    bool masks applied as DeBERTa's masked_fill of the negated mask, where(not(keep), fill, s)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits = [], []

    def const(name, a):
        inits.append(numpy_helper.from_array(np.asarray(a), name))
        return name

    def op(kind, ins, out, **attrs):
        nodes.append(helper.make_node(kind, ins, [out], name=out, **attrs))
        return out

    def attn(p, xq, xkv, b, sq, skv, heads, add=None, keep=None):
        c, d = 32, 32 // heads
        w = {n: const(f"{p}/W_{n}", (rng.standard_normal((c, c)) / np.sqrt(c)).astype(np.float32)) for n in "qkvo"}
        heads_q = const(f"{p}/hq", np.array([b, sq, heads, d], np.int64))
        heads_kv = const(f"{p}/hkv", np.array([b, skv, heads, d], np.int64))
        q = op("Transpose", [op("Reshape", [op("MatMul", [xq, w["q"]], f"{p}/q0"), heads_q], f"{p}/q1")], f"{p}/q",
               perm=[0, 2, 1, 3])
        kt = op("Transpose", [op("Reshape", [op("MatMul", [xkv, w["k"]], f"{p}/k0"), heads_kv], f"{p}/k1")],
                f"{p}/kt", perm=[0, 2, 3, 1])
        v = op("Transpose", [op("Reshape", [op("MatMul", [xkv, w["v"]], f"{p}/v0"), heads_kv], f"{p}/v1")], f"{p}/v",
               perm=[0, 2, 1, 3])
        s = op("Mul", [op("MatMul", [q, kt], f"{p}/s0"), const(f"{p}/scale", np.float32(d ** -0.5))], f"{p}/s1")
        if add is not None:
            s = op("Add", [s, add], f"{p}/s2")
        if keep is not None:
            fill = const(f"{p}/fill", np.float32(np.finfo(np.float32).min))
            s = op("Where", [op("Not", [keep], f"{p}/nk"), fill, s] if negated else [keep, s, fill], f"{p}/s3")
        o = op("MatMul", [op("Softmax", [s], f"{p}/p", axis=-1), v], f"{p}/o0")
        o = op("Reshape", [op("Transpose", [o], f"{p}/o1", perm=[0, 2, 1, 3]),
                           const(f"{p}/merge", np.array([b, sq, c], np.int64))], f"{p}/o2")
        return op("Add", [xq, op("MatMul", [o, w["o"]], f"{p}/o3")], f"{p}/out")

    windows = const("windows", np.array([4, 4, 32], np.int64))
    tokens = const("tokens", np.array([1, 16, 32], np.int64))
    shift = np.where(rng.random((4, 1, 4, 4)) < 0.7, 0.0, -100.0).astype(np.float32)
    shift[..., 0] = 0.0  # Swin's shifted-window mask: 0 / -100, every row keeps a key
    xw = op("Reshape", ["x", windows], "xw")
    h = attn("wmsa", xw, xw, 4, 4, 4, 2)
    h = attn("swmsa", h, h, 4, 4, 4, 2, add=const("shift_mask", shift))
    h = op("Reshape", [h, tokens], "h")
    h = attn("self", h, h, 1, 16, 16, 4, keep=const("causal", np.tril(np.ones((16, 16), bool))))
    axes = const("axes", np.array([1, 2], np.int64))
    h = attn("cross", h, "memory", 1, 16, 12, 4, keep=op("Unsqueeze", ["memory_mask", axes], "mm"))
    nodes.append(helper.make_node("Identity", [h], ["y"], name="y"))
    graph = helper.make_graph(nodes, "four_attentions", [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 32]),
        helper.make_tensor_value_info("memory", TensorProto.FLOAT, [1, 12, 32]),
        helper.make_tensor_value_info("memory_mask", TensorProto.BOOL, [1, 12])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 32])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(path))
    return path


def test_masked_fill_of_the_negated_mask_fuses(tmp_path, monkeypatch):
    """DeBERTa's where(not(mask), lowest, scores) is where(mask, scores, lowest): the causal and the
    padding-masked attentions fuse as in the plain form (before: "a fill that is not a scalar
    constant"), with ORT parity."""
    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    path = _four_variant_model(tmp_path / "negated.onnx", negated=True)
    mod, _ = run_phases(open_model(path, HOST, {}).relax(), HOST, stop_after="fuse-attention")
    specs = [attention.AttentionSpec.from_json(str(f.attrs[attention.KERNEL_ATTR])) for _, f in mod.functions_items()
             if isinstance(f, tvm.tirx.PrimFunc) and attention.is_kernel(f)]
    assert len(specs) == 4 and sum(s.causal for s in specs) == 1 and "relax.nn.softmax" not in _ops(mod)
    rep = verify(VerifyOptions(model=path, target="host", shape={}, use_tuning=False))
    assert rep.passed, [c for c in rep.comparisons if not c.passed]


def test_distinct_attention_variants_get_distinct_kernels(tmp_path, monkeypatch):
    """Every fused kernel was added under one global symbol, so a model with two or more
    attention variants failed to build ("duplicate global symbol: fused_attention", exit 70):
    all of Swin's exports did. Four variants: four kernels, four symbols, and ORT parity."""
    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    path = _four_variant_model(tmp_path / "four.onnx")
    mod, _ = run_phases(open_model(path, HOST, {}).relax(), HOST, stop_after="fuse-attention")
    kernels = [f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc) and attention.is_kernel(f)]
    specs = {attention.AttentionSpec.from_json(str(f.attrs[attention.KERNEL_ATTR])) for f in kernels}
    assert len(kernels) == len(specs) == 4, [s.describe() for s in specs]
    assert sum(s.causal for s in specs) == 1 and sum(s.add is not None for s in specs) == 1
    assert {s.heads for s in specs} == {2, 4} and {s.skv for s in specs} == {4, 16, 12}
    symbols = {str(f.attrs["global_symbol"]) for f in kernels}
    assert len(symbols) == 4 and all(s.startswith("fused_attention") for s in symbols), symbols
    assert "relax.nn.softmax" not in _ops(mod), "every attention is fused"
    rep = verify(VerifyOptions(model=path, target="host", shape={}, use_tuning=False))
    assert {c.pair for c in rep.comparisons} == {"tvm vs ort"}
    assert rep.passed, [c for c in rep.comparisons if not c.passed]
