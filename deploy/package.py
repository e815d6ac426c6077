"""Package an artifact for a device without Python: the edge app, the TVM runtime.

    PACKAGE/
      module.so, weights.bin,    the artifact, verified and copied as is
      manifest.json
      lib/                       libtvm_runtime.so, libtvm_ffi.so for the artifact's arch
      bin/edge_app               the C++ runner (deploy/edge_app), when app=True
      run.sh                     how to run it, when app=True

For the host arch the libraries are the apache-tvm wheel's; for aarch64 they are
cross-built from the runtime sources the wheel ships (deploy/edge_app/Makefile).
The app's sources ship inside the blockforge package, so this works from any folder of a
wheel install. Builds are cached under <cache>/edge/<arch>/ (settings.edge_build_root()),
made from a copy of the sources in <cache>/edge/src/ that changes only with their content;
make decides what is stale.

The cache is untrusted like every other input: make judges freshness by mtime, so a file
put there (a shell script as bin/edge_app, a symlink, an x86-64 libtvm_runtime.so in
aarch64/lib/) looks up to date. Each build writes <arch>/cache-record.json: the source key
and the sha256 of every output it built. What is shipped must be a regular file (opened
with O_NOFOLLOW), an ELF for the package's arch and, for cache outputs, match the record;
an output without a record entry is deleted before make so that make builds it. A bad one
is deleted and rebuilt once; if the rebuild is still bad, packaging stops with one line
naming the file. Files are copied through the descriptor that was hashed, and the
package's manifest.json lists bin/ and lib/ in 'package_files' (verified by both loaders:
compile/manifest.verify_package and the app's VerifyPackage; run.sh checks the hashes
before the app and its libraries load).
The directory appears atomically.
"""

from __future__ import annotations

import filecmp
import hashlib
import importlib.util
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from blockforge import settings
from blockforge.compile.artifact.manifest import (copy_regular, elf_arch, elf_arch_of, hash_regular, is_artifact,
                                         read_manifest, read_regular, verify_files, verify_package)
from blockforge.errors import BlockforgeError
from blockforge.fsutil import TREE, Output, atomic_directory, atomic_write_json, check_outputs
from blockforge.targets.toolchain import CROSS_COMPILERS, arch_name, host_arch, package_version

RUNTIME_LIBS = ("libtvm_runtime.so", "libtvm_ffi.so")
MAKE_JOBS = 2
CACHE_RECORD = "cache-record.json"
RECORD_FORMAT = "blockforge.edge-cache/1"
MAX_RECORD_BYTES = 1 << 16

_log = logging.getLogger("blockforge.package")


@dataclass
class PackageOptions:
    artifact: Path
    output: Path | None = None  # default: <artifact dir>.pkg next to it
    app: bool = False  # also build (if needed) and include the edge_app binary and run.sh
    force: bool = False  # replace an existing output that is not a blockforge package


@dataclass
class Shipped:
    """One file a package ships in bin/ or lib/, checked: where it is now (the edge build
    cache, or the wheel for the host runtime) and the sha256 it must still have when copied."""
    rel: str  # bin/edge_app, lib/libtvm_runtime.so, lib/libtvm_ffi.so
    path: Path
    sha256: str


@dataclass
class PackageResult:
    path: Path
    arch: str
    files: dict[str, int]  # relative name -> size in bytes


def edge_app_dir() -> Path:
    """The edge app's sources, shipped inside the package (blockforge/deploy/edge_app)."""
    d = Path(__file__).resolve().parent / "edge_app"
    if not (d / "Makefile").is_file():
        raise BlockforgeError(f"{d}: the edge app's sources are missing from this install (reinstall blockforge)")
    return d


def build_root() -> Path:
    return settings.edge_build_root()


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin:
        raise BlockforgeError(f"python package {name} is not installed (pip install apache-tvm)")
    return Path(spec.origin).parent


def wheel_libs() -> list[Path]:
    libs = [package_dir("tvm") / "lib" / "libtvm_runtime.so", package_dir("tvm_ffi") / "lib" / "libtvm_ffi.so"]
    for p in libs:
        if not p.is_file():
            raise BlockforgeError(f"{p} is missing: the apache-tvm install is incomplete")
    return libs


