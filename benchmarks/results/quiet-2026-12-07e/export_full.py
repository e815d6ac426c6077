"""Full-size random-weight exports for the fusion A/B: MPNet-base (all-mpnet-base-v2's config) and a
Gemma-2-style decoder at llama_gqa's size (12 layers, 768 wide, 12/4 heads, softcap 50, window 4096)."""
import sys, torch, transformers as tf, onnx, numpy as np
which, out = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
if which == "mpnet":
    m = tf.MPNetModel(tf.MPNetConfig(vocab_size=30527, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                     intermediate_size=3072, max_position_embeddings=514)).eval()
else:
    m = tf.Gemma2Model(tf.Gemma2Config(vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                       num_key_value_heads=4, head_dim=64, intermediate_size=3072,
                                       max_position_embeddings=2048, sliding_window=4096,
                                       attn_logit_softcapping=50.0, final_logit_softcapping=30.0)).eval()
ids = torch.randint(1, 30000, (1, 128)); mask = torch.ones(1, 128, dtype=torch.int64)
class W(torch.nn.Module):
    def __init__(s, m): super().__init__(); s.m = m
    def forward(s, a, b):
        kw = dict(input_ids=a, attention_mask=b)
        if which != "mpnet": kw["use_cache"] = False
        return s.m(**kw)[0]
with torch.no_grad():
    torch.onnx.export(W(m), (ids, mask), out, input_names=["input_ids", "attention_mask"], output_names=["out"],
                      dynamic_axes={"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}},
                      opset_version=17, dynamo=False)
mm = onnx.load(out, load_external_data=True)
if mm.ir_version > 10: mm.ir_version = 10
onnx.save(mm, out)
print("ok", out)
