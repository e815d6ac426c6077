"""Load an artifact and run it. Loading a .so runs native code, so the manifest and
the sha256 of every file are checked first, and the target must run here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from blockforge.errors import BlockforgeError, error_line
from blockforge.fsutil import sha256_file
from blockforge.graph.model_io import TensorSig, check_inputs
from blockforge.targets import resolve

from .artifact import MANIFEST_FORMAT


def read_manifest(artifact: Path) -> dict:
    artifact = Path(artifact)
    mpath = artifact / "manifest.json"
    if not artifact.is_dir():
        raise BlockforgeError(f"{artifact}: not an artifact directory")
    if not mpath.is_file():
        raise BlockforgeError(f"{artifact}: no manifest.json (not a blockforge artifact)")
    try:
        manifest = json.loads(mpath.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise BlockforgeError(f"{mpath}: corrupt manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise BlockforgeError(f"{mpath}: unknown manifest format (expected {MANIFEST_FORMAT})")
    for key in ("files", "target", "inputs", "outputs", "module"):
        if key not in manifest:
            raise BlockforgeError(f"{mpath}: manifest lacks {key!r}")
    return manifest


def verify_files(artifact: Path, manifest: dict) -> None:
    for name, digest in manifest["files"].items():
        p = Path(artifact) / name
        if Path(name).name != name:
            raise BlockforgeError(f"{artifact}: manifest names a file outside the artifact: {name!r}")
        if not p.is_file():
            raise BlockforgeError(f"{artifact}: {name} is missing")
        if sha256_file(p) != digest:
            raise BlockforgeError(f"{artifact}: {name} does not match its sha256 in manifest.json "
                                  "(tampered or corrupted); refusing to load it")


ELF_MACHINES = {3: "i386", 40: "arm", 62: "x86_64", 183: "aarch64", 243: "riscv64"}


def elf_arch(path: Path) -> str | None:
    """Architecture an ELF shared object was built for (e_machine), or None if not ELF."""
    with open(path, "rb") as f:
        head = f.read(20)
    if len(head) < 20 or head[:4] != b"\x7fELF":
        return None
    order = "little" if head[5] == 1 else "big"
    machine = int.from_bytes(head[18:20], order)
    return ELF_MACHINES.get(machine, f"e_machine {machine}")


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
    import tvm
    from tvm import relax

    artifact = Path(artifact)
    manifest = read_manifest(artifact)
    verify_files(artifact, manifest)
    t = manifest["target"]
    target = resolve(t["json"]) if t.get("name") == "custom" else resolve(t["name"])
    problem = target.run_problem()
    if problem:
        raise BlockforgeError(f"{artifact}: built for {t['name']} ({t['json'].get('kind')}), cannot run here: {problem}")
    from blockforge.targets.resolve import host_arch

    so = artifact / manifest["module"]
    arch = elf_arch(so)
    if arch is None:
        raise BlockforgeError(f"{artifact}: module.so is not an ELF shared object; refusing to load it")
    if arch != host_arch():
        raise BlockforgeError(f"{artifact}: module.so is for {arch}, this machine is {host_arch()}")
    if target.kind == "cuda":
        from .pipeline import _cuda_env

        _cuda_env()
    try:
        lib = tvm.runtime.load_module(str(artifact / manifest["module"]))
    except Exception as e:
        raise BlockforgeError(f"{artifact}: cannot load module.so: {error_line(e, last=True)}") from None
    dev = tvm_device(target.device)
    return LoadedModule(artifact, manifest, relax.VirtualMachine(lib, dev), dev)
