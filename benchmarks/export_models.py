"""Real PyTorch / Hugging Face exports: the test corpus and the full-size benchmark models.

    .venv/bin/pip install -e '.[export]'   (torch==2.13.0, transformers, onnxscript)
    .venv/bin/python benchmarks/export_models.py tiny   # -> tests/fixtures/models/ + index.json
    .venv/bin/python benchmarks/export_models.py full   # -> artifacts/models/ (not committed)

Random weights from transformers configs (nothing is downloaded). Every model is exported
with BOTH of torch's exporters, the dynamo one (torch.export -> onnxscript; names its dims
s33, s50, ...) and the legacy TorchScript one (keeps the names given: batch, seq), each at
opset 17 and 18, with dynamic batch and sequence axes (ViT, Swin: batch only). GPT-2 is
exported causal without a KV cache (use_cache=False). Swin (shifted windows) has several
attention variants in one model: stage 1's window and shifted-window (masked) attention, 2
heads, and stage 2's 4-head attention over one window (no shift: the resolution is the window). Models are written with ir_version <= 10:
onnxruntime 1.31 refuses newer IR versions (the exporters write 10/11).

`make test` never needs torch: the tiny exports are committed, their index lists each
file's inputs, dims and sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import warnings
from pathlib import Path

MAX_IR_VERSION = 10  # onnxruntime 1.31
FIXTURES = Path("tests/fixtures/models")
FULL = Path("artifacts/models")

# Tiny: a few hundred KB each. vocab 128 keeps the embedding tables small.
TINY = dict(hidden=32, heads=2, layers=2, ff=64, vocab=128, positions=64, image=32, patch=8)
# Full size: BERT-base, DistilBERT (6 layers), RoBERTa-base, GPT-2 small (vocab 50257), ViT-B/16.
FULL_SIZE = dict(hidden=768, heads=12, layers=12, ff=3072, vocab=30522, positions=512, image=224, patch=16)
# Swin: its own shape (stages of depths x heads, embed dim doubling per stage); tiny: 32x32
# images, 4x4 patches (8x8 tokens), 4x4 windows; full: Swin-T.
SWIN = {"tiny": dict(image=32, patch=4, embed=16, depths=[2, 2], heads=[2, 4], window=4, mlp_ratio=2.0),
        "full": dict(image=224, patch=4, embed=96, depths=[2, 2, 6, 2], heads=[3, 6, 12, 24], window=7,
                     mlp_ratio=4.0)}
# Audio (the conv front ends, compile/conv): Whisper's encoder (two k=3 convs, the second
# stride 2, on num_mel_bins x 2*max_source_positions frames; batch dynamic only) and Wav2Vec2
# (a strided conv feature extractor with GroupNorm after the first, a grouped positional conv;
# batch and samples dynamic). Tiny: 8 mel bins x 32 frames; 400 samples through kernels
# (10, 3, 2) strides (5, 2, 2) -> 19 frames. Full: Whisper-base's encoder, Wav2Vec2-base.
AUDIO = {"tiny": dict(mel=8, frames=32, samples=400, conv_dim=(16, 16, 16), conv_kernel=(10, 3, 2),
                      conv_stride=(5, 2, 2), pos_kernel=8, pos_groups=2),
         "full": dict(mel=80, frames=3000, samples=16000, conv_dim=(512,) * 7, conv_kernel=(10, 3, 3, 3, 3, 2, 2),
                      conv_stride=(5, 2, 2, 2, 2, 2, 2), pos_kernel=128, pos_groups=16)}
AUDIO_MODELS = ("whisper", "wav2vec2")
FULL_LAYERS = {"distilbert": 6}
FULL_VOCAB = {"gpt2": 50257, "roberta": 50265}
EAGER_MODELS = ("bert", "distilbert", "roberta", "gpt2", "vit", "swin", "whisper", "wav2vec2")
# transformers' default attention (torch's scaled_dot_product_attention), exported as it
# lowers: the scale split as sqrt(scale) on Q and on K^T, boolean masks turned additive
# (where(keep, 0, -FLT_MAX)), an IsNaN/Where guard zeroing fully masked rows, GQA's
# key/value repeat (Unsqueeze/Expand/Reshape). Opset 18 only (the dynamo exporter's own).
SDPA_FAMILIES = ("bert", "gpt2", "vit", "llama", "qwen2", "opt", "gemma")
SDPA_SUFFIX = "_sdpa"
SDPA_OPSETS = (18,)
# BLOOM's default is still eager (transformers refuses SDPA for it): ALiBi, a per-head
# linear position bias added to the scores, at opset 18.
DEFAULT_EAGER = ("bloom",)
MODELS = EAGER_MODELS + tuple(f + SDPA_SUFFIX for f in SDPA_FAMILIES) + DEFAULT_EAGER
IMAGE_MODELS = ("vit", "swin")
# Decoders with grouped-query attention: 4 query heads over 2 key/value heads.
GQA = dict(heads=4, kv_heads=2)
EXPORTERS = ("dynamo", "legacy")
OPSETS = (17, 18)


def make_model(kind: str, s: dict):
    """A random-weight transformers model (eval mode) and its example inputs."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    attn = "eager"
    if kind.endswith(SDPA_SUFFIX):
        kind, attn = kind[: -len(SDPA_SUFFIX)], "sdpa"
    # eager: plain MatMul/Softmax attention; sdpa: transformers' default
    common = dict(attn_implementation=attn)
    if kind in ("llama", "qwen2", "gemma"):
        cls = {"llama": (tf.LlamaConfig, tf.LlamaModel), "qwen2": (tf.Qwen2Config, tf.Qwen2Model),
               "gemma": (tf.GemmaConfig, tf.GemmaModel)}[kind]
        extra = dict(head_dim=s["hidden"] // GQA["heads"]) if kind == "gemma" else {}
        cfg = cls[0](vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                     num_attention_heads=GQA["heads"], num_key_value_heads=GQA["kv_heads"],
                     intermediate_size=s["ff"], max_position_embeddings=s["positions"], use_cache=False,
                     **extra, **common)
        model = cls[1](cfg)
    elif kind == "opt":
        cfg = tf.OPTConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                           num_attention_heads=s["heads"], ffn_dim=s["ff"], word_embed_proj_dim=s["hidden"],
                           max_position_embeddings=s["positions"], use_cache=False, **common)
        model = tf.OPTModel(cfg)
    elif kind == "bloom":  # ALiBi: a per-head linear position bias added to the scores
        cfg = tf.BloomConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], n_layer=s["layers"], n_head=s["heads"],
                             use_cache=False, **common)
        model = tf.BloomModel(cfg)
    elif kind == "bert":
        cfg = tf.BertConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                            num_attention_heads=s["heads"], intermediate_size=s["ff"],
                            max_position_embeddings=s["positions"], **common)
        model = tf.BertModel(cfg, add_pooling_layer=False)
    elif kind == "roberta":
        cfg = tf.RobertaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                               num_attention_heads=s["heads"], intermediate_size=s["ff"],
                               max_position_embeddings=s["positions"] + 2, **common)
        model = tf.RobertaModel(cfg, add_pooling_layer=False)
    elif kind == "distilbert":
        cfg = tf.DistilBertConfig(vocab_size=s["vocab"], dim=s["hidden"], n_layers=s["layers"], n_heads=s["heads"],
                                  hidden_dim=s["ff"], max_position_embeddings=s["positions"], **common)
        model = tf.DistilBertModel(cfg)
    elif kind == "gpt2":
        cfg = tf.GPT2Config(vocab_size=s["vocab"], n_embd=s["hidden"], n_layer=s["layers"], n_head=s["heads"],
                            n_inner=s["ff"], n_positions=s["positions"], use_cache=False, **common)
        model = tf.GPT2Model(cfg)
    elif kind == "vit":
        cfg = tf.ViTConfig(hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                           intermediate_size=s["ff"], image_size=s["image"], patch_size=s["patch"], **common)
        model = tf.ViTModel(cfg, add_pooling_layer=False)
    elif kind == "whisper":
        a = s["audio"]
        cfg = tf.WhisperConfig(d_model=s["hidden"], encoder_layers=s["layers"], encoder_attention_heads=s["heads"],
                               encoder_ffn_dim=s["ff"], decoder_layers=1, decoder_attention_heads=s["heads"],
                               decoder_ffn_dim=s["ff"], num_mel_bins=a["mel"], max_source_positions=a["frames"] // 2,
                               vocab_size=s["vocab"], pad_token_id=0, bos_token_id=1, eos_token_id=2,
                               decoder_start_token_id=1, **common)
        model = tf.models.whisper.modeling_whisper.WhisperEncoder(cfg)  # the encoder alone: no decoder weights
    elif kind == "wav2vec2":
        a = s["audio"]
        cfg = tf.Wav2Vec2Config(hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                                intermediate_size=s["ff"], conv_dim=a["conv_dim"], conv_kernel=a["conv_kernel"],
                                conv_stride=a["conv_stride"], num_conv_pos_embeddings=a["pos_kernel"],
                                num_conv_pos_embedding_groups=a["pos_groups"], feat_extract_norm="group",
                                do_stable_layer_norm=False, mask_time_prob=0.0, **common)
        model = tf.Wav2Vec2Model(cfg)
    elif kind == "swin":
        w = s["swin"]
        cfg = tf.SwinConfig(image_size=w["image"], patch_size=w["patch"], embed_dim=w["embed"], depths=w["depths"],
                            num_heads=w["heads"], window_size=w["window"], mlp_ratio=w["mlp_ratio"],
                            drop_path_rate=0.0, **common)
        model = tf.SwinModel(cfg, add_pooling_layer=False)
    else:
        raise ValueError(kind)
    model.eval()
    if kind == "whisper":
        return model, {"input_features": torch.randn(2, s["audio"]["mel"], s["audio"]["frames"])}
    if kind == "wav2vec2":
        return model, {"input_values": torch.randn(2, s["audio"]["samples"])}
    if kind in IMAGE_MODELS:
        image = s["swin"]["image"] if kind == "swin" else s["image"]
        return model, {"pixel_values": torch.randn(2, 3, image, image)}
    ids = torch.randint(0, s["vocab"], (2, 16))
    # GPT-2 gets its attention_mask too (as HF's exports have it): without one, transformers
    # looks for packed sequences in the position ids with aten::diff, which the legacy
    # exporter cannot translate.
    return model, {"input_ids": ids, "attention_mask": torch.ones(2, 16, dtype=torch.int64)}


