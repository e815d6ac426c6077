"""`run ARTIFACT --decode N`: the cache pairing (inferred from names at compile time,
recorded in the manifest, checked before a loop), the loop against the oracle (a
blockforge block) and against ONNX Runtime's greedy loop on the same file (a tiny
language model with logits, input_ids, attention_mask, position_ids and two cache pairs),
and the refusals: a past bound at compile time, hostile 'decode' sections."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from blockforge.compile.decode import infer_pairing
from blockforge.errors import BlockforgeError
from blockforge.graph.builders import build
from blockforge.graph.oracle import reference_outputs
from blockforge.graph.spec import BlockSpec
# The verbs in-process: their outputs and errors are under test, not the process (~2 s of
# CPU less per call than an interpreter start and a TVM import; verbs still run their children).
from conftest import assert_user_error, run_cli_in_process as cli, save_npz
from decode_models import D, H, HOSTILE, ort_greedy, tiny_lm, with_decode_section

SPEC = BlockSpec(d_model=D, heads=H, d_ff=64, causal=True, kv_cache=True)


@pytest.fixture(scope="module")
def block_artifact(tmp_path_factory):
    d = tmp_path_factory.mktemp("decode_block")
    onnx.save(build(SPEC)[0], str(d / "b.onnx"))
    res = cli("compile", str(d / "b.onnx"), "--target", "host", "--shape", "batch=1,seq=1", "-o", str(d / "b.host"))
    assert res.rc == 0, res.err
    return d / "b.host"


# ------------------------------------------------------------------ pairing (no build)


def sig(name, shape, dtype="float32"):
    return {"name": name, "shape": shape, "dtype": dtype}


def test_pairing_blockforge_and_exporter_names():
    p = infer_pairing([sig("x", [1, 1, 8]), sig("past_key", ["b", 2, "past", 4]), sig("past_value", ["b", 2, "past", 4])],
                      [sig("output", [1, 1, 8]), sig("present_key", ["b", 2, "total", 4]),
                       sig("present_value", ["b", 2, "total", 4])])
    assert [(q.present, q.past, q.axis) for q in p.pairs] == [("present_key", "past_key", 2),
                                                             ("present_value", "past_value", 2)]
    assert p.tokens is None
    p = infer_pairing([sig("input_ids", [1, "s"], "int64"), sig("past_key_values.3.key", [1, 2, "p", 4])],
                      [sig("logits", [1, "s", 9]), sig("present.3.key", [1, 2, "p + 1", 4])])
    assert p.pairs[0].past == "past_key_values.3.key" and p.tokens.input_ids == "input_ids"
    assert p.tokens.attention_mask is None
    assert infer_pairing([sig("x", [1])], [sig("y", [1])]) is None


@pytest.mark.parametrize("ins, outs, words", [
    ([sig("past_key", [1, 2, 17, 4])], [sig("present_key", [1, 2, "total", 4])], "fixed at 17"),
    ([sig("past_key", [1, 2, "p", 4])], [sig("present_key", [1, 2, "p", 4])], "no axis differs"),
    ([sig("past_key", [1, "a", "p", 4])], [sig("present_key", [1, "b", "q", 4])], "axes [1, 2] differ"),
    ([sig("past_key", [1, 2, "p", 4], "float16")], [sig("present_key", [1, 2, "t", 4])], "cannot feed"),
    ([sig("past_key", [1, 2, "p", 4]), sig("past_value", [1, 2, "p", 4])], [sig("present_key", [1, 2, "t", 4])],
     "past_value looks like a cache but no present output feeds it"),
    ([sig("past.0.key", [1, 2, "p", 4]), sig("past_key_values.0.key", [1, 2, "p", 4])],
     [sig("present.0.key", [1, 2, "t", 4])], "ambiguous"),
])
def test_pairing_refusals(ins, outs, words):
    with pytest.raises(BlockforgeError, match=None) as e:
        infer_pairing(ins, outs)
    assert words in str(e.value)


# ------------------------------------------------------------------ the loop


def test_block_loop_matches_the_oracle(block_artifact, tmp_path):
    """5 calls from an empty cache (past inputs left out of --inputs): each output and the
    final cache match the oracle run the same way; --json has one record per call."""
    x = np.random.default_rng(0).standard_normal((1, 1, D)).astype(np.float32)
    prompt = save_npz(tmp_path / "p.npz", x=x)
    res = cli("run", str(block_artifact), "--inputs", str(prompt), "--decode", "5",
              "--json", str(tmp_path / "d.json"), "--output", str(tmp_path / "o.npz"))
    assert res.rc == 0, res.err
    assert "step 4: past     4 + 1" in res.out
    d = json.loads((tmp_path / "d.json").read_text())
    assert [s["past"] for s in d["steps"]] == [0, 1, 2, 3, 4] and d["tokens"] is None
    w = build(SPEC)[1]
    pk = pv = np.zeros((1, H, 0, D // H), np.float32)
    for _ in range(5):
        r = reference_outputs(SPEC, w, {"x": x, "past_key": pk, "past_value": pv})
        pk, pv = r["present_key"], r["present_value"]
    got = np.load(tmp_path / "o.npz")
    for n in r:
        np.testing.assert_allclose(got[n], r[n], rtol=1e-4, atol=1e-5, err_msg=n)


def test_steps_get_the_loaded_weights_uncopied(block_artifact):
    """Every call of main gets the artifact's weights (weights.bin) after the inputs, as the
    very tensors loaded once: a decode step copies none of them."""
    import dataclasses

    from blockforge.compile import load_artifact
    from blockforge.compile.decode.loop import DecodeOptions, decode

    mod = load_artifact(block_artifact)
    n_in, weights = len(mod.manifest["inputs"]), mod.params
    assert len(weights) == len(mod.manifest["weights"]["tensors"]) >= 4
    seen, real = [], mod.vm["main"]

    def main(*args):
        seen.append(args[n_in:])
        return real(*args)

    fake = dataclasses.replace(mod, vm={"main": main})
    decode(fake, {"x": np.ones((1, 1, D), np.float32)}, DecodeOptions(3))
    assert len(seen) == 3 and all(len(s) == len(weights) and all(a is b for a, b in zip(s, weights)) for s in seen)


def test_language_model_greedy_matches_ort(workdir):
    """Tokens, attention_mask and position_ids fed as a generator does; the tokens are ORT's
    greedy tokens on the same file."""
    tiny_lm(workdir / "lm.onnx")
    res = cli("compile", "lm.onnx", "--target", "host", "--shape", "batch=1", "-o", "lm.host")
    assert res.rc == 0, res.err
    man = json.loads((workdir / "lm.host/manifest.json").read_text())
    assert man["decode"]["tokens"] == {"logits": "logits", "input_ids": "input_ids",
                                       "attention_mask": "attention_mask", "position_ids": "position_ids"}
    prompt = np.array([[3, 14, 15, 9]], np.int64)
    save_npz(workdir / "p.npz", input_ids=prompt, attention_mask=np.ones((1, 4), np.int64),
             position_ids=np.arange(4, dtype=np.int64)[None])
    res = cli("run", "lm.host", "--inputs", "p.npz", "--decode", "8", "--json", "d.json")
    assert res.rc == 0, res.err
    want = ort_greedy(workdir / "lm.onnx", prompt, 8)
    assert json.loads((workdir / "d.json").read_text())["tokens"] == [want]
    assert f"tokens[0]: {' '.join(map(str, want))}" in res.out
    assert len(set(want)) > 1  # the feed matters: a constant token would hide a broken loop


def test_fixed_past_cannot_loop(workdir):
    onnx.save(build(SPEC)[0], "b.onnx")
    assert cli("compile", "b.onnx", "--target", "host", "--shape", "batch=1,seq=1,past=3", "-o", "b.host").rc == 0
    save_npz(workdir / "p.npz", x=np.zeros((1, 1, D), np.float32),
             past_key=np.zeros((1, H, 3, D // H), np.float32), past_value=np.zeros((1, H, 3, D // H), np.float32))
    assert_user_error(cli("run", "b.host", "--inputs", "p.npz", "--decode", "3"),
                      "cannot decode", "past length is fixed at 3", "compile without binding it in --shape")


def test_usage_errors(block_artifact, tmp_path):
    prompt = save_npz(tmp_path / "p.npz", x=np.zeros((1, 1, D), np.float32))
    assert_user_error(cli("run", str(block_artifact), "--inputs", str(prompt)), "--output is required")
    assert_user_error(cli("run", str(block_artifact), "--inputs", str(prompt), "--decode", "0"), "--decode must be")
    assert_user_error(cli("run", str(block_artifact), "--inputs", str(prompt), "--decode", "70000"),
                      "--decode must be")


# ------------------------------------------------------------------ hostile 'decode' sections

@pytest.mark.parametrize("case", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_decode_section(block_artifact, tmp_path, case):
    art = with_decode_section(block_artifact, tmp_path / "a", case)
    prompt = save_npz(tmp_path / "p.npz", x=np.zeros((1, 1, D), np.float32))
    assert_user_error(cli("run", str(art), "--inputs", str(prompt), "--decode", "2"), case[3])


def test_ctrl_c_ends_with_one_line(block_artifact, tmp_path):
    """SIGINT mid-loop: exit 130, the one line every verb ends with, nothing half-written."""
    import signal
    import subprocess
    import sys

    prompt = save_npz(tmp_path / "p.npz", x=np.zeros((1, 1, D), np.float32))
    p = subprocess.Popen([sys.executable, "-m", "blockforge", "run", str(block_artifact), "--inputs", str(prompt),
                          "--decode", "60000", "--json", str(tmp_path / "d.json")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in p.stdout:
            if "step 5:" in line:
                break
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130 and err == "blockforge: interrupted\n", err
    assert not (tmp_path / "d.json").exists()
