"""Families a user brings that the main corpus does not hold: the committed regression corpus of
issue #20's sweep (tests/fixtures/families/, checked by tests/test_families.py).

    .venv/bin/pip install -e '.[export]'
    .venv/bin/python benchmarks/export_families.py                 # every family, both exporters
    .venv/bin/python benchmarks/export_families.py --families mobilevit,segformer --exporters dynamo

Each family is a tiny random-weight transformers config (nothing is downloaded) exported by the
dynamo exporter (opset 18, dims named by torch) and the legacy one (opset 17, dims named here),
batch and sequence dynamic where the model allows. The twenty-fifth session's sweep of 29 of
these families (full-size runs in benchmarks/results/quiet-2026-12-07e/) found three attention
forms the fuser did not know (MPNet, Swin V2, Gemma 2) and the CNN families' convolutions on
TVM's default schedule (the twenty-sixth's depthwise and pointwise kernels); the twenty-seventh
added 23 (ResNet, RegNet, MobileNet V1/V2, EfficientNet, ConvNeXt V2, BiT, PoolFormer,
SwiftFormer, MobileViT V2, CvT, LeViT, FocalNet, AST, ALBERT, DeBERTa-v2, CLIP text, Mistral,
Phi, GPT-NeoX, SEW, BART, T5) and with them found ORT's wrong Pad_Fusion (BiT), the legacy
exporter's output dims (MobileNet), Col2Im (MobileViT V2) and Einsum (CvT): this corpus keeps
each such finding a test. Each index entry records what the compiler must do with the file, counted
in the file itself: the Softmax nodes (each an attention the fuser must take) and the depthwise
convolutions (each a call of compile/conv/depthwise.py's kernels).

Mixture-of-experts decoders (Mixtral, Qwen2-MoE) are not here: neither exporter writes them
with transformers' grouped experts, and the legacy trace of eager experts is valid only while
every traced expert gets a token (blockforge refuses it with the data-dependent-shape hint).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from export_models import MAX_IR_VERSION  # noqa: E402

FIXTURES = Path("tests/fixtures/families")
EXPORTERS = {"dynamo": 18, "legacy": 17}
# The legacy exporter's col2im (MobileViT V2's fold) fails on a size it cannot read
# ("'NoneType' object is not subscriptable" in symbolic_opset18): its dynamo export only.
ONLY_DYNAMO = {"mobilevitv2"}
H, L, HEADS, FF, VOCAB = 32, 2, 4, 64, 128  # head_dim 8; vocab 128 keeps the tables small
_TEXT = dict(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=L, num_attention_heads=HEADS, intermediate_size=FF,
             max_position_embeddings=64)
_DEC = dict(_TEXT, num_key_value_heads=2)  # grouped-query attention: 4 query heads over 2
_VIS = dict(hidden_size=H, num_hidden_layers=L, num_attention_heads=HEADS, intermediate_size=FF)
_AUDIO = dict(_VIS, conv_dim=(16,) * 7, num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4)
_S2S = dict(vocab_size=VOCAB, d_model=H, encoder_layers=L, decoder_layers=L, encoder_attention_heads=HEADS,
            decoder_attention_heads=HEADS, encoder_ffn_dim=FF, decoder_ffn_dim=FF, max_position_embeddings=64)

# name: (config class, model class, config kwargs, input kind). Input kinds: image<n> (1, 3, n, n),
# text (ids + a mask with 3 padded positions), dec (ids + an all-ones mask: causal, no padding),
# audio (1, 4000 samples), spectrogram (1, 64 frames, 32 mel bins), s2s (encoder ids + mask, 7
# decoder ids).
FAMILIES = {
    # CNNs and hybrids: depthwise, pointwise and strided convs (compile/conv)
    "convnext": ("ConvNextConfig", "ConvNextModel",
                 dict(hidden_sizes=[8, 16, 24, 32], depths=[1, 1, 2, 1], image_size=64), "image64"),
    # heads 36/48/60 wide at full size: odd widths here too (9, 12, 15)
    "mobilevit": ("MobileViTConfig", "MobileViTModel",
                  dict(image_size=64, hidden_sizes=[18, 24, 30], num_attention_heads=2,
                       neck_hidden_sizes=[8, 8, 12, 16, 16, 24, 48], expand_ratio=2.0, mlp_ratio=2.0), "image64"),
    "segformer": ("SegformerConfig", "SegformerModel",
                  dict(hidden_sizes=[16, 24, 32, 32], depths=[1, 1, 1, 1], num_attention_heads=[1, 2, 4, 4],
                       mlp_ratios=[2, 2, 2, 2], decoder_hidden_size=32), "image64"),
    "resnet": ("ResNetConfig", "ResNetModel",
               dict(embedding_size=16, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1], layer_type="bottleneck"),
               "image64"),
    # grouped 3x3 convs (8 channels a group) and squeeze-excitation
    "regnet": ("RegNetConfig", "RegNetModel",
               dict(embedding_size=16, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1], groups_width=8,
                    layer_type="y"), "image64"),
    "mobilenet_v1": ("MobileNetV1Config", "MobileNetV1Model", dict(depth_multiplier=0.125, min_depth=8, image_size=64),
                     "image64"),
    # ReLU6 (Clip), TF-style asymmetric padding
    "mobilenet_v2": ("MobileNetV2Config", "MobileNetV2Model", dict(depth_multiplier=0.15, finegrained_output=False, image_size=64),
                     "image64"),
    # squeeze-excitation on depthwise blocks, 5x5 depthwise, SiLU
    "efficientnet": ("EfficientNetConfig", "EfficientNetModel",
                     dict(image_size=64, width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320), "image64"),
    "convnextv2": ("ConvNextV2Config", "ConvNextV2Model",
                   dict(hidden_sizes=[8, 16, 24, 32], depths=[1, 1, 2, 1], image_size=64), "image64"),
    # weight-standardised convs, GroupNorm
    "bit": ("BitConfig", "BitModel", dict(embedding_size=16, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1],
                                          num_groups=8), "image64"),
    "poolformer": ("PoolFormerConfig", "PoolFormerModel", dict(hidden_sizes=[16, 24, 32, 48], depths=[1, 1, 1, 1]),
                   "image64"),
    "swiftformer": ("SwiftFormerConfig", "SwiftFormerModel",
                    dict(image_size=64, depths=[1, 1, 1, 1], embed_dims=[16, 24, 32, 48]), "image64"),
    # separable self-attention (a softmax over tokens), GroupNorm
    "mobilevitv2": ("MobileViTV2Config", "MobileViTV2Model",
                    dict(image_size=64, width_multiplier=0.125, n_attn_blocks=[1, 1, 1]), "image64"),
    # convolutional token embeddings and depthwise conv projections of Q, K, V (with BatchNorm)
    # (a stage's depth must exceed its index: transformers reads its drop-path rates by stage)
    "cvt": ("CvtConfig", "CvtModel", dict(embed_dim=[16, 24, 32], num_heads=[1, 2, 2], depth=[1, 2, 3]), "image64"),
    # attention biases by relative position, hardswish, subsampling attention
    "levit": ("LevitConfig", "LevitModel",
              dict(image_size=64, hidden_sizes=[32, 48, 64], num_attention_heads=[2, 3, 4], depths=[1, 1, 1],
                   key_dim=[8, 8, 8]), "image64"),
    # focal modulation: depthwise convs at several levels
    "focalnet": ("FocalNetConfig", "FocalNetModel",
                 dict(image_size=64, patch_size=4, embed_dim=16, depths=[1, 1], hidden_sizes=[16, 32]), "image64"),
    # vision transformers
    "deit": ("DeiTConfig", "DeiTModel", dict(_VIS, image_size=64, patch_size=16), "image64"),
    "beit": ("BeitConfig", "BeitModel", dict(_VIS, image_size=64, patch_size=16, use_relative_position_bias=True),
             "image64"),
    "dinov2": ("Dinov2Config", "Dinov2Model", dict(_VIS, image_size=56, patch_size=14, mlp_ratio=2), "image70"),
    "siglip": ("SiglipVisionConfig", "SiglipVisionModel", dict(_VIS, image_size=64, patch_size=16), "image64"),
    "swinv2": ("Swinv2Config", "Swinv2Model",
               dict(image_size=64, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4),
               "image64"),
    "yolos": ("YolosConfig", "YolosModel", dict(_VIS, image_size=[64, 64], patch_size=16, num_detection_tokens=10),
              "image64"),
    "ast": ("ASTConfig", "ASTModel", dict(_VIS, patch_size=16, max_length=64, num_mel_bins=32, frequency_stride=10,
                                         time_stride=10), "spectrogram"),
    # encoders
    "albert": ("AlbertConfig", "AlbertModel", dict(_TEXT, embedding_size=16), "text"),
    # disentangled attention: content-to-position and position-to-content scores
    "deberta_v2": ("DebertaV2Config", "DebertaV2Model",
                   dict(_TEXT, relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=8), "text"),
    "clip_text": ("CLIPTextConfig", "CLIPTextModel", dict(_TEXT), "dec"),
    "electra": ("ElectraConfig", "ElectraModel", dict(_TEXT, embedding_size=16), "text"),
    "xlm_roberta": ("XLMRobertaConfig", "XLMRobertaModel", dict(_TEXT, max_position_embeddings=66), "text"),
    "mpnet": ("MPNetConfig", "MPNetModel", dict(_TEXT, max_position_embeddings=66), "text"),
    "modernbert": ("ModernBertConfig", "ModernBertModel",
                   dict(_TEXT, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
                        global_attn_every_n_layers=2, local_attention=8), "text"),
    # decoders
    "mistral": ("MistralConfig", "MistralModel", dict(_DEC, head_dim=8, sliding_window=8), "dec"),
    "phi": ("PhiConfig", "PhiModel", dict(_DEC), "dec"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXModel", dict(_TEXT), "dec"),
    "qwen3": ("Qwen3Config", "Qwen3Model", dict(_DEC, head_dim=8), "dec"),
    "phi3": ("Phi3Config", "Phi3Model", dict(_DEC, pad_token_id=0), "dec"),
    "falcon": ("FalconConfig", "FalconModel",
               dict(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=L, num_attention_heads=HEADS,
                    new_decoder_architecture=True, num_kv_heads=2), "dec"),
    "gemma2": ("Gemma2Config", "Gemma2Model", dict(_DEC, head_dim=8, sliding_window=8), "dec"),
    "gemma3": ("Gemma3TextConfig", "Gemma3TextModel", dict(_DEC, head_dim=8, sliding_window=8), "dec"),
    "stablelm": ("StableLmConfig", "StableLmModel", dict(_DEC), "dec"),
    "gptj": ("GPTJConfig", "GPTJModel",
             dict(vocab_size=VOCAB, n_embd=H, n_layer=L, n_head=HEADS, rotary_dim=4, n_positions=64), "dec"),
    "codegen": ("CodeGenConfig", "CodeGenModel",
                dict(vocab_size=VOCAB, n_embd=H, n_layer=L, n_head=HEADS, rotary_dim=4, n_positions=64, n_ctx=64),
                "dec"),
    "olmo": ("OlmoConfig", "OlmoModel", dict(_DEC), "dec"),
    "granite": ("GraniteConfig", "GraniteModel", dict(_DEC), "dec"),
    "starcoder2": ("Starcoder2Config", "Starcoder2Model", dict(_DEC), "dec"),
    # speech: a strided conv feature extractor and a grouped positional conv
    "hubert": ("HubertConfig", "HubertModel", dict(_AUDIO), "audio"),
    "wavlm": ("WavLMConfig", "WavLMModel", dict(_AUDIO), "audio"),
    "sew": ("SEWConfig", "SEWModel", dict(_AUDIO, conv_stride=(5, 2, 2, 2, 2, 2, 2), conv_kernel=(10, 3, 3, 3, 3, 2, 2),
                                         squeeze_factor=2), "audio"),
    "data2vec_audio": ("Data2VecAudioConfig", "Data2VecAudioModel", dict(_AUDIO, num_conv_pos_embeddings=5),
                       "audio"),
    # encoder-decoders: self, causal and cross attention in one graph
    "pegasus": ("PegasusConfig", "PegasusModel", dict(_S2S), "s2s"),
    "marian": ("MarianConfig", "MarianModel", dict(_S2S, decoder_start_token_id=0, pad_token_id=0), "s2s"),
    "bart": ("BartConfig", "BartModel", dict(_S2S), "s2s"),
    # relative position buckets, RMSNorm, ReLU FFN
    "t5": ("T5Config", "T5Model", dict(vocab_size=VOCAB, d_model=H, d_kv=8, d_ff=FF, num_layers=L, num_heads=HEADS,
                                       decoder_start_token_id=0), "s2s"),
}
TEXT_SEQ, DECODER_SEQ, SAMPLES, PADDED = 16, 7, 4000, 3


def example_inputs(kind: str, seed: int = 1) -> dict:
    """The inputs a family is exported with and tested on: numpy arrays (tests/test_families.py
    builds the same ones without torch)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if kind.startswith("image"):
        n = int(kind[len("image"):])
        return {"pixel_values": rng.standard_normal((1, 3, n, n), dtype=np.float32)}
    if kind == "audio":
        return {"input_values": rng.standard_normal((1, SAMPLES), dtype=np.float32)}
    if kind == "spectrogram":  # AST: (batch, frames = max_length, mel bins)
        return {"input_values": rng.standard_normal((1, 64, 32), dtype=np.float32)}
    ids = rng.integers(1, VOCAB, (1, TEXT_SEQ), dtype=np.int64)
    mask = np.ones((1, TEXT_SEQ), np.int64)
    if kind in ("text", "s2s"):
        mask[0, :PADDED] = 0  # padded positions: the mask's arithmetic is under test too
    out = {"input_ids": ids, "attention_mask": mask}
    if kind == "s2s":
        out["decoder_input_ids"] = rng.integers(1, VOCAB, (1, DECODER_SEQ), dtype=np.int64)
    return out