class _Wrapped:
    """forward(*inputs) -> last_hidden_state: one plain tensor output, no ModelOutput dict."""

    def __new__(cls, model, names):
        import torch

        class W(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, *args):
                kw = dict(zip(names, args))
                if "input_ids" in kw and "pixel_values" not in kw and hasattr(model.config, "use_cache"):
                    kw["use_cache"] = False
                return self.model(**kw, return_dict=True).last_hidden_state

        return W().eval()


def export_one(kind: str, exporter: str, opset: int, size: dict, path: Path) -> dict:
    import onnx
    import torch

    model, inputs = make_model(kind, size)
    base = kind[: -len(SDPA_SUFFIX)] if kind.endswith(SDPA_SUFFIX) else kind
    names = list(inputs)
    wrapped = _Wrapped(model, names)
    args = tuple(inputs.values())
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            batch_only = base in IMAGE_MODELS or base == "whisper"  # Whisper: frames fixed by its positions
            axes = {n: ({0: "batch"} if batch_only or n == "pixel_values" else {0: "batch", 1: "seq"}) for n in names}
            axes["last_hidden_state"] = {0: "batch"} if batch_only else {0: "batch", 1: "seq"}
            if base == "wav2vec2":  # samples in, frames out: two different lengths
                axes = {"input_values": {0: "batch", 1: "samples"}, "last_hidden_state": {0: "batch", 1: "frames"}}
            torch.onnx.export(wrapped, args, str(path), input_names=names, output_names=["last_hidden_state"],
                              dynamic_axes=axes, opset_version=opset, dynamo=False, do_constant_folding=True)
        else:
            _dynamo_export(wrapped, args, names, opset, path)
    config = dict(size["swin"]) if kind == "swin" else \
        {**_config(base, size), **({"audio": dict(size["audio"])} if base in AUDIO_MODELS else {})}
    entry = _finish_export(path, kind, exporter, opset, config)
    if entry.get("file"):
        entry.update(attention="sdpa" if kind.endswith(SDPA_SUFFIX) else "eager",
                     attention_layers=_attention_layers(base, size))
    return entry


