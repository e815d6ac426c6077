"""Hostile artifacts and inputs against the artifact trust chain and the C++ edge app.

- manifest_cases.json: one table of hostile manifests (artifacts, and packages' bin/ and
  lib/ with their 'package_files'); blockforge's Python loader
  (load_artifact) and the edge app (plain and ASan/UBSan builds) must each refuse every
  case with one error line holding the case's fragment, before any native code is
  loaded (a planted library's constructor would leave a marker file).
- NPY_CASES: hostile .npy inputs against a symbolic-dim artifact (sizes that wrap,
  dims beyond int64, FIFOs, devices...): one `edge_app: error:` line, exit 2, and no
  sanitizer report from the ASan/UBSan build.
- the output: a planted symlink is never written through.
- hostile .npz inputs through `blockforge run`.

Case counts: len(manifest_cases()) x 3 loaders, len(NPY_CASES) x 2 builds (README's
robustness table quotes them; `make robustness` reruns them).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from conftest import assert_user_error, run_cli
from edge_harness import (app, assert_app_refused, assert_no_sanitizer_report, evil_so, manifest_cases, run_app,
                          symbolic_artifact)

CASES = manifest_cases()
LOADERS = ["python", "edge_app", "edge_app-asan"]
X = np.random.default_rng(0).standard_normal((1, 4, 64)).astype(np.float32)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict:
    art = symbolic_artifact(tmp_path_factory)
    so, marker = evil_so(tmp_path_factory)
    return {"artifact": art, "evil": so, "marker": marker}


@pytest.fixture
def inputs(tmp_path) -> dict[str, Path]:
    np.save(tmp_path / "x.npy", X)
    return {"x": tmp_path / "x.npy"}


# --------------------------------------------------------------------------- mutations


def _sha256(path: Path) -> str | None:
    """The digest of a small regular file (following links), else None."""
    if not path.is_file() or path.stat().st_size > 64 << 20:
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _plant(art: Path, rel: str, kind: str, evil: Path) -> None:
    p = art / rel
    if p.is_symlink() or p.is_file():
        p.unlink()
    if kind == "dir":
        p.mkdir()
    elif kind == "evil-so":
        shutil.copy2(evil, p)
    elif kind == "bytes":
        p.write_bytes(b"not loaded\n")
    elif kind == "fifo":
        os.mkfifo(p)
    elif kind.startswith("sparse:"):
        with open(p, "wb") as f:
            f.truncate(int(kind.split(":", 1)[1]))
    elif kind.startswith("symlink:"):
        os.symlink(kind.split(":", 1)[1], p)
    elif kind.startswith("elf-machine:"):  # the evil library, its ELF header saying another CPU
        data = bytearray(evil.read_bytes())
        data[18:20] = int(kind.split(":", 1)[1]).to_bytes(2, "little")
        p.write_bytes(bytes(data))
    else:
        raise ValueError(f"unknown plant kind {kind!r}")


def _walk(doc, path: list):
    for key in path[:-1]:
        doc = doc[key]
    return doc, path[-1]


def mutate_artifact(src: Path, dest: Path, mutation: dict, evil: Path) -> Path:
    """A copy of `src` at `dest` (inside its own folder: the '{outside}' of the table)
    with one manifest case's mutation applied, as manifest_cases.json describes."""
    outside = dest.parent
    sub = lambda v: v.replace("{outside}", str(outside)) if isinstance(v, str) else v  # noqa: E731
    shutil.copytree(src, dest)
    for rel, kind in mutation.get("plant", {}).items():
        _plant(dest, rel.rstrip("/"), kind, evil)
    m = json.loads((dest / "manifest.json").read_text())
    for path, value in mutation.get("set", []):
        parent, key = _walk(m, [sub(k) for k in path])
        value = copy.deepcopy(value)
        if isinstance(parent, list) and key == len(parent):
            parent.append(value)
        else:
            parent[key] = sub(value)
    for path in mutation.get("delete", []):
        parent, key = _walk(m, path)
        del parent[key]
    for i in range(mutation.get("many_files", 0)):
        m["files"][f"f{i}.bin"] = "{zero}"
    for name, size in mutation.get("truncate", {}).items():  # cut short or zero-extended, then re-hashed
        os.truncate(dest / name, size)
    for listing in ("files", "package_files"):
        if not isinstance(m.get(listing), dict):
            continue
        for name, digest in m[listing].items():
            valid = isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)
            if digest == "{sha256}" or valid:
                m[listing][name] = _sha256(dest / name) or "0" * 64
            elif digest == "{zero}":
                m[listing][name] = "0" * 64
    for name in mutation.get("flip", []):
        data = bytearray((dest / name).read_bytes())
        data[len(data) // 2] ^= 0x40
        (dest / name).write_bytes(bytes(data))
    text = json.dumps(m, indent=1)
    for old, new in mutation.get("text", []):
        assert old in text, old
        text = text.replace(old, new, 1)
    raw = text.encode("utf-8") + mutation.get("append", "").encode()
    for old, new in mutation.get("bytes", []):
        assert bytes.fromhex(old) in raw, old
        raw = raw.replace(bytes.fromhex(old), bytes.fromhex(new), 1)
    if "whole" in mutation:
        raw = mutation["whole"].encode()
    if "pad_to" in mutation:
        raw += b" " * (mutation["pad_to"] - len(raw))
    mpath = dest / "manifest.json"
    mpath.unlink()
    kind = mutation.get("manifest")
    if kind == "symlink":
        (dest / "real.json").write_bytes(raw)
        os.symlink("real.json", mpath)
    elif kind == "fifo":
        os.mkfifo(mpath)
    else:
        mpath.write_bytes(raw)
    return dest


# --------------------------------------------------------------------------- manifests


def test_case_table_is_shared_and_sizable():
    ids = [c["id"] for c in CASES]
    assert len(set(ids)) == len(ids) >= 50
    assert all(c["refusal"] and c["mutation"] for c in CASES)


@pytest.mark.parametrize("loader", LOADERS)
def test_pristine_artifact_runs(base, tmp_path, inputs, loader):
    """The control: the unmutated copy loads and runs in every loader, and they agree."""
    art = mutate_artifact(base["artifact"], tmp_path / "d" / "art", {}, base["evil"])
    from blockforge.compile import load_artifact

    want = load_artifact(base["artifact"]).run({"x": X})["output"]
    if loader == "python":
        got = load_artifact(art).run({"x": X})["output"]
    else:
        res = run_app(app("asan" if loader.endswith("asan") else "plain"), art, inputs, tmp_path / "out.npy")
        assert_no_sanitizer_report(res)
        assert res.returncode == 0, res.stderr
        got = np.load(tmp_path / "out.npy")
    assert got.shape == (1, 4, 64) and np.allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("loader", LOADERS)
def test_listed_package_files_pass(base, tmp_path, inputs, loader):
    """The control for the package_files cases: a bin/ and lib/ that match their listing
    pass every loader's checks (and the listed library is not loaded by them)."""
    art = mutate_artifact(base["artifact"], tmp_path / "d" / "art", {
        "plant": {"lib": "dir", "lib/libtvm_ffi.so": "evil-so", "bin": "dir", "bin/edge_app": "evil-so"},
        "set": [[["package_files"], {"lib/libtvm_ffi.so": "{sha256}", "bin/edge_app": "{sha256}"}]]}, base["evil"])
    base["marker"].unlink(missing_ok=True)
    if loader == "python":
        from blockforge.compile import load_artifact

        assert load_artifact(art).run({"x": X})["output"].shape == (1, 4, 64)
    else:
        res = run_app(app("asan" if loader.endswith("asan") else "plain"), art, inputs, tmp_path / "out.npy")
        assert_no_sanitizer_report(res)
        assert res.returncode == 0, res.stderr
    assert not base["marker"].exists()


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_hostile_manifest_refused(base, tmp_path, inputs, monkeypatch, case, loader):
    art = mutate_artifact(base["artifact"], tmp_path / "d" / "art", case["mutation"], base["evil"])
    base["marker"].unlink(missing_ok=True)
    if loader == "python":
        import tvm

        from blockforge.compile import load_artifact
        from blockforge.errors import BlockforgeError

        loads = []
        monkeypatch.setattr(tvm.runtime, "load_module", lambda *a, **k: loads.append(a) or 1 / 0)
        with pytest.raises(BlockforgeError) as err:
            load_artifact(art)
        msg = str(err.value)
        assert "\n" not in msg and case["refusal"].lower() in msg.lower(), msg
        assert loads == [], "load_module was called before the refusal"
    else:
        res = run_app(app("asan" if loader.endswith("asan") else "plain"), art, inputs, tmp_path / "out.npy",
                      timeout=60)
        assert_app_refused(res, case["refusal"])
        assert not (tmp_path / "out.npy").exists()
    assert not base["marker"].exists(), "a planted library was loaded (its constructor ran)"


@pytest.mark.parametrize("loader", LOADERS)
def test_weights_shape_lie_fails_at_the_call(base, tmp_path, inputs, loader):
    """A weights table that passes every check of both readers but gives w0 another shape of
    the same size ((2, 64, 64) -> (4, 32, 64)): the module's own checks of its lifted
    parameters (VMShapeLower, as for the inputs) fail the call with one line, no wild read."""
    art = mutate_artifact(base["artifact"], tmp_path / "d" / "art",
                          {"set": [[["weights", "tensors", 0, "shape"], [4, 32, 64]]]}, base["evil"])
    if loader == "python":
        from blockforge.compile import load_artifact
        from blockforge.errors import BlockforgeError

        with pytest.raises(BlockforgeError) as err:
            load_artifact(art).run({"x": X})
        assert "\n" not in str(err.value) and "compiled module failed to run" in str(err.value), err.value
    else:
        res = run_app(app("asan" if loader.endswith("asan") else "plain"), art, inputs, tmp_path / "out.npy")
        assert_no_sanitizer_report(res)
        assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert res.stderr.startswith("edge_app: error: main failed"), res.stderr
        assert not (tmp_path / "out.npy").exists()


# --------------------------------------------------------------------------- .npy inputs


def npy_bytes(shape: str, data: int | bytes = 0, descr: str = "<f4", fortran: str = "False",
              version: int = 1, extra: str = "", hlen: int | None = None) -> bytes:
    """A .npy file with a hand-written header (np.save refuses the hostile ones)."""
    d = f"{{'descr': '{descr}', 'fortran_order': {fortran}, 'shape': {shape}, {extra}}}".encode()
    pre = 10 if version == 1 else 12
    d += b" " * ((64 - (pre + len(d) + 1) % 64) % 64) + b"\n"
    n = len(d) if hlen is None else hlen
    head = b"\x93NUMPY" + bytes([version, 0]) + n.to_bytes(2 if version == 1 else 4, "little")
    return head + d + (data if isinstance(data, bytes) else bytes(data))


@dataclass
class NpyCase:
    id: str
    make: Callable[[Path], Path]  # tmp dir -> the input path
    fragment: str


def _file(name: str, data: bytes) -> Callable[[Path], Path]:
    def make(d: Path) -> Path:
        (d / name).write_bytes(data)
        return d / name
    return make


def _sparse(shape: str, nbytes: int) -> Callable[[Path], Path]:
    """A header claiming `shape` and a sparse data region of nbytes (no disk used)."""
    def make(d: Path) -> Path:
        p = d / "sparse.npy"
        head = npy_bytes(shape)
        with open(p, "wb") as f:
            f.write(head)
            f.truncate(len(head) + nbytes)
        return p
    return make


def _fifo(d: Path) -> Path:
    os.mkfifo(d / "fifo.npy")
    return d / "fifo.npy"


def _dir(d: Path) -> Path:
    (d / "dir.npy").mkdir()
    return d / "dir.npy"


NPY_CASES = [
    # elements x itemsize wrapped: 2^56+1 x 64 x 4 = 2^64 + 256 (the app allocated 256 bytes,
    # the kernel ran on the claimed shape); 2^62 x 64 x 4 = 2^70 wraps to 0 (segfault).
    NpyCase("size-wraps-to-256", _file("w.npy", npy_bytes("(1, 72057594037927937, 64)", 256)), "more than 2^64 bytes"),
    NpyCase("size-wraps-to-0", _file("w.npy", npy_bytes("(1, 4611686018427387904, 64)")), "more than 2^64 bytes"),
    NpyCase("dim-int64-max", _file("m.npy", npy_bytes("(9223372036854775807, 4, 64)", 1024)), "more than 2^64 bytes"),
    NpyCase("dims-product-int64-max", _file("m.npy", npy_bytes("(3037000500, 3037000500, 64)")), "more than 2^64"),
    NpyCase("dim-beyond-int64", _file("b.npy", npy_bytes("(99999999999999999999, 4, 64)")), "exceeds int64"),
    NpyCase("dim-float-1e23", _file("f.npy", npy_bytes("(1e23, 4, 64)", 1024)), "shape"),
    NpyCase("dim-negative", _file("n.npy", npy_bytes("(-1, 4, 64)", 1024)), "non-integer"),
    NpyCase("symbolic-dim-over-bound", _sparse("(1, 70000, 64)", 70000 * 64 * 4), "outside [1, 65536]"),
    NpyCase("symbolic-dim-zero", _file("z.npy", npy_bytes("(1, 0, 64)")), "outside [1, 65536]"),
    NpyCase("static-dim-mismatch", _file("s.npy", npy_bytes("(1, 4, 32)", 512)), "does not match the model's"),
    NpyCase("rank-mismatch", _file("r.npy", npy_bytes("(4, 64)", 1024)), "does not match the model's"),
    NpyCase("over-2gib", _sparse("(160, 65536, 64)", 160 * 65536 * 64 * 4), "larger than"),
    NpyCase("data-truncated", _file("t.npy", npy_bytes("(1, 4, 64)", 100)), "truncated"),
    NpyCase("data-trailing", _file("t.npy", npy_bytes("(1, 4, 64)", 1028)), "its shape needs 1024"),
    NpyCase("header-length-past-end", _file("h.npy", npy_bytes("(1, 4, 64)", 0, hlen=60000)), "truncated header"),
    NpyCase("header-v2-huge-length", _file("h.npy", npy_bytes("(1, 4, 64)", 1024, version=2, hlen=2**31)),
            "header longer than"),
    NpyCase("bad-magic", _file("g.npy", b"PK\x03\x04" + bytes(200)), "bad magic"),
    NpyCase("empty-file", _file("e.npy", b""), "bad magic"),
    NpyCase("fortran-order", _file("o.npy", npy_bytes("(1, 4, 64)", 1024, fortran="True")), "Fortran"),
    NpyCase("big-endian", _file("be.npy", npy_bytes("(1, 4, 64)", 1024, descr=">f4")), "dtype >f4"),
    NpyCase("object-dtype", _file("ob.npy", npy_bytes("(1, 4, 64)", 1024, descr="|O")), "dtype |O"),
    NpyCase("rank-40", _file("k.npy", npy_bytes("(" + "1, " * 40 + ")", 4)), "more than 32 dims"),
    NpyCase("extra-header-key", _file("x.npy", npy_bytes("(1, 4, 64)", 1024, extra="'evil': 1, ")), "unexpected"),
    NpyCase("one-tuple-without-comma", _file("c.npy", npy_bytes("(256)", 1024)), "not a tuple"),
    NpyCase("fifo", _fifo, "not a regular file (a FIFO)"),
    NpyCase("dev-zero", lambda d: Path("/dev/zero"), "not a regular file (a character device)"),
    NpyCase("directory", _dir, "not a regular file (a directory)"),
    NpyCase("missing", lambda d: d / "gone.npy", "is missing"),
]


def test_npy_case_count():
    assert len({c.id for c in NPY_CASES}) == len(NPY_CASES) >= 25


@pytest.mark.parametrize("build", ["plain", "asan"])
@pytest.mark.parametrize("case", NPY_CASES, ids=[c.id for c in NPY_CASES])
def test_hostile_npy_refused(base, tmp_path, case, build):
    res = run_app(app(build), base["artifact"], {"x": case.make(tmp_path)}, tmp_path / "out.npy", timeout=60)
    assert_app_refused(res, case.fragment)
    assert "input 'x'" in res.stderr
    assert not (tmp_path / "out.npy").exists() and not list(tmp_path.glob(".out.npy.*"))


@pytest.mark.parametrize("build", ["plain", "asan"])
def test_symbolic_dims_bind_within_bounds(base, tmp_path, build):
    """The bounds refuse what is hostile, not what is legitimate: other batch/seq values run."""
    x = np.random.default_rng(1).standard_normal((2, 7, 64)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    res = run_app(app(build), base["artifact"], {"x": tmp_path / "x.npy"}, tmp_path / "out.npy")
    assert_no_sanitizer_report(res)
    assert res.returncode == 0, res.stderr
    assert np.load(tmp_path / "out.npy").shape == (2, 7, 64)


# --------------------------------------------------------------------------- output


@pytest.mark.parametrize("build", ["plain", "asan"])
def test_planted_symlinks_not_written_through(base, tmp_path, inputs, build):
    """The old app wrote OUT.npy.tmp (a fixed name, following links) and renamed it."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out.npy"
    os.symlink(victim, tmp_path / "out.npy.tmp")
    res = run_app(app(build), base["artifact"], inputs, out)
    assert_no_sanitizer_report(res)
    assert res.returncode == 0, res.stderr
    assert victim.read_text() == "precious" and np.load(out).shape == (1, 4, 64)
    # a symlink at OUT.npy itself is replaced, not written through
    out.unlink()
    os.symlink(victim, out)
    res = run_app(app(build), base["artifact"], inputs, out)
    assert res.returncode == 0, res.stderr
    assert victim.read_text() == "precious" and not out.is_symlink() and np.load(out).shape == (1, 4, 64)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.npy", "out.npy.tmp", "victim.txt", "x.npy"]


@pytest.mark.parametrize("build", ["plain", "asan"])
@pytest.mark.parametrize("where", ["directory", "missing-folder"])
def test_unwritable_output_refused(base, tmp_path, inputs, build, where):
    out = tmp_path / "out.npy" if where == "directory" else tmp_path / "nope" / "out.npy"
    if where == "directory":
        out.mkdir()
    res = run_app(app(build), base["artifact"], inputs, out)
    assert_app_refused(res, "cannot write")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["x.npy"] + (["out.npy"] if out.is_dir() else []))


# --------------------------------------------------------------------------- .npz through `blockforge run`


def _npz_member(path: Path, members: dict[str, bytes]) -> Path:
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


NPZ_CASES = [
    # numpy allocates what the header claims before reading: 256 TiB was a MemoryError traceback
    ("claims-256-TiB", {"x.npy": npy_bytes("(1, 1099511627776, 64)", 256)}, "limit 2 GiB"),
    ("size-wraps", {"x.npy": npy_bytes("(1, 72057594037927937, 64)", 256)}, "limit 2 GiB"),
    ("data-short", {"x.npy": npy_bytes("(1, 4, 64)", 100)}, "needs 1024"),
    # a member that is not a .npy came back as bytes: AttributeError traceback
    ("raw-member", {"x": b"hello"}, "not a .npy array"),
    # found by the .npz fuzz (1000 inputs): numpy sized an object array before refusing to
    # unpickle it, an OverflowError traceback
    ("object-dtype-huge-shape", {"x.npy": npy_bytes("(99999999999999999999, 4, 64)", 64, descr="|O")},
     "Python objects"),
]


@pytest.mark.parametrize("name, members, fragment", NPZ_CASES, ids=[c[0] for c in NPZ_CASES])
def test_hostile_npz_refused_by_run(base, tmp_path, name, members, fragment):
    npz = _npz_member(tmp_path / "in.npz", members)
    r = run_cli("run", base["artifact"], "--inputs", npz, "--output", tmp_path / "out.npz", cwd=tmp_path)
    assert_user_error(r, fragment)
    assert not (tmp_path / "out.npz").exists()
