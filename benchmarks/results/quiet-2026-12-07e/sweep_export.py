"""Export one tiny random-weight HF family with one exporter: python sweep_export.py FAMILY EXPORTER OUTDIR"""
import sys, os, numpy as np, torch, transformers as tf
fam = sys.argv[1]; exp, out = (sys.argv[2:4] + ["", ""])[:2]
torch.manual_seed(0)
H, L, NH, FF, V = 64, 2, 4, 128, 1000
dec = dict(vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=NH, intermediate_size=FF,
           max_position_embeddings=256)
vis = dict(hidden_size=H, num_hidden_layers=L, num_attention_heads=NH, intermediate_size=FF)
F = {
 "convnext": (tf.ConvNextConfig, tf.ConvNextModel, dict(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1], image_size=64), "img64"),
 "mobilevit": (tf.MobileViTConfig, tf.MobileViTModel, dict(image_size=64, hidden_sizes=[48, 64, 80], neck_hidden_sizes=[8, 16, 24, 24, 32, 40, 160]), "img64"),
 "deit": (tf.DeiTConfig, tf.DeiTModel, dict(vis, image_size=64, patch_size=16), "img64"),
 "beit": (tf.BeitConfig, tf.BeitModel, dict(vis, image_size=64, patch_size=16, use_relative_position_bias=True), "img64"),
 "dinov2": (tf.Dinov2Config, tf.Dinov2Model, dict(vis, image_size=64, patch_size=14, mlp_ratio=2), "img70"),
 "siglip": (tf.SiglipVisionConfig, tf.SiglipVisionModel, dict(vis, image_size=64, patch_size=16), "img64"),
 "segformer": (tf.SegformerConfig, tf.SegformerModel, dict(hidden_sizes=[16, 32, 40, 64], depths=[1, 1, 1, 1], num_attention_heads=[1, 2, 4, 4]), "img64"),
 "swinv2": (tf.Swinv2Config, tf.Swinv2Model, dict(image_size=64, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4), "img64"),
 "yolos": (tf.YolosConfig, tf.YolosModel, dict(vis, image_size=[64, 64], patch_size=16, num_detection_tokens=10), "img64"),
 "electra": (tf.ElectraConfig, tf.ElectraModel, dict(dec, embedding_size=32), "text"),
 "xlm_roberta": (tf.XLMRobertaConfig, tf.XLMRobertaModel, dict(dec), "text"),
 "mpnet": (tf.MPNetConfig, tf.MPNetModel, dict(dec), "text"),
 "modernbert": (tf.ModernBertConfig, tf.ModernBertModel, dict(dec, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2, global_attn_every_n_layers=2, local_attention=8), "text"),
 "mixtral": (tf.MixtralConfig, tf.MixtralModel, dict(dec, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2), "dec"),
 "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeModel, dict(dec, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64), "dec"),
 "qwen3": (tf.Qwen3Config, tf.Qwen3Model, dict(dec, num_key_value_heads=2, head_dim=16), "dec"),
 "phi3": (tf.Phi3Config, tf.Phi3Model, dict(dec, num_key_value_heads=2, pad_token_id=0), "dec"),
 "falcon": (tf.FalconConfig, tf.FalconModel, dict(vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=NH, new_decoder_architecture=True, num_kv_heads=2), "dec"),
 "gemma2": (tf.Gemma2Config, tf.Gemma2Model, dict(dec, num_key_value_heads=2, head_dim=16, sliding_window=8), "dec"),
 "gemma3": (tf.Gemma3TextConfig, tf.Gemma3TextModel, dict(dec, num_key_value_heads=2, head_dim=16, sliding_window=8), "dec"),
 "stablelm": (tf.StableLmConfig, tf.StableLmModel, dict(dec, num_key_value_heads=2), "dec"),
 "gptj": (tf.GPTJConfig, tf.GPTJModel, dict(vocab_size=V, n_embd=H, n_layer=L, n_head=NH, rotary_dim=8, n_positions=256), "dec"),
 "codegen": (tf.CodeGenConfig, tf.CodeGenModel, dict(vocab_size=V, n_embd=H, n_layer=L, n_head=NH, rotary_dim=8, n_positions=256, n_ctx=256), "dec"),
 "olmo": (tf.OlmoConfig, tf.OlmoModel, dict(dec, num_key_value_heads=2), "dec"),
 "granite": (tf.GraniteConfig, tf.GraniteModel, dict(dec, num_key_value_heads=2), "dec"),
 "starcoder2": (tf.Starcoder2Config, tf.Starcoder2Model, dict(dec, num_key_value_heads=2), "dec"),
 "hubert": (tf.HubertConfig, tf.HubertModel, dict(vis, conv_dim=(32,) * 7, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4), "audio"),
 "wavlm": (tf.WavLMConfig, tf.WavLMModel, dict(vis, conv_dim=(32,) * 7, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4), "audio"),
 "data2vec_audio": (tf.Data2VecAudioConfig, tf.Data2VecAudioModel, dict(vis, conv_dim=(32,) * 7, num_conv_pos_embeddings=5, num_conv_pos_embedding_groups=4), "audio"),
 "pegasus": (tf.PegasusConfig, tf.PegasusModel, dict(vocab_size=V, d_model=H, encoder_layers=L, decoder_layers=L, encoder_attention_heads=NH, decoder_attention_heads=NH, encoder_ffn_dim=FF, decoder_ffn_dim=FF, max_position_embeddings=256), "s2s"),
 "marian": (tf.MarianConfig, tf.MarianModel, dict(vocab_size=V, d_model=H, encoder_layers=L, decoder_layers=L, encoder_attention_heads=NH, decoder_attention_heads=NH, encoder_ffn_dim=FF, decoder_ffn_dim=FF, max_position_embeddings=256, decoder_start_token_id=0, pad_token_id=0), "s2s"),
}
if fam == "--list":
    print(" ".join(F)); sys.exit(0)