def _dynamo_export(wrapped, args: tuple, names: list[str], opset: int, path: Path, decompose: bool = False) -> None:
    """decompose: torch.export with torch's default decompositions first, then the ONNX
    exporter on that program (for a model its own decomposition step fails on)."""
    import torch

    # Dim.DYNAMIC, as most users write it: torch names the dims itself (s33, s50, ...),
    # which is what binding by whole input shapes (--shape input_ids=1x128) is for.
    dyn = torch.export.Dim.DYNAMIC
    shapes = tuple({0: dyn} if n in ("pixel_values", "input_features") else {0: dyn, 1: dyn} for n in names)
    if decompose:
        wrapped = torch.export.export(wrapped, args, dynamic_shapes=(shapes,), strict=False).run_decompositions()
        args = ()
    prog = torch.onnx.export(wrapped, args, input_names=names, output_names=["last_hidden_state"],
                             dynamic_shapes=None if decompose else (shapes,), opset_version=opset, dynamo=True, optimize=True,
                             verify=False, external_data=False)
    prog.save(str(path), external_data=False)


def _finish_export(path: Path, kind: str, exporter: str, opset: int, config: dict) -> dict:
    """The written file checked (opset, IR version, onnx checker) and its index entry."""
    import onnx

    m = onnx.load(str(path))
    for node in m.graph.node:
        # The dynamo exporter records each node's Python stack trace (paths of this machine).
        del node.metadata_props[:]
        node.doc_string = ""
    got = next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx"))
    if got != opset:
        # The dynamo exporter writes opset 18 and converts down; when onnx's version converter
        # fails (Swin: "No Adapter To Version 17 for Pad") it keeps 18 and says so only in a
        # log line: a skip, as below, not a file misnamed op17.
        path.unlink()
        return {"file": None, "model": kind, "exporter": exporter, "opset": opset,
                "skipped": f"the exporter wrote opset {got}, not {opset} (its version converter failed)"}
    if m.ir_version > MAX_IR_VERSION:
        m.ir_version = MAX_IR_VERSION
    try:
        onnx.checker.check_model(m, full_check=True)
    except onnx.checker.ValidationError as e:
        # The dynamo exporter implements opset >= 18 only and converts down with onnx's
        # version converter, which leaves e.g. Split's opset-18 num_outputs attribute in
        # GPT-2 at opset 17: recorded as a skip, not repaired behind the exporter's back.
        path.unlink()
        return {"file": None, "model": kind, "exporter": exporter, "opset": opset,
                "skipped": f"the exporter wrote an invalid model: {str(e).splitlines()[0]}"}
    onnx.save(m, str(path))
    data = path.read_bytes()
    sig = [{"name": i.name, "shape": [d.dim_value if d.HasField("dim_value") else d.dim_param
                                      for d in i.type.tensor_type.shape.dim]} for i in m.graph.input]
    return {"file": path.name, "model": kind, "exporter": exporter, "opset": opset, "ir_version": m.ir_version,
            "inputs": sig, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "config": config}



