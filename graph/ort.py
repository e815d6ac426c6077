"""ONNX Runtime, the reference runtime: CPU always, CUDA only when asked and present."""

from __future__ import annotations

import os

import numpy as np
import onnx

from blockforge.errors import BlockforgeError, error_line
from blockforge.logs import native_output_to_log


def _ort():
    import onnxruntime as ort

    ort.set_default_logger_severity(3)  # errors only; ORT warns on every fp16 fallback
    return ort


def cuda_available() -> bool:
    try:
        return "CUDAExecutionProvider" in _ort().get_available_providers() and _gpu_present()
    except Exception:
        return False


def _gpu_present() -> bool:
    # The onnxruntime-gpu wheel lists the CUDA provider even without a GPU and then
    # logs errors when asked for it; look for a device node first.
    return os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl")


def session(model: onnx.ModelProto, *, threads: int | None = None, device: str = "cpu", spin: bool = True,
            optimize: bool = True):
    """optimize False: ORT's graph optimizations off (ORT_DISABLE_ALL): the graph as written, no
    fused kernels (a quantized model's parity spread, graph/parity.py). ORT rewrites known to
    change this model's numbers are off either way (ort_deviations.wrong_rewrites)."""
    from .ort_deviations import wrong_rewrites

    ort = _ort()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if threads:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
    if not spin:
        # ORT's workers otherwise busy-wait after each run, stealing the cores from
        # whatever runs next in the same process (measured: TVM 1.8 ms alone, 4.0 ms
        # interleaved with a spinning ORT session on 2 cores).
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if device == "cuda":
        if not cuda_available():
            raise BlockforgeError("ONNX Runtime CUDA provider requested but no usable GPU is present")
        # TF32 off: compare true float32 arithmetic.
        providers = [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"]
    else:
        providers = ["CPUExecutionProvider"]
    # ORT's C++ logger writes its errors ("[E:onnxruntime:...]") to file descriptor 2, before
    # the exception that carries the same text: to the log file, as TVM's native output.
    try:
        with native_output_to_log():
            return ort.InferenceSession(model.SerializeToString(), so, providers=providers,
                                        disabled_optimizers=wrong_rewrites(model))
    except Exception as e:
        raise BlockforgeError(f"ONNX Runtime cannot load the model: {error_line(e)}") from None


def run(model_or_session, inputs: dict[str, np.ndarray], **kw) -> dict[str, np.ndarray]:
    sess = model_or_session if not isinstance(model_or_session, onnx.ModelProto) else session(model_or_session, **kw)
    try:
        with native_output_to_log():
            outs = sess.run(None, inputs)
    except Exception as e:
        raise BlockforgeError(f"ONNX Runtime failed to run the model: {error_line(e)}") from None
    return {o.name: v for o, v in zip(sess.get_outputs(), outs)}