cfgc, modc, kw, kind = F[fam]
cfg = cfgc(**kw)
if os.environ.get("EXPERTS"):
    cfg._experts_implementation = os.environ["EXPERTS"]
model = modc(cfg).eval()
if os.environ.get("EXPERTS") and hasattr(model, "set_experts_implementation"):
    model.set_experts_implementation(os.environ["EXPERTS"])
S = 16
g = torch.Generator().manual_seed(1)
if kind.startswith("img"):
    n = int(kind[3:])
    ins = {"pixel_values": torch.randn(1, 3, n, n, generator=g)}
    dyn = {"pixel_values": {0: "batch"}}
elif kind == "audio":
    ins = {"input_values": torch.randn(1, 4000, generator=g)}
    dyn = {"input_values": {0: "batch", 1: "samples"}}
elif kind == "s2s":
    ins = {"input_ids": torch.randint(1, V, (1, S), generator=g), "attention_mask": torch.ones(1, S, dtype=torch.int64),
           "decoder_input_ids": torch.randint(1, V, (1, 7), generator=g)}
    dyn = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}, "decoder_input_ids": {0: "batch", 1: "dseq"}}
else:
    ins = {"input_ids": torch.randint(1, V, (1, S), generator=g), "attention_mask": torch.ones(1, S, dtype=torch.int64)}
    ins["attention_mask"][0, :3] = 0 if kind == "text" else 1
    dyn = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}
names = list(ins)

class W(torch.nn.Module):
    def __init__(s, m): super().__init__(); s.m = m
    def forward(s, *a):
        kw = dict(zip(names, a))
        if kind in ("dec",):
            kw["use_cache"] = False
        o = s.m(**kw)
        return o[0]

w = W(model).eval()
path = os.path.join(out, f"{fam}_{exp}.onnx")
with torch.no_grad():
    if exp == "legacy":
        torch.onnx.export(w, tuple(ins.values()), path, input_names=names, output_names=["out"],
                          dynamic_axes=dyn, opset_version=17, dynamo=False)
    else:
        ds = tuple({k: torch.export.Dim.DYNAMIC for k in v} for v in dyn.values())
        torch.onnx.export(w, tuple(ins.values()), path, input_names=names, output_names=["out"],
                          dynamic_shapes=(ds,), opset_version=18, dynamo=True, external_data=False)
import onnx
m = onnx.load(path)
if m.ir_version > 10:
    m.ir_version = 10
onnx.save(m, path)
np.savez(os.path.join(out, f"{fam}_{exp}.npz"), **{k: v.numpy() for k, v in ins.items()})
print("exported", path)
