"""Output paths: every verb that writes refuses an output it cannot write with one clear line
(exit 2, no traceback, before the work), never leaves a partial result, and two writers
racing to one output end with one complete result.

Count of cases: len(CASES) + the named tests (test_case_count prints the figures)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from blockforge.graph import FFNSpec, export

from conftest import BLOCKFORGE, assert_user_error, compiled_ffn, run_cli

SHAPE = "batch=1,seq=4"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict:
    return compiled_ffn(tmp_path_factory.mktemp("outputs"), d_model=16, seq=4)


@contextlib.contextmanager
def read_only(path: Path):
    """A directory nobody can create files in: mode 0555, or for root (who ignores modes)
    the immutable attribute."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("running as root without chattr +i: no way to make a read-only directory")
    try:
        yield path
    finally:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)


# (name, args(base, dir) -> list, what the one error line says)
RO = "ro"  # the read-only directory under each test's tmp_path
READ_ONLY_CASES = [
    ("export -o", lambda b, d: ["export", "ffn", "--d-model", 16, "-o", d / RO / "m.onnx"], "cannot write"),
    ("compile -o", lambda b, d: ["compile", b["model"], "--target", "host", "--shape", SHAPE, "-o", d / RO / "a"],
     "cannot write"),
    ("run --output", lambda b, d: ["run", b["art"], "--inputs", b["inputs"], "--output", d / RO / "o.npz"],
     "cannot write"),
    ("package -o", lambda b, d: ["package", b["art"], "-o", d / RO / "p"], "cannot write"),
    ("verify --json", lambda b, d: ["verify", b["model"], "--shape", SHAPE, "--json", d / RO / "r.json"],
     "cannot write"),
    ("bench --json", lambda b, d: ["bench", b["model"], "--shape", SHAPE, "--json", d / RO / "b.json"], "cannot write"),
    ("bench --plot", lambda b, d: ["bench", b["model"], "--shape", SHAPE, "--plot", d / RO / "b.png"], "cannot write"),
    ("tune --json", lambda b, d: ["tune", b["model"], "--target", "host", "--shape", SHAPE, "--json", d / RO / "t.json",
                                  "--db", d / "db"], "cannot write"),
    ("tune --db", lambda b, d: ["tune", b["model"], "--target", "host", "--shape", SHAPE, "--db", d / RO / "db",
                                "--no-measure"], "not permitted"),
]


@pytest.mark.parametrize("case", READ_ONLY_CASES, ids=[c[0] for c in READ_ONLY_CASES])
def test_read_only_output_directory(case, base, tmp_path):
    name, args, fragment = case
    with read_only(tmp_path / RO):
        r = run_cli(*args(base, tmp_path), cwd=tmp_path)
        assert_user_error(r, rc=2)
        assert "internal error" not in r.err, r.err
        assert list((tmp_path / RO).iterdir()) == []
    said = r.err.lower()
    assert fragment in said or "permission denied" in said or "not permitted" in said, r.err


def _dir(d: Path, name: str) -> Path:
    (d / name).mkdir(parents=True)
    return d / name


def _file(d: Path, name: str) -> Path:
    (d / name).write_text("a user's file\n")
    return d / name


def _after(_made: Path, args: list) -> list:
    return args


# (name, args(base, dir) -> list, fragment of the one line)
WRONG_KIND_CASES = [
    ("export -o DIRECTORY", lambda b, d: ["export", "ffn", "--d-model", 16, "-o", _dir(d, "m.onnx")], "is a directory"),
    ("export whose .json is a directory", lambda b, d: _after(_dir(d, "m.json"), ["export", "ffn", "--d-model", 16,
                                                                                  "-o", d / "m.onnx"]),
     "is a directory"),
    ("export -o under a file", lambda b, d: ["export", "ffn", "--d-model", 16, "-o", _file(d, "f") / "m.onnx"],
     "is a file"),
    ("run --output DIRECTORY", lambda b, d: ["run", b["art"], "--inputs", b["inputs"], "--output", _dir(d, "o")],
     "is a directory"),
    ("verify --json DIRECTORY", lambda b, d: ["verify", b["model"], "--shape", SHAPE, "--json", _dir(d, "r")],
     "is a directory"),
    ("bench --plot DIRECTORY", lambda b, d: ["bench", b["model"], "--shape", SHAPE, "--plot", _dir(d, "p")],
     "is a directory"),
    ("tune --json DIRECTORY", lambda b, d: ["tune", b["model"], "--target", "host", "--shape", SHAPE, "--json",
                                            _dir(d, "t"), "--db", d / "db"], "is a directory"),
    ("compile -o FILE", lambda b, d: ["compile", b["model"], "--target", "host", "--shape", SHAPE, "-o", _file(d, "a")],
     "is a file"),
    ("compile --dump-ir FILE", lambda b, d: ["compile", b["model"], "--target", "host", "--shape", SHAPE,
                                             "-o", d / "a", "--dump-ir", _file(d, "ir")], "must be a directory"),
    ("package -o FILE", lambda b, d: ["package", b["art"], "-o", _file(d, "p")], "is a file"),
    ("tune --db FILE", lambda b, d: ["tune", b["model"], "--target", "host", "--shape", SHAPE,
                                     "--db", _file(d, "db")], "must be a directory"),
]


