"""The combined QKV projection's split, head transposes and RoPE as one row kernel
(compile/passes/qkv_heads.py; issue #20 item 3: Llama-style GQA ran a split copy and three scalar
reshape/transpose/RoPE kernels per layer, GPT-2 a split and a K^T transpose)."""

from __future__ import annotations

import re

from pathlib import Path

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
from tvm import relax  # noqa: E402

from blockforge.compile.passes.qkv_heads import qkv_heads_pass  # noqa: E402
from blockforge.compile.pipeline import build, run_phases  # noqa: E402
from blockforge.targets import resolve  # noqa: E402
from conftest import relax_op_names as _ops  # noqa: E402

HOST = resolve("host")
FIXTURES = Path(__file__).parent / "fixtures" / "models"
B, S, H, HKV, D = 2, 5, 4, 2, 8  # odd seq; GQA 4/2
TEXT = {"input_ids": (2, 9), "attention_mask": (2, 9)}


def _tables(seq: int = S):
    pos = np.arange(seq)[:, None] * (1.0 / 10000 ** (np.arange(0, D, 2) / D))[None, :]
    emb = np.concatenate([pos, pos], -1)
    return np.cos(emb).astype("float32")[None, None], np.sin(emb).astype("float32")[None, None]


def _rope_np(t, cos, sin):
    h2 = t.shape[-1] // 2
    return t * cos + np.concatenate([-t[..., h2:], t[..., :h2]], -1) * sin


