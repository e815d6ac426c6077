"""`blockforge export`: build an MHA / FFN / encoder block as ONNX. Choices and defaults come
from the spec tables (graph/spec.py), not retyped here."""

from __future__ import annotations

import dataclasses

from .common import add_force


def add(sub) -> None:
    from blockforge.graph import spec as S

    mha, ffn, blk = (
        {f.name: f.default for f in dataclasses.fields(c)} for c in (S.MHASpec, S.FFNSpec, S.BlockSpec))
    p = sub.add_parser("export", help="build an MHA / FFN / encoder block as ONNX")
    p.add_argument("kind", choices=list(S.SPEC_TYPES))
    p.add_argument("--d-model", type=int, default=mha["d_model"])
    p.add_argument("--heads", type=int, default=mha["heads"])
    p.add_argument("--d-ff", type=int, default=None, help="default 4*d_model")
    p.add_argument("--activation", choices=list(S.ACTIVATIONS), default=None,
                   help=f"FFN activation (ffn default {ffn['activation']}, block default {blk['activation']})")
    p.add_argument("--cross", action="store_true", help="cross-attention: key/value get their own length")
    p.add_argument("--kv-seq", type=int, default=None, help="static key/value length (implies --cross)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--kv-cache", action="store_true",
                   help="mha/block: past_key/past_value inputs (B, h, past, d_k) and present_key/present_value "
                        "outputs (B, h, past+seq, d_k), for decoding")
    p.add_argument("--mask", choices=[m for m in S.MASKS if m], default=None, help="add a key_padding_mask input")
    p.add_argument("--no-bias", action="store_true")
    p.add_argument("--layout", choices=list(S.LAYOUTS), default=mha["layout"])
    p.add_argument("--norm", choices=list(S.NORMS), default=blk["norm"], help="block: pre-LN or post-LN")
    p.add_argument("--dtype", choices=list(S.DTYPES), default=mha["dtype"])
    p.add_argument("--opset", type=int, default=mha["opset"], help=f"{S.MIN_OPSET}..{S.MAX_OPSET}")
    p.add_argument("--seed", type=int, default=mha["seed"])
    p.add_argument("--batch", type=int, default=None, help="static batch (default symbolic)")
    p.add_argument("--seq", type=int, default=None, help="static sequence length (default symbolic)")
    p.add_argument("--quantize", choices=["dynamic", "static"], default=None,
                   help="write it int8-quantized as `blockforge quantize --mode` does (static: random calibration)")
    p.add_argument("--per-channel", action="store_true", help="with --quantize: one weight scale per column")
    p.add_argument("--reduce-range", action="store_true",
                   help="with --quantize: 7-bit weights (x86 without VNNI runs them on VPMADDUBSW)")
    p.add_argument("--bias-adds", action="store_true",
                   help="with --quantize static: the bias Adds quantized too (`blockforge quantize --bias-adds`)")
    p.add_argument("-o", "--output", default=None, help="MODEL.onnx (default artifacts/<name>.onnx)")
    add_force(p)
    p.set_defaults(func=run)


def spec_from_args(a):
    from blockforge.errors import BlockforgeError
    from blockforge.graph.spec import BlockSpec, FFNSpec, MHASpec

    common = dict(d_model=a.d_model, dtype=a.dtype, opset=a.opset, seed=a.seed, batch=a.batch, seq=a.seq)
    if a.kind == "mha":
        return MHASpec(**common, heads=a.heads, cross=a.cross, kv_seq=a.kv_seq, causal=a.causal,
                       mask=a.mask, bias=not a.no_bias, layout=a.layout, kv_cache=a.kv_cache)
    if a.kind == "ffn":
        if a.kv_cache:
            raise BlockforgeError("--kv-cache is for mha and block (an FFN has no attention to cache)")
        return FFNSpec(**common, d_ff=a.d_ff, **({"activation": a.activation} if a.activation else {}))
    return BlockSpec(**common, heads=a.heads, d_ff=a.d_ff, **({"activation": a.activation} if a.activation else {}),
                     norm=a.norm, causal=a.causal, layout=a.layout, kv_cache=a.kv_cache)


def run(a) -> int:
    from blockforge.graph.export import export

    from blockforge.errors import BlockforgeError

    if a.per_channel and not a.quantize:
        raise BlockforgeError("--per-channel needs --quantize dynamic|static")
    if a.reduce_range and not a.quantize:
        raise BlockforgeError("--reduce-range needs --quantize dynamic|static")
    if a.bias_adds and a.quantize != "static":
        raise BlockforgeError("--bias-adds needs --quantize static")
    res = export(spec_from_args(a), a.output, force=a.force, quantize=a.quantize, per_channel=a.per_channel,
                 bias_adds=a.bias_adds, reduce_range=a.reduce_range)
    m = res.manifest
    if a.quantize:
        q = m["quantization"]
        print(f"quantized {a.quantize}: {q['int8_gemms']} int8 GEMMs"
              + (f"; calibration: {q['calibration']}" if q["calibration"] else ""))
    print(f"wrote {res.model_path} ({m['bytes'] / 2**20:.1f} MiB, {m['params']:,} params, "
          f"{m['matmul_flops'] / 1e9:.3f} GFLOP at {m['flops_at']}) and {res.manifest_path}")
    return 0
