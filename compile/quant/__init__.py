"""int8 compute for quantized models (issue #19): the VNNI tensor intrinsic, the int8 GEMM
kernel generator and the Relax pass that routes ONNX Runtime's quantized matmuls to it.
Nothing here runs at import: the intrinsic is registered on first use."""
