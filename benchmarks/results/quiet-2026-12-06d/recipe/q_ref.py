from pathlib import Path
from blockforge.graph.quantize import QuantizeOptions, quantize
r = quantize(QuantizeOptions(model=Path("/tmp/s15/ffn_f32.onnx"), output=Path("/tmp/s15/ffn_static_ref.onnx"), mode="static",
                             per_channel=True, shape={"batch": 1, "seq": 128}, force=True))
print(r.quantized_nodes)
