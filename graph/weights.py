"""Deterministic weights from a seed.

Scaling follows the usual fan-in rule (std = 1/sqrt(fan_in)) so activations stay
O(1) through the block, which keeps parity checks meaningful in float16.
"""

from __future__ import annotations

import numpy as np

from .spec import BlockSpec, FFNSpec, MHASpec, Spec

Weights = dict[str, np.ndarray]


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float, dtype: str) -> np.ndarray:
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(dtype)


def mha_weights(spec: MHASpec) -> Weights:
    rng = np.random.default_rng(spec.seed)
    h, d, dk = spec.heads, spec.d_model, spec.d_k
    std = 1.0 / np.sqrt(d)
    w = {
        "W_Q": _normal(rng, (h, d, dk), std, spec.dtype),  # W_Q^(i) = W_Q[i]: (d_model, d_k)
        "W_K": _normal(rng, (h, d, dk), std, spec.dtype),
        "W_V": _normal(rng, (h, d, dk), std, spec.dtype),
        "W_O": _normal(rng, (h * dk, d), 1.0 / np.sqrt(h * dk), spec.dtype),
    }
    if spec.bias:
        w["b_Q"] = _normal(rng, (h, dk), 0.02, spec.dtype)
        w["b_K"] = _normal(rng, (h, dk), 0.02, spec.dtype)
        w["b_V"] = _normal(rng, (h, dk), 0.02, spec.dtype)
        w["b_O"] = _normal(rng, (d,), 0.02, spec.dtype)
    return w


def ffn_weights(spec: FFNSpec) -> Weights:
    rng = np.random.default_rng(spec.seed)
    d, f = spec.d_model, spec.d_ff
    return {
        "W_1": _normal(rng, (d, f), 1.0 / np.sqrt(d), spec.dtype),
        "b_1": _normal(rng, (f,), 0.02, spec.dtype),
        "W_2": _normal(rng, (f, d), 1.0 / np.sqrt(f), spec.dtype),
        "b_2": _normal(rng, (d,), 0.02, spec.dtype),
    }


def block_weights(spec: BlockSpec) -> Weights:
    rng = np.random.default_rng(spec.seed + 2)
    d = spec.d_model
    w = {f"mha/{k}": v for k, v in mha_weights(spec.mha_spec()).items()}
    w.update({f"ffn/{k}": v for k, v in ffn_weights(spec.ffn_spec()).items()})
    for ln in ("ln1", "ln2"):
        w[f"{ln}/gamma"] = (1.0 + _normal(rng, (d,), 0.05, "float32")).astype(spec.dtype)
        w[f"{ln}/beta"] = _normal(rng, (d,), 0.02, spec.dtype)
    return w


def make_weights(spec: Spec) -> Weights:
    if isinstance(spec, MHASpec):
        return mha_weights(spec)
    if isinstance(spec, FFNSpec):
        return ffn_weights(spec)
    return block_weights(spec)
