"""Load an artifact and run it. Loading a .so runs native code, so the manifest and
the sha256 of every file are checked first, and the target must run here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from blockforge.errors import BlockforgeError, error_line
from blockforge.graph.model_io import TensorSig, check_inputs
from blockforge.targets import resolve
from blockforge.targets.toolchain import cuda_load_env, host_arch

from .manifest import elf_arch, read_manifest, verify_files


def _sigs(items: list[dict]) -> list[TensorSig]:
    return [TensorSig(i["name"], tuple(i["shape"]), i["dtype"]) for i in items]


@dataclass
class LoadedModule:
    artifact: Path
    manifest: dict
    vm: object
    device: object

    @property
    def inputs(self) -> list[TensorSig]:
        return _sigs(self.manifest["inputs"])

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        check_inputs(self.inputs, inputs, "inputs")
        return run_vm(self.vm, self.device, self.inputs, _sigs(self.manifest["outputs"]), inputs)


def run_vm(vm, device, in_sigs: list[TensorSig], out_sigs: list[TensorSig], inputs: dict) -> dict[str, np.ndarray]:
    import tvm

    args = [tvm.runtime.tensor(np.ascontiguousarray(inputs[s.name]), device) for s in in_sigs]
    try:
        out = vm["main"](*args)
    except Exception as e:
        raise BlockforgeError(f"compiled module failed to run: {error_line(e, last=True)}") from None
    outs = list(out) if isinstance(out, (list, tuple)) or type(out).__name__ == "Array" else [out]
    return {s.name: o.numpy() for s, o in zip(out_sigs, outs)}


def tvm_device(kind: str | None):
    import tvm

    return tvm.cuda(0) if kind == "cuda" else tvm.cpu(0)


def load_artifact(artifact: str | Path) -> LoadedModule:
    """Checks everything a hostile artifact could use before any native code runs:
    read_manifest type-checks manifest.json ('module' must be one of the hashed 'files',
    all plain names), verify_files hashes every listed regular file (no symlinks), the
    target must run here and the module must be an ELF for this CPU; only then dlopen."""
    import tvm
    from tvm import relax

    artifact = Path(artifact)
    manifest = read_manifest(artifact)
    verify_files(artifact, manifest)
    t = manifest["target"]
    target = resolve(t["json"]) if t["name"] == "custom" else resolve(t["name"])
    problem = target.run_problem()
    if problem:
        raise BlockforgeError(f"{artifact}: built for {t['name']} ({t['json'].get('kind')}), cannot run here: {problem}")
    module = manifest["module"]
    so = artifact / module
    arch = elf_arch(so)
    if arch is None:
        raise BlockforgeError(f"{artifact}: {module} is not an ELF shared object; refusing to load it")
    if arch != host_arch():
        raise BlockforgeError(f"{artifact}: {module} is for {arch}, this machine is {host_arch()}")
    try:
        if target.kind == "cuda":
            with cuda_load_env():
                lib = tvm.runtime.load_module(str(so))
        else:
            lib = tvm.runtime.load_module(str(so))
    except Exception as e:
        raise BlockforgeError(f"{artifact}: cannot load {module}: {error_line(e, last=True)}") from None
    dev = tvm_device(target.device)
    return LoadedModule(artifact, manifest, relax.VirtualMachine(lib, dev), dev)
