"""Edge embedding: packaged artifacts run in the C++ edge_app (no Python), on the host
and on aarch64 under qemu, and match ONNX Runtime within the tolerance table; the app
refuses tampered or foreign modules and inputs that do not fit the manifest."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from blockforge.compile import CompileOptions, compile_model
from blockforge.deploy.package import PackageOptions, package_artifact, runtime_libs
from blockforge.errors import BlockforgeError
from blockforge.fsutil import sha256_file
from blockforge.graph import FFNSpec, MHASpec, export, ort, tolerance_for
from blockforge.targets.toolchain import host_arch

# Among the longest files: marked slow as a whole, so `make test` starts it first (conftest
# _heavy_first) and `make check` never picks it up.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
EDGE_APP = REPO / "deploy" / "edge_app"
QEMU = ["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu"]
DIMS = {"batch": 1, "seq": 16}

SPECS = {
    "mha-boolmask": MHASpec(d_model=64, heads=4, mask="bool"),
    "ffn": FFNSpec(d_model=64, d_ff=128),
    "ffn-fp16": FFNSpec(d_model=64, d_ff=128, dtype="float16", activation="gelu"),
}

needs_aarch64_gxx = pytest.mark.skipif(
    shutil.which("aarch64-linux-gnu-g++") is None,
    reason="aarch64-linux-gnu-g++ not installed (Debian package g++-aarch64-linux-gnu)")
needs_qemu = pytest.mark.skipif(
    shutil.which("qemu-aarch64") is None or not Path("/usr/aarch64-linux-gnu").is_dir(),
    reason="qemu-aarch64 or the aarch64 sysroot /usr/aarch64-linux-gnu missing (Debian packages "
           "qemu-user and g++-aarch64-linux-gnu)")


@pytest.fixture(scope="module", autouse=True)
def edge_env(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BLOCKFORGE_LOG", str(tmp_path_factory.mktemp("log") / "blockforge.log"))
        yield


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(spec name, target) -> compiled artifact dir, compiled once per module."""
    root = tmp_path_factory.mktemp("edge")
    cache: dict[tuple[str, str], Path] = {}

    def get(name: str, target: str) -> Path:
        if (name, target) not in cache:
            model = root / f"{name}.onnx"
            if not model.exists():
                export(SPECS[name], model)
            res = compile_model(CompileOptions(model=model, target=target, shape=DIMS,
                                               output=root / f"{name}.{target}", use_tuning=False))
            cache[(name, target)] = res.artifact
        return cache[(name, target)]

    get.root = root
    return get


