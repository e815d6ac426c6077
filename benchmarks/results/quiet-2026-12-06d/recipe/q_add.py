import onnxruntime.quantization as oq
from pathlib import Path
orig = oq.quantize_static
def patched(*a, **kw):
    kw["op_types_to_quantize"] = list(kw.get("op_types_to_quantize") or []) + ["Add"]
    return orig(*a, **kw)
oq.quantize_static = patched
from blockforge.graph.quantize import QuantizeOptions, quantize
r = quantize(QuantizeOptions(model=Path("/tmp/s15/ffn_f32.onnx"), output=Path("/tmp/s15/ffn_static_add.onnx"), mode="static",
                             per_channel=True, shape={"batch": 1, "seq": 128}, force=True))
print(r)
