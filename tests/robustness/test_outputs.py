"""Output paths: every verb that writes refuses an output it cannot write with one clear line
(exit 2, no traceback, before the work), never leaves a partial result, and two writers
racing to one output end with one complete result. One policy for every path a verb
writes (fsutil.check_outputs): an input of the same run, a device, FIFO or symbolic link,
two outputs on one path, an empty path and an unwritable place are refused before any work.

Count of cases: len(CASES) + the named tests (test_case_count prints the figures)."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

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
    from blockforge.compile.artifact.manifest import read_manifest, verify_files

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


# ------------------------------------------------------------------ one policy, every flag
#
# Every path a verb writes, in-process through the CLI entry (blockforge.cli.main): the
# first function of each verb's work is replaced by a sentinel, so "refused before any
# work" is observed, not inferred from timing (the time is asserted too).

SENTINEL = "reached the work (test sentinel)"


@dataclass(frozen=True)
class Flag:
    argv: Callable  # (base, dir, target) -> argv
    kind: str  # "file" (replaced by rename), "tree" (a directory replaced whole), "into" (written into)
    work: str  # module:attribute the sentinel replaces
    input: Callable | None = None  # (base, dir) -> the input file that "input" cases name
    second: Callable | None = None  # target -> argv naming it as another output of the run
    any_name: bool = True  # False: only names ending in .onnx get past argument checks (export)
    reads_artifact: bool = False  # an artifact directory is an input (its files are inputs too)


def _model(b, d) -> Path:
    dst = d / "in.onnx"
    if not dst.exists():
        dst.write_bytes(Path(b["model"]).read_bytes())
    return dst


def _npz(b, d) -> Path:
    dst = d / "in.npz"
    if not dst.exists():
        dst.write_bytes(Path(b["inputs"]).read_bytes())
    return dst


_TUNE = lambda b, d: ["tune", _model(b, d), "--target", "host", "--shape", SHAPE, "--no-measure"]  # noqa: E731
FLAGS = {
    "export -o": Flag(lambda b, d, t: ["export", "ffn", "--d-model", 16, "-o", t], "file", "blockforge.graph.export:build",
                      any_name=False),
    "compile -o": Flag(lambda b, d, t: ["compile", _model(b, d), "--target", "host", "--shape", SHAPE, "-o", t],
                       "tree", "blockforge.compile.artifact.write:open_model", _model, lambda t: ["--dump-ir", t]),
    "compile --dump-ir": Flag(lambda b, d, t: ["compile", _model(b, d), "--target", "host", "--shape", SHAPE,
                                               "-o", d / "art", "--dump-ir", t], "into",
                              "blockforge.compile.artifact.write:open_model"),
    "verify --json": Flag(lambda b, d, t: ["verify", _model(b, d), "--shape", SHAPE, "--json", t], "file",
                          "blockforge.compile.verify:verify", _model),
    "bench --json": Flag(lambda b, d, t: ["bench", _model(b, d), "--shape", SHAPE, "--json", t], "file",
                         "blockforge.bench:bench", _model, lambda t: ["--plot", t]),
    "bench --plot": Flag(lambda b, d, t: ["bench", _model(b, d), "--shape", SHAPE, "--plot", t], "file",
                         "blockforge.bench:bench", _model),
    "tune --json": Flag(lambda b, d, t: [*_TUNE(b, d), "--tuning-db", d / "db", "--json", t], "file",
                        "blockforge.tune.jobs:open_model", _model),
    "tune --tuning-db": Flag(lambda b, d, t: [*_TUNE(b, d), "--tuning-db", t], "into", "blockforge.tune.jobs:open_model",
                             second=lambda t: ["--json", t]),
    "run --output": Flag(lambda b, d, t: ["run", b["art"], "--inputs", _npz(b, d), "--output", t], "file",
                         "blockforge.graph.model_io:load_npz", _npz, reads_artifact=True),
    "package -o": Flag(lambda b, d, t: ["package", b["art"], "-o", t], "tree", "blockforge.deploy.package:_shipped",
                       lambda b, d: Path(b["art"]), reads_artifact=True),
}


def _fifo(d: Path, name: str) -> Path:
    os.mkfifo(d / name)
    return d / name


def _link(d: Path, name: str, to) -> Path:
    (d / name).symlink_to(to)
    return d / name


def _hardlink(d: Path, name: str, to: Path) -> Path:
    os.link(to, d / name)
    return d / name


# (name, make(base, dir, input) -> target, force, refused?(flag) -> bool, fragment of the one line, applies(flag))
# Names end in .onnx: export takes only MODEL.onnx, and the same names serve every flag.
ALWAYS = lambda f: True  # noqa: E731
POLICY_CASES = [
    ("the input itself", lambda b, d, i: i, False, ALWAYS, "input", lambda f: f.input and f.kind != "into"),
    ("the input itself, --force", lambda b, d, i: i, True, lambda f: f.kind == "tree", "overlaps the input",
     lambda f: f.input and f.kind != "into"),
    ("a hard link to the input", lambda b, d, i: _hardlink(d, "h.onnx", i if i.is_file() else i / "manifest.json"),
     False, ALWAYS, "input", lambda f: f.input and f.kind != "into"),
    ("a file of the input artifact", lambda b, d, i: Path(b["art"]) / "manifest.json", False, ALWAYS, "input",
     lambda f: f.reads_artifact),
    ("a symlink to the input", lambda b, d, i: _link(d, "s.onnx", i), False, ALWAYS, "input",
     lambda f: f.input and f.kind != "into"),
    ("a symlink to the input, --force", lambda b, d, i: _link(d, "s.onnx", i), True, lambda f: f.kind == "tree",
     "overlaps the input", lambda f: f.input and f.kind != "into"),
    ("a FIFO", lambda b, d, i: _fifo(d, "f.onnx"), False, ALWAYS, "is a FIFO", ALWAYS),
    ("a FIFO, --force", lambda b, d, i: _fifo(d, "f.onnx"), True, ALWAYS, "is a FIFO", ALWAYS),
    ("/dev/null", lambda b, d, i: Path("/dev/null"), False, ALWAYS, "character device", lambda f: f.any_name),
    ("/dev/full, --force", lambda b, d, i: Path("/dev/full"), True, ALWAYS, "character device", lambda f: f.any_name),
    ("a symlink to /dev/full, --force", lambda b, d, i: _link(d, "dev.onnx", "/dev/full"), True, ALWAYS,
     "symbolic link to a character device", ALWAYS),
    ("a symlink to a file", lambda b, d, i: _link(d, "l.onnx", _file(d, "victim")), False, ALWAYS, "symbolic link",
     lambda f: f.kind != "into"),
    ("a symlink to a file, --force", lambda b, d, i: _link(d, "l.onnx", _file(d, "victim")), True, lambda f: False, "",
     lambda f: f.kind != "into"),
    ("a symlink to a file (a directory is expected)", lambda b, d, i: _link(d, "l.onnx", _file(d, "victim")), True,
     ALWAYS, "must be a directory", lambda f: f.kind == "into"),
    ("two outputs on one path", lambda b, d, i: d / "same.onnx", False, ALWAYS, "name the same path",
     lambda f: f.second is not None),
    ("an empty path", lambda b, d, i: "", False, ALWAYS, "the path is empty", ALWAYS),
    ("an unwritable place (/proc)", lambda b, d, i: Path("/proc/xyz.onnx"), False, ALWAYS, "cannot write in /proc", ALWAYS),
]
POLICY_TABLE = [(fname, case) for fname, f in FLAGS.items() for case in POLICY_CASES if case[5](f)]


def _nodes(d: Path) -> dict:
    """Every node under d and the devices: type, inode, device number, bytes of regular
    files (FIFOs are never opened)."""
    out = {}
    for p in [*d.rglob("*"), Path("/dev/null"), Path("/dev/full")]:
        if p.name == "blockforge.log":
            continue
        st = p.lstat()
        data = p.read_bytes() if stat.S_ISREG(st.st_mode) else (os.readlink(p) if p.is_symlink() else None)
        out[str(p)] = (stat.S_IFMT(st.st_mode), st.st_ino, st.st_rdev, data)
    return out


def _main_in_process(argv, monkeypatch, capsys, work: str) -> tuple[int, str, float]:
    from blockforge.cli import main
    from blockforge.errors import BlockforgeError

    def sentinel(*a, **k):
        raise BlockforgeError(SENTINEL)

    module, attr = work.split(":")
    monkeypatch.setattr(importlib.import_module(module), attr, sentinel)
    capsys.readouterr()
    t0 = time.monotonic()
    rc = main([str(x) for x in argv])
    return rc, capsys.readouterr().err, time.monotonic() - t0


@pytest.mark.parametrize("fname,case", POLICY_TABLE, ids=[f"{f}: {c[0]}" for f, c in POLICY_TABLE])
def test_output_policy(fname, case, base, tmp_path, monkeypatch, capsys):
    name, make, force, refused, fragment, _ = case
    f = FLAGS[fname]
    monkeypatch.setenv("BLOCKFORGE_LOG", str(tmp_path / "blockforge.log"))
    monkeypatch.chdir(tmp_path)
    inp = f.input(base, tmp_path) if f.input else None
    target = make(base, tmp_path, inp)
    argv = f.argv(base, tmp_path, target)
    if name.startswith("two outputs"):
        argv += f.second(target)
    argv += ["--force"] if force else []
    before = {**_nodes(tmp_path), **_nodes(Path(base["art"]))}
    rc, err, took = _main_in_process(argv, monkeypatch, capsys, f.work)
    lines = [ln for ln in err.splitlines() if ln.startswith("blockforge: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    if refused(f):
        assert rc == 2 and SENTINEL not in err and fragment.lower() in lines[0].lower(), err
        assert took < 2.0, f"took {took:.1f} s: the policy runs before any work"
    else:
        assert rc == 2 and SENTINEL in err, f"--force should let this output through to the work: {err}"
    assert {**_nodes(tmp_path), **_nodes(Path(base["art"]))} == before, "the refused command changed what was there"


def test_force_replaces_a_link_never_its_target(base, tmp_path, monkeypatch, capsys):
    """Where --force lets an output through, the write replaces the link (by rename), not the
    file it points to; and `run --output` naming its own --inputs replaces the inputs."""
    from blockforge.cli import main

    monkeypatch.setenv("BLOCKFORGE_LOG", str(tmp_path / "blockforge.log"))
    victim = _file(tmp_path, "victim")
    link = _link(tmp_path, "r.json", victim)
    assert main(["verify", str(_model(base, tmp_path)), "--shape", SHAPE, "--json", str(link), "--force"]) == 0
    assert not link.is_symlink() and json.loads(link.read_text())["passed"] is True
    assert victim.read_text() == "a user's file\n"
    npz = _npz(base, tmp_path)
    assert main(["run", str(base["art"]), "--inputs", str(npz), "--output", str(npz), "--force"]) == 0
    assert set(np.load(npz)) != {"x"}, "the outputs replaced the inputs, as asked"


def test_atomic_write_never_renames_over_a_device_or_fifo(tmp_path):
    """The write itself refuses a node that appeared after the checks."""
    from blockforge.errors import BlockforgeError
    from blockforge.fsutil import atomic_write_bytes, atomic_write_group

    fifo = _fifo(tmp_path, "f")
    with pytest.raises(BlockforgeError, match="is a FIFO"):
        atomic_write_bytes(fifo, b"x")
    with pytest.raises(BlockforgeError, match="is a FIFO"):
        atomic_write_group({tmp_path / "a": b"a", fifo: b"x"})
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"], "no temporary file, no half of the group"


def test_dump_ir_writes_never_follow_a_planted_link(base, tmp_path):
    """--dump-ir writes each phase by rename: a link planted under a phase's name is
    replaced, the file it points to is left alone."""
    victim = _file(tmp_path, "victim")
    dump = tmp_path / "ir"
    dump.mkdir()
    _link(dump, "00-import.py", victim)
    r = run_cli("compile", base["model"], "--target", "host", "--shape", SHAPE, "-o", tmp_path / "a",
                "--dump-ir", dump, cwd=tmp_path)
    assert r.rc == 0, r.text
    assert victim.read_text() == "a user's file\n"
    assert not (dump / "00-import.py").is_symlink() and "def main" in (dump / "00-import.py").read_text()


def test_case_count():
    print(json.dumps({"read_only": len(READ_ONLY_CASES), "wrong_kind": len(WRONG_KIND_CASES),
                      "policy": len(POLICY_TABLE), "named": 6}))


def test_a_temporary_output_a_child_still_writes_in_is_removed_after_the_children(tmp_path, monkeypatch):
    """A signal unwinds atomic_directory while a linker (orphaned by its killed g++ driver) still
    writes module.so into the temporary directory: the first rmtree leaves it (the clean-clone CI
    of dd4a621 found `.art.*.tmp` beside the artifact); the CLI removes it again once its children
    ended (cli._dispatch -> fsutil.remove_leftovers)."""
    from blockforge import fsutil

    real = fsutil.shutil.rmtree
    calls = []

    def racing_rmtree(path, ignore_errors=False):
        calls.append(Path(path))
        real(path, ignore_errors=ignore_errors)
        if len(calls) == 1:  # the child writes again while the first removal runs
            Path(path).mkdir()
            (Path(path) / "module.so").write_bytes(b"\x7fELF")

    monkeypatch.setattr(fsutil.shutil, "rmtree", racing_rmtree)
    dest = tmp_path / "art"
    with contextlib.suppress(KeyboardInterrupt):
        with fsutil.atomic_directory(dest, what="artifact") as tmp:
            (tmp / "manifest.json").write_text("{}")
            raise KeyboardInterrupt
    assert [p.name for p in tmp_path.iterdir()] == [tmp.name], "the racing write is there before the children end"
    fsutil.remove_leftovers()
    assert list(tmp_path.iterdir()) == [], "a temporary output left after the children ended"
    assert not fsutil._LEFTOVERS