@pytest.mark.parametrize("case", WRONG_KIND_CASES, ids=[c[0] for c in WRONG_KIND_CASES])
def test_directory_where_a_file_goes_and_back(case, base, tmp_path):
    name, args, fragment = case
    argv = args(base, tmp_path)
    before = {p.relative_to(tmp_path): (p.is_dir(), p.read_bytes() if p.is_file() else None)
              for p in tmp_path.rglob("*")}
    r = run_cli(*argv, cwd=tmp_path)
    assert_user_error(r, fragment, rc=2)
    after = {p.relative_to(tmp_path): (p.is_dir(), p.read_bytes() if p.is_file() else None)
             for p in tmp_path.rglob("*") if p.name != "blockforge.log"}
    assert after == before, "the refused command changed the directory"


def test_export_writes_model_and_manifest_or_neither(tmp_path, monkeypatch):
    """The manifest's rename fails: the model's is undone (a new pair) or put back (a
    replaced pair); the pair on disk always matches (the manifest's sha256 is the model's)."""
    import blockforge.fsutil as fsutil
    from blockforge.errors import BlockforgeError
    from blockforge.fsutil import sha256_file

    out = tmp_path / "m.onnx"
    real = os.replace

    def failing(src, dst, *a, **k):
        if str(dst).endswith(".json"):
            raise OSError(28, "No space left on device")
        return real(src, dst, *a, **k)

    monkeypatch.setattr(fsutil.os, "replace", failing)
    with pytest.raises(BlockforgeError, match="No space left"):
        export(FFNSpec(d_model=16, d_ff=32), out)
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "a new pair: neither file"
    monkeypatch.setattr(fsutil.os, "replace", real)
    export(FFNSpec(d_model=16, d_ff=32, seed=1), out)
    first = (out.read_bytes(), out.with_suffix(".json").read_bytes())
    monkeypatch.setattr(fsutil.os, "replace", failing)
    with pytest.raises(BlockforgeError, match="No space left"):
        export(FFNSpec(d_model=16, d_ff=32, seed=2), out)
    assert (out.read_bytes(), out.with_suffix(".json").read_bytes()) == first, "the previous pair is back"
    assert json.loads(first[1])["sha256"] == sha256_file(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json", "m.onnx"], "no temporary file left"


def test_two_compiles_racing_to_one_output(base, tmp_path):
    """Both succeed, or one says clearly why not; what is left is one complete artifact."""
    from blockforge.compile.manifest import read_manifest, verify_files

    dest = tmp_path / "art"
    env = {**os.environ, "BLOCKFORGE_LOG": str(tmp_path / "log")}
    cmd = [*BLOCKFORGE, "compile", str(base["model"]), "--target", "host", "--shape", SHAPE, "-o", str(dest)]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    for rc, out, err in results:
        assert rc in (0, 2), err
        assert "Traceback" not in err and "internal error" not in err, err
        if rc == 2:
            assert len([ln for ln in err.splitlines() if ln.startswith("blockforge: error:")]) == 1, err
    assert any(rc == 0 for rc, _, _ in results), results
    verify_files(dest, read_manifest(dest))  # every file the manifest names, with its hash
    strays = [p.name for p in tmp_path.iterdir() if p.name.startswith(".art.")]
    assert not strays, f"temporary or replaced outputs left: {strays}"


def test_verify_prints_no_numpy_warning_for_masked_rows(tmp_path):
    """A key-padding mask of -inf over a whole row: NaN by the formula, in ORT as in the
    oracle, and `verify` says so without a raw numpy RuntimeWarning."""
    from blockforge.graph import MHASpec

    model = export(MHASpec(d_model=16, heads=2, mask="additive"), tmp_path / "m.onnx").model_path
    rng = np.random.default_rng(0)
    x = {k: rng.standard_normal((1, 4, 16)).astype(np.float32) for k in ("query", "key", "value")}
    np.savez(tmp_path / "in.npz", **x, key_padding_mask=np.full((1, 4), -np.inf, np.float32))
    r = run_cli("verify", model, "--inputs", tmp_path / "in.npz", cwd=tmp_path)
    assert r.rc == 0, r.text
    assert "RuntimeWarning" not in r.text and "Traceback" not in r.text, r.err


def test_case_count():
    print(json.dumps({"read_only": len(READ_ONLY_CASES), "wrong_kind": len(WRONG_KIND_CASES), "named": 3}))
