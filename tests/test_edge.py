"""Edge embedding: packaged artifacts run in the C++ edge_app (no Python), on the host
and on aarch64 under qemu, and match ONNX Runtime within the tolerance table; the app
refuses tampered or foreign modules and inputs that do not fit the manifest."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
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
            res = compile_model(CompileOptions(model=model, target=target, dims=DIMS,
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
    assert set(bare.files) == {"module.so", "manifest.json", "lib/libtvm_runtime.so", "lib/libtvm_ffi.so"}
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
