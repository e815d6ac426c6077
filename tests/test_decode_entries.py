"""Prefill and decode from one artifact (compile/decode/entries.py): a decoder compiled with
seq symbolic gets a second entry `decode` (main with seq bound to 1), recorded in the manifest
as "step"; a call with seq 1 runs it (LoadedModule.run, `run --decode`, the edge app), every
other call main. The step entry has what a bound seq = 1 build has (the fused attention reads
the cached keys untransposed); both entries share one weights.bin."""

from __future__ import annotations

import json

import numpy as np
import pytest

from blockforge.errors import BlockforgeError
from test_decoders import ENTRIES, FIXTURES, SYMBOLIC_ENTRIES, _feeds, batch_dims


def _entry(kind: str) -> dict:
    return next(e for e in SYMBOLIC_ENTRIES if e["model"] == kind)


def _called_specs(mod, name: str) -> set[str]:
    """The K layouts of the fused attention kernels function `name` calls."""
    from tvm import relax, tirx

    from blockforge.compile.attention.flash import KERNEL_ATTR, AttentionSpec

    found = set()

    def visit(e):
        if isinstance(e, relax.Call) and getattr(e.op, "name", None) == "relax.call_tir":
            f = mod[e.args[0]]
            if isinstance(f, tirx.PrimFunc) and f.attrs is not None and KERNEL_ATTR in f.attrs:
                found.add(AttentionSpec.from_json(str(f.attrs[KERNEL_ATTR])).k)

    relax.analysis.post_order_visit(mod[name].body, visit)
    return found


@pytest.mark.parametrize("kind", ["gpt2_past", "llama_past"])
def test_step_entry_reads_the_cached_keys(kind, monkeypatch):
    """With seq symbolic, main's attention transposes the whole cache to K^T every call (the
    key-rows form needs a query length of 1); the step entry reads K as the cache holds it."""
    from blockforge.compile.decode.entries import STEP_ENTRY, add_step_entry, token_dim
    from blockforge.compile.pipeline import run_phases
    from blockforge.compile.session import open_model
    from blockforge.targets import resolve

    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    host = resolve("host")
    path = FIXTURES / _entry(kind)["file"]
    session = open_model(path, host, batch_dims(path))
    dim = token_dim([s.to_dict() for s in session.inputs], [s.to_dict() for s in session.outputs])
    assert dim == session.inputs[0].dims[1] and isinstance(dim, str)
    mod, _ = run_phases(add_step_entry(session.relax(), dim), host, stop_after="fuse-attention")
    assert _called_specs(mod, "main") == {"bhds"}
    assert _called_specs(mod, STEP_ENTRY) == {"bhsd"}


def _data_path_kernels(mod, name: str) -> dict[str, int]:
    """The kernels function `name` calls that read float tensors (the data path: GEMMs,
    attention, norms, the cache copies, embeddings), by name without numbers or 'fused_'
    (FuseOps numbers them per module), with their call counts. Left out: the mask and
    position kernels on integer and bool tensors, which a static build folds to constants
    and a symbolic past computes each call (a few elements)."""
    import re
    from collections import Counter

    from tvm import relax, tirx

    fn = mod[name]
    allocated = {b.var for blk in fn.body.blocks for b in blk.bindings if isinstance(b.value, relax.Call)
                 and getattr(b.value.op, "name", None) == "relax.builtin.alloc_tensor"}

    def float_input(a) -> bool:  # the call's arguments after lowering: its inputs, then its allocated outputs
        ty = getattr(a, "ty", None)
        shape = getattr(ty, "shape", None)
        return a not in allocated and shape is not None and hasattr(shape, "__len__") and len(shape) >= 1 \
            and str(getattr(ty, "dtype", "")).startswith(("float", "bfloat"))

    found = Counter()

    def visit(e):
        if isinstance(e, relax.Call) and isinstance(e.op, relax.GlobalVar) and isinstance(mod[e.op], tirx.PrimFunc) \
                and any(float_input(a) for a in e.args):
            found[re.sub(r"\d+", "", e.op.name_hint).removeprefix("fused_")] += 1

    relax.analysis.post_order_visit(mod[name].body, visit)
    return dict(found)