def _check_arch(arch: str) -> str:
    """The make target that builds for `arch` on this machine."""
    here = host_arch()
    if arch == here:
        return "host"
    if arch in CROSS_COMPILERS:
        compiler, package = CROSS_COMPILERS[arch]
        if not shutil.which(compiler):
            raise BlockforgeError(f"cross compiler {compiler} not found; install the Debian package {package}")
        return arch
    raise BlockforgeError(f"edge_app cannot be built for {arch} on this {here} machine "
                          f"(it builds for {here}, and cross-builds for {', '.join(CROSS_COMPILERS)})")


def _failed_step(log_text: str) -> str:
    """'the step: the first compiler/linker error', read from a make log."""
    step = "make"
    for line in log_text.splitlines():
        m = re.search(r"\*\*\* \[(?:[^\]]*?:\d+: )?([^\]]+)\]", line)
        if m:
            step = Path(m.group(1).strip()).name
            break
    first_error = next((ln.strip() for ln in log_text.splitlines()
                        if re.search(r"\berror\b|undefined reference|not found", ln)
                        and not ln.startswith("make")), "")
    return f"{step}: {first_error[:300]}" if first_error else step


def _synced_sources(root: Path) -> Path:
    """The app's sources copied to <build root>/src, a file rewritten only when its bytes
    changed, and make run from there. make judges staleness by mtime, and pip gives every
    file of a reinstall a new one: run from the installed files, each `pip install` (so each
    `make test`) recompiled 7 of the aarch64 runtime's objects, whose dependencies include
    runtime/compat headers. Called under the build lock."""
    src, dest = edge_app_dir(), root / "src"
    wanted = {p.relative_to(src) for p in src.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    for rel in sorted(wanted):
        d = dest / rel
        if d.is_file() and filecmp.cmp(src / rel, d, shallow=False):
            continue
        d.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / rel, d.with_name(d.name + ".tmp"))
        os.replace(d.with_name(d.name + ".tmp"), d)
    for d in [p for p in dest.rglob("*") if p.is_file()]:
        if d.relative_to(dest) not in wanted:
            d.unlink()  # gone from the package: make must not pick it up
    return dest


def _run_make(root: Path, src: Path, target: str, arch: str) -> None:
    """make TARGET from the synced sources `src` into `root` (under the build lock); one
    line naming the failed step."""
    log = root / f"make-{arch}.log"
    cmd = ["make", "-C", str(src), f"-j{MAKE_JOBS}", target, f"BUILD_DIR={root}",
           f"TVM_DIR={package_dir('tvm')}", f"TVM_FFI_DIR={package_dir('tvm_ffi')}"]
    with open(log, "w") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    if rc:
        raise BlockforgeError(f"building edge_app for {arch} failed at {_failed_step(log.read_text(errors='replace'))} "
                              f"(make exit {rc}; full log: {log})")


def _source_key(src: Path) -> str:
    """What a build's outputs are made from: the synced sources' content, the TVM packages
    and the compilers. A record with another key describes other outputs. (The make target
    is not part of it: the runtime-only and the app targets share lib/.)"""
    h = hashlib.sha256()
    for p in sorted(q for q in src.rglob("*") if q.is_file()):
        h.update(f"{p.relative_to(src).as_posix()}\0".encode())
        h.update(hashlib.sha256(p.read_bytes()).digest())
    for part in (str(package_dir("tvm")), str(package_dir("tvm_ffi")), package_version("apache-tvm"),
                 package_version("apache-tvm-ffi"), os.environ.get("CXX", "g++"), os.environ.get("AARCH64_CXX", "")):
        h.update(f"\0{part}".encode())
    return h.hexdigest()


def _read_record(out: Path, key: str) -> dict[str, str]:
    """rel -> sha256 of the outputs the last build under `key` made; {} when the record is
    missing, unreadable or for another key (then nothing in the cache is trusted)."""
    try:
        rec = json.loads(read_regular(out / CACHE_RECORD, CACHE_RECORD, MAX_RECORD_BYTES, where=str(out)))
    except (BlockforgeError, ValueError):  # ValueError: not JSON, not UTF-8
        return {}
    files = rec.get("files") if isinstance(rec, dict) and rec.get("format") == RECORD_FORMAT \
        and rec.get("key") == key else None
    if not isinstance(files, dict):
        return {}
    return {k: v for k, v in files.items() if isinstance(k, str) and isinstance(v, str)}


