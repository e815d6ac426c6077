"""int8 compute for quantized models (issue #19): the VNNI tensor intrinsic (intrin), the
aarch64 SDOT one (sdot), the instructions as data (isa), the int8 GEMM kernel generator
(gemm), the activation-range kernel (minmax), QDQ matmuls as MatMulInteger on the graph TVM
imports (qdq) and the Relax pass that routes the integer matmuls to the kernel (rewrite).
Nothing here runs at import: the intrinsics are registered on first use."""