# What a step entry computes from `past` on the data path and a bound build folds to constants:
# GPT-2's learned position embedding row (a gather), the RoPE tables (angles, cos, sin).
POSITION_KERNELS = {"gpt2_past": {"take": 1},
                    "llama_past": {"expand_dims_cast_multiply_concatenate": 1, "tir_cos_expand_dims": 1,
                                   "tir_sin_expand_dims": 1}}
POSITION_KERNELS["qwen2_past"] = POSITION_KERNELS["llama_past"]


@pytest.mark.parametrize("entry", ENTRIES, ids=[e["file"][:-5] for e in ENTRIES])
def test_step_entry_runs_the_static_builds_kernels(entry, monkeypatch):
    """The step entry (past symbolic) calls the data-path kernels a build bound at past = 16,
    seq = 1 calls, as many times: no reshape kept as a copy, no split left unfused, nothing a
    symbolic past adds beside the mask and positions (POSITION_KERNELS). Llama and Qwen2 kept
    layer 0's QKV split and RoPE as 3 kernels before qkv_heads moved the RoPE tables' chain
    ahead of that layer's split (the step entry computes them there, a bound build folds
    them). (GPT-2 small, full size, in thread CPU time at 1 TVM thread, load 6.5: the step
    entry 1.02x the static build at P = 128, 0.99x at P = 512; its GEMMs are the static
    build's TIR.)"""
    import onnx

    from blockforge.bench.decode import cache_layout, shapes
    from blockforge.compile.decode.entries import STEP_ENTRY, add_step_entry, token_dim
    from blockforge.compile.pipeline import run_phases
    from blockforge.compile.session import open_model
    from blockforge.targets import resolve

    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    host = resolve("host")
    path = FIXTURES / entry["file"]
    session = open_model(path, host, batch_dims(path))
    dim = token_dim([s.to_dict() for s in session.inputs], [s.to_dict() for s in session.outputs])
    step, _ = run_phases(add_step_entry(session.relax(), dim), host, stop_after="lower")
    bound = open_model(path, host, shapes(cache_layout(onnx.load(str(path), load_external_data=False)), 16, 1))
    static, _ = run_phases(bound.relax(), host, stop_after="lower")
    got, want = _data_path_kernels(step, STEP_ENTRY), _data_path_kernels(static, "main")
    assert want.get("attention_", 0) >= 2 and want.get("concatenate", 0) >= 4  # the decoder's step, fused
    extra = POSITION_KERNELS[entry["model"]]
    assert got == {k: want.get(k, 0) + extra.get(k, 0) for k in {*want, *extra}}
    # the prompt's entry (main, seq symbolic too) writes each layer's heads in one kernel as the
    # bound build does (before: a split and a kernel per part; Llama-style's prefill 5% slower)
    prompt = _data_path_kernels(step, "main")
    assert prompt.get("qkv_heads", 0) == want.get("qkv_heads") == 2 and "split" not in prompt, prompt


def _ort(path):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def gpt2_artifacts(tmp_path_factory):
    """The GPT-2 fixture compiled with seq symbolic: with the step entry, and without it (what
    an older blockforge wrote: one entry)."""
    from blockforge.compile import CompileOptions, compile_model

    d = tmp_path_factory.mktemp("entries")
    path = FIXTURES / _entry("gpt2_past")["file"]
    out = {}
    for name, step in (("two", True), ("one", False)):
        out[name] = compile_model(CompileOptions(model=path, shape=batch_dims(path), output=d / name,
                                                 use_tuning=False, step_entry=step)).artifact
    return out