def _remove(path: Path) -> None:
    """Whatever is at `path` (a file, a symlink, not its target, or a directory)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def _hash_shippable(path: Path, arch: str) -> tuple[str | None, str | None]:
    """(sha256, None) for a regular file (not followed through a symlink) that is an ELF
    for `arch`, hashed through the descriptor that was checked; else (None, why not)."""
    try:
        sha, head = hash_regular(path, str(path), where="edge build")
    except BlockforgeError as e:
        return None, str(e)
    found = elf_arch_of(head)
    if found is None:
        return None, f"edge build: {path} is not an ELF file"
    if found != arch:
        return None, f"edge build: {path} is for {found}, not {arch}"
    return sha, None


def _build_outputs(target: str, arch: str, rels: list[str]) -> list[Shipped]:
    """make `target` and return its outputs `rels` (paths under <root>/<arch>/), each
    checked against the cache record (see the module docstring); a bad one is removed and
    rebuilt, and one line naming the file is raised when the rebuild is still bad."""
    from filelock import FileLock

    edge_app_dir()  # the sources are there, or one clear error
    if not shutil.which("make"):
        raise BlockforgeError("make not found; install the Debian packages make and g++")
    cxx = os.environ.get("CXX", "g++")
    if not shutil.which(shlex.split(cxx)[0] if cxx.strip() else "g++"):
        raise BlockforgeError(f"C++ compiler {cxx} not found; install the Debian package g++")
    root = build_root()
    root.mkdir(parents=True, exist_ok=True)
    out = root / arch
    with FileLock(str(root / ".build.lock")):  # one build at a time per build dir
        src = _synced_sources(root)
        key = _source_key(src)
        recorded = _read_record(out, key)
        for d in {Path(rel).parent for rel in rels}:
            if (out / d).is_symlink() or (os.path.lexists(out / d) and not (out / d).is_dir()):
                # make would build through it into another folder: a real one is made instead
                _remove(out / d)
                for rel in [r for r in recorded if Path(r).parent == d]:
                    del recorded[rel]
        for rel in rels:
            # Not recorded by a build of these sources, or no longer what that build made:
            # removed, so that make builds it (before make: a bad lib/libtvm_ffi.so would
            # be linked into the runtime).
            sha, problem = _hash_shippable(out / rel, arch) if rel in recorded else (None, "unrecorded")
            if problem or sha != recorded[rel]:
                if rel in recorded:
                    _log.warning("%s; rebuilding it", problem or f"edge build: {out / rel} does not match the "
                                 "sha256 recorded when it was built")
                    del recorded[rel]
                _remove(out / rel)
        _run_make(root, src, target, arch)
        found = {}
        for rel in rels:  # what make left: built now, or checked against the record above
            found[rel], problem = _hash_shippable(out / rel, arch)
            if problem:
                raise BlockforgeError(f"{problem} (rebuilding it did not help; remove {out} and retry)")
        atomic_write_json(out / CACHE_RECORD, {"format": RECORD_FORMAT, "key": key, "files": {**recorded, **found}})
    return [Shipped(rel, out / rel, found[rel]) for rel in rels]


def _wheel_runtime(arch: str) -> list[Shipped]:
    """The host runtime: the apache-tvm wheel's libraries, held to the same rules."""
    shipped = []
    for p in wheel_libs():
        sha, problem = _hash_shippable(p, arch)
        if problem:
            raise BlockforgeError(f"{problem} (the apache-tvm install is damaged; reinstall apache-tvm)")
        shipped.append(Shipped(f"lib/{p.name}", p, sha))
    return shipped


def _shipped(arch: str, app: bool) -> list[Shipped]:
    """What a package for `arch` ships in bin/ and lib/: the runtime libraries (the wheel's
    for the host arch, cross-built for aarch64) and, with app, bin/edge_app."""
    arch = arch_name(arch)
    target = _check_arch(arch)
    bin_ = ["bin/edge_app"] if app else []
    if target == "host":
        return _wheel_runtime(arch) + (_build_outputs("host", arch, bin_) if app else [])
    libs = [f"lib/{name}" for name in RUNTIME_LIBS]
    return _build_outputs(arch if app else f"{arch}-runtime", arch, libs + bin_)


def build_app(arch: str) -> Path:
    """Build edge_app for `arch` (cached under <cache>/edge/<arch>/) and return the binary."""
    return next(s.path for s in _shipped(arch, app=True) if s.rel == "bin/edge_app")


def runtime_libs(arch: str) -> list[Path]:
    """The runtime libraries to ship for `arch`: the wheel's for the host arch,
    cross-built ones (built here if needed) for aarch64."""
    return [s.path for s in _shipped(arch, app=False)]


