"""The preset table: where blockforge can compile for, as data.

Each preset is a TVM target JSON plus what building and running it needs. Values
in angle brackets are filled in for the machine at resolve time:
  <host-cpu>   tvm.target.codegen.llvm_get_system_cpu()
  <cores>      physical cores of this machine
Cross compilers and kernel file extensions follow from the arch and kind
(targets/toolchain.py), so they are not repeated here.
"""

from __future__ import annotations

PRESETS: dict[str, dict] = {
    "host": {
        "description": "this machine's CPU (LLVM, native mcpu)",
        "target": {"kind": "llvm", "mcpu": "<host-cpu>", "num-cores": "<cores>"},
        "device": "cpu",
        "arch": "<host-arch>",
    },
    "x86-64-avx2": {
        "description": "x86-64 with AVX2/FMA (Haswell and newer)",
        "target": {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "haswell", "num-cores": "<cores>"},
        "device": "cpu",
        "arch": "x86_64",
        "cpu_flags": ["avx2", "fma"],
    },
    "x86-64-avx512": {
        "description": "x86-64 with AVX-512 (Skylake-SP and newer, Zen 4/5)",
        "target": {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "skylake-avx512", "num-cores": "<cores>"},
        "device": "cpu",
        "arch": "x86_64",
        "cpu_flags": ["avx512f", "avx512bw", "avx512vl"],
    },
    # The int8 kernel's 256-bit VPDPBUSD (compile/quant/isa.py "avxvnni"): client x86 cores with
    # AVX-VNNI and no AVX-512 (Alder Lake's P-cores have it fused off). Zen 5 has both: this
    # preset runs there too (how the tests run its kernels).
    "x86-64-avxvnni": {
        "description": "x86-64 with AVX2 and AVX-VNNI, no AVX-512 (Alder Lake / Raptor Lake / Meteor Lake "
                       "client cores)",
        "target": {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "alderlake", "num-cores": "<cores>"},
        "device": "cpu",
        "arch": "x86_64",
        "cpu_flags": ["avx2", "fma", "avx_vnni"],
    },
    "aarch64-linux": {
        "description": "64-bit ARM Linux with NEON (cross-compiled)",
        "target": {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"], "num-cores": "<cores>"},
        "device": "cpu",
        "arch": "aarch64",
    },
    "aarch64-linux-dotprod": {
        "description": "64-bit ARM Linux with NEON and the int8 dot product (Armv8.2+: Cortex-A55/A76, "
                       "Neoverse N1; cross-compiled)",
        "target": {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon", "+dotprod"],
                   "num-cores": "<cores>"},
        "device": "cpu",
        "arch": "aarch64",
        "cpu_flags": ["asimddp"],
    },
    "aarch64-linux-i8mm": {
        "description": "64-bit ARM Linux with NEON, the int8 dot product and matrix multiply (Armv8.6+: "
                       "Cortex-A710/X2, Neoverse N2/V1, Graviton 3; cross-compiled)",
        "target": {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon", "+dotprod", "+i8mm"],
                   "num-cores": "<cores>"},
        "device": "cpu",
        "arch": "aarch64",
        "cpu_flags": ["asimddp", "i8mm"],
    },
    "cuda-sm80": {
        "description": "NVIDIA Ampere (A100), CUDA",
        "target": {"kind": "cuda", "arch": "sm_80", "host": {"kind": "llvm", "mcpu": "<host-cpu>"}},
        "device": "cuda",
        "toolchain": "nvcc",
        "debian_package": "nvidia-cuda-toolkit",
        "compute_capability": "8.0",
    },
    "cuda-sm90": {
        "description": "NVIDIA Hopper (H100/H200), CUDA",
        "target": {"kind": "cuda", "arch": "sm_90", "host": {"kind": "llvm", "mcpu": "<host-cpu>"}},
        "device": "cuda",
        "toolchain": "nvcc",
        "debian_package": "nvidia-cuda-toolkit",
        "compute_capability": "9.0",
    },
    "opencl": {
        "description": "OpenCL C kernels (build only: this runtime has no OpenCL)",
        "target": {"kind": "opencl", "host": {"kind": "llvm"}},
        "device": None,
    },
    "metal": {
        "description": "Metal shading language kernels (build only)",
        "target": {"kind": "metal", "host": {"kind": "llvm"}},
        "device": None,
    },
    "webgpu": {
        "description": "WGSL kernels for WebGPU (build only)",
        "target": {"kind": "webgpu", "host": {"kind": "llvm"}},
        "device": None,
    },
}
