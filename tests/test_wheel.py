"""Installed, not checked out: blockforge built as a wheel, installed into a fresh venv outside the
repository, runs export -> compile -> package --app -> the packaged app from a folder of its own,
keeps its per-user state in one cache (HOME and XDG_CACHE_HOME point into a temp dir), and
writes nothing into the working folder but what was asked for.

The fresh venv holds only the wheel (installed --no-deps); the dependencies (tvm, onnx, ...)
come from this venv's site-packages through a folder of links to every entry there except
blockforge's own, named by a .pth file: the installed blockforge's files can only come from
the wheel, and nothing is downloaded or compiled for the test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest

from conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.isolation]  # the isolation child is under test too
DEPS_SITE = Path(sysconfig.get_paths()["purelib"])  # this venv's site-packages: the dependencies
SHAPE = "batch=1,seq=16"
HAS_AARCH64 = (shutil.which("aarch64-linux-gnu-g++") is not None and shutil.which("qemu-aarch64") is not None
               and Path("/usr/aarch64-linux-gnu").is_dir())


@dataclass
class Installed:
    root: Path  # the temp dir everything lives in
    venv: Path
    site: Path  # the fresh venv's site-packages
    home: Path
    cache: Path  # where blockforge's per-user state must land: $XDG_CACHE_HOME/blockforge
    env: dict[str, str]

    def run(self, *args, cwd: Path, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
        """`blockforge ARGS` as a user of the wheel runs it: the venv's console script."""
        p = subprocess.run([str(self.venv / "bin" / "blockforge"), *map(str, args)], cwd=cwd, capture_output=True,
                           text=True, timeout=timeout, env={**self.env, **(env or {})}, stdin=subprocess.DEVNULL)
        return p

    def ok(self, *args, cwd: Path, **kw) -> str:
        p = self.run(*args, cwd=cwd, **kw)
        assert p.returncode == 0, f"blockforge {' '.join(map(str, args))}: rc={p.returncode}\n{p.stdout}{p.stderr}"
        assert "Traceback" not in p.stdout + p.stderr
        return p.stdout


def _sources(dest: Path) -> Path:
    """What the wheel is built from: pyproject.toml, README.md and the top-level Python
    packages (the folders pyproject's package-dir maps); copied, so the checkout's build/ and
    *.egg-info cannot leak into the wheel."""
    for path in [REPO / "pyproject.toml", REPO / "README.md", *REPO.glob("LICENSE*")]:
        shutil.copy2(path, dest / path.name)
    for folder in sorted(p.parent for p in REPO.glob("*/__init__.py")):
        if folder.name != "tests":
            shutil.copytree(folder, dest / folder.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def _deps_folder(dest: Path) -> Path:
    """Links to this venv's site-packages entries, blockforge's own left out."""
    dest.mkdir()
    for entry in DEPS_SITE.iterdir():
        name = entry.name.lower()
        if name == "blockforge" or name.startswith(("blockforge-", "__editable__")) or name.endswith(".pth"):
            continue
        (dest / entry.name).symlink_to(entry)
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    root = tmp_path_factory.mktemp("wheel")
    (root / "src").mkdir()
    src = _sources(root / "src")
    dist = root / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                    str(src)], check=True, capture_output=True, timeout=300, cwd=root)
    (wheel,) = dist.glob("blockforge-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "blockforge_test_deps.pth").write_text(str(_deps_folder(root / "deps")) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True, timeout=300)
    home = root / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("BLOCKFORGE_", "PYTHON", "VIRTUAL_ENV", "XDG_"))}
    env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), PATH=f"{venv / 'bin'}:{env.get('PATH', '')}")
    return Installed(root, venv, site, home, home / ".cache" / "blockforge", env)