def _attention_layers(base: str, size: dict) -> int:
    """Attention subgraphs per forward pass (what the fused-kernel count tests expect)."""
    return sum(size["swin"]["depths"]) if base == "swin" else size["layers"]


def _config(base: str, size: dict) -> dict:
    cfg = {k: size[k] for k in ("hidden", "heads", "layers", "ff")}
    if base in ("llama", "qwen2", "gemma"):
        cfg.update(GQA)
    return cfg


# ------------------------------------------------------------------ decoders with their KV cache
# Causal LMs exported for decoding: inputs input_ids (batch, seq), attention_mask
# (batch, past + seq) and past_key_values.{i}.key / .value (batch, kv_heads, past, head_dim);
# outputs logits and present.{i}.key / .value (batch, kv_heads, past + seq, head_dim), the
# names Hugging Face's own ONNX exports use. Llama and Qwen2 are GQA (kv_heads < heads; Qwen2
# has q/k/v biases). The past length is symbolic ("past" in the legacy export); a dynamo export
# names its dims itself, bound by whole input shapes (--shape input_ids=1x1,...).
DECODERS = ("gpt2_past", "llama_past", "qwen2_past")
DECODER_TINY = dict(hidden=32, heads=4, kv_heads=2, layers=2, ff=64, vocab=128, positions=512)  # P + S <= 512
DECODER_FULL = {"gpt2_past": dict(hidden=768, heads=12, kv_heads=12, layers=12, ff=3072, vocab=50257, positions=2048),
                "llama_past": dict(hidden=768, heads=12, kv_heads=4, layers=12, ff=2048, vocab=32000, positions=2048),
                "qwen2_past": dict(hidden=768, heads=12, kv_heads=4, layers=12, ff=2048, vocab=32000, positions=2048)}
