"""The block with a key/value cache (`export mha|block --kv-cache`): structure, the oracle
against ONNX Runtime at P = 0, 1, 17, 128 for every layout, and a host build with the past
length left symbolic that runs at several P."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from blockforge.graph.builders import build
from blockforge.graph.model_io import signature
from blockforge.graph.oracle import reference_outputs
from blockforge.graph.spec import BlockSpec, MHASpec
from blockforge.errors import BlockforgeError
# The verbs in-process: their outputs and errors are under test, not the process (~2 s of
# CPU less per call than an interpreter start and a TVM import; verbs still run their children).
from conftest import assert_user_error, run_cli_in_process as cli

D, H = 32, 4
PASTS = [0, 1, 17, 128]


def _inputs(spec, p: int, s: int = 3, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, s, D)).astype(np.float32)
    cache = {n: rng.standard_normal((2, H, p, D // H)).astype(np.float32) for n in ("past_key", "past_value")}
    return {**({"query": x, "key": x, "value": x} if isinstance(spec, MHASpec) else {"x": x}), **cache}


def test_structure():
    m, _ = build(MHASpec(d_model=D, heads=H, causal=True, kv_cache=True))
    ins, outs = signature(m)
    assert [(s.name, s.dims) for s in ins if s.name.startswith("past")] == [
        ("past_key", ("batch", H, "past", D // H)), ("past_value", ("batch", H, "past", D // H))]
    assert [(s.name, s.dims) for s in outs] == [("output", ("batch", "seq", D)),
                                               ("present_key", ("batch", H, "total_seq", D // H)),
                                               ("present_value", ("batch", H, "total_seq", D // H))]
    names = {n.name for n in m.graph.node}
    assert {"head_0/k_cache", "head_3/v_cache", "head_0/k_cache/past", "present_key", "causal/allowed"} <= names
    op = build(MHASpec(d_model=D, heads=H, causal=True, kv_cache=True, layout="attention-op"))[0]
    (att,) = [n for n in op.graph.node if n.op_type == "Attention"]
    assert list(att.input)[4:] == ["past_key", "past_value"]  # the op's own cache inputs
    assert list(att.output) == ["attention", "present_key", "present_value"]


@pytest.mark.parametrize("bad", [dict(cross=True), dict(kv_seq=8), dict(mask="bool")])
def test_refused_combinations(bad):
    with pytest.raises(BlockforgeError):
        MHASpec(d_model=D, heads=H, kv_cache=True, **bad)


def test_ffn_has_no_cache(workdir):
    assert_user_error(cli("export", "ffn", "--kv-cache", "-o", "f.onnx"), "--kv-cache is for mha and block")


@pytest.mark.parametrize("spec", [
    MHASpec(d_model=D, heads=H, causal=True, kv_cache=True, layout="per-head"),
    MHASpec(d_model=D, heads=H, causal=True, kv_cache=True, layout="packed"),
    MHASpec(d_model=D, heads=H, causal=True, kv_cache=True, layout="attention-op"),
    MHASpec(d_model=D, heads=H, causal=False, kv_cache=True, layout="packed"),
    BlockSpec(d_model=D, heads=H, d_ff=64, causal=True, kv_cache=True),
], ids=["per-head", "packed", "attention-op", "packed-noncausal", "block"])
def test_oracle_matches_ort(spec):
    m, w = build(spec)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in m.graph.output]
    for p in PASTS:
        inputs = _inputs(spec, p)
        got = dict(zip(names, sess.run(None, inputs)))
        want = reference_outputs(spec, w, inputs)
        assert set(want) == set(names)
        for n in names:
            np.testing.assert_allclose(got[n], want[n], rtol=1e-4, atol=1e-5, err_msg=f"P={p} {n}")
        np.testing.assert_array_equal(got["present_key"][:, :, :p], inputs["past_key"])  # the cache is kept


def test_causal_over_past_plus_seq():
    """Query i at absolute position P+i sees keys 0..P+i: changing the last new token's key
    leaves every earlier query's output unchanged; changing a cached key changes all."""
    spec = MHASpec(d_model=D, heads=H, causal=True, kv_cache=True, layout="packed")
    m, _ = build(spec)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    base = _inputs(spec, 5, s=4)
    y0 = sess.run(["output"], base)[0]
    later = dict(base)
    x = base["query"].copy()
    x[:, -1] += 1.0
    later.update(query=x, key=x, value=x)
    y1 = sess.run(["output"], later)[0]
    np.testing.assert_array_equal(y0[:, :-1], y1[:, :-1])
    assert not np.allclose(y0[:, -1], y1[:, -1])
    past = dict(base, past_key=base["past_key"] + 1.0)
    assert not np.allclose(sess.run(["output"], past)[0][:, 0], y0[:, 0])


def test_compile_symbolic_past_and_verify(workdir):
    """One host build with past symbolic (batch=1, seq=1 bound) runs at P = 1 and 17 and
    matches the oracle; verify at a bound past passes every output."""
    from blockforge.compile import load_artifact

    assert cli("export", "block", "--kv-cache", "--causal", "--d-model", str(D), "--heads", str(H),
               "--d-ff", "64", "-o", "b.onnx").rc == 0
    res = cli("compile", "b.onnx", "--target", "host", "--shape", "batch=1,seq=1", "-o", "b.host")
    assert res.rc == 0, res.err
    mod = load_artifact("b.host")
    spec = BlockSpec(d_model=D, heads=H, d_ff=64, causal=True, kv_cache=True)
    w = build(spec)[1]
    for p in (1, 17):
        inputs = {k: v[:1] for k, v in _inputs(spec, p, s=1).items()}
        got, want = mod.run(inputs), reference_outputs(spec, w, inputs)
        for n in want:
            np.testing.assert_allclose(got[n], want[n], rtol=1e-4, atol=1e-5, err_msg=f"P={p} {n}")
    v = cli("verify", "b.onnx", "--shape", "batch=1,seq=1,past=17", "--target", "host")
    assert v.rc == 0 and "present_value" in v.out and "FAIL" not in v.out, v.out + v.err
