"""What the decode-loop tests share (tests/test_decode_loop.py: the Python loader,
tests/test_edge_decode.py: the C++ edge app): a tiny language model with a cache, ONNX
Runtime's greedy loop over it, and one table of hostile 'decode' sections that both
loaders must refuse with the same words."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

D, H, V = 32, 4, 50


def tiny_lm(path) -> None:
    """logits = (E[ids] + P[pos] + mean over the cache of K + V + 0.3 len(mask)) W, with two caches
    named as exporters do (past_key_values.0.key/.value -> present.0.key/.value)."""
    rng = np.random.default_rng(1)
    emb = rng.standard_normal((V, D)).astype(np.float32)
    pos = rng.standard_normal((64, D)).astype(np.float32)
    n = lambda op, i, o, **k: helper.make_node(op, i, [o], name=o, **k)  # noqa: E731
    nodes = [
        n("Gather", ["E", "input_ids"], "tok"),  # (B, S, D)
        n("Gather", ["Pos", "position_ids"], "at"),  # (B, S, D)
        n("Add", ["tok", "at"], "x"),
        n("Unsqueeze", ["x", "one"], "x4"),  # (B, 1, S, D)
        n("Concat", ["past_key_values.0.key", "x4"], "present.0.key", axis=2),  # (B, 1, T, D)
        n("Tanh", ["x4"], "v4"),
        n("Concat", ["past_key_values.0.value", "v4"], "present.0.value", axis=2),
        n("Add", ["present.0.key", "present.0.value"], "kv"),
        n("ReduceMean", ["kv", "t_axis"], "ctx", keepdims=1),  # (B, 1, 1, D)
        n("Squeeze", ["ctx", "one"], "ctx3"),  # (B, 1, D)
        # the mask's length enters the logits: a mask that did not grow changes the tokens
        n("Cast", ["attention_mask"], "m", to=TensorProto.FLOAT),  # (B, T)
        n("ReduceSum", ["m", "one"], "m_len", keepdims=1),  # (B, 1)
        n("Unsqueeze", ["m_len", "one"], "m_len3"),  # (B, 1, 1)
        n("Mul", ["m_len3", "m_scale"], "m_term"),
        n("Add", ["x", "ctx3"], "h0"),  # (B, S, D)
        n("Add", ["h0", "m_term"], "h"),
        n("MatMul", ["h", "Et"], "logits"),  # (B, S, V)
    ]
    inits = [numpy_helper.from_array(a, k) for k, a in (
        ("E", emb), ("Pos", pos), ("Et", rng.standard_normal((D, V)).astype(np.float32)), ("one", np.array([1], np.int64)),
        ("m_scale", np.array(0.3, np.float32)), ("t_axis", np.array([2], np.int64)))]
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    vi = helper.make_tensor_value_info
    g = helper.make_graph(nodes, "tiny_lm", [
        vi("input_ids", i64, ["batch", "seq"]), vi("attention_mask", i64, ["batch", "total"]),
        vi("position_ids", i64, ["batch", "seq"]),
        vi("past_key_values.0.key", f, ["batch", 1, "past", D]), vi("past_key_values.0.value", f, ["batch", 1, "past", D]),
    ], [vi("logits", f, ["batch", "seq", V]), vi("present.0.key", f, ["batch", 1, "total", D]),
        vi("present.0.value", f, ["batch", 1, "total", D])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    onnx.save(m, str(path))


def ort_greedy(path, prompt: np.ndarray, n: int) -> list[int]:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    b, s = prompt.shape
    feed = {"input_ids": prompt, "attention_mask": np.ones((b, s), np.int64),
            "position_ids": np.arange(s, dtype=np.int64)[None].repeat(b, 0),
            "past_key_values.0.key": np.zeros((b, 1, 0, D), np.float32),
            "past_key_values.0.value": np.zeros((b, 1, 0, D), np.float32)}
    toks = []
    for _ in range(n):
        logits, k, v = sess.run(None, feed)
        t = logits[:, -1].argmax(-1)
        toks.append(int(t[0]))
        feed.update({"input_ids": t.reshape(b, 1).astype(np.int64), "past_key_values.0.key": k,
                     "past_key_values.0.value": v, "position_ids": feed["position_ids"][:, -1:] + 1,
                     "attention_mask": np.concatenate([feed["attention_mask"], np.ones((b, 1), np.int64)], 1)})
    return toks


# (id, json path in manifest.json, value (None: delete), words of the refusal)
SWAPPED = {"pairs": [{"present": "present_value", "past": "past_key", "axis": 2},
                     {"present": "present_key", "past": "past_value", "axis": 2}], "tokens": None}
HOSTILE = [
    ("swapped", ["decode"], SWAPPED, "does not match the pairing"),
    ("axis", ["decode", "pairs", 0, "axis"], 1, "does not match the pairing"),
    ("axis-type", ["decode", "pairs", 0, "axis"], "2", "'pairs' entry 0 must be"),
    ("unknown-output", ["decode", "pairs", 0, "present"], "output", "does not match the pairing"),
    ("not-object", ["decode"], [1, 2], "must be an object"),
    ("empty-pairs", ["decode", "pairs"], [], "non-empty list"),
    ("extra-key", ["decode", "pairs", 0, "evil"], 1, "'pairs' entry 0 must be"),
    ("tokens", ["decode", "tokens"], {"logits": "output", "input_ids": "x"}, "'tokens' must be null"),
    ("tokens-invented", ["decode", "tokens"], {"logits": "output", "input_ids": "x", "attention_mask": None,
                                               "position_ids": None}, "does not match the pairing"),
    ("missing", ["decode"], None, "records no cache pairing"),
]


def with_decode_section(artifact, dest, case):
    """A copy of `artifact` at `dest` with one HOSTILE case applied to manifest.json."""
    _, path, value, _ = case
    shutil.copytree(artifact, dest, symlinks=True)
    m = json.loads((dest / "manifest.json").read_text())
    doc = m
    for k in path[:-1]:
        doc = doc[k]
    if value is None:
        del doc[path[-1]]
    else:
        doc[path[-1]] = value
    (dest / "manifest.json").write_text(json.dumps(m))
    return dest
