# Twenty-eighth session: ORT on a model with and without session.set_denormal_as_zero (python denormals.py MODEL.onnx;
# the input is pixel_values (1, 3, 256, 256), MobileViT-small's). The output's max says whether its activations underflowed.
import onnxruntime as ort, numpy as np, time, sys
path = sys.argv[1]
x = np.random.default_rng(0).standard_normal((1, 3, 256, 256)).astype(np.float32)
for daz in ("0", "1", "0", "1"):
    so = ort.SessionOptions(); so.intra_op_num_threads = 2
    so.add_session_config_entry("session.set_denormal_as_zero", daz)
    s = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    s.run(None, {"pixel_values": x})
    t = time.perf_counter()
    for _ in range(3): y = s.run(None, {"pixel_values": x})[0]
    print("denormal_as_zero", daz, f"{(time.perf_counter() - t) / 3 * 1e3:.1f} ms", float(np.abs(y).max()), flush=True)
