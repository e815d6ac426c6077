"""Facts about this machine and the tools that build for a target, in one place.

Public on purpose: compile (nvcc fatbins, cross linking), deploy (the edge app's
cross build) and the tests read the same facts instead of re-deriving them.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
from functools import lru_cache
from typing import Iterator

from blockforge.settings import physical_cores

__all__ = ["ARCH_ALIASES", "CROSS_COMPILERS", "KERNEL_SOURCE_EXT", "arch_name", "cpu_flags", "cpu_id", "cpu_model",
           "cross_compiler", "cuda_load_env", "host_arch", "host_cpu", "nvcc", "physical_cores"]

# What `uname -m`, LLVM triples and ELF readers call the same architecture.
ARCH_ALIASES = {"amd64": "x86_64", "x86-64": "x86_64", "arm64": "aarch64"}

# arch -> (cross C++ compiler, the Debian package that provides it)
CROSS_COMPILERS = {"aarch64": ("aarch64-linux-gnu-g++", "g++-aarch64-linux-gnu")}

# target kind -> file extension of the device kernels an artifact ships
KERNEL_SOURCE_EXT = {"cuda": "cu", "opencl": "cl", "metal": "metal", "webgpu": "wgsl"}

NVCC_FALLBACKS = ("/usr/local/cuda/bin/nvcc",)


def arch_name(arch: str) -> str:
    a = (arch or "").lower()
    return ARCH_ALIASES.get(a, a)


def host_arch() -> str:
    return arch_name(platform.machine())


def cross_compiler(arch: str) -> tuple[str, str] | None:
    """(compiler, debian package) to build for `arch` here, or None when native."""
    arch = arch_name(arch)
    if arch == host_arch():
        return None
    return CROSS_COMPILERS.get(arch)


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@lru_cache(maxsize=1)
def host_cpu() -> str:
    """LLVM's name for this CPU (what `-mcpu` gets)."""
    import tvm

    return str(tvm.target.codegen.llvm_get_system_cpu())


@lru_cache(maxsize=1)
def cpu_model() -> str:
    """The marketing name of this CPU (recorded with every benchmark)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


@lru_cache(maxsize=1)
def cpu_id() -> str:
    """The exact CPU model, as tuning verdicts are keyed: the marketing name plus the x86
    family/model numbers. Hypervisors often cut the name short ("AMD EPYC" on this VM, for
    both Zen 4 and Zen 5 hosts), and the numbers tell those apart."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor is enough
                k, _, v = line.partition(":")
                fields[k.strip()] = v.strip()
    except OSError:
        pass
    nums = [f"{k} {fields[k]}" for k in ("cpu family", "model") if fields.get(k)]
    return cpu_model() + (f" ({', '.join(nums)})" if nums else "")


def package_version(name: str) -> str | None:
    """The installed version of a Python distribution (an engine, a toolchain), or None."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def nvcc() -> str | None:
    return shutil.which("nvcc") or next((p for p in NVCC_FALLBACKS if os.path.exists(p)), None)


@contextlib.contextmanager
def cuda_load_env() -> Iterator[None]:
    """While loading a CUDA module: TVM 0.27 compiles the embedded CUDA C at load time with
    NVRTC (needs the cuda-bindings package) or nvcc; point it at nvcc where NVRTC is missing.
    The environment is restored afterwards."""
    saved = {k: os.environ.get(k) for k in ("TVM_CUDA_COMPILE_MODE", "PATH")}
    try:
        try:
            import cuda.bindings  # noqa: F401
        except ImportError:
            os.environ.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")
            found = nvcc()
            if found and shutil.which("nvcc") is None:
                os.environ["PATH"] = os.environ.get("PATH", "") + os.pathsep + os.path.dirname(found)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