def _dynamic_axes(kind: str, names: list[str]) -> dict:
    if kind.startswith("image"):
        return {"pixel_values": {0: "batch"}}
    if kind == "audio":
        return {"input_values": {0: "batch", 1: "samples"}}
    if kind == "spectrogram":
        return {"input_values": {0: "batch"}}
    return {n: {0: "batch", 1: "dseq" if n == "decoder_input_ids" else "seq"} for n in names}


def export_family(name: str, exporter: str, out: Path) -> dict:
    import numpy as np
    import onnx
    import torch
    import transformers as tf

    cfg_cls, model_cls, kw, kind = FAMILIES[name]
    torch.manual_seed(0)
    model = getattr(tf, model_cls)(getattr(tf, cfg_cls)(**kw)).eval()
    inputs = {k: torch.from_numpy(v) for k, v in example_inputs(kind).items()}
    names = list(inputs)

    class Wrapped(torch.nn.Module):  # one plain tensor out: the last hidden state
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, *args):
            kw = dict(zip(names, args))
            if kind == "dec":
                kw["use_cache"] = False
            return self.m(**kw)[0]

    path = out / f"{name}_{exporter}.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    axes = _dynamic_axes(kind, names)
    opset = EXPORTERS[exporter]
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            torch.onnx.export(Wrapped().eval(), tuple(inputs.values()), str(path), input_names=names,
                              output_names=["last_hidden_state"], dynamic_axes=axes, opset_version=opset,
                              dynamo=False, do_constant_folding=True)
        else:
            dyn = torch.export.Dim.DYNAMIC
            shapes = tuple({i: dyn for i in axes[n]} for n in names)
            prog = torch.onnx.export(Wrapped().eval(), tuple(inputs.values()), input_names=names,
                                     output_names=["last_hidden_state"], dynamic_shapes=(shapes,),
                                     opset_version=opset, dynamo=True, optimize=True, verify=False,
                                     external_data=False)
            prog.save(str(path), external_data=False)
    m = onnx.load(str(path))
    for node in m.graph.node:  # the dynamo exporter's stack traces name this machine's paths
        del node.metadata_props[:]
        node.doc_string = ""
    m.ir_version = min(m.ir_version, MAX_IR_VERSION)  # onnxruntime 1.31
    onnx.checker.check_model(m, full_check=True)
    onnx.save(m, str(path))
    data = path.read_bytes()
    return {"file": path.name, "family": name, "exporter": exporter, "opset": opset, "kind": kind,
            "inputs": {k: list(v.shape) for k, v in inputs.items()},
            "softmax": _count(m, "Softmax"), "depthwise_convs": _depthwise(m), "convs": _count(m, "Conv"),
            "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "config": _plain(kw)}


def _count(m, op: str) -> int:
    return sum(n.op_type == op for n in m.graph.node)


def _depthwise(m) -> int:
    """Conv nodes with one input channel per group and as many groups as output channels."""
    from onnx import numpy_helper

    weights = {t.name: t.dims for t in m.graph.initializer}
    weights.update({n.output[0]: numpy_helper.to_array(a.t).shape for n in m.graph.node if n.op_type == "Constant"
                    for a in n.attribute if a.name == "value"})
    count = 0
    for n in m.graph.node:
        if n.op_type != "Conv" or n.input[1] not in weights:
            continue
        group = next((a.i for a in n.attribute if a.name == "group"), 1)
        w = weights[n.input[1]]
        count += group > 1 and w[0] == group and w[1] == 1
    return count


def _plain(kw: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in kw.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--exporters", default=",".join(EXPORTERS))
    ap.add_argument("--out", default=str(FIXTURES))
    a = ap.parse_args(argv)
    out = Path(a.out)
    chosen = a.families.split(",")
    unknown = [f for f in chosen if f not in FAMILIES] + [e for e in a.exporters.split(",") if e not in EXPORTERS]
    if unknown:
        ap.error(f"unknown: {', '.join(unknown)}")
    entries = []
    for name in chosen:
        for exporter in a.exporters.split(","):
            if exporter != "dynamo" and name in ONLY_DYNAMO:
                continue
            e = export_family(name, exporter, out)
            entries.append(e)
            print(f"wrote {out / e['file']} ({e['bytes'] / 1024:.0f} KiB, {e['softmax']} softmax, "
                  f"{e['depthwise_convs']} depthwise of {e['convs']} convs)", flush=True)
    import torch
    import transformers

    # A subset re-exported: the other entries of an existing index stay.
    index = out / "index.json"
    done = {e["file"] for e in entries}
    kept = [e for e in json.loads(index.read_text())["models"] if e["file"] not in done] if index.exists() else []
    order = {f: i for i, f in enumerate(FAMILIES)}
    models = sorted(kept + entries, key=lambda e: (order.get(e["family"], len(order)), e["exporter"]))
    doc = {"generated_by": "benchmarks/export_families.py",
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__}, "models": models}
    index.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
