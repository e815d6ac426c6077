"""Package an artifact for a device without Python: the edge app, the TVM runtime.

    PACKAGE/
      module.so, manifest.json   the artifact, verified and copied as is
      lib/                       libtvm_runtime.so, libtvm_ffi.so for the artifact's arch
      bin/edge_app               the C++ runner (deploy/edge_app), when app=True
      run.sh                     how to run it, when app=True

For the host arch the libraries are the apache-tvm wheel's; for aarch64 they are
cross-built from the runtime sources the wheel ships (deploy/edge_app/Makefile).
The app's sources ship inside the blockforge package, so this works from any folder of a
wheel install. Builds are cached under <cache>/edge/<arch>/ (settings.edge_build_root()),
made from a copy of the sources in <cache>/edge/src/ that changes only with their content;
make decides what is stale.
The directory appears atomically.
"""

from __future__ import annotations

import filecmp
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from blockforge import settings
from blockforge.compile.manifest import elf_arch, is_artifact, read_manifest, verify_files
from blockforge.errors import BlockforgeError
from blockforge.fsutil import TREE, Output, atomic_directory, check_outputs
from blockforge.targets.toolchain import CROSS_COMPILERS, arch_name, host_arch

RUNTIME_LIBS = ("libtvm_runtime.so", "libtvm_ffi.so")
MAKE_JOBS = 2


@dataclass
class PackageOptions:
    artifact: Path
    output: Path | None = None  # default: <artifact dir>.pkg next to it
    app: bool = False  # also build (if needed) and include the edge_app binary and run.sh
    force: bool = False  # replace an existing output that is not a blockforge package


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


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin:
        raise BlockforgeError(f"python package {name} is not installed (pip install apache-tvm)")
    return Path(spec.origin).parent


def _wheel_libs() -> list[Path]:
    libs = [_package_dir("tvm") / "lib" / "libtvm_runtime.so", _package_dir("tvm_ffi") / "lib" / "libtvm_ffi.so"]
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


def _make(target: str, arch: str) -> Path:
    from filelock import FileLock

    edge_app_dir()  # the sources are there, or one clear error
    if not shutil.which("make"):
        raise BlockforgeError("make not found; install the Debian packages make and g++")
    cxx = os.environ.get("CXX", "g++")
    if not shutil.which(shlex.split(cxx)[0] if cxx.strip() else "g++"):
        raise BlockforgeError(f"C++ compiler {cxx} not found; install the Debian package g++")
    root = build_root()
    root.mkdir(parents=True, exist_ok=True)
    log = root / f"make-{arch}.log"
    with FileLock(str(root / ".build.lock")):  # one build at a time per build dir
        cmd = ["make", "-C", str(_synced_sources(root)), f"-j{MAKE_JOBS}", target, f"BUILD_DIR={root}",
               f"TVM_DIR={_package_dir('tvm')}", f"TVM_FFI_DIR={_package_dir('tvm_ffi')}"]
        with open(log, "w") as f:
            f.write("$ " + shlex.join(cmd) + "\n")
            f.flush()
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    if rc:
        raise BlockforgeError(f"building edge_app for {arch} failed at {_failed_step(log.read_text(errors='replace'))} "
                              f"(make exit {rc}; full log: {log})")
    return root / arch


def build_app(arch: str) -> Path:
    """Build edge_app for `arch` (cached under <cache>/edge/<arch>/) and return the binary."""
    arch = arch_name(arch)
    target = _check_arch(arch)
    out = _make(target, arch) / "bin" / "edge_app"
    if not out.is_file():
        raise BlockforgeError(f"make finished but {out} is missing")
    return out


def runtime_libs(arch: str) -> list[Path]:
    """The runtime libraries to ship for `arch`: the wheel's for the host arch,
    cross-built ones (built here if needed) for aarch64."""
    arch = arch_name(arch)
    target = _check_arch(arch)
    if target == "host":
        return _wheel_libs()
    libdir = _make(f"{arch}-runtime", arch) / "lib"
    libs = [libdir / name for name in RUNTIME_LIBS]
    missing = [str(p) for p in libs if not p.is_file()]
    if missing:
        raise BlockforgeError(f"make finished but {', '.join(missing)} is missing")
    return libs


def _run_sh(manifest: dict, arch: str) -> str:
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
    check_outputs([Output("-o", out, TREE, "package", is_package)], [artifact], force=opts.force)
    dest = Path(out)

    libs = runtime_libs(arch)
    app = build_app(arch) if opts.app else None
    with atomic_directory(dest, is_ours=is_package, what="package", force=opts.force) as tmp:
        for name in [*manifest["files"], "manifest.json"]:
            shutil.copy2(artifact / name, tmp / name)
        (tmp / "lib").mkdir()
        for lib in libs:
            shutil.copy2(lib, tmp / "lib" / lib.name)
        if app is not None:
            (tmp / "bin").mkdir()
            shutil.copy2(app, tmp / "bin" / "edge_app")
            os.chmod(tmp / "bin" / "edge_app", 0o755)
            (tmp / "run.sh").write_text(_run_sh(manifest, arch))
            os.chmod(tmp / "run.sh", 0o755)
        # the copies must still be what the manifest promised
        verify_files(tmp, manifest)
        files = {p.relative_to(tmp).as_posix(): p.stat().st_size
                 for p in sorted(tmp.rglob("*")) if p.is_file()}
    return PackageResult(dest, arch, files)
