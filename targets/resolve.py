"""Presets (or raw target JSON) resolved to TVM targets, in one place."""

from __future__ import annotations

import copy
import json
import os
import shutil
from dataclasses import dataclass, field
from functools import lru_cache

from blockforge.errors import BlockforgeError, error_line

from .presets import PRESETS
from .toolchain import KERNEL_SOURCE_EXT, arch_name, cpu_flags, cross_compiler, host_arch, host_cpu, nvcc, physical_cores

GPU_KINDS = {"cuda", "rocm", "opencl", "metal", "vulkan", "webgpu"}


@dataclass(frozen=True)
class ResolvedTarget:
    name: str  # preset name, or "custom"
    target_json: dict  # fully concrete, what tvm.target.Target gets
    device: str | None  # "cpu", "cuda", or None (build only)
    arch: str
    cross_compiler: str | None = None
    debian_package: str | None = None
    source_ext: str | None = None
    cpu_flags: tuple = field(default_factory=tuple)
    toolchain: str | None = None

    @property
    def kind(self) -> str:
        return self.target_json["kind"]

    @property
    def is_gpu(self) -> bool:
        return self.kind in GPU_KINDS

    def tvm_target(self):
        import tvm

        try:
            return tvm.target.Target(self.target_json)
        except Exception as e:
            raise BlockforgeError(f"TVM rejects target {json.dumps(self.target_json)}: {error_line(e, last=True)}") from None

    def key(self) -> str:
        """Stable device key for tuning databases: what the generated code depends on."""
        t = self.target_json
        parts = [t["kind"]]
        for k in ("arch", "mtriple", "mcpu"):
            if k in t:
                parts.append(str(t[k]))
        if "mattr" in t:
            parts.append("".join(sorted(t["mattr"])))
        if "num-cores" in t:
            parts.append(f"{t['num-cores']}c")
        return "-".join(p.replace("_", "").replace("/", "") for p in parts)

    def build_problem(self) -> str | None:
        """Why this target cannot be built here, or None."""
        if self.cross_compiler and not shutil.which(self.cross_compiler):
            return (f"cross compiler {self.cross_compiler} not found; install the Debian package "
                    f"{self.debian_package} (apt-get install {self.debian_package})")
        if self.toolchain == "nvcc" and not nvcc():
            return f"nvcc not found (install {self.debian_package} or the CUDA toolkit, or put nvcc on PATH)"
        if not _codegen_enabled(self.kind):
            return f"this TVM build has no {self.kind} code generator"
        return None

    def run_problem(self) -> str | None:
        """Why compiled code for this target cannot run here, or None."""
        if self.device is None:
            return f"{self.kind} is build-only here (the TVM runtime in this wheel runs CPU and CUDA)"
        if self.device == "cuda":
            return None if cuda_device_present() else "no CUDA GPU on this machine"
        if self.arch != host_arch():
            return f"code is for {self.arch}, this machine is {host_arch()}"
        missing = [f for f in self.cpu_flags if f not in cpu_flags()]
        if missing:
            return f"this CPU lacks {', '.join(missing)}"
        return None


@lru_cache(maxsize=None)
def _codegen_enabled(kind: str) -> bool:
    import tvm

    if kind == "llvm":
        return True
    return tvm.get_global_func(f"target.build.{kind}", allow_missing=True) is not None


def cuda_device_present() -> bool:
    if not (os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl")):
        return False
    try:
        import tvm

        return bool(tvm.cuda(0).exist)
    except Exception:
        return False


def _fill(obj, values: dict):
    if isinstance(obj, dict):
        return {k: _fill(v, values) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fill(v, values) for v in obj]
    if isinstance(obj, str) and obj in values:
        return values[obj]()
    return obj


_PLACEHOLDERS = {"<host-cpu>": host_cpu, "<cores>": physical_cores, "<host-arch>": host_arch}


def resolve(name_or_json: str | dict) -> ResolvedTarget:
    """A preset name, or a TVM target JSON object (string or dict), to a ResolvedTarget."""
    if isinstance(name_or_json, str) and name_or_json.strip().startswith("{"):
        try:
            name_or_json = json.loads(name_or_json)
        except json.JSONDecodeError as e:
            raise BlockforgeError(f"malformed target JSON: {e.msg} at position {e.pos}") from None
    if isinstance(name_or_json, dict):
        return _custom(name_or_json)
    if name_or_json not in PRESETS:
        raise BlockforgeError(f"unknown target {name_or_json!r}; presets: {', '.join(PRESETS)} "
                              "(or pass a TVM target JSON object)")
    p = copy.deepcopy(PRESETS[name_or_json])
    target_json = _fill(p["target"], _PLACEHOLDERS)
    arch = _fill(p.get("arch", "<host-arch>"), _PLACEHOLDERS)
    cross = cross_compiler(arch) if target_json["kind"] == "llvm" else None
    return ResolvedTarget(
        name=name_or_json, target_json=target_json, device=p.get("device"), arch=arch,
        cross_compiler=cross[0] if cross else None,
        debian_package=cross[1] if cross else p.get("debian_package"),
        source_ext=KERNEL_SOURCE_EXT.get(target_json["kind"]),
        cpu_flags=tuple(p.get("cpu_flags", ())), toolchain=p.get("toolchain"))


def _custom(t: dict) -> ResolvedTarget:
    if not isinstance(t.get("kind"), str):
        raise BlockforgeError('target JSON needs a "kind" (e.g. {"kind": "llvm", "mcpu": "znver4"})')
    kind = t["kind"]
    if kind == "llvm":
        triple = str(t.get("mtriple", ""))
        arch = arch_name(triple.split("-")[0]) if triple else host_arch()
        cross = cross_compiler(arch)
        r = ResolvedTarget("custom", dict(t), "cpu", arch, *(cross or (None, None)))
    elif kind == "cuda":
        r = ResolvedTarget("custom", dict(t), "cuda", host_arch(), toolchain="nvcc",
                           debian_package="nvidia-cuda-toolkit")
    else:
        r = ResolvedTarget("custom", dict(t), None, host_arch(), source_ext=KERNEL_SOURCE_EXT.get(kind))
    r.tvm_target()  # validate now: one clear error for unknown kinds/attributes
    return r


def list_targets() -> list[dict]:
    from .precision import supported_precisions

    rows = []
    for name in PRESETS:
        r = resolve(name)
        bp, rp = r.build_problem(), r.run_problem()
        rows.append({"name": name, "description": PRESETS[name]["description"], "target": r.target_json,
                     "can_build": bp is None, "build_problem": bp,
                     "can_run": bp is None and rp is None, "run_problem": rp,
                     "precisions": supported_precisions(r)})
    return rows
