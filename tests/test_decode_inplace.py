"""The preallocated KV cache written in place (compile/decode/inplace.py, `compile
--kv-capacity`): the entry `decode_inplace` takes capacity buffers (B, h, C, d) and the past
length as a ShapeTuple, writes the step's row with call_tir_inplace and reads rows [0, P + 1)
in the fused attention; its presents are its past buffers. Outputs equal the copying step
entry's and ORT's at P = 0, 1, 17, 128; `run --decode` runs it after the prompt."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from blockforge.errors import ArgumentError, BlockforgeError
from test_decoders import FIXTURES, SYMBOLIC_ENTRIES, _feeds, batch_dims

CAPACITY = 160  # P = 128 plus a step, and the 6-call loop below


def _entry(kind: str) -> dict:
    return next(e for e in SYMBOLIC_ENTRIES if e["model"] == kind)


def _marked(kind: str, capacity: int = CAPACITY):
    """The fixture's Relax module with main, decode and the marked decode_inplace."""
    from blockforge.compile.decode import inplace
    from blockforge.compile.decode.entries import add_step_entry, token_dim
    from blockforge.compile.decode.pairing import record
    from blockforge.compile.session import open_model
    from blockforge.targets import resolve

    host = resolve("host")
    path = FIXTURES / _entry(kind)["file"]
    session = open_model(path, host, batch_dims(path))
    ins, outs = [s.to_dict() for s in session.inputs], [s.to_dict() for s in session.outputs]
    dim = token_dim(ins, outs)
    pairs = inplace.cache_indices(ins, outs, record(ins, outs))
    return inplace.add_inplace_entry(add_step_entry(session.relax(), dim), dim, capacity, pairs), host, pairs


def _cache_concats(func) -> int:
    """Concats whose first part is an input of the function (a cache grown by the step's rows;
    not RoPE's rotate-half concat)."""
    from tvm import relax

    n = [0]
    params = set(func.params)

    def visit(e):
        if isinstance(e, relax.Call) and getattr(e.op, "name", None) == "relax.concat" \
                and isinstance(e.args[0], relax.Tuple) and e.args[0].fields[0] in params:
            n[0] += 1

    relax.analysis.post_order_visit(func.body, visit)
    return n[0]