EXAMPLE_PAST, EXAMPLE_SEQ = 5, 3  # > 1 each: the exporters specialise dims of size 0 and 1


def make_decoder(kind: str, s: dict):
    """A random-weight causal LM (eval mode, eager attention) and its config."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    common = dict(attn_implementation="eager", use_cache=True)
    if kind == "gpt2_past":
        cfg = tf.GPT2Config(vocab_size=s["vocab"], n_embd=s["hidden"], n_layer=s["layers"], n_head=s["heads"],
                            n_inner=s["ff"], n_positions=s["positions"], **common)
        model = tf.GPT2LMHeadModel(cfg)
    elif kind in ("llama_past", "qwen2_past"):
        cls, mcls = (tf.LlamaConfig, tf.LlamaForCausalLM) if kind == "llama_past" else (tf.Qwen2Config, tf.Qwen2ForCausalLM)
        cfg = cls(vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                  num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], intermediate_size=s["ff"],
                  max_position_embeddings=s["positions"], tie_word_embeddings=False, **common)
        model = mcls(cfg)
    else:
        raise ValueError(kind)
    return model.eval(), cfg


def _decoder_wrapper(model, layers: int):
    """forward(input_ids, attention_mask, k0, v0, k1, v1, ...) -> (logits, k0', v0', ...):
    flat past tensors in, a DynamicCache built from them (transformers 5 takes Cache objects
    only), flat present tensors out."""
    import torch
    from transformers import DynamicCache

    class W(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, *past):
            cache = DynamicCache(config=model.config)
            for i in range(layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache,
                             use_cache=True, return_dict=True)
            present = out.past_key_values
            flat = []
            for i in range(layers):
                layer = present.layers[i]
                flat += [layer.keys, layer.values]
            return (out.logits, *flat)

    return W().eval()


def export_decoder(kind: str, exporter: str, opset: int, size: dict, path: Path) -> dict:
    import torch

    model, cfg = make_decoder(kind, size)
    layers, kv, d = size["layers"], size["kv_heads"] if kind != "gpt2_past" else size["heads"], size["hidden"] // size["heads"]
    batch = 2
    past = [torch.randn(batch, kv, EXAMPLE_PAST, d) for _ in range(2 * layers)]
    ids = torch.randint(0, size["vocab"], (batch, EXAMPLE_SEQ))
    mask = torch.ones(batch, EXAMPLE_PAST + EXAMPLE_SEQ, dtype=torch.int64)
    args = (ids, mask, *past)
    past_names = [f"past_key_values.{i}.{w}" for i in range(layers) for w in ("key", "value")]
    present_names = [f"present.{i}.{w}" for i in range(layers) for w in ("key", "value")]
    names, outputs = ["input_ids", "attention_mask", *past_names], ["logits", *present_names]
    wrapped = _decoder_wrapper(model, layers)
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "past_seq"},
                    "logits": {0: "batch", 1: "seq"}}
            axes.update({n: {0: "batch", 2: "past"} for n in past_names})
            axes.update({n: {0: "batch", 2: "past_seq"} for n in present_names})
            torch.onnx.export(wrapped, args, str(path), input_names=names, output_names=outputs, dynamic_axes=axes,
                              opset_version=opset, dynamo=False, do_constant_folding=True)
        else:
            dyn = torch.export.Dim.DYNAMIC
            shapes = ({0: dyn, 1: dyn}, {0: dyn, 1: dyn}, tuple({0: dyn, 2: dyn} for _ in past_names))  # *past: one tuple
            prog = torch.onnx.export(wrapped, args, input_names=names, output_names=outputs, dynamic_shapes=shapes,
                                     opset_version=opset, dynamo=True, optimize=True, verify=False, external_data=False)
            prog.save(str(path), external_data=False)
    config = {k: size[k] for k in ("hidden", "heads", "layers", "ff")}
    config["kv_heads"] = kv
    entry = _finish_export(path, kind, exporter, opset, config)
    entry["past"] = {"layers": layers, "kv_heads": kv, "head_dim": d}
    return entry


# ------------------------------------------------------------------ the whole-model peer table
# benchmarks/whole_models.py (issue #20): each model as a user exports it, full size, random
# weights from its config, transformers' default attention (SDPA where the model has it), the
# dynamo exporter at opset 18, batch (and seq) dynamic. Each entry: the family, the inputs the
# table runs (batch 1), and the config's sizes, full and tiny (`whole --tiny`: the same recipes
# at toy sizes, committed as tests/fixtures/whole_models/, the script's --smoke models).
WHOLE_OPSET = 18
_TEXT = {"full": {"input_ids": [1, 128], "attention_mask": [1, 128]},
         "tiny": {"input_ids": [1, 8], "attention_mask": [1, 8]}}
_IMAGE = {"full": {"pixel_values": [1, 3, 224, 224]}, "tiny": {"pixel_values": [1, 3, 32, 32]}}
_ENC = dict(full=dict(hidden=768, heads=12, layers=12, ff=3072), tiny=dict(hidden=32, heads=2, layers=2, ff=64))
WHOLE = {
    "bert_base": dict(family="bert", inputs=_TEXT, size={"full": dict(_ENC["full"], vocab=30522),
                                                       "tiny": dict(_ENC["tiny"], vocab=128)}),
    "gpt2_small": dict(family="gpt2", inputs=_TEXT, size={"full": dict(_ENC["full"], vocab=50257),
                                                        "tiny": dict(_ENC["tiny"], vocab=128)}),
    # Llama-style: 12 query heads over 4 key/value heads, SwiGLU 2048 (~8/3 x 768), RMSNorm, RoPE
    "llama_gqa": dict(family="llama", inputs=_TEXT,
                      size={"full": dict(hidden=768, heads=12, kv_heads=4, layers=12, ff=2048, vocab=32000),
                            "tiny": dict(hidden=32, heads=4, kv_heads=2, layers=2, ff=64, vocab=128)}),
    "vit_b16": dict(family="vit", inputs=_IMAGE, size={"full": dict(_ENC["full"], image=224, patch=16),
                                                     "tiny": dict(_ENC["tiny"], image=32, patch=8)}),
    # Whisper-base's encoder: 512 wide, 6 layers, 8 heads; 30 s of audio = 80 mel x 3000 frames
    "whisper_base_encoder": dict(family="whisper",
                                 inputs={"full": {"input_features": [1, 80, 3000]},
                                         "tiny": {"input_features": [1, 8, 32]}},
                                 size={"full": dict(hidden=512, heads=8, layers=6, ff=2048, mel=80, frames=3000),
                                       "tiny": dict(_ENC["tiny"], mel=8, frames=32)}),
    # Wav2Vec2-base: 1 s of 16 kHz audio
    "wav2vec2_base": dict(family="wav2vec2",
                          inputs={"full": {"input_values": [1, 16000]}, "tiny": {"input_values": [1, 400]}},
                          size={"full": dict(_ENC["full"], **AUDIO["full"]), "tiny": dict(_ENC["tiny"], **AUDIO["tiny"])}),
    # CLIP ViT-B/32's vision tower (transformers' CLIPVisionConfig defaults), quick_gelu
    "clip_vision": dict(family="clip_vision", inputs=_IMAGE, size={"full": dict(_ENC["full"], image=224, patch=32),
                                                                 "tiny": dict(_ENC["tiny"], image=32, patch=8)}),
    # T5-base's encoder: relative position bias, RMSNorm, ReLU FFN, d_kv 64. torch 2.13's ONNX
    # exporter fails in its own decomposition step, static shapes or not ("Cannot view a tensor
    # with shape [1, 8, 2, 16] ... as (1, 8, 32)": a reshape made a view), so torch.export's
    # default decompositions run first (`decompose`); the ONNX exporter then takes that program.
    "t5_base_encoder": dict(family="t5", inputs=_TEXT, decompose=True, size={"full": dict(_ENC["full"], vocab=32128),
                                                           "tiny": dict(_ENC["tiny"], vocab=128)}),
}


def make_whole(name: str, tiny: bool):
    """A WHOLE entry's random-weight model (eval mode) and example inputs (batch 2, so the
    exporter keeps batch dynamic; text seq 16 keeps seq dynamic)."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    e = WHOLE[name]
    s = e["size"]["tiny" if tiny else "full"]
    h, heads, layers, ff = s["hidden"], s["heads"], s["layers"], s["ff"]
    fam = e["family"]
    if fam == "bert":
        model = tf.BertModel(tf.BertConfig(vocab_size=s["vocab"], hidden_size=h, num_hidden_layers=layers,
                                           num_attention_heads=heads, intermediate_size=ff), add_pooling_layer=False)
    elif fam == "gpt2":
        model = tf.GPT2Model(tf.GPT2Config(vocab_size=s["vocab"], n_embd=h, n_layer=layers, n_head=heads, n_inner=ff,
                                           use_cache=False))
    elif fam == "llama":
        model = tf.LlamaModel(tf.LlamaConfig(vocab_size=s["vocab"], hidden_size=h, num_hidden_layers=layers,
                                             num_attention_heads=heads, num_key_value_heads=s["kv_heads"],
                                             intermediate_size=ff, use_cache=False))
    elif fam == "vit":
        model = tf.ViTModel(tf.ViTConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                                         intermediate_size=ff, image_size=s["image"], patch_size=s["patch"]),
                            add_pooling_layer=False)
    elif fam == "whisper":
        cfg = tf.WhisperConfig(d_model=h, encoder_layers=layers, encoder_attention_heads=heads, encoder_ffn_dim=ff,
                               decoder_layers=1, decoder_attention_heads=heads, decoder_ffn_dim=ff,
                               num_mel_bins=s["mel"], max_source_positions=s["frames"] // 2)
        model = tf.models.whisper.modeling_whisper.WhisperEncoder(cfg)
    elif fam == "wav2vec2":
        model = tf.Wav2Vec2Model(tf.Wav2Vec2Config(
            hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=ff,
            conv_dim=s["conv_dim"], conv_kernel=s["conv_kernel"], conv_stride=s["conv_stride"],
            num_conv_pos_embeddings=s["pos_kernel"], num_conv_pos_embedding_groups=s["pos_groups"],
            feat_extract_norm="group", do_stable_layer_norm=False, mask_time_prob=0.0))
    elif fam == "clip_vision":
        model = tf.CLIPVisionModel(tf.CLIPVisionConfig(hidden_size=h, num_hidden_layers=layers,
                                                       num_attention_heads=heads, intermediate_size=ff,
                                                       image_size=s["image"], patch_size=s["patch"]))
    elif fam == "t5":
        model = tf.T5EncoderModel(tf.T5Config(vocab_size=s["vocab"], d_model=h, d_kv=h // heads, d_ff=ff,
                                              num_layers=layers, num_heads=heads, feed_forward_proj="relu",
                                              use_cache=False))
    else:
        raise ValueError(fam)
    example = {}
    for n, shape in e["inputs"]["tiny" if tiny else "full"].items():
        shape = [2, *shape[1:]] if n not in ("input_ids", "attention_mask") else [2, 16]
        example[n] = (torch.randint(0, s["vocab"], shape) if n == "input_ids" else
                      torch.ones(shape, dtype=torch.int64) if n == "attention_mask" else torch.randn(*shape))
    return model.eval(), example


def export_whole(name: str, tiny: bool, path: Path) -> dict:
    """One WHOLE model: the ONNX file and its entry (sha256, config, the inputs to run, versions)."""
    import torch
    import transformers

    model, example = make_whole(name, tiny)
    names = list(example)
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _dynamo_export(_Wrapped(model, names), tuple(example.values()), names, WHOLE_OPSET, path,
                       decompose=WHOLE[name].get("decompose", False))
    e = WHOLE[name]
    entry = _finish_export(path, name, "dynamo", WHOLE_OPSET, dict(e["size"]["tiny" if tiny else "full"]))
    entry.update(family=e["family"], size="tiny" if tiny else "full", run_inputs=e["inputs"]["tiny" if tiny else "full"],
                 versions={"torch": torch.__version__, "transformers": transformers.__version__})
    return entry


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["tiny", "full", "whole"])
    ap.add_argument("--tiny", action="store_true", help="whole: the toy-size recipes (whole_models.py --smoke)")
    ap.add_argument("--models", default=",".join(MODELS + DECODERS))
    ap.add_argument("--exporters", default=",".join(EXPORTERS))
    ap.add_argument("--opsets", default=None, help="comma list (tiny default 17,18; full default 17)")
    ap.add_argument("--layers", type=int, default=None, help="full: layers (default the real model's: 12, DistilBERT 6)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.what == "whole":  # whole_models.py's table: <out>/<name>.onnx + <name>.json each
        out = Path(a.out) if a.out else FULL
        names = list(WHOLE) if a.models == ap.get_default("models") else a.models.split(",")
        for name in names:
            entry = export_whole(name, a.tiny, out / f"{name}.onnx")
            (out / f"{name}.json").write_text(json.dumps(entry, indent=1) + "\n")
            print(f"wrote {out / name}.onnx ({entry['bytes'] / 1024:.0f} KiB)", flush=True)
        return 0
    tiny = a.what == "tiny"
    size = dict(TINY if tiny else FULL_SIZE, swin=SWIN[a.what], audio=AUDIO[a.what])
    if a.layers:
        size["layers"] = a.layers
    out = Path(a.out) if a.out else (FIXTURES if tiny else FULL)
    opsets = [int(x) for x in (a.opsets or ("17,18" if tiny else "17")).split(",")]
    index = []
    for kind in a.models.split(","):
        kind_size = dict(size)
        if not tiny:
            kind_size["layers"] = a.layers or FULL_LAYERS.get(kind, size["layers"])
            kind_size["vocab"] = FULL_VOCAB.get(kind, size["vocab"])
        if kind in DECODERS:
            kind_size = dict(DECODER_TINY if tiny else DECODER_FULL[kind])
            kind_size["layers"] = a.layers or kind_size["layers"]
        for exporter in a.exporters.split(","):
            newer = kind.endswith(SDPA_SUFFIX) or kind in DEFAULT_EAGER
            for opset in ([o for o in opsets if o in SDPA_OPSETS] if newer else opsets):
                name = f"{kind}_{exporter}_op{opset}.onnx"
                export = export_decoder if kind in DECODERS else export_one
                entry = export(kind, exporter, opset, kind_size, out / name)
                index.append(entry)
                if entry.get("skipped"):
                    print(f"skipped {name}: {entry['skipped']}", flush=True)
                else:
                    print(f"wrote {out / name} ({entry['bytes'] / 1024:.0f} KiB)", flush=True)
    if tiny:
        import torch
        import transformers

        # --models exports a subset: the other models' entries of an existing index stay.
        kinds = set(a.models.split(","))
        old = out / "index.json"
        kept = [e for e in json.loads(old.read_text())["models"] if e["model"] not in kinds] if old.exists() else []
        order = {k: i for i, k in enumerate(MODELS + DECODERS)}
        index = sorted(kept + index, key=lambda e: order.get(e["model"], len(order)))
        doc = {"generated_by": "benchmarks/export_models.py tiny",
               "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
               "models": index}
        (out / "index.json").write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
