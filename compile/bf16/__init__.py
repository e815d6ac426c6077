"""bf16 compute (issue #19, `compile --precision bf16`): the VDPBF16PS tensor intrinsic
(intrin), the bf16 GEMM kernel generator (gemm) and the Relax pass that puts the model's
constant-weight float32 matmuls on it (rewrite). Nothing here runs at import: the intrinsic
is registered on first use."""
