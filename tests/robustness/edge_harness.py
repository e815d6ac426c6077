"""Shared by the edge robustness tests (test_edge_hostile.py, test_edge_fuzz.py): the app
builds (plain, ASan/UBSan, the parser fuzz driver), one symbolic-dim artifact, a shared
library whose constructor leaves a marker file when anything dlopens it, and running
the app. Everything is built once per session (cached here) and make reuses the builds
between sessions (<cache>/edge/)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
CASES_FILE = HERE / "manifest_cases.json"
# Sanitizer findings exit with their own code (not the app's 1 or 2) and are never recovered from.
SAN_ENV = {"ASAN_OPTIONS": "exitcode=86:detect_leaks=1:abort_on_error=0",
           "UBSAN_OPTIONS": "exitcode=86:halt_on_error=1:print_stacktrace=1"}
SAN_MARKS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:", "SUMMARY: UndefinedBehavior")

_cache: dict = {}


def manifest_cases() -> list[dict]:
    return json.loads(CASES_FILE.read_text())["cases"]


def sanitizer_problem() -> str | None:
    """Why this toolchain cannot build the sanitizer targets, or None."""
    if "san" not in _cache:
        cxx = shutil.which(os.environ.get("CXX", "g++"))
        problem = None
        if cxx is None:
            problem = "no C++ compiler (Debian package g++)"
        else:
            d = Path(__import__("tempfile").mkdtemp(prefix="san-probe-"))
            (d / "p.cc").write_text("#include <sanitizer/common_interface_defs.h>\nint main() { return 0; }\n")
            r = subprocess.run([cxx, "-fsanitize=address,undefined", str(d / "p.cc"), "-o", str(d / "p")],
                               capture_output=True, text=True)
            if r.returncode or subprocess.run([str(d / "p")], capture_output=True).returncode:
                problem = f"{cxx} cannot build with -fsanitize=address,undefined (libasan/libubsan missing): " \
                          f"{(r.stderr.strip().splitlines() or [''])[-1][:200]}"
            shutil.rmtree(d, ignore_errors=True)
        _cache["san"] = problem
    return _cache["san"]


def needs_sanitizers() -> None:
    problem = sanitizer_problem()
    if problem:
        pytest.skip(problem)


def _make(target: str) -> Path:
    """`make TARGET` in the installed app sources, into the same build root packaging uses."""
    from filelock import FileLock

    from blockforge.deploy.package import package_dir, build_root, edge_app_dir

    root = build_root()
    root.mkdir(parents=True, exist_ok=True)
    cmd = ["make", "-C", str(edge_app_dir()), "-j2", target, f"BUILD_DIR={root}", f"PYTHON={sys.executable}",
           f"TVM_DIR={package_dir('tvm')}", f"TVM_FFI_DIR={package_dir('tvm_ffi')}"]
    with FileLock(str(root / ".build.lock")):
        r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"make {target} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return root


def app(kind: str) -> Path:
    """The edge_app binary: kind 'plain' (what `package --app` ships) or 'asan'."""
    if kind not in _cache:
        from blockforge.deploy.package import build_app
        from blockforge.targets.toolchain import host_arch

        if kind == "plain":
            if shutil.which(os.environ.get("CXX", "g++")) is None or shutil.which("make") is None:
                pytest.skip("edge_app needs make and g++ (Debian packages make, g++)")
            _cache[kind] = _private_copy(build_app(host_arch()))
        else:
            needs_sanitizers()
            _cache[kind] = _make("host-asan") / f"{host_arch()}-asan" / "bin" / "edge_app"
    return _cache[kind]


def _private_copy(binary: Path) -> Path:
    """bin/edge_app and its ../lib (the rpath) copied out of the shared build cache, removed at
    exit: test_edge.py's cache tests tamper with the cached app and rebuild it, and under
    pytest-xdist another worker's run of the cached path then found no file (85 hostile cases
    failed with FileNotFoundError in one such run)."""
    import atexit
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="edge-app-plain-"))
    atexit.register(shutil.rmtree, root, True)
    shutil.copytree(binary.parent.parent / "lib", root / "lib")
    (root / "bin").mkdir()
    shutil.copy2(binary, root / "bin" / "edge_app")
    return root / "bin" / "edge_app"


def fuzz_driver() -> Path:
    if "fuzz" not in _cache:
        needs_sanitizers()
        _cache["fuzz"] = _make("fuzz") / "fuzz" / "fuzz_parsers"
    return _cache["fuzz"]


def symbolic_artifact(tmp_path_factory) -> Path:
    """A host artifact of FFN d_model 64 compiled without binding its dims: input
    x (batch, seq, 64), so the app must bound the symbolic dims itself."""
    if "artifact" not in _cache:
        from blockforge.compile import CompileOptions, compile_model
        from blockforge.graph import FFNSpec, export

        root = tmp_path_factory.mktemp("edge-artifact")
        export(FFNSpec(d_model=64, d_ff=128), root / "ffn.onnx")
        res = compile_model(CompileOptions(model=root / "ffn.onnx", target="host", shape={},
                                           output=root / "ffn.host", use_tuning=False))
        assert json.loads((res.artifact / "manifest.json").read_text())["inputs"][0]["shape"] == ["batch", "seq", 64]
        _cache["artifact"] = res.artifact
    return _cache["artifact"]


def evil_so(tmp_path_factory) -> tuple[Path, Path]:
    """(a shared library for this CPU, the marker file its constructor creates when loaded)."""
    if "evil" not in _cache:
        cxx = shutil.which(os.environ.get("CXX", "g++"))
        if cxx is None:
            pytest.skip("no C++ compiler (Debian package g++)")
        root = tmp_path_factory.mktemp("evil")
        marker = root / "constructor-ran"
        (root / "evil.cc").write_text(
            "#include <cstdio>\n"
            f"__attribute__((constructor)) static void evil() {{ if (FILE* f = std::fopen({json.dumps(str(marker))}, "
            '"w")) { std::fputs("loaded", f); std::fclose(f); } }\n')
        subprocess.run([cxx, "-shared", "-fPIC", "-o", str(root / "evil.so"), str(root / "evil.cc")], check=True)
        _cache["evil"] = (root / "evil.so", marker)
    return _cache["evil"]


def run_app(binary: Path, artifact: Path, inputs: dict[str, Path], out: Path, *extra: str,
            timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [str(binary), str(artifact), *[a for n, p in inputs.items() for a in ("--input", f"{n}={p}")],
           "--output", str(out), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout,
                          env={**os.environ, **SAN_ENV}, stdin=subprocess.DEVNULL)


def assert_no_sanitizer_report(res: subprocess.CompletedProcess) -> None:
    assert res.returncode != 86 and not any(m in res.stderr for m in SAN_MARKS), res.stderr[-6000:]


def assert_app_refused(res: subprocess.CompletedProcess, fragment: str) -> None:
    """One `edge_app: error:` line holding the fragment, exit 2, no sanitizer report."""
    assert_no_sanitizer_report(res)
    assert res.returncode == 2, f"rc={res.returncode}\n{res.stdout}\n{res.stderr[-3000:]}"
    errs = [ln for ln in res.stderr.splitlines() if ln.startswith("edge_app: error:")]
    assert len(errs) == 1 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert fragment.lower() in errs[0].lower(), errs[0]
    assert "ran main" not in res.stdout