@pytest.mark.parametrize("kind", ["gpt2_past", "llama_past"])
def test_inplace_entry_writes_rows_not_the_cache(kind, monkeypatch):
    """After kv-inplace: decode concatenates every cache (a copy of it per step), decode_inplace
    none; each cache buffer is read by its row write alone, each attention reads the buffers
    (the capacity kernel), no slice of a buffer is left, and the entry returns the written
    buffers as its presents. After lower, the kernels: no concatenate in decode_inplace, one
    kv_write_rows per cache."""
    from tvm import relax

    from blockforge.compile.decode.inplace import INPLACE_ENTRY, inplace_report
    from blockforge.compile.decode.entries import STEP_ENTRY
    from blockforge.compile.pipeline import run_phases
    from test_decode_entries import _data_path_kernels

    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    layers = _entry(kind)["past"]["layers"]
    marked, host, pairs = _marked(kind)
    mod, names = run_phases(marked, host, stop_after="kv-inplace")
    assert names[-2:] == ["fuse-attention", "kv-inplace"]
    assert _cache_concats(mod[STEP_ENTRY]) == 2 * layers
    assert _cache_concats(mod[INPLACE_ENTRY]) == 0
    assert inplace_report(mod) == {"writes": 2 * layers, "attention": layers, "slices": 0}
    f = mod[INPLACE_ENTRY]
    assert str(f.params[-1].ty.values[0]) == str(mod[STEP_ENTRY].params[pairs[0][0]].ty.shape.values[2])
    writes = {b.var: b.value for blk in f.body.blocks for b in blk.bindings
              if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", None) == "relax.call_tir_inplace"}
    for i, _, axis in pairs:
        cache = f.params[i]
        assert int(cache.ty.shape.values[axis]) == CAPACITY
        readers = [v for v, c in writes.items() if c.args[1].fields[0].same_as(cache)]
        assert len(readers) == 1
    ret = {b.var: b.value for blk in f.body.blocks for b in blk.bindings}[f.body.body]
    assert all(ret.fields[o] in writes for _, o, _ in pairs)
    low, _ = run_phases(marked, host, stop_after="lower")
    step, inpl = _data_path_kernels(low, STEP_ENTRY), _data_path_kernels(low, INPLACE_ENTRY)
    assert step.get("concatenate", 0) >= 2 * layers and "kv_write_rows" not in step
    assert "concatenate" not in inpl and inpl["kv_write_rows"] == 2 * layers


def test_capacity_kernel_reads_rows_of_the_buffer():
    """flash.kernel with kv_capacity: K and V are buffers of C rows, the key count a scalar
    input after the tensors (before the output); without it, K/V hold Skv rows."""
    from blockforge.compile.attention.flash import AttentionSpec, kernel

    spec = AttentionSpec("float32", "bhsd", "bhsd", "bhsd", "bhsd", heads=4, d=8, dv=8, scale=0.35, batch=1, sq=1,
                         add=("b", "1", "q", "k"), kv_heads=2)
    plain, cap = kernel(spec), kernel(AttentionSpec(**{**spec.__dict__, "kv_capacity": 96}))
    from tvm import tirx

    def shp(f, i):  # a buffer param's shape
        return [str(int(d)) if isinstance(d, tirx.IntImm) else str(d) for d in f.params[i].shape]

    assert shp(plain, 1) == ["1", "2", "kv_seq", "8"] and len(plain.params) == 5
    assert shp(cap, 1) == shp(cap, 2) == ["1", "2", "96", "8"] and len(cap.params) == 6
    assert cap.params[4].name == "kv_seq" and str(cap.params[4].ty) == "int64"  # a scalar
    assert shp(cap, 3) == ["1", "1", "1", "kv_seq"]
    assert "kv_capacity" not in spec.to_json()  # tuning records keep their text
    with pytest.raises(ValueError, match="kv_capacity needs a symbolic key length"):
        kernel(AttentionSpec(**{**spec.__dict__, "skv": 16, "kv_capacity": 96}))


@pytest.fixture(scope="module")
def inplace_artifacts(tmp_path_factory):
    from blockforge.compile import CompileOptions, compile_model

    d = tmp_path_factory.mktemp("inplace")
    out = {}
    for kind in ("gpt2_past", "llama_past"):
        path = FIXTURES / _entry(kind)["file"]
        out[kind] = compile_model(CompileOptions(model=path, shape=batch_dims(path), output=d / kind,
                                                 use_tuning=False, kv_capacity=CAPACITY)).artifact
    return out


def _caps(feeds: dict, names: list[str], capacity: int) -> dict:
    """Capacity buffers holding each past; the rows past it NaN (read, they would show)."""
    out = {}
    for n in names:
        a = feeds[n]
        buf = np.full(a.shape[:2] + (capacity,) + a.shape[3:], np.nan, np.float32)
        buf[:, :, :a.shape[2]] = a
        out[n] = buf
    return out


@pytest.mark.parametrize("kind", ["gpt2_past", "llama_past"])
def test_inplace_entry_matches_ort_and_the_step_entry(kind, inplace_artifacts):
    """At P = 0, 1, 17, 128: logits and the presents (the buffers' rows [0, P + 1)) are ORT's
    and exactly the copying step entry's; rows past P + 1 are untouched (NaN), and each present
    is the buffer passed in (same memory)."""
    import onnxruntime as ort
    import tvm

    from blockforge.compile.artifact.runtime import load_artifact
    from blockforge.compile.decode.inplace import INPLACE_ENTRY

    entry = _entry(kind)
    mod = load_artifact(inplace_artifacts[kind])
    m = mod.manifest
    first = m["decode"]["pairs"][0]
    dim = next(s for s in m["inputs"] if s["name"] == first["past"])["shape"][first["axis"]]
    assert m["inplace"] == {"function": INPLACE_ENTRY, "capacity": CAPACITY, "dim": dim}
    sess = ort.InferenceSession(str(FIXTURES / entry["file"]), providers=["CPUExecutionProvider"])
    in_names = [s["name"] for s in m["inputs"]]
    out_names = [s["name"] for s in m["outputs"]]
    pasts = [p["past"] for p in m["decode"]["pairs"]]
    for past in (0, 1, 17, 128):
        feeds = _feeds(entry, past, 1, seed=past + 7)
        want = dict(zip(out_names, sess.run(None, feeds)))
        args = {k: tvm.runtime.tensor(v, mod.device) for k, v in feeds.items()}
        ref = mod.vm["decode"](*(args[n] for n in in_names), *mod.params)
        caps = {k: tvm.runtime.tensor(v, mod.device) for k, v in _caps(feeds, pasts, CAPACITY).items()}
        got = mod.vm[INPLACE_ENTRY](*(caps.get(n, args[n]) for n in in_names), tvm.runtime.ShapeTuple([past]),
                                    *mod.params)
        for k, name in enumerate(out_names):
            g = got[k].numpy()
            if name in {p["present"] for p in m["decode"]["pairs"]}:
                assert np.isnan(g[:, :, past + 1:]).all(), f"{name} P={past}: rows past P + 1 written"
                buf = caps[next(p["past"] for p in m["decode"]["pairs"] if p["present"] == name)]
                assert np.shares_memory(np.from_dlpack(got[k]), np.from_dlpack(buf)), name
                g = g[:, :, :past + 1]
            np.testing.assert_array_equal(g, ref[k].numpy(), err_msg=f"{name} P={past}")
            np.testing.assert_allclose(g, want[name], rtol=1e-4, atol=1e-5, err_msg=f"{name} P={past}")


def test_run_decode_runs_the_inplace_entry(inplace_artifacts, tmp_path):
    """`run --decode 6`: the prompt through main, 5 steps through decode_inplace; tokens and the
    last outputs ORT's greedy loop's, and the copying loop's (--copy-cache: decode)."""
    from conftest import run_cli_in_process as cli, save_npz
    from test_decoders import ort_greedy_hf

    entry = _entry("llama_past")
    art = inplace_artifacts["llama_past"]
    prompt = np.array([[3, 14, 15, 9]], np.int64)
    save_npz(tmp_path / "p.npz", input_ids=prompt, attention_mask=np.ones((1, 4), np.int64))
    want, last = ort_greedy_hf(FIXTURES / entry["file"], entry, prompt, 6)
    runs = {}
    for flag, step in (((), "decode_inplace"), (("--copy-cache",), "decode")):
        res = cli("run", str(art), "--inputs", str(tmp_path / "p.npz"), "--decode", "6", *flag,
                  "--json", str(tmp_path / "d.json"), "--output", str(tmp_path / "last.npz"), "--force")
        assert res.rc == 0, res.err
        got = json.loads((tmp_path / "d.json").read_text())
        assert [s["entry"] for s in got["steps"]] == ["main"] + [step] * 5
        assert got["tokens"] == [want]
        runs[step] = dict(np.load(tmp_path / "last.npz"))
        for name, w in last.items():
            np.testing.assert_allclose(runs[step][name], w, rtol=1e-4, atol=1e-5, err_msg=name)
    for name in last:
        np.testing.assert_array_equal(runs["decode_inplace"][name], runs["decode"][name], err_msg=name)


def test_capacity_refusals(inplace_artifacts, tmp_path):
    """Bad capacities and non-decoders at compile, a loop that would outgrow the buffers
    before it runs, and a manifest whose 'inplace' was edited at load."""
    from blockforge.compile import CompileOptions, compile_model
    from blockforge.compile.artifact.runtime import load_artifact
    from blockforge.compile.decode import DecodeOptions, decode

    path = FIXTURES / _entry("gpt2_past")["file"]
    for bad in (0, -1, True, 2.5, "64", 1 << 40):
        with pytest.raises(ArgumentError, match="kv_capacity must be an integer"):
            compile_model(CompileOptions(model=path, shape=batch_dims(path), output=tmp_path / "x", kv_capacity=bad))
    with pytest.raises(ArgumentError, match=r"needs a decoder .* step entry"):
        compile_model(CompileOptions(model=path, shape=batch_dims(path), output=tmp_path / "y", kv_capacity=64,
                                     step_entry=False))
    mod = load_artifact(inplace_artifacts["gpt2_past"])
    prompt = {"input_ids": np.array([[1, 2, 3]], np.int64), "attention_mask": np.ones((1, 3), np.int64)}
    with pytest.raises(ArgumentError, match=f"would fill {3 + CAPACITY - 2 + 1} positions .* capacity of {CAPACITY}"):
        decode(mod, prompt, DecodeOptions(CAPACITY))
    assert len(decode(mod, prompt, DecodeOptions(CAPACITY - 2)).steps) == CAPACITY - 2  # fills it exactly
    assert len(decode(mod, prompt, DecodeOptions(CAPACITY, inplace=False)).steps) == CAPACITY
    for edit, msg in (({"capacity": 1 << 40}, "is not in"), ({"function": "main"}, "is not decode_inplace"),
                      ({"dim": "seq"}, "is not the past dim"), ({"extra": 1}, "exactly")):
        art = tmp_path / f"edited-{len(msg)}"
        shutil.copytree(inplace_artifacts["gpt2_past"], art)
        m = json.loads((art / "manifest.json").read_text())
        m["inplace"] = {**m["inplace"], **edit}
        (art / "manifest.json").write_text(json.dumps(m))
        with pytest.raises(BlockforgeError, match=msg):
            load_artifact(art)


def test_unfused_attention_reads_a_slice_and_matches(monkeypatch):
    """Without the fused kernel (ablation fuse-attention) the attention's matmuls read each
    buffer's rows [0, P + 1) as a slice (a copy per step, as Concat made: correct, not
    faster); the outputs still equal the step entry's and ORT's."""
    import onnxruntime as ort
    import tvm
    from tvm import relax

    from blockforge.compile.decode.inplace import INPLACE_ENTRY, inplace_report
    from blockforge.compile.pipeline import build, run_phases

    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    entry = _entry("gpt2_past")
    layers = entry["past"]["layers"]
    marked, host, pairs = _marked("gpt2_past", 32)
    mod, names = run_phases(marked, host, stop_after="kv-inplace", without={"fuse-attention"})
    assert "fuse-attention" not in names and inplace_report(mod) == {"writes": 2 * layers, "attention": 0,
                                                                     "slices": 2 * layers}
    vm = relax.VirtualMachine(build(marked, host, without={"fuse-attention"}).executable, tvm.cpu())
    sess = ort.InferenceSession(str(FIXTURES / entry["file"]), providers=["CPUExecutionProvider"])
    feeds = _feeds(entry, 17, 1, seed=5)
    names_in = [i.name for i in sess.get_inputs()]
    pasts = [names_in[i] for i, _, _ in pairs]
    caps = _caps(feeds, pasts, 32)
    got = vm[INPLACE_ENTRY](*(tvm.runtime.tensor(caps.get(n, feeds[n])) for n in names_in),
                            tvm.runtime.ShapeTuple([17]))
    presents = {o for _, o, _ in pairs}
    for k, w in enumerate(sess.run(None, feeds)):
        g = got[k].numpy()
        np.testing.assert_allclose(g[:, :, :18] if k in presents else g, w, rtol=1e-4, atol=1e-5, err_msg=str(k))