def _tree(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*")}


def test_wheel_installs_blockforge_apart_from_the_checkout(installed):
    """The installed files are the wheel's: the package, the edge app's sources as package
    data, no checkout on sys.path, no generic top-level modules."""
    probe = installed.root / "probe"
    probe.mkdir()
    code = ("import json, sys, importlib.util, blockforge\n"
            "from blockforge.deploy.package import edge_app_dir\n"
            "subs = ('cli', 'graph', 'targets', 'compile', 'tune', 'bench', 'deploy')\n"
            "print(json.dumps({'init': blockforge.__file__,\n"
            "  'subs': [importlib.util.find_spec('blockforge.' + n).origin for n in subs],\n"
            "  'edge_app': str(edge_app_dir()), 'path': sys.path,\n"
            "  'leaked': [n for n in ('graph', 'compile', 'targets', 'core', 'tune', 'bench', 'deploy')\n"
            "             if importlib.util.find_spec(n)]}))")
    p = subprocess.run([str(installed.venv / "bin" / "python"), "-c", code], cwd=probe, env=installed.env,
                       capture_output=True, text=True, timeout=120, check=True)
    info = json.loads(p.stdout)
    site = str(installed.site)
    assert info["init"].startswith(site) and all(o.startswith(site) for o in info["subs"]), info
    assert info["leaked"] == [], info
    assert not [e for e in info["path"] if e and Path(e).resolve().is_relative_to(REPO)], info["path"]
    app = Path(info["edge_app"])
    assert app.is_relative_to(installed.site)
    assert {"Makefile", "main.cc"} <= {p.name for p in app.iterdir()}
    assert (app / "runtime").is_dir() and any((app / "runtime").rglob("*.h")), "runtime/ stand-in headers missing"
    assert _tree(probe) == set()


def test_export_compile_package_run_from_anywhere(installed):
    """The whole pipeline from a folder outside the repository; only the requested outputs
    appear in it, logs and edge builds land in the cache, and the app matches ONNX Runtime."""
    from blockforge.graph import ort

    work = installed.root / "work"
    inputs = installed.root / "inputs"
    work.mkdir()
    inputs.mkdir()
    installed.ok("export", "ffn", "--d-model", 64, "--d-ff", 128, "-o", "ffn.onnx", cwd=work)
    installed.ok("compile", "ffn.onnx", "--target", "host", "--shape", SHAPE, "-o", "ffn.host", cwd=work)
    out = installed.ok("package", "ffn.host", "--app", "-o", "ffn.pkg", cwd=work)
    assert "ffn.pkg" in out

    x = np.random.default_rng(0).standard_normal((1, 16, 64)).astype(np.float32)
    np.save(inputs / "x.npy", x)
    # run.sh from yet another folder: it finds its libraries next to itself
    p = subprocess.run([str(work / "ffn.pkg" / "run.sh"), "--input", f"x={inputs / 'x.npy'}",
                        "--output", str(work / "out.npy")], cwd=inputs, capture_output=True, text=True,
                       timeout=120, env=installed.env)
    assert p.returncode == 0, p.stdout + p.stderr
    ref = ort.run(onnx.load(str(work / "ffn.onnx")), {"x": x})["output"]
    assert np.allclose(np.load(work / "out.npy"), ref, rtol=1e-4, atol=1e-5)

    assert _tree(work) == {"ffn.onnx", "ffn.json", "out.npy"} | {f"ffn.host/{n}" for n in ("module.so", "weights.bin", "manifest.json")} \
        | {"ffn.host", "ffn.pkg"} | {f"ffn.pkg/{n}" for n in _tree(work / "ffn.pkg")}, _tree(work)
    assert _tree(inputs) == {"x.npy"}
    # the CLI opened its log in the cache (export, compile, package log nothing there yet)
    assert (installed.cache / "logs" / "blockforge.log").is_file(), _tree(installed.home)
    edge = installed.cache / "edge"
    assert (edge / os.uname().machine / "bin" / "edge_app").is_file(), _tree(edge)
    # HOME holds the cache and nothing else blockforge (or TVM under it) decided to write
    assert {p.relative_to(installed.home).parts[0] for p in installed.home.iterdir()} <= {".cache"}, \
        _tree(installed.home)
    # ...besides ONNX Runtime's own device id (Microsoft/DeveloperTools/.onnxruntime), which
    # onnxruntime 1.31 writes on first use wherever it runs: not blockforge's state.
    assert {p.name for p in (installed.home / ".cache").iterdir()} - {"Microsoft"} == {"blockforge"}


def test_tune_env_and_a_second_folder_share_the_default_database(installed):
    """A tiny tune fills the device's default database in the cache; `env` lists it; a compile
    from another folder applies it without being told where it is."""
    work = installed.root / "tune"
    other = installed.root / "elsewhere"
    work.mkdir()
    other.mkdir()
    installed.ok("export", "ffn", "--d-model", 64, "--d-ff", 128, "-o", "ffn.onnx", cwd=work)
    log = installed.cache / "logs" / "blockforge.log"
    before = log.stat().st_size if log.exists() else 0
    out = installed.ok("tune", "ffn.onnx", "--target", "host", "--shape", SHAPE, "--trials-per-task", 1,
                       "--population", 32, "--no-measure", "--no-progress", cwd=work, timeout=900)
    root = installed.cache / "tuning"
    (db,) = [d for d in root.iterdir() if d.is_dir()]
    assert str(db) in out, out
    assert _tree(work) == {"ffn.onnx", "ffn.json"}, _tree(work)
    assert log.stat().st_size > before, "tune's Python logging (MetaSchedule) did not reach the cache's log"

    info = json.loads(installed.ok("env", "--json", cwd=other))
    assert info["cache_dir"] == str(installed.cache)
    assert info["log_file"] == str(installed.cache / "logs" / "blockforge.log")
    assert info["edge_builds"] == str(installed.cache / "edge")
    assert info["package"] == str(installed.site / "blockforge")
    assert info["settings_source"]["BLOCKFORGE_CACHE_DIR"] == "default"
    built = sorted({"aarch64", os.uname().machine})
    assert info["edge_built"] == [a for a in built if (installed.cache / "edge" / a / "bin" / "edge_app").is_file()]
    (listed,) = info["tuning_databases"]
    assert listed["device"] == db.name and listed["path"] == str(db), listed
    assert listed["records"] >= 2 and listed["workloads"] == 2, listed  # one trial (+ a seed) per FFN task
    text = installed.ok("env", cwd=other)
    assert str(installed.cache) in text and db.name in text and f"{listed['records']} records" in text, text
    assert f"edge builds {installed.cache / 'edge'} ({', '.join(info['edge_built'])}" in text or not info["edge_built"]

    # the one setting that moves all of it
    moved = installed.root / "moved-cache"
    info = json.loads(installed.ok("env", "--json", cwd=other, env={"BLOCKFORGE_CACHE_DIR": str(moved)}))
    assert (info["cache_dir"], info["log_file"], info["tuning_root"], info["edge_builds"]) == (
        str(moved), str(moved / "logs" / "blockforge.log"), str(moved / "tuning"), str(moved / "edge"))
    assert info["tuning_databases"] == [] and info["settings_source"]["BLOCKFORGE_CACHE_DIR"] == "environment"

    installed.ok("compile", work / "ffn.onnx", "--target", "host", "--shape", SHAPE, "-o", "ffn.tuned", cwd=other)
    tuning = json.loads((other / "ffn.tuned" / "manifest.json").read_text())["tuning"]
    assert tuning is not None and tuning["path"] == str(db) and tuning["records"] == listed["records"], tuning
    assert _tree(other) == {"ffn.tuned", "ffn.tuned/module.so", "ffn.tuned/weights.bin", "ffn.tuned/manifest.json"}, _tree(other)


@pytest.mark.skipif(not HAS_AARCH64, reason="aarch64-linux-gnu-g++, qemu-aarch64 or the aarch64 sysroot "
                    "/usr/aarch64-linux-gnu missing (Debian packages g++-aarch64-linux-gnu and qemu-user)")
def test_aarch64_package_runs_under_qemu(installed):
    """The cross-built app from the wheel's sources. The TVM runtime it links is built from the
    apache-tvm wheel's sources, which the wheel test does not change: it is built once per run,
    in the suite's cache (conftest), and copied in, so only the app is built here. Asking the
    suite's cache for it first (under its build lock) makes this test wait for the build
    test_edge may be running on the other xdist worker, or do it for test_edge, instead of a
    second cross-build of the runtime in this cache (minutes of CPU on a clean clone)."""
    from blockforge import settings
    from blockforge.deploy.package import runtime_libs
    from blockforge.graph import ort

    runtime_libs("aarch64")  # the suite's one build of the aarch64 runtime
    built = settings.edge_build_root() / "aarch64"  # the suite's cache (conftest)
    mine = installed.cache / "edge" / "aarch64"
    if built.is_dir() and not mine.exists():
        shutil.copytree(built, mine, symlinks=True, ignore=shutil.ignore_patterns("bin"))
    work = installed.root / "a64"
    work.mkdir()
    installed.ok("export", "ffn", "--d-model", 64, "--d-ff", 128, "-o", "ffn.onnx", cwd=work)
    installed.ok("compile", "ffn.onnx", "--target", "aarch64-linux", "--shape", SHAPE, "-o", "ffn.a64", cwd=work)
    installed.ok("package", "ffn.a64", "--app", "-o", "ffn.pkg", cwd=work, timeout=1800)
    x = np.random.default_rng(1).standard_normal((1, 16, 64)).astype(np.float32)
    np.save(installed.root / "x64.npy", x)
    p = subprocess.run([str(work / "ffn.pkg" / "run.sh"), "--input", f"x={installed.root / 'x64.npy'}",
                        "--output", str(work / "out.npy")], cwd=work, capture_output=True, text=True, timeout=300,
                       env={**installed.env, "EDGE_APP_EMULATOR": "qemu-aarch64 -L /usr/aarch64-linux-gnu"})
    assert p.returncode == 0, p.stdout + p.stderr
    ref = ort.run(onnx.load(str(work / "ffn.onnx")), {"x": x})["output"]
    assert np.allclose(np.load(work / "out.npy"), ref, rtol=1e-4, atol=1e-5)
    assert (mine / "bin" / "edge_app").is_file()
    assert {p.name for p in work.iterdir()} == {"ffn.onnx", "ffn.json", "ffn.a64", "ffn.pkg", "out.npy"}
