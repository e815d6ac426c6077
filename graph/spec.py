"""Block specifications: frozen, validated on construction.

A spec says *what* is computed; builders turn it into ONNX, the oracle into numpy.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Union

from blockforge.errors import ArgumentError, BlockforgeError

DTYPES = ("float32", "float16")
ACTIVATIONS = ("relu", "gelu", "gelu_tanh")
LAYOUTS = ("per-head", "packed", "attention-op")
MASKS = (None, "additive", "bool")
NORMS = ("pre", "post")
MIN_OPSET, MAX_OPSET = 17, 21  # 17: LayerNormalization; 21: newest both ORT and TVM import
GELU_OPSET = 20  # ONNX Gelu exists from opset 20; older opsets get the exact Erf form
# The attention-op layout is one ONNX Attention node, which exists from opset 23. Its
# opsets are 23..24: what onnxruntime 1.31 runs (checked for both) and onnx_ops imports.
ATTENTION_OPSETS = (23, 24)

# Refuse sizes whose initializers alone would take more than this (bytes). Keeps a
# typo like --d-model 1000000 from allocating tens of GB before anything fails.
MAX_PARAM_BYTES = 1536 << 20  # also keeps the model under protobuf's 2 GiB
MAX_DIM = 1 << 16
# --kv-cache: the cached key/value length is the symbolic dim "past"; present_* grow to
# "total_seq" (= past + seq, a name only: ONNX has no dim arithmetic).
PAST_DIM, TOTAL_DIM = "past", "total_seq"


def _check_dim(name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise BlockforgeError(f"{name} must be an integer, got {value!r}")
    if value <= 0:
        raise BlockforgeError(f"{name} must be positive, got {value}")
    if value > MAX_DIM:
        raise BlockforgeError(f"{name}={value} exceeds the limit of {MAX_DIM}")


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        shown = ", ".join(str(c) for c in choices)
        raise BlockforgeError(f"unknown {name} {value!r} (choose from: {shown})")


@dataclass(frozen=True)
class Common:
    """Fields every block has: numerics, shapes and weight seed."""

    d_model: int = 512
    dtype: str = "float32"
    opset: int | None = None  # None: GELU_OPSET (the attention-op layout: 23)
    seed: int = 0
    batch: int | None = None  # None: symbolic dim "batch"
    seq: int | None = None  # None: symbolic dim "seq"

    def _opsets(self) -> tuple[int, int]:
        """The lowest and highest opset this spec can be built for."""
        return ATTENTION_OPSETS if getattr(self, "layout", None) == "attention-op" else (MIN_OPSET, MAX_OPSET)

    def _validate_common(self) -> None:
        _check_dim("d_model", self.d_model)
        _check_choice("dtype", self.dtype, DTYPES)
        lo, hi = self._opsets()
        if self.opset is None:
            object.__setattr__(self, "opset", max(lo, GELU_OPSET))  # 20 (Gelu), or 23 (Attention)
        if isinstance(self.opset, bool) or not isinstance(self.opset, int) or not lo <= self.opset <= hi:
            if getattr(self, "layout", None) == "attention-op":
                raise BlockforgeError(f"the attention-op layout needs an opset in [{lo}, {hi}] (ONNX Attention "
                                      f"exists from opset 23), got {self.opset!r}")
            raise BlockforgeError(f"opset must be an integer in [{lo}, {hi}], got {self.opset!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise BlockforgeError(f"seed must be a non-negative integer, got {self.seed!r}")
        _check_dim("batch", self.batch, allow_none=True)
        _check_dim("seq", self.seq, allow_none=True)

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == "float32" else 2

    def _check_param_budget(self) -> None:
        nbytes = self.param_count() * self.itemsize
        if nbytes > MAX_PARAM_BYTES:
            raise BlockforgeError(
                f"{self.kind} spec needs {nbytes / 2**30:.1f} GiB of weights "
                f"(limit {MAX_PARAM_BYTES / 2**30:.1f} GiB); reduce d_model/d_ff"
            )

    def to_dict(self) -> dict:
        return {"kind": self.kind, **dataclasses.asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def _check_kv_cache(spec) -> None:
    if not isinstance(spec.kv_cache, bool):
        raise BlockforgeError(f"kv_cache must be true or false, got {spec.kv_cache!r}")
    if spec.kv_cache and spec.cross:
        raise ArgumentError("a key/value cache is for self-attention (the cached keys are this sequence's "
                            "earlier positions); drop {kv_cache} or {kv_seq}/{cross}", "kv_cache", "kv_seq", "cross")
    if spec.kv_cache and spec.mask is not None:
        raise ArgumentError("{mask} with {kv_cache} is not supported (the padding mask would have to span "
                            "past + seq); drop one of them", "mask", "kv_cache")


@dataclass(frozen=True)
class MHASpec(Common):
    """Multi-Head Attention: Concat(head_1..head_h) W_O, head_i = Attention(qW_Q^i, kW_K^i, vW_V^i)."""

    heads: int = 8
    cross: bool = False  # key/value get their own sequence dim ("kv_seq")
    kv_seq: int | None = None  # static key/value length (implies cross)
    causal: bool = False
    mask: str | None = None  # key-padding mask input: None | "additive" | "bool"
    bias: bool = True
    layout: str = "per-head"
    kv_cache: bool = False  # past_key/past_value in, present_key/present_value out (decoding)

    kind = "mha"

    def __post_init__(self) -> None:
        self._validate_common()
        _check_dim("heads", self.heads)
        if self.d_model % self.heads:
            raise BlockforgeError(
                f"d_model ({self.d_model}) must be divisible by heads ({self.heads})"
            )
        _check_dim("kv_seq", self.kv_seq, allow_none=True)
        if self.kv_seq is not None and not self.cross:
            object.__setattr__(self, "cross", True)
        if self.causal and self.cross:
            raise ArgumentError("a causal mask needs self-attention (query and key of one length); "
                                "drop {causal} or {kv_seq}/{cross}", "causal", "kv_seq", "cross")
        _check_choice("mask", self.mask, MASKS)
        _check_choice("layout", self.layout, LAYOUTS)
        if not isinstance(self.bias, bool):
            raise BlockforgeError(f"bias must be true or false, got {self.bias!r}")
        _check_kv_cache(self)
        self._check_param_budget()

    @property
    def d_k(self) -> int:
        return self.d_model // self.heads

    def param_count(self) -> int:
        n = 4 * self.d_model * self.d_model
        return n + (4 * self.d_model if self.bias else 0)


@dataclass(frozen=True)
class FFNSpec(Common):
    """Position-wise FFN: act(x W_1 + b_1) W_2 + b_2."""

    d_ff: int | None = None  # default 4 * d_model
    activation: str = "relu"

    kind = "ffn"

    def __post_init__(self) -> None:
        self._validate_common()
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        _check_dim("d_ff", self.d_ff)
        _check_choice("activation", self.activation, ACTIVATIONS)
        self._check_param_budget()

    def param_count(self) -> int:
        return 2 * self.d_model * self.d_ff + self.d_ff + self.d_model


@dataclass(frozen=True)
class BlockSpec(Common):
    """Encoder block: MHA + FFN with residuals and LayerNormalization (pre- or post-LN)."""

    heads: int = 8
    d_ff: int | None = None
    activation: str = "gelu"
    norm: str = "pre"
    causal: bool = False
    layout: str = "per-head"
    eps: float = 1e-5
    kv_cache: bool = False


    kind = "block"

    def __post_init__(self) -> None:
        if self.layout == "attention-op":
            raise BlockforgeError("the attention-op layout is for mha only; a block uses per-head or packed")
        self._validate_common()
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        _check_choice("norm", self.norm, NORMS)
        if not (isinstance(self.eps, float) and 0 < self.eps < 1):
            raise BlockforgeError(f"eps must be a float in (0, 1), got {self.eps!r}")
        # Validate the parts (same messages as building them alone).
        self.mha_spec()
        self.ffn_spec()
        self._check_param_budget()

    def _common(self) -> dict:
        return dict(d_model=self.d_model, dtype=self.dtype, opset=self.opset,
                    batch=self.batch, seq=self.seq)

    def mha_spec(self) -> MHASpec:
        return MHASpec(**self._common(), seed=self.seed, heads=self.heads,
                       causal=self.causal, layout=self.layout, bias=True, kv_cache=self.kv_cache)

    def ffn_spec(self) -> FFNSpec:
        return FFNSpec(**self._common(), seed=self.seed + 1, d_ff=self.d_ff,
                       activation=self.activation)

    def param_count(self) -> int:
        return self.mha_spec().param_count() + self.ffn_spec().param_count() + 4 * self.d_model


Spec = Union[MHASpec, FFNSpec, BlockSpec]
SPEC_TYPES = {"mha": MHASpec, "ffn": FFNSpec, "block": BlockSpec}


def spec_from_dict(data: dict) -> Spec:
    """Rebuild a spec from `to_dict()` output (e.g. ONNX metadata); unknown fields are refused."""
    if not isinstance(data, dict):
        raise BlockforgeError("spec must be a JSON object")
    data = dict(data)
    kind = data.pop("kind", None)
    if kind not in SPEC_TYPES:
        raise BlockforgeError(f"unknown block kind {kind!r} (choose from: {', '.join(SPEC_TYPES)})")
    cls = SPEC_TYPES[kind]
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise BlockforgeError(f"unknown {kind} spec field(s): {', '.join(unknown)}")
    return cls(**data)
