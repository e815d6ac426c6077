"""Full-size random-weight exports of new families (transformers' default configs), legacy exporter, opset 17."""
import sys, torch, transformers as tf, onnx
which, out = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
img = lambda n: ({"pixel_values": torch.randn(1, 3, n, n)}, {"pixel_values": {0: "batch"}})
M = {
  "convnext_tiny": (lambda: tf.ConvNextModel(tf.ConvNextConfig()), img(224)),
  "dinov2_base": (lambda: tf.Dinov2Model(tf.Dinov2Config(image_size=224)), img(224)),
  "segformer_b0": (lambda: tf.SegformerModel(tf.SegformerConfig()), img(512)),
  "mobilevit_small": (lambda: tf.MobileViTModel(tf.MobileViTConfig()), img(256)),
  "modernbert_base": (lambda: tf.ModernBertModel(tf.ModernBertConfig(pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)),
                      ({"input_ids": torch.randint(3, 50000, (1, 512)), "attention_mask": torch.ones(1, 512, dtype=torch.int64)},
                       {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}})),
}
mk, (ins, dyn) = M[which]
model = mk().eval()
names = list(ins)
class W(torch.nn.Module):
    def __init__(s, m): super().__init__(); s.m = m
    def forward(s, *a): return s.m(**dict(zip(names, a)))[0]
with torch.no_grad():
    torch.onnx.export(W(model), tuple(ins.values()), out, input_names=names, output_names=["out"], dynamic_axes=dyn,
                      opset_version=17, dynamo=False)
m = onnx.load(out)
if m.ir_version > 10: m.ir_version = 10
onnx.save(m, out)
print("ok", out, {k: tuple(v.shape) for k, v in ins.items()})