def test_two_entries_match_ort_and_share_the_weights(gpt2_artifacts):
    """Every output vs ORT at P = 0, 1, 17, 128 through the step entry and a 5-token prompt
    through main; weights.bin is the one-entry build's (the step's prepacked copies are main's
    by content, not a second set)."""
    from blockforge.compile.artifact.runtime import TensorSig, load_artifact, run_vm

    entry = _entry("gpt2_past")
    two, one = (json.loads((gpt2_artifacts[k] / "manifest.json").read_text()) for k in ("two", "one"))
    assert two["step"] == {"function": "decode", "dim": "seq"} and "step" not in one
    assert two["weights"] == one["weights"]
    assert (gpt2_artifacts["two"] / "weights.bin").read_bytes() == (gpt2_artifacts["one"] / "weights.bin").read_bytes()
    mod = load_artifact(gpt2_artifacts["two"])
    outs = [TensorSig(o["name"], tuple(o["shape"]), o["dtype"]) for o in two["outputs"]]
    sess = _ort(FIXTURES / entry["file"])
    for past, seq in ((0, 5), (0, 1), (1, 1), (17, 1), (128, 1)):
        feeds = _feeds(entry, past, seq, seed=past + seq)
        fn = mod.entry({k: v.shape for k, v in feeds.items()})
        assert fn == ("decode" if seq == 1 else "main")
        # run() refuses an empty cache (P = 0 is the decode loop's first call): the VM directly
        got = mod.run(feeds) if past else run_vm(mod.vm, mod.device, mod.inputs, outs, feeds, mod.params, entry=fn)
        for (name, g), w in zip(got.items(), sess.run(None, feeds)):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=f"{name} P={past} S={seq}")


def test_older_single_entry_artifact_runs_every_call_through_main(gpt2_artifacts, tmp_path):
    """No 'step' in the manifest: seq 1 runs main, as before; a 'step' naming a function the
    module lacks is refused at load, in one line."""
    from blockforge.compile.artifact.runtime import load_artifact

    entry = _entry("gpt2_past")
    mod = load_artifact(gpt2_artifacts["one"])
    feeds = _feeds(entry, 17, 1, seed=3)
    assert mod.entry({k: v.shape for k, v in feeds.items()}) == "main"
    want = _ort(FIXTURES / entry["file"]).run(None, feeds)
    for g, w in zip(mod.run(feeds).values(), want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    import shutil

    art = tmp_path / "claims-a-step"
    shutil.copytree(gpt2_artifacts["one"], art)
    m = json.loads((art / "manifest.json").read_text())
    m["step"] = {"function": "decode", "dim": "seq"}
    (art / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BlockforgeError, match="'step' names function 'decode', which module.so does not have"):
        load_artifact(art)


def test_run_decode_steps_through_the_step_entry(gpt2_artifacts, tmp_path):
    """`run --decode 6`: the prompt (seq 4) through main, the 5 steps through decode; the
    tokens are ORT's greedy tokens and the last call's outputs ORT's."""
    from conftest import run_cli_in_process as cli, save_npz
    from test_decoders import ort_greedy_hf

    entry = _entry("gpt2_past")
    prompt = np.array([[3, 14, 15, 9]], np.int64)
    save_npz(tmp_path / "p.npz", input_ids=prompt, attention_mask=np.ones((1, 4), np.int64))
    res = cli("run", str(gpt2_artifacts["two"]), "--inputs", str(tmp_path / "p.npz"), "--decode", "6",
              "--json", str(tmp_path / "d.json"), "--output", str(tmp_path / "last.npz"))
    assert res.rc == 0, res.err
    got = json.loads((tmp_path / "d.json").read_text())
    assert [s["entry"] for s in got["steps"]] == ["main"] + ["decode"] * 5
    want, last = ort_greedy_hf(FIXTURES / entry["file"], entry, prompt, 6)
    assert got["tokens"] == [want]
    outs = np.load(tmp_path / "last.npz")
    for name, w in last.items():
        np.testing.assert_allclose(outs[name], w, rtol=1e-4, atol=1e-5, err_msg=name)


def test_compile_no_step_entry(tmp_path):
    """`compile --no-step-entry`: one entry (a shorter build), no 'step' in the manifest; the
    default says which entry the steps run."""
    from conftest import run_cli_in_process as cli

    path = FIXTURES / _entry("gpt2_past")["file"]
    res = cli("compile", str(path), "--target", "host", "--shape", "batch=1", "--no-step-entry", "-o",
              str(tmp_path / "one"))
    assert res.rc == 0, res.err
    assert "step" not in json.loads((tmp_path / "one" / "manifest.json").read_text())
    assert "decode steps" not in res.out
