"""Independent numpy oracle: the seed formulas computed in float64 from spec + weights.

Shares nothing with the ONNX builders but the weight dictionary, so a bug in the
graph code cannot hide in both.
"""

from __future__ import annotations

import math

import numpy as np

from .spec import BlockSpec, FFNSpec, MHASpec, Spec
from .weights import Weights


def _f64(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, d_k: int, allowed=None, additive=None) -> np.ndarray:
    """softmax(Q K^T / sqrt(d_k)) V for (B, S, d_k) x (B, S_kv, d_k)."""
    scores = q @ k.swapaxes(-1, -2) / math.sqrt(d_k)  # (B, S, S_kv)
    if additive is not None:
        scores = scores + additive
    if allowed is not None:
        scores = np.where(allowed, scores, np.finfo(np.float64).min)
    return softmax(scores) @ v  # (B, S, d_k)


def mha(spec: MHASpec, w: Weights, query, key, value, key_padding_mask=None, past=None):
    """The output; with `past` = (past_key, past_value), each (B, h, P, d_k), the tuple
    (output, present_key, present_value) with K_i = Concat(past_K_i, key W_K^(i))."""
    w = {n: _f64(a) for n, a in w.items()}
    query, key, value = _f64(query), _f64(key), _f64(value)
    p = 0 if past is None else np.shape(past[0])[2]
    allowed = additive = None
    if spec.causal:  # query i is at absolute position P+i and sees keys 0..P+i
        s = query.shape[1]
        allowed = np.tril(np.ones((s, p + s), dtype=bool), k=p)  # (S, P+S)
    if spec.mask == "bool":
        m = np.asarray(key_padding_mask, dtype=bool)[:, None, :]  # (B, 1, S_kv)
        allowed = m if allowed is None else (allowed & m)
    elif spec.mask == "additive":
        additive = _f64(key_padding_mask)[:, None, :]  # (B, 1, S_kv)
    heads, ks, vs = [], [], []
    for i in range(spec.heads):
        q = query @ w["W_Q"][i] + (w["b_Q"][i] if spec.bias else 0)  # (B, S, d_k)
        k = key @ w["W_K"][i] + (w["b_K"][i] if spec.bias else 0)  # (B, S_kv, d_k)
        v = value @ w["W_V"][i] + (w["b_V"][i] if spec.bias else 0)  # (B, S_kv, d_k)
        if past is not None:
            k = np.concatenate([_f64(past[0])[:, i], k], axis=1)  # (B, P+S, d_k)
            v = np.concatenate([_f64(past[1])[:, i], v], axis=1)  # (B, P+S, d_k)
            ks.append(k)
            vs.append(v)
        heads.append(attention(q, k, v, spec.d_k, allowed, additive))
    out = np.concatenate(heads, axis=-1) @ w["W_O"]  # (B, S, d_model)
    out = out + w["b_O"] if spec.bias else out
    return out if past is None else (out, np.stack(ks, axis=1), np.stack(vs, axis=1))  # present: (B, h, P+S, d_k)


def gelu(x: np.ndarray, approximate: str = "none") -> np.ndarray:
    if approximate == "tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    from scipy.special import erf  # float64 erf; numpy has none

    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def ffn(spec: FFNSpec, w: Weights, x) -> np.ndarray:
    w = {n: _f64(a) for n, a in w.items()}
    h = _f64(x) @ w["W_1"] + w["b_1"]  # (B, S, d_ff)
    if spec.activation == "relu":
        h = np.maximum(0.0, h)
    else:
        h = gelu(h, "tanh" if spec.activation == "gelu_tanh" else "none")
    return h @ w["W_2"] + w["b_2"]  # (B, S, d_model)


def layer_norm(x: np.ndarray, gamma, beta, eps: float) -> np.ndarray:
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * _f64(gamma) + _f64(beta)


def block(spec: BlockSpec, w: Weights, x, past=None):
    """The output; with `past`, (output, present_key, present_value) as mha()."""
    mw = {k[4:]: v for k, v in w.items() if k.startswith("mha/")}
    fw = {k[4:]: v for k, v in w.items() if k.startswith("ffn/")}
    ms, fs = spec.mha_spec(), spec.ffn_spec()
    x = _f64(x)
    ln = lambda t, n: layer_norm(t, w[f"{n}/gamma"], w[f"{n}/beta"], spec.eps)  # noqa: E731
    present = ()

    def attend(t):
        nonlocal present
        r = mha(ms, mw, t, t, t, past=past)
        if past is None:
            return r
        present = r[1:]
        return r[0]

    if spec.norm == "pre":
        a = ln(x, "ln1")
        h = x + attend(a)
        y = h + ffn(fs, fw, ln(h, "ln2"))
    else:
        h = ln(x + attend(x), "ln1")
        y = ln(h + ffn(fs, fw, h), "ln2")
    return y if past is None else (y, *present)


CACHE_OUTPUTS = ("present_key", "present_value")


def reference(spec: Spec, weights: Weights, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """The oracle's output (float64) for named model inputs."""
    return reference_outputs(spec, weights, inputs)["output"]


def reference_outputs(spec: Spec, weights: Weights, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every output of the block by name: output, and with a cache present_key/present_value."""
    if isinstance(spec, FFNSpec):
        return {"output": ffn(spec, weights, inputs["x"])}
    past = (inputs["past_key"], inputs["past_value"]) if spec.kv_cache else None
    if isinstance(spec, MHASpec):
        r = mha(spec, weights, inputs["query"], inputs["key"], inputs["value"], inputs.get("key_padding_mask"), past)
    else:
        r = block(spec, weights, inputs["x"], past)
    return dict(zip(("output", *CACHE_OUTPUTS), r)) if past is not None else {"output": r}