def _llama_module(sign_ok: bool = True, q_3d: bool = False, symbolic: bool = False):
    """x (B, S, (H + 2 HKV) D) -> split -> heads -> RoPE(q), RoPE(k) -> K^T, V, as dynamo writes
    it. sign_ok=False: concat(x2, -x1) (rotate_half the other way); q_3d: q also read as (B*H, S, D).
    symbolic: S a free dim (a build bound with seq left free), the tables inputs of (1, 1, S, D)."""
    s = tvm.tirx.Var("seq", "int64") if symbolic else S
    x = relax.Var("x", relax.TensorType((B, s, (H + 2 * HKV) * D), "float32"))
    if symbolic:
        cos, sin = (relax.Var(n, relax.TensorType((1, 1, s, D), "float32")) for n in ("cos", "sin"))
        params = [x, cos, sin]
    else:
        cos, sin = (relax.const(t) for t in _tables())
        params = [x]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            parts = bb.emit(relax.op.split(x, [H * D, (H + HKV) * D], axis=2))
            outs = []
            for i, h in enumerate((H, HKV, HKV)):
                t = bb.emit(relax.op.reshape(relax.TupleGetItem(parts, i), [B, s, h, D]))
                t = bb.emit(relax.op.permute_dims(t, [0, 2, 1, 3]))
                if i < 2:
                    lo = bb.emit(relax.op.strided_slice(t, [3], [0], [D // 2]))
                    hi = bb.emit(relax.op.strided_slice(t, [3], [D // 2], [2 ** 63 - 1]))
                    rot = bb.emit(relax.op.concat([relax.op.negative(hi), lo] if sign_ok
                                                  else [hi, relax.op.negative(lo)], axis=-1))
                    t = bb.emit(relax.op.add(relax.op.multiply(t, cos), relax.op.multiply(rot, sin)))
                if i == 1:
                    t = bb.emit(relax.op.permute_dims(t, [0, 1, 3, 2]))  # K^T
                if i == 0 and q_3d:
                    outs.append(bb.emit(relax.op.reshape(t, [B * H, s, D])))
                outs.append(t)
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    return bb.get()


def _gpt2_module():
    """GPT-2 (dynamo): q and v read as (B, S, H, D) views, K^T through reshapes and transposes."""
    x = relax.Var("x", relax.TensorType((B, S, 3 * H * D), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            parts = bb.emit(relax.op.split(x, 3, axis=2))
            q = bb.emit(relax.op.reshape(relax.TupleGetItem(parts, 0), [B, S, H, D]))
            k = bb.emit(relax.op.reshape(relax.TupleGetItem(parts, 1), [B, S, H, D]))
            v = bb.emit(relax.op.reshape(relax.TupleGetItem(parts, 2), [B, S, H, D]))
            k = bb.emit(relax.op.reshape(relax.op.permute_dims(k, [0, 2, 1, 3]), [B * H, S, D]))
            k = bb.emit(relax.op.reshape(relax.op.permute_dims(k, [0, 2, 1]), [B, H, D, S]))
            out = bb.emit_output(relax.Tuple([q, k, v]))
        bb.emit_func_output(out)
    return bb.get()


def _kernels(mod) -> list[str]:
    return [str(f.attrs["blockforge.qkv_heads"]) for _, f in mod.functions_items()
            if getattr(f, "attrs", None) is not None and "blockforge.qkv_heads" in f.attrs]


def _run(mod, x, without=frozenset()) -> list[np.ndarray]:
    vm = relax.VirtualMachine(build(mod, HOST, without=without).executable, tvm.cpu())
    return [t.numpy() for t in vm["main"](tvm.runtime.tensor(x))]


def _x(n: int, seq: int = S) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((B, seq, n)).astype("float32")


def test_llama_split_heads_and_rope_become_one_kernel_with_numpy_numbers():
    mod = _llama_module()
    new = qkv_heads_pass()(mod)
    assert _ops(new) == ["relax.call_tir"], _ops(new)
    assert _kernels(new) == [f"bhsd@0:{H}x{D}+rope,bhds@{H * D}:{HKV}x{D}+rope,bhsd@{(H + HKV) * D}:{HKV}x{D}"]
    x = _x((H + 2 * HKV) * D)
    q, kt, v = _run(mod, x)
    cos, sin = _tables()
    heads = lambda a, h: a.reshape(B, S, h, D).transpose(0, 2, 1, 3)  # noqa: E731
    np.testing.assert_allclose(q, _rope_np(heads(x[..., :H * D], H), cos, sin), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kt, _rope_np(heads(x[..., H * D:(H + HKV) * D], HKV), cos, sin).transpose(0, 1, 3, 2),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(v, heads(x[..., (H + HKV) * D:], HKV))
    for a, b in zip(_run(mod, x, without={"qkv-heads"}), (q, kt, v)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_symbolic_seq_gets_the_same_kernel_with_a_tail():
    """seq left free (the one build `run --decode` runs: its prompt through main): the same one
    kernel, its row tiles ending in a tail of S mod 16 (vector stores of K^T where a tile is
    whole, row by row in the tail), numbers as numpy's at a tail only, whole tiles, and both."""
    mod = _llama_module(symbolic=True)
    new = qkv_heads_pass()(mod)
    assert _ops(new) == ["relax.call_tir"], _ops(new)
    assert _kernels(new) == [f"bhsd@0:{H}x{D}+rope,bhds@{H * D}:{HKV}x{D}+rope,bhsd@{(H + HKV) * D}:{HKV}x{D}"]
    for kernel in (f for _, f in new.functions_items() if isinstance(f, tvm.tirx.PrimFunc)):
        assert "T.vectorized" in kernel.script() and "seq" in kernel.script()
    vm = relax.VirtualMachine(build(mod, HOST).executable, tvm.cpu())
    heads = lambda a, h, n: a.reshape(B, n, h, D).transpose(0, 2, 1, 3)  # noqa: E731
    for seq in (5, 16, 33):
        x = _x((H + 2 * HKV) * D, seq)
        cos, sin = _tables(seq)
        q, kt, v = (t.numpy() for t in vm["main"](*(tvm.runtime.tensor(a) for a in (x, cos, sin))))
        np.testing.assert_allclose(q, _rope_np(heads(x[..., :H * D], H, seq), cos, sin), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(kt, _rope_np(heads(x[..., H * D:(H + HKV) * D], HKV, seq), cos, sin)
                                   .transpose(0, 1, 3, 2), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(v, heads(x[..., (H + HKV) * D:], HKV, seq))


def test_a_static_ragged_seq_stores_whole_key_tiles_as_vectors():
    """A static S no 16 divides (ViT's 197 tokens): every whole 16-row tile stores K^T as
    vectors along S and only the last one row by row (each row was a strided scalar scatter
    before: ViT-B/16's kernel alone 71 -> 57-67 us on Zen 5); numbers as numpy's."""
    from blockforge.compile.passes.qkv_heads import HeadsOut, heads_kernel

    seq, n = 37, 3 * H * D
    outs = [HeadsOut("bhsd", 0, H, D, None), HeadsOut("bhds", H * D, H, D, None), HeadsOut("bhsd", 2 * H * D, H, D, None)]
    f = heads_kernel([1, seq, n], outs, [], lanes=16)
    text = f.script()
    # the K^T tile: one vectorized store of 16 rows under the whole-tile test, a serial tail
    assert re.search(r"if .*\+ T\.int64\(16\) <= T\.int64\(37\)", text), text
    assert text.count("T.vectorized(T.int64(16))") == 1
    lib = tvm.compile(tvm.IRModule({"main": f}), target=HOST.tvm_target())
    x = np.random.default_rng(1).standard_normal((1, seq, n)).astype("float32")
    got = [tvm.runtime.tensor(np.zeros(sh, "float32")) for sh in ((1, H, seq, D), (1, H, D, seq), (1, H, seq, D))]
    lib["main"](tvm.runtime.tensor(x), *got)
    heads = lambda a: a.reshape(1, seq, H, D).transpose(0, 2, 1, 3)  # noqa: E731
    np.testing.assert_array_equal(got[0].numpy(), heads(x[..., :H * D]))
    np.testing.assert_array_equal(got[1].numpy(), heads(x[..., H * D:2 * H * D]).transpose(0, 1, 3, 2))
    np.testing.assert_array_equal(got[2].numpy(), heads(x[..., 2 * H * D:]))


def test_symbolic_dims_that_do_not_fit_at_the_samples_leave_the_graph_alone():
    """A static (2, 3, 4) viewed as (a, b, c, d), all four free (ONNX's reshape with negative and
    extended dims): at the sample values the view's size is not 24; an equal split of a free width
    in 3 (43 at the first samples). Nothing is traced there (before: numpy raised inside the pass
    and the build failed)."""
    x = relax.Var("x", relax.TensorType((2, 3, 4), "float32"))
    dims = [tvm.tirx.Var(n, "int64") for n in "abcd"]
    like = relax.Var("like", relax.TensorType(dims, "float32"))  # defines the four dims, as a match_cast does
    bb = relax.BlockBuilder()
    with bb.function("main", [x, like]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.reshape(x, dims))
        bb.emit_func_output(out)
    mod = bb.get()
    tvm.ir.assert_structural_equal(qkv_heads_pass()(mod), mod)
    # the same for an equal split of a free width (3 parts of 43 columns at the first samples)
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((1, 5, n), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            parts = bb.emit(relax.op.split(x, 3, axis=2))
            q = bb.emit(relax.op.permute_dims(relax.op.reshape(relax.TupleGetItem(parts, 0), [1, 5, 1, n // 3]),
                                              [0, 2, 1, 3]))
            out = bb.emit_output(q)
        bb.emit_func_output(out)
    mod = bb.get()
    tvm.ir.assert_structural_equal(qkv_heads_pass()(mod), mod)


def test_gpt2_split_and_key_transpose_become_one_kernel():
    mod = _gpt2_module()
    new = qkv_heads_pass()(mod)
    assert "relax.split" not in _ops(new) and "relax.permute_dims" not in _ops(new), _ops(new)
    assert _kernels(new) == [f"bshd@0:{H}x{D},bshd@{2 * H * D}:{H}x{D},bhds@{H * D}:{H}x{D}"]  # binding order
    x = _x(3 * H * D)
    q, kt, v = _run(mod, x)
    np.testing.assert_array_equal(q, x[..., :H * D].reshape(B, S, H, D))
    np.testing.assert_array_equal(kt, x[..., H * D:2 * H * D].reshape(B, S, H, D).transpose(0, 2, 3, 1))
    np.testing.assert_array_equal(v, x[..., 2 * H * D:].reshape(B, S, H, D))


def test_a_rotation_that_is_not_rotate_half_is_left_to_the_graph():
    """concat(x2, -x1) is not RoPE (the halves right, the signs not): its negated half is no
    layout the kernel writes, so nothing is rewritten."""
    mod = _llama_module(sign_ok=False)
    new = qkv_heads_pass()(mod)
    assert _kernels(new) == [] and "relax.split" in _ops(new), (_kernels(new), _ops(new))


def test_a_part_read_in_another_layout_leaves_the_split_alone():
    """q also read as (B*H, S, D) (no head layout the kernel writes): nothing is rewritten."""
    mod = _llama_module(q_3d=True)
    new = qkv_heads_pass()(mod)
    assert _kernels(new) == [] and "relax.split" in _ops(new), _ops(new)


def _calls(mod) -> list[str]:
    return [b.value.args[0].name_hint for blk in mod["main"].body.blocks for b in blk.bindings
            if getattr(getattr(b.value, "op", None), "name", None) == "relax.call_tir"]


@pytest.mark.parametrize("name", ["llama_sdpa_dynamo_op18", "qwen2_sdpa_legacy_op18", "gemma_sdpa_dynamo_op18",
                                  "gpt2_sdpa_dynamo_op18"])
def test_decoder_exports_run_one_heads_kernel_per_layer_and_match_ort(name, monkeypatch):
    """2-layer fixtures: one qkv_heads call per layer after legalize, no split, no concatenate
    (ablated: a split per layer); outputs vs ONNX Runtime."""
    from blockforge.compile import VerifyOptions, open_model, verify

    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    path = FIXTURES / f"{name}.onnx"
    session = open_model(path, "host", TEXT)
    calls = {w: _calls(run_phases(session.relax(), session.target, stop_after="legalize", without=w)[0])
             for w in (frozenset(), frozenset({"qkv-heads"}))}
    new, old = calls[frozenset()], calls[frozenset({"qkv-heads"})]
    assert sum(c.startswith("qkv_heads") for c in new) == 2, new
    assert not any(c == "split" or "concatenate" in c for c in new), new
    assert sum(c == "split" for c in old) == 2 and not any(c.startswith("qkv_heads") for c in old), old
    # its reshapes still become views: TVM's RewriteDataflowReshape aborted on the hand-written
    # kernel and was skipped for the whole module (GPT-2: every reshape a copy)
    lowered = run_phases(session.relax(), session.target, stop_after="lower")[0].script(show_meta=False)
    main = lowered[lowered.index("def main("):]
    assert not re.findall(r"cls\.(reshape\w*)\(", main) and "qkv_heads" in main, re.findall(r"cls\.(\w+)\(", main)
    report = verify(VerifyOptions(model=path, target="host", shape=TEXT, use_tuning=False))
    assert report.passed, [c for c in report.comparisons if not c.passed]


def _lone_module(k_t: bool):
    """One projection's output (no split) read as heads: K^T (B, H, D, S) through BERT's reshape /
    transpose / reshape chain, or q as a (B, S, H, D) view."""
    x = relax.Var("x", relax.TensorType((B, S, H * D), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            t = bb.emit(relax.op.reshape(x, [B, S, H, D]))
            if k_t:
                t = bb.emit(relax.op.reshape(relax.op.permute_dims(t, [0, 2, 1, 3]), [B * H, S, D]))
                t = bb.emit(relax.op.reshape(relax.op.permute_dims(t, [0, 2, 1]), [B, H, D, S]))
            out = bb.emit_output(t)
        bb.emit_func_output(out)
    return bb.get()


def test_a_lone_key_transpose_becomes_the_kernel_and_a_lone_view_does_not():
    """A projection's K^T with no split (BERT, ViT, T5: separate q/k/v matmuls) is a transpose the
    kernel writes in whole vectors along S (before: TVM's scalar strided copy, 0.065 ms a BERT-base
    layer); the same projection read as (B, S, H, D) is a view and stays one."""
    mod = _lone_module(k_t=True)
    new = qkv_heads_pass()(mod)
    assert _ops(new) == ["relax.call_tir"] and _kernels(new) == [f"bhds@0:{H}x{D}"], (_ops(new), _kernels(new))
    x = _x(H * D)
    vm = relax.VirtualMachine(build(mod, HOST).executable, tvm.cpu())
    np.testing.assert_array_equal(vm["main"](tvm.runtime.tensor(x)).numpy(),
                                  x.reshape(B, S, H, D).transpose(0, 2, 3, 1))
    view = _lone_module(k_t=False)
    tvm.ir.assert_structural_equal(qkv_heads_pass()(view), view)