def make_inputs(artifact: Path, dest: Path, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {}
    for sig in json.loads((artifact / "manifest.json").read_text())["inputs"]:
        if sig["dtype"] == "bool":
            a = rng.random(sig["shape"]) > 0.3
            a[..., 0] = True  # no fully masked row
        else:
            a = rng.standard_normal(sig["shape"]).astype(sig["dtype"])
        arrays[sig["name"]] = a
        np.save(dest / f"{sig['name']}.npy", a)
    return arrays


def run_app(pkg: Path, inputs: dict[str, Path], out: Path, *extra: str, emulate: bool = False,
            timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [*(QEMU if emulate else []), str(pkg / "bin" / "edge_app"), str(pkg)]
    for name, path in inputs.items():
        cmd += ["--input", f"{name}={path}"]
    cmd += ["--output", str(out), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def npy_args(dest: Path, arrays: dict) -> dict[str, Path]:
    return {name: dest / f"{name}.npy" for name in arrays}


def assert_refused(res: subprocess.CompletedProcess, *fragments: str, rc: int = 2) -> None:
    """One `edge_app: error:` line with the fragments, the exit code, nothing written."""
    text = res.stdout + res.stderr
    assert res.returncode == rc, f"rc={res.returncode}\n{text}"
    errs = [ln for ln in res.stderr.splitlines() if ln.startswith("edge_app: error:")]
    assert len(errs) == 1, res.stderr
    for f in fragments:
        assert f.lower() in errs[0].lower(), errs[0]
    assert "ran main" not in res.stdout


def check_parity(name: str, artifact: Path, pkg: Path, work: Path, emulate: bool) -> None:
    spec = SPECS[name]
    arrays = make_inputs(artifact, work)
    out = work / "out.npy"
    res = run_app(pkg, npy_args(work, arrays), out, "--repeat", "3", emulate=emulate)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ran main in" in res.stdout and "(median of 3)" in res.stdout, res.stdout
    got = np.load(out)
    ref = ort.run(onnx.load(artifact.parent / f"{name}.onnx"), arrays)["output"]
    assert got.dtype == ref.dtype and got.shape == ref.shape
    tol = tolerance_for(spec.dtype, spec.kind)
    assert np.allclose(got.astype(np.float64), ref.astype(np.float64), rtol=tol.rtol, atol=tol.atol), \
        f"max abs diff {np.abs(got.astype(np.float64) - ref).max()} (tolerance {tol})"


# --------------------------------------------------------------------------- host


@pytest.mark.parametrize("name", list(SPECS))
def test_host_package_matches_ort(built, tmp_path, name):
    artifact = built(name, "host")
    res = package_artifact(PackageOptions(artifact, output=tmp_path / "pkg", app=True))
    assert res.path == tmp_path / "pkg" and res.arch == host_arch()
    assert {"module.so", "manifest.json", "bin/edge_app", "run.sh", "lib/libtvm_runtime.so",
            "lib/libtvm_ffi.so"} <= set(res.files)
    assert all(size > 0 for size in res.files.values())
    check_parity(name, artifact, res.path, tmp_path, emulate=False)


def test_package_layout_and_run_sh(built, tmp_path):
    artifact = built("ffn", "host")
    default = package_artifact(PackageOptions(artifact, app=True))
    assert default.path == artifact.with_name(artifact.name + ".pkg")
    bare = package_artifact(PackageOptions(artifact, output=tmp_path / "bare", app=False))
    assert set(bare.files) == {"module.so", "weights.bin", "manifest.json", "lib/libtvm_runtime.so", "lib/libtvm_ffi.so"}
    assert [p.name for p in runtime_libs(default.arch)] == ["libtvm_runtime.so", "libtvm_ffi.so"]
    # run.sh runs from anywhere
    arrays = make_inputs(artifact, tmp_path)
    out = tmp_path / "o.npy"
    r = subprocess.run([str(default.path / "run.sh"), "--input", f"x={tmp_path / 'x.npy'}",
                        "--output", str(out)], capture_output=True, text=True, cwd="/", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert np.load(out).shape == arrays["x"].shape


def test_package_refuses_bad_artifacts(built, tmp_path, monkeypatch):
    artifact = built("ffn", "host")
    copy = tmp_path / "copy"
    shutil.copytree(artifact, copy)
    data = bytearray((copy / "module.so").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (copy / "module.so").write_bytes(bytes(data))
    with pytest.raises(BlockforgeError, match="does not match its sha256"):
        package_artifact(PackageOptions(copy))
    with pytest.raises(BlockforgeError, match="not an artifact directory"):
        package_artifact(PackageOptions(tmp_path / "nope"))
    (tmp_path / "occupied").mkdir()
    (tmp_path / "occupied" / "notes.txt").write_text("mine")
    with pytest.raises(BlockforgeError, match="not a blockforge package"):
        package_artifact(PackageOptions(artifact, output=tmp_path / "occupied"))
    # an artifact directory is not a package: refused as an output, left as it was
    with pytest.raises(BlockforgeError, match="not a blockforge package"):
        package_artifact(PackageOptions(artifact, output=tmp_path / "copy"))
    assert (copy / "manifest.json").is_file() and (copy / "module.so").is_file()
    # the app's sources ship inside the package: found from any working directory
    monkeypatch.chdir(tmp_path)
    res = package_artifact(PackageOptions(artifact, output=tmp_path / "p", app=True))
    assert "bin/edge_app" in res.files
    # an install that lost the app's sources (package data) says so
    import blockforge.deploy.package as package_mod

    monkeypatch.setattr(package_mod, "__file__", str(tmp_path / "package.py"))
    with pytest.raises(BlockforgeError, match="sources are missing"):
        package_artifact(PackageOptions(artifact, output=tmp_path / "p2", app=True))
    assert not (tmp_path / "p2").exists()


@pytest.mark.skipif(os.uname().machine == "aarch64", reason="the host is aarch64: nothing to cross-build")
def test_missing_cross_compiler_named(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(BlockforgeError, match="g\\+\\+-aarch64-linux-gnu"):
        runtime_libs("aarch64")


def test_tampered_module_refused(built, tmp_path):
    artifact = built("ffn", "host")
    pkg = package_artifact(PackageOptions(artifact, output=tmp_path / "pkg", app=True)).path
    arrays = make_inputs(artifact, tmp_path)
    so = pkg / "module.so"
    data = bytearray(so.read_bytes())
    data[len(data) // 3] ^= 0x01
    so.write_bytes(bytes(data))
    res = run_app(pkg, npy_args(tmp_path, arrays), tmp_path / "out.npy")
    assert_refused(res, "module.so does not match its sha256 in manifest.json", "refusing to load it")
    assert not (tmp_path / "out.npy").exists()


@needs_aarch64_gxx
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="checks an aarch64 module on an x86_64 host")
def test_foreign_arch_module_refused(built, tmp_path):
    host_pkg = package_artifact(PackageOptions(built("ffn", "host"), output=tmp_path / "pkg", app=True)).path
    arm = built("ffn", "aarch64-linux")
    shutil.copy2(arm / "module.so", host_pkg / "module.so")
    # fix the digest so that only the architecture check can refuse it
    manifest = json.loads((host_pkg / "manifest.json").read_text())
    manifest["files"]["module.so"] = sha256_file(host_pkg / "module.so")
    (host_pkg / "manifest.json").write_text(json.dumps(manifest))
    arrays = make_inputs(arm, tmp_path)
    res = run_app(host_pkg, npy_args(tmp_path, arrays), tmp_path / "out.npy")
    assert_refused(res, "module.so is for aarch64, this is x86_64")


def test_bad_inputs_refused(built, tmp_path):
    artifact = built("mha-boolmask", "host")
    pkg = package_artifact(PackageOptions(artifact, output=tmp_path / "pkg", app=True)).path
    arrays = make_inputs(artifact, tmp_path)
    good = npy_args(tmp_path, arrays)
    out = tmp_path / "out.npy"

    np.save(tmp_path / "short.npy", arrays["query"][:, :8])
    res = run_app(pkg, {**good, "query": tmp_path / "short.npy"}, out)
    assert_refused(res, "input 'query'", "shape (1, 8, 64) does not match the model's (1, 16, 64)")

    res = run_app(pkg, {**good, "quarry": good["query"]}, out)
    assert_refused(res, "unknown input 'quarry'", "query, key, value, key_padding_mask")

    res = run_app(pkg, {k: v for k, v in good.items() if k != "key_padding_mask"}, out)
    assert_refused(res, "missing input 'key_padding_mask'")

    np.save(tmp_path / "f64.npy", arrays["query"].astype(np.float64))
    res = run_app(pkg, {**good, "query": tmp_path / "f64.npy"}, out)
    assert_refused(res, "input 'query'", "dtype float64", "float32")

    np.save(tmp_path / "mask_f32.npy", arrays["key_padding_mask"].astype(np.float32))
    res = run_app(pkg, {**good, "key_padding_mask": tmp_path / "mask_f32.npy"}, out)
    assert_refused(res, "input 'key_padding_mask'", "dtype float32", "bool")

    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    res = run_app(pkg, {**good, "value": tmp_path / "junk.npy"}, out)
    assert_refused(res, "input 'value'", "not a .npy file")

    res = run_app(pkg, good, out, "--repeat", "zero")
    assert_refused(res, "--repeat")
    assert not out.exists()


def test_runtime_error_is_one_line(built, tmp_path):
    """A manifest that misstates the signature gets past the app's checks; the VM's own
    check then fails inside main: one error line, exit 1."""
    pkg = package_artifact(PackageOptions(built("ffn", "host"), output=tmp_path / "pkg", app=True)).path
    manifest = json.loads((pkg / "manifest.json").read_text())
    manifest["inputs"][0]["dtype"] = "float16"
    (pkg / "manifest.json").write_text(json.dumps(manifest))
    np.save(tmp_path / "x.npy", np.zeros(manifest["inputs"][0]["shape"], np.float16))
    res = run_app(pkg, {"x": tmp_path / "x.npy"}, tmp_path / "out.npy")
    assert_refused(res, "main failed", "float32", rc=1)
    assert "Traceback" not in res.stderr and not (tmp_path / "out.npy").exists()


_INTERRUPTS = {"SIGINT": (signal.SIGINT, 130, "edge_app: interrupted"),
               "SIGTERM": (signal.SIGTERM, 143, "edge_app: terminated"),
               "SIGKILL": (signal.SIGKILL, -9, "")}


@pytest.mark.parametrize("how", list(_INTERRUPTS))
def test_nothing_left_in_tmpdir_however_the_app_ends(built, tmp_path, how):
    """The private copy of module.so is removed once it is loaded, so a run killed later
    (SIGKILL; the aarch64 tests' SIGILL left two edge_app-* directories in /tmp per CI run)
    leaves nothing; Ctrl-C (to the process group, as a terminal sends it) and SIGTERM end
    with one line and 128 + the signal; no output and no hidden temporary beside it."""
    sig, rc, line = _INTERRUPTS[how]
    pkg = package_artifact(PackageOptions(built("ffn", "host"), output=tmp_path / "pkg", app=True)).path
    make_inputs(built("ffn", "host"), tmp_path)
    tmpdir, outdir = tmp_path / "tmpdir", tmp_path / "outdir"
    tmpdir.mkdir()
    outdir.mkdir()
    cmd = [str(pkg / "bin" / "edge_app"), str(pkg), "--input", f"x={tmp_path / 'x.npy'}",
           "--output", str(outdir / "out.npy"), "--repeat", "1000000"]
    # its own process group, SIGINT not inherited as ignored (a non-interactive shell's background job)
    proc = subprocess.Popen(cmd, env={**os.environ, "TMPDIR": str(tmpdir)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        maps = Path(f"/proc/{proc.pid}/maps")
        deadline = time.monotonic() + 60
        while "/module.so" not in maps.read_text():  # loaded: the copy is mapped
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=10)
            time.sleep(0.05)
        time.sleep(0.2)  # running main now
        assert sorted(p.name for p in tmpdir.rglob("*")) == []  # the copy is gone while it runs
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == rc, (out, err)
    if line:
        assert err == line + "\n", err
    assert sorted(p.name for p in tmpdir.rglob("*")) == []
    assert sorted(p.name for p in outdir.iterdir()) == []


# --------------------------------------------------------------------------- aarch64


@pytest.mark.slow
@needs_aarch64_gxx
@needs_qemu
@pytest.mark.parametrize("name", list(SPECS))
def test_aarch64_package_matches_ort_under_qemu(built, tmp_path, name):
    # The first run cross-builds the TVM runtime (minutes); later runs reuse build/edge/aarch64.
    artifact = built(name, "aarch64-linux")
    res = package_artifact(PackageOptions(artifact, output=tmp_path / "pkg", app=True))
    assert res.arch == "aarch64"
    for rel in ("bin/edge_app", "lib/libtvm_runtime.so", "lib/libtvm_ffi.so", "module.so"):
        head = (res.path / rel).read_bytes()[:20]
        assert head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == 183, rel
    check_parity(name, artifact, res.path, tmp_path, emulate=True)


# --------------------------------------------------------------------------- the edge build cache
# The cache (<cache>/edge/<arch>/) is untrusted: make judges freshness by mtime, so a file
# planted there looked up to date and was shipped. Each case tampers with the session's
# cache and packages: the tampered bytes are rebuilt away (or refused), never shipped.


def _is_elf_for(path: Path, machine: int) -> bool:
    head = path.read_bytes()[:20]
    return not path.is_symlink() and head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == machine


HOST_MACHINE = {"x86_64": 62, "aarch64": 183}.get(os.uname().machine)


@pytest.mark.parametrize("tamper", ["shell-script", "symlink", "symlinked-bin-dir"])
def test_tampered_cache_app_rebuilt(built, tmp_path, tamper):
    from blockforge.deploy.package import build_app

    artifact = built("ffn", "host")
    cached = build_app(host_arch())
    decoy = tmp_path / "decoy"
    decoy.write_bytes(b"#!/bin/sh\necho pwned\nexit 0\n")
    cached.unlink()
    if tamper == "symlink":
        os.symlink(decoy, cached)
    elif tamper == "symlinked-bin-dir":  # bin/ -> a folder holding the script as edge_app
        cached.parent.rmdir()
        (tmp_path / "bin").mkdir()
        shutil.copy2(decoy, tmp_path / "bin" / "edge_app")
        os.symlink(tmp_path / "bin", cached.parent)
        decoy = tmp_path / "bin" / "edge_app"
    else:
        shutil.copy2(decoy, cached)  # newer than its sources: make alone would keep it
        os.chmod(cached, 0o755)
    res = package_artifact(PackageOptions(artifact, output=tmp_path / "pkg", app=True))
    app = res.path / "bin" / "edge_app"
    assert _is_elf_for(app, HOST_MACHINE) and b"pwned" not in app.read_bytes()
    assert _is_elf_for(cached, HOST_MACHINE) and not cached.parent.is_symlink()
    assert decoy.read_bytes().endswith(b"exit 0\n")  # nothing written through a link
    manifest = json.loads((res.path / "manifest.json").read_text())
    assert manifest["package_files"]["bin/edge_app"] == sha256_file(app)
    check_parity("ffn", artifact, res.path, tmp_path, emulate=False)


def test_cache_record_mismatch_rebuilt(built, tmp_path):
    """An ELF of the right CPU that is not what the last build made (the record's sha256)."""
    from blockforge.deploy.package import build_app

    cached = build_app(host_arch())
    good = cached.read_bytes()
    cached.write_bytes(good + b"\0appended")  # still an x86-64 ELF, still newer than its sources
    res = package_artifact(PackageOptions(built("ffn", "host"), output=tmp_path / "pkg", app=True))
    assert (res.path / "bin" / "edge_app").read_bytes() == cached.read_bytes() and not cached.read_bytes().endswith(b"appended")


def test_bad_rebuild_refused_with_one_line(built, tmp_path, monkeypatch):
    """When the rebuild still gives a bad file, packaging stops naming it; nothing is written."""
    import blockforge.deploy.package as package_mod

    cached = package_mod.build_app(host_arch())
    real_make = package_mod._run_make

    def make_then_tamper(*args):
        real_make(*args)
        cached.unlink(missing_ok=True)
        cached.write_bytes(b"#!/bin/sh\nexit 0\n")

    monkeypatch.setattr(package_mod, "_run_make", make_then_tamper)
    with pytest.raises(BlockforgeError) as err:
        package_artifact(PackageOptions(built("ffn", "host"), output=tmp_path / "pkg", app=True))
    msg = str(err.value)
    assert "\n" not in msg and f"{cached} is not an ELF file" in msg and "rebuilding it did not help" in msg, msg
    assert not (tmp_path / "pkg").exists()
    monkeypatch.undo()
    assert _is_elf_for(package_mod.build_app(host_arch()), HOST_MACHINE)  # the next build repairs it


def test_symlinked_wheel_runtime_refused(built, tmp_path, monkeypatch):
    import blockforge.deploy.package as package_mod

    real = package_mod.wheel_libs()
    os.symlink(real[0], tmp_path / "libtvm_runtime.so")
    monkeypatch.setattr(package_mod, "wheel_libs", lambda: [tmp_path / "libtvm_runtime.so", real[1]])
    with pytest.raises(BlockforgeError, match="libtvm_runtime.so is a symlink; refusing to follow it"):
        package_artifact(PackageOptions(built("ffn", "host"), output=tmp_path / "pkg"))
    assert not (tmp_path / "pkg").exists()


def test_tampered_package_refused_by_loaders(built, tmp_path):
    """A package's bin/ and lib/ are in its manifest: run.sh, the app and `blockforge run`
    refuse a changed library; the app refuses runtime libraries from elsewhere."""
    from conftest import assert_user_error, run_cli

    artifact = built("ffn", "host")
    pkg = package_artifact(PackageOptions(artifact, output=tmp_path / "pkg", app=True)).path
    arrays = make_inputs(artifact, tmp_path)
    np.savez(tmp_path / "in.npz", **arrays)
    out = tmp_path / "out.npy"
    r = run_cli("run", pkg, "--inputs", tmp_path / "in.npz", "--output", tmp_path / "good.npz", cwd=tmp_path)
    assert r.rc == 0, r.text  # the untampered package passes the Python loader's checks
    # libraries from LD_LIBRARY_PATH (the app's RUNPATH lets it win): identical bytes, other files
    other = tmp_path / "other-lib"
    shutil.copytree(pkg / "lib", other)
    res = subprocess.run([str(pkg / "bin" / "edge_app"), str(pkg), "--input", f"x={tmp_path / 'x.npy'}",
                          "--output", str(out)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "LD_LIBRARY_PATH": str(other)})
    assert_refused(res, f"the TVM runtime was loaded from {other}/libtvm_")
    with open(pkg / "lib" / "libtvm_ffi.so", "ab") as f:
        f.write(b"\0")  # still loads: only the hash can tell
    res = run_app(pkg, npy_args(tmp_path, arrays), out)
    assert_refused(res, "lib/libtvm_ffi.so does not match its sha256 in manifest.json")
    res = subprocess.run([str(pkg / "run.sh"), "--input", f"x={tmp_path / 'x.npy'}", "--output", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "run.sh: error:" in res.stderr \
        and "lib/libtvm_ffi.so does not match its sha256" in res.stderr, res.stderr
    r = run_cli("run", pkg, "--inputs", tmp_path / "in.npz", "--output", tmp_path / "out.npz", cwd=tmp_path)
    assert_user_error(r, "lib/libtvm_ffi.so does not match its sha256")
    assert not out.exists() and not (tmp_path / "out.npz").exists()


@needs_aarch64_gxx
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="plants an x86-64 library in the aarch64 cache")
@pytest.mark.parametrize("tamper", ["x86_64-runtime", "symlinked-ffi"])
def test_tampered_aarch64_cache_rebuilt(tmp_path, tamper):
    """The first call cross-builds the runtime (minutes) unless the session's cache has it;
    the repair relinks one library from the cached objects."""
    from blockforge.deploy.package import wheel_libs

    libs = runtime_libs("aarch64")
    victim = libs[0] if tamper == "x86_64-runtime" else libs[1]
    wheel = {p.name: p for p in wheel_libs()}
    victim.unlink()
    if tamper == "x86_64-runtime":
        shutil.copyfile(wheel[victim.name], victim)  # an x86-64 libtvm_runtime.so, newer than its objects
    else:
        decoy = tmp_path / "unrelated.so"
        decoy.write_bytes(b"\x7fELF unrelated")
        os.symlink(decoy, victim)
    again = runtime_libs("aarch64")
    assert again == libs and all(_is_elf_for(p, 183) for p in again)
    assert (victim.read_bytes() != wheel[victim.name].read_bytes())


@needs_aarch64_gxx
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="plants an x86-64 library in the aarch64 cache")
def test_tampered_aarch64_runtime_refused_when_rebuild_fails(built, tmp_path, monkeypatch):
    """The refusal path without minutes of cross-building: make is replaced by one that
    leaves the x86-64 library in place."""
    import blockforge.deploy.package as package_mod

    artifact = built("ffn", "aarch64-linux")
    lib = runtime_libs("aarch64")[0]
    x86 = package_mod.wheel_libs()[0]
    monkeypatch.setattr(package_mod, "_run_make", lambda *a: None if lib.exists() else shutil.copyfile(x86, lib))
    lib.unlink()
    shutil.copyfile(x86, lib)
    with pytest.raises(BlockforgeError) as err:
        package_artifact(PackageOptions(artifact, output=tmp_path / "pkg"))
    msg = str(err.value)
    assert "\n" not in msg and f"{lib} is for x86_64, not aarch64" in msg and "rebuilding it did not help" in msg, msg
    assert not (tmp_path / "pkg").exists()
    monkeypatch.undo()
    assert _is_elf_for(runtime_libs("aarch64")[0], 183)  # the real rebuild repairs it