def _copy_shipped(item: Shipped, dest: Path) -> None:
    """Copy through an O_NOFOLLOW descriptor, hashing what is written: the package holds
    exactly the bytes that were checked, or packaging stops."""
    if copy_regular(item.path, str(item.path), dest, where="package", exclusive=True) != item.sha256:
        raise BlockforgeError(f"package: {item.path} changed while being packaged; run package again")
    os.chmod(dest, 0o755)


def _run_sh(manifest: dict, arch: str, shipped: list[Shipped]) -> str:
    inputs = " ".join(f"--input {i['name']}={i['name']}.npy" for i in manifest["inputs"])
    sig = "\n".join(f"#   {i['name']}: {i['dtype']} {tuple(i['shape'])}" for i in manifest["inputs"])
    emu = "" if arch == host_arch() else (
        "# On another machine, run it under an emulator through EDGE_APP_EMULATOR, e.g.\n"
        f'#   EDGE_APP_EMULATOR="qemu-{arch} -L /usr/{arch}-linux-gnu" ./run.sh ...\n')
    return f"""#!/bin/sh
# Run the packaged model ({arch}) with edge_app, no Python needed:
#   ./run.sh {inputs} --output output.npy [--repeat 10]
# Inputs are .npy files (C order, little-endian), as manifest.json lists them:
{sig}
{emu}here=$(cd "$(dirname "$0")" && pwd)
# The dynamic loader runs lib/'s code before edge_app can check anything: check the
# hashes manifest.json lists for bin/ and lib/ first (edge_app checks them again).
if command -v sha256sum >/dev/null 2>&1; then
  for entry in {" ".join(f"{s.sha256}:{s.rel}" for s in shipped)}; do
    want=${{entry%%:*}} rel=${{entry#*:}}
    if [ -L "$here/$rel" ] || [ ! -f "$here/$rel" ] || \\
       [ "$(sha256sum < "$here/$rel" | cut -d' ' -f1)" != "$want" ]; then
      echo "run.sh: error: $here/$rel does not match its sha256 in manifest.json (tampered or corrupted); refusing to run it" >&2
      exit 2
    fi
  done
fi
exec ${{EDGE_APP_EMULATOR:-}} "$here/bin/edge_app" "$here" "$@"
"""


def is_package(path: Path) -> bool:
    """A package blockforge wrote: an artifact's manifest plus the runtime libraries."""
    return is_artifact(path) and (Path(path) / "lib").is_dir()


def package_artifact(opts: PackageOptions) -> PackageResult:
    artifact = Path(opts.artifact)
    manifest = read_manifest(artifact)
    verify_files(artifact, manifest)
    target = manifest["target"]
    if target.get("device") != "cpu":
        raise BlockforgeError(f"{artifact}: built for {target.get('name')} (device {target.get('device')}); "
                              "only CPU artifacts can be packaged with the edge runtime")
    module = manifest["module"]
    arch = arch_name(target.get("arch") or "")
    found = elf_arch(artifact / module)
    if found is None:
        raise BlockforgeError(f"{artifact}: {module} is not an ELF shared library")
    if arch and found != arch:
        raise BlockforgeError(f"{artifact}: {module} is for {found} but manifest.json says {arch}")
    arch = found
    out = opts.output if opts.output is not None else artifact.with_name(artifact.name + ".pkg")
    check_outputs([Output("output", out, TREE, "package", is_package)], [artifact], force=opts.force)
    dest = Path(out)

    shipped = _shipped(arch, opts.app)
    manifest = {**manifest, "package_files": {s.rel: s.sha256 for s in sorted(shipped, key=lambda s: s.rel)}}
    with atomic_directory(dest, is_ours=is_package, what="package", force=opts.force) as tmp:
        for name in manifest["files"]:
            shutil.copy2(artifact / name, tmp / name)
        (tmp / "lib").mkdir()
        if opts.app:
            (tmp / "bin").mkdir()
        for item in shipped:
            _copy_shipped(item, tmp / item.rel)
        # the artifact's manifest plus what the package ships in bin/ and lib/
        atomic_write_json(tmp / "manifest.json", manifest)
        if opts.app:
            (tmp / "run.sh").write_text(_run_sh(manifest, arch, shipped))
            os.chmod(tmp / "run.sh", 0o755)
        # the copies must still be what the manifest promised
        verify_files(tmp, manifest)
        verify_package(tmp, manifest, arch)
        files = {p.relative_to(tmp).as_posix(): p.stat().st_size
                 for p in sorted(tmp.rglob("*")) if p.is_file()}
    return PackageResult(dest, arch, files)
