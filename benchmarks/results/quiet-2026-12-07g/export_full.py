"""Full-size random-weight exports of the twenty-seventh session's new families (transformers' default
configs unless named), legacy exporter, opset 17: python export_full.py NAME OUT.onnx"""
import sys, torch, transformers as tf, onnx
which, out = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
img = lambda n: ({"pixel_values": torch.randn(1, 3, n, n)}, {"pixel_values": {0: "batch"}})
text = lambda s: ({"input_ids": torch.randint(3, 30000, (1, s)), "attention_mask": torch.ones(1, s, dtype=torch.int64)},
                  {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}})
M = {
  # ResNet-50 (transformers' default ResNetConfig), MobileNetV2-1.0, EfficientNet-B0, CvT-13 (a DeBERTa-v3-base
  # did not export: the legacy exporter failed to serialize its graph, "Failed to serialize proto")
  "resnet50": (lambda: tf.ResNetModel(tf.ResNetConfig()), img(224)),
  "mobilenet_v2": (lambda: tf.MobileNetV2Model(tf.MobileNetV2Config()), img(224)),
  "efficientnet_b0": (lambda: tf.EfficientNetModel(tf.EfficientNetConfig(width_coefficient=1.0, depth_coefficient=1.0,
                                                                       image_size=224, hidden_dim=1280)), img(224)),
  "cvt_13": (lambda: tf.CvtModel(tf.CvtConfig()), img(224)),
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
