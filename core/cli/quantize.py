"""`blockforge quantize`: an int8 model through onnxruntime.quantization (graph/quantize.py)."""

from __future__ import annotations

import sys

from .common import add_force, add_shape, note_text, path_or_none, shape


def add(sub) -> None:
    from blockforge.graph.quantize import ACTIVATION_TYPES, MODES, RANDOM_BATCHES

    p = sub.add_parser("quantize", help="int8-quantize an ONNX model (onnxruntime.quantization, transformer-safe "
                                        "defaults: LayerNorm, Softmax, Gelu, residual adds stay float)")
    p.add_argument("model")
    p.add_argument("--mode", choices=list(MODES), required=True,
                   help="dynamic: int8 weights, activation scales at run time; static: QDQ, calibrated")
    p.add_argument("--calibration", default=None,
                   help="static: .npz of inputs (one batch, or batches stacked on a new axis 0); "
                        f"default {RANDOM_BATCHES} random batches from the model's signature")
    p.add_argument("--per-channel", action="store_true", help="one weight scale per output column")
    p.add_argument("--reduce-range", action="store_true",
                   help="7-bit weights: what x86 CPUs without VNNI (Haswell to Ice Lake clients, Skylake-SP, "
                        "AMD Zen 1-3) run on VPMADDUBSW; full-range weights take the exact VPMADDWD kernel there "
                        "(0.85x its speed on Zen 5) at a smaller error against float")
    p.add_argument("--activation-type", choices=list(ACTIVATION_TYPES), default="s8",
                   help="static: activations int8 (S8S8, default) or uint8 (U8S8)")
    p.add_argument("--bias-adds", action="store_true",
                   help="static: also quantize the bias Add after each quantized MatMul (ORT's default op list): "
                        "the int8 kernel then reads the activation after it from a table (BERT-base FFN ~10%% "
                        "faster) at one more rounding step of error per GEMM (its rel L2 vs float 2.9e-2, not 2.4e-2)")
    add_shape(p, "batch=2,seq=32, for random calibration")
    p.add_argument("--seed", type=int, default=0, help="random calibration batches")
    p.add_argument("-o", "--output", required=True, help="OUT.onnx")
    add_force(p)
    p.set_defaults(func=run)


def run(a) -> int:
    from pathlib import Path

    from blockforge.errors import printable
    from blockforge.graph.quantize import QuantizeOptions, quantize

    opts = QuantizeOptions(model=Path(a.model), output=Path(a.output), mode=a.mode,
                           calibration=path_or_none(a.calibration, "--calibration"), per_channel=a.per_channel,
                           activation_type=a.activation_type, shape=shape(a), seed=a.seed, force=a.force,
                           bias_adds=a.bias_adds, reduce_range=a.reduce_range)
    res = quantize(opts, progress=lambda s: print(f"quantize: {s}", file=sys.stderr, flush=True))
    for note in res.notes:
        print(f"note: {note_text(note)}")
    if res.calibration:
        print(f"calibration: {printable(res.calibration, limit=None)}")
    kept = ", ".join(f"{n} {why}" for why, n in res.kept_float.items()) or "none"
    print(f"wrote {printable(str(res.output))} ({res.mode}: {res.quantized_nodes} int8 GEMMs; kept in float: {kept})")
    return 0
