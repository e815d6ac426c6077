"""Bad input across the CLI verbs: each case must end as one clear error line, the expected
non-zero exit, no traceback, no crash (signal), and no partial output left behind.

Count of distinct cases: len(CASES) (the README quotes it; `make robustness` reruns them).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from blockforge.graph import FFNSpec, MHASpec, export

from conftest import run_cli, run_cli_in_process

# The isolation child is under test here (tests/conftest.py turns it off elsewhere).
pytestmark = pytest.mark.isolation


@pytest.fixture(scope="session")
def base(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("base")
    ffn = export(FFNSpec(d_model=16, d_ff=32), d / "ffn.onnx").model_path
    mha = export(MHASpec(d_model=16, heads=2), d / "mha.onnx").model_path
    cross = export(MHASpec(d_model=16, heads=2, cross=True), d / "cross.onnx").model_path
    art = d / "ffn.host"
    r = run_cli("compile", ffn, "--target", "host", "--shape", "batch=1,seq=4", "-o", art, cwd=d)
    assert r.rc == 0, r.text
    return {"dir": d, "ffn": ffn, "mha": mha, "cross": cross, "art": art}


def _model(nodes, inputs, outputs, inits=(), opset=17, ir=8) -> onnx.ModelProto:
    m = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(inits)),
                          opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = ir
    return m


def _ext_model(d: Path, location: str) -> Path:
    """A valid model whose weight lives in external data at `location`."""
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "W")
    m = _model([helper.make_node("MatMul", ["x", "W"], ["y"])],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [w])
    t = m.graph.initializer[0]
    t.ClearField("raw_data")
    t.ClearField("float_data")
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", "0"), ("length", "64")):
        e = t.external_data.add()
        e.key, e.value = k, v
    p = d / "ext.onnx"
    p.write_bytes(m.SerializeToString())
    return p


def _write(d: Path, name: str, data: bytes) -> Path:
    p = d / name
    p.write_bytes(data)
    return p


def _npz(d: Path, **arrays) -> Path:
    p = d / "in.npz"
    np.savez(p, **arrays)
    return p


def _copy_art(b, d: Path) -> Path:
    dst = d / "art"
    shutil.copytree(b["art"], dst)
    return dst


def _tamper(b, d):
    art = _copy_art(b, d)
    data = bytearray((art / "module.so").read_bytes())
    data[4096] ^= 0x5A
    (art / "module.so").write_bytes(bytes(data))
    return art


def _foreign_arch(b, d):
    """module.so swapped for an aarch64 ELF, manifest re-hashed: only the arch check can stop it."""
    import hashlib

    art = _copy_art(b, d)
    head = bytearray(b"\x7fELF\x02\x01\x01" + bytes(9) + (3).to_bytes(2, "little") + (183).to_bytes(2, "little"))
    (art / "module.so").write_bytes(bytes(head) + bytes(4096))
    m = json.loads((art / "manifest.json").read_text())
    m["files"]["module.so"] = hashlib.sha256((art / "module.so").read_bytes()).hexdigest()
    (art / "manifest.json").write_text(json.dumps(m))
    return art


def _db(d: Path, workloads: str | None = None, records: str | None = None, device: dict | None = None) -> Path:
    db = d / "db"
    db.mkdir()
    if workloads is not None:
        (db / "database_workload.json").write_text(workloads)
    if records is not None:
        (db / "database_tuning_record.json").write_text(records)
    if device is not None:
        (db / "device.json").write_text(json.dumps(device))
    return db


@dataclass
class Case:
    id: str
    args: Callable[[dict, Path], list]
    fragment: str
    rc: int = 2
    outputs: tuple[str, ...] = ()  # files that must not exist afterwards
    # The table runs in-process (run_cli_in_process: no interpreter + TVM import per case);
    # one case per verb also runs as a real `blockforge` process, so each verb's refusal is
    # seen as the user sees it (the process's stderr and exit status).
    process: bool = False


X = np.zeros((1, 4, 16), np.float32)
CASES = [
    # --- model files -------------------------------------------------------------------
    Case("onnx-empty", lambda b, d: ["inspect", _write(d, "e.onnx", b"")], "empty file", process=True),
    Case("onnx-random-bytes", lambda b, d: ["verify", _write(d, "r.onnx", np.random.default_rng(1).bytes(4096))],
         "not an onnx model", process=True),
    Case("onnx-truncated", lambda b, d: ["compile", _write(d, "t.onnx", b["ffn"].read_bytes()[:700]),
                                         "--target", "host", "-o", d / "o"], "", outputs=("o",)),
    Case("protobuf-not-a-model", lambda b, d: ["inspect", _write(
        d, "t.onnx", helper.make_tensor("t", TensorProto.FLOAT, [2], [1.0, 2.0]).SerializeToString())],
         "not an onnx model"),
    Case("model-without-graph", lambda b, d: ["inspect", _write(
        d, "n.onnx", helper.make_model(helper.make_graph([], "g", [], [])).SerializeToString()[:6])], ""),
    Case("checker-dangling-input", lambda b, d: ["verify", _write(d, "c.onnx", _model(
        [helper.make_node("Relu", ["nope"], ["y"])], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])]).SerializeToString())], "checker"),
    Case("model-is-directory", lambda b, d: ["inspect", d], "not a regular file"),
    Case("model-missing", lambda b, d: ["verify", d / "missing.onnx"], "no such file"),
    # --- external data (CVE classes) ------------------------------------------------------
    Case("external-data-dotdot", lambda b, d: ["inspect", _ext_model(d, "../secret.bin")], "outside"),
    Case("external-data-absolute", lambda b, d: ["inspect", _ext_model(d, "/etc/passwd")], "outside"),
    Case("external-data-symlink", lambda b, d: ["inspect", (os.symlink("/etc/hostname", d / "w.bin"),
                                                            _ext_model(d, "w.bin"))[1]], "symlink"),
    Case("external-data-hardlink", lambda b, d: ["inspect", ((d / "real.bin").write_bytes(bytes(64)),
                                                             os.link(d / "real.bin", d / "w.bin"),
                                                             _ext_model(d, "w.bin"))[2]], "hardlink"),
    Case("external-data-missing", lambda b, d: ["inspect", _ext_model(d, "gone.bin")], "missing"),
    # --- models blockforge cannot take ------------------------------------------------------
    Case("unsupported-op", lambda b, d: ["compile", _write(d, "dft.onnx", _model(
        [helper.make_node("DFT", ["x"], ["y"])], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 2])]).SerializeToString()),
        "--target", "host", "-o", d / "o"], "unsupported ONNX op(s): DFT", outputs=("o",), process=True),
    Case("huge-declared-dims", lambda b, d: ["verify", _write(d, "h.onnx", _model(
        [helper.make_node("Relu", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [100000, 100000, 768])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [100000, 100000, 768])]).SerializeToString())],
         "GiB"),
    Case("huge-bound-dim", lambda b, d: ["verify", b["ffn"], "--shape", "batch=65536,seq=65536"], "GiB"),
    # --- inputs ---------------------------------------------------------------------------
    Case("npz-wrong-name", lambda b, d: ["verify", b["ffn"], "--inputs", _npz(d, y=X)], "missing x"),
    Case("npz-wrong-shape", lambda b, d: ["verify", b["ffn"], "--inputs", _npz(d, x=np.zeros((1, 4, 8), np.float32))],
         "shape"),
    Case("npz-wrong-dtype", lambda b, d: ["verify", b["ffn"], "--inputs", _npz(d, x=X.astype(np.float64))], "dtype"),
    Case("npz-garbage", lambda b, d: ["verify", b["ffn"], "--inputs", _write(d, "g.npz", b"PK\x03\x04junk")], "npz"),
    Case("npz-pickled-object", lambda b, d: ["verify", b["ffn"], "--inputs",
                                             (np.savez(d / "o.npz", x=np.array([{"a": 1}], dtype=object)),
                                              d / "o.npz")[1]], "npz"),
    Case("run-wrong-shape", lambda b, d: ["run", b["art"], "--inputs", _npz(d, x=np.zeros((2, 4, 16), np.float32)),
                                          "--output", d / "out.npz"], "shape", outputs=("out.npz",), process=True),
    Case("bad-shape-flag", lambda b, d: ["verify", b["ffn"], "--shape", "seq=-1"], "[1,"),
    Case("shape-unknown-dim", lambda b, d: ["compile", b["ffn"], "--target", "host", "--shape", "heads=2",
                                            "-o", d / "o"], "symbolic dims", outputs=("o",)),
    # --- artifacts ------------------------------------------------------------------------
    Case("manifest-hash-mismatch", lambda b, d: ["run", _tamper(b, d), "--inputs", _npz(d, x=X),
                                                 "--output", d / "out.npz"], "sha256", outputs=("out.npz",)),
    Case("module-for-other-arch", lambda b, d: ["run", _foreign_arch(b, d), "--inputs", _npz(d, x=X),
                                                "--output", d / "out.npz"], "is for aarch64", outputs=("out.npz",)),
    Case("artifact-without-manifest", lambda b, d: ["run", (d / "empty").mkdir() or d / "empty", "--inputs",
                                                    _npz(d, x=X), "--output", d / "out.npz"], "no manifest.json"),
    Case("package-not-an-artifact", lambda b, d: ["package", d / "nothing"], "not an artifact", process=True),
    # --- targets --------------------------------------------------------------------------
    Case("unknown-target", lambda b, d: ["compile", b["ffn"], "--target", "tpu9", "-o", d / "o"], "unknown target",
         outputs=("o",)),
    Case("malformed-target-json", lambda b, d: ["compile", b["ffn"], "--target", '{"kind": "llvm",', "-o", d / "o"],
         "malformed target JSON", outputs=("o",)),
    Case("target-json-unknown-kind", lambda b, d: ["verify", b["ffn"], "--target", '{"kind": "quantum"}'],
         "TVM rejects target"),
    # --- tuning databases -----------------------------------------------------------------
    Case("db-corrupt", lambda b, d: ["compile", b["ffn"], "--target", "host", "--tuning-db",
                                     _db(d, "garbage\n[1]\n"), "-o", d / "o"], "corrupt", outputs=("o",)),
    Case("db-foreign-lines", lambda b, d: ["compile", b["ffn"], "--target", "host", "--tuning-db",
                                           _db(d, '{"not": "a workload"}\n'), "-o", d / "o"], "foreign",
         outputs=("o",)),
    Case("db-other-device", lambda b, d: ["tune", b["ffn"], "--target", "host", "--db",
                                          _db(d, device={"format": "blockforge.tuning-db/1", "key": "cuda-sm90"})],
         "is for device", process=True),
    Case("db-empty", lambda b, d: ["compile", b["ffn"], "--target", "host", "--tuning-db", _db(d, "", ""),
                                   "-o", d / "o"], "no records", outputs=("o",)),
    Case("db-is-a-file", lambda b, d: ["tune", b["ffn"], "--target", "host", "--db", _write(d, "db", b"x")],
         "must be a directory"),
    Case("db-record-bad-index", lambda b, d: ["compile", b["ffn"], "--target", "host", "--tuning-db",
                                              _db(d, '["1", {}]\n', '[7, []]\n[7, []]\n'), "-o", d / "o"],
         "refers to workload", outputs=("o",)),
    Case("tune-zero-trials", lambda b, d: ["tune", b["ffn"], "--target", "host", "--trials", "0", "--db", d / "db"],
         "positive"),
    Case("tune-no-tracker", lambda b, d: ["tune", b["ffn"], "--target", "host", "--db", d / "db",
                                          "--rpc-tracker", "127.0.0.1:9", "--rpc-key", "k"], "no RPC tracker"),
    # --- specs ----------------------------------------------------------------------------
    Case("spec-heads-zero", lambda b, d: ["export", "mha", "--heads", "0", "-o", d / "m.onnx"], "positive",
         outputs=("m.onnx",), process=True),
    Case("spec-not-divisible", lambda b, d: ["export", "mha", "--d-model", "100", "--heads", "8", "-o", d / "m.onnx"],
         "divisible", outputs=("m.onnx",)),
    Case("spec-too-big", lambda b, d: ["export", "ffn", "--d-model", "30000", "--d-ff", "30000", "-o", d / "m.onnx"], "GiB",
         outputs=("m.onnx",)),
    Case("spec-opset-range", lambda b, d: ["export", "ffn", "--opset", "7", "-o", d / "m.onnx"], "opset",
         outputs=("m.onnx",)),
    Case("bench-unknown-contender", lambda b, d: ["bench", b["ffn"], "--against", "ort,magic"], "unknown contender",
         process=True),
    # bench's default batch=1,seq=128 binds only those names: a cross-attention's kv_seq stays open
    Case("bench-symbolic-dim", lambda b, d: ["bench", b["cross"]], "kv_seq"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(base, tmp_path, case):
    r = (run_cli if case.process else run_cli_in_process)(*case.args(base, tmp_path), cwd=tmp_path)
    assert r.rc == case.rc, f"rc={r.rc}\n{r.text}"
    assert "Traceback" not in r.text and "internal error" not in r.text, r.text
    errors = [ln for ln in r.err.splitlines() if ln.startswith("blockforge: error:")]
    assert len(errors) == 1, r.err
    assert case.fragment.lower() in errors[0].lower(), errors[0]
    for name in case.outputs:
        assert not (tmp_path / name).exists(), f"partial output {name} left behind"
    assert not list(tmp_path.rglob("*.tmp")), "temporary files left behind"


def test_case_count():
    assert len({c.id for c in CASES}) == len(CASES) >= 30


@pytest.mark.parametrize("values, word", [(np.nan, "NaN"), (np.inf, "Inf")])
def test_non_finite_inputs_are_reported(base, tmp_path, values, word):
    x = np.ones((1, 4, 16), np.float32)
    x[0, 1, 3] = values
    r = run_cli_in_process("verify", base["ffn"], "--inputs", _npz(tmp_path, x=x), cwd=tmp_path)
    assert "Traceback" not in r.text and r.rc in (0, 1), r.text
    assert f"1 {word}" in r.out or "holds 0 NaN and 1 Inf" in r.out, r.out


def test_external_data_inside_folder_is_accepted(tmp_path):
    """The policy refuses escapes, not external data: a plain file beside the model loads."""
    (tmp_path / "w.bin").write_bytes(np.ones(16, np.float32).tobytes())
    r = run_cli_in_process("inspect", _ext_model(tmp_path, "w.bin"), cwd=tmp_path)
    assert r.rc == 0, r.text
