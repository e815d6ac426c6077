"""The artifact manifest: its format, and the checks that come before loading native code.

Written by compile (artifact.py), read by the loader (runtime.py), packaging (deploy) and,
with the same rules, by the C++ edge app (deploy/edge_app/main.cc).
"""

from __future__ import annotations

import json
from pathlib import Path

from blockforge.errors import BlockforgeError
from blockforge.fsutil import sha256_file
from blockforge.targets.toolchain import arch_name

FORMAT = "blockforge.artifact/1"
NAME = "manifest.json"
REQUIRED = ("files", "target", "inputs", "outputs", "module")

ELF_MACHINES = {3: "i386", 40: "arm", 62: "x86_64", 183: "aarch64", 243: "riscv64"}


def read_manifest(artifact: Path) -> dict:
    artifact = Path(artifact)
    mpath = artifact / NAME
    if not artifact.is_dir():
        raise BlockforgeError(f"{artifact}: not an artifact directory")
    if not mpath.is_file():
        raise BlockforgeError(f"{artifact}: no manifest.json (not a blockforge artifact)")
    try:
        manifest = json.loads(mpath.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise BlockforgeError(f"{mpath}: corrupt manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BlockforgeError(f"{mpath}: unknown manifest format (expected {FORMAT})")
    for key in REQUIRED:
        if key not in manifest:
            raise BlockforgeError(f"{mpath}: manifest lacks {key!r}")
    return manifest


def is_artifact(path: Path) -> bool:
    """Whether `path` is a blockforge artifact directory (its manifest says so)."""
    try:
        m = json.loads((Path(path) / NAME).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(m, dict) and m.get("format") == FORMAT


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


def elf_arch(path: Path) -> str | None:
    """Architecture an ELF shared object was built for (e_machine), or None if not ELF."""
    with open(path, "rb") as f:
        head = f.read(20)
    if len(head) < 20 or head[:4] != b"\x7fELF":
        return None
    order = "little" if head[5] == 1 else "big"
    machine = int.from_bytes(head[18:20], order)
    return arch_name(ELF_MACHINES.get(machine, f"e_machine {machine}"))
