"""Fuzzing the edge app's readers and `blockforge run`'s inputs, for a bounded time.

- fuzz_parsers (deploy/edge_app/fuzz_parsers.cc, ASan + UBSan, edge coverage) mutates
  .npy files and manifests in-process for EDGE_FUZZ_SECONDS (default 20): no sanitizer
  report, no exception but the parsers' own, no accepted input that breaks their
  promises; the corpus must grow (coverage feedback works) and mutants must be both
  accepted and refused (they reach past the first check).
- Differential: manifests from that run (corpus entries and fresh mutants) read by the
  C++ reader and by blockforge's Python reader (compile/artifact/manifest.py) get the same verdict,
  and the same message where the refusal is about the manifest's types.
- `blockforge run` on EDGE_FUZZ_NPZ (default 150) hostile .npz files, in a child process.

A longer run, e.g.:
    EDGE_FUZZ_SECONDS=600 EDGE_FUZZ_NPZ=3000 .venv/bin/pytest tests/robustness/test_edge_fuzz.py -s
or the driver alone: make -C deploy/edge_app fuzz, then build/edge/fuzz/fuzz_parsers --seconds 600.
(Test-only knobs: read here, not by blockforge.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_harness import fuzz_driver, symbolic_artifact

SECONDS = float(os.environ.get("EDGE_FUZZ_SECONDS", "20"))
SEED = int(os.environ.get("EDGE_FUZZ_SEED", "20261130"))
NPZ_N = int(os.environ.get("EDGE_FUZZ_NPZ", "150"))
EMIT = 400


@pytest.fixture(scope="module")
def fuzz_run(tmp_path_factory) -> dict:
    """One bounded run of the parser fuzzer, seeded with a real artifact's and a package's
    manifest and numpy's files."""
    driver = fuzz_driver()
    d = tmp_path_factory.mktemp("fuzz")
    seeds = [symbolic_artifact(tmp_path_factory) / "manifest.json", d / "package.json", d / "decoder.json"]
    # a package's manifest too, so that mutants reach the 'package_files' checks
    m = json.loads(seeds[0].read_text())
    m["package_files"] = {"bin/edge_app": "0" * 64, "lib/libtvm_ffi.so": "1" * 64, "lib/libtvm_runtime.so": "2" * 64}
    seeds[1].write_text(json.dumps(m, indent=1))
    # and a decoder's sections ('step', 'decode', 'inplace'), so mutants reach the in-place checks
    m = json.loads(seeds[0].read_text())
    m.update(step={"function": "decode", "dim": "seq"}, inplace={"function": "decode_inplace", "dim": "seq", "capacity": 64},
             decode={"pairs": [{"present": "y", "past": "x", "axis": 1}], "tokens": None})
    seeds[2].write_text(json.dumps(m, indent=1))
    for name, a, version in (("f32", np.ones((1, 4, 64), np.float32), (1, 0)),
                             ("f16", np.zeros((3,), np.float16), (1, 0)),
                             ("bool", np.eye(3, dtype=bool), (1, 0)),
                             ("v2", np.arange(6, dtype=np.int64), (2, 0))):
        with open(d / f"{name}.npy", "wb") as f:
            np.lib.format.write_array(f, a, version=version)
        seeds.append(d / f"{name}.npy")
    (d / "crashes").mkdir()
    (d / "emit").mkdir()
    p = subprocess.run([str(driver), "--seconds", str(SECONDS), "--seed", str(SEED), "--crash-dir", str(d / "crashes"),
                        "--emit", str(d / "emit"), "--emit-count", str(EMIT), *map(str, seeds)],
                       capture_output=True, text=True, timeout=SECONDS + 300)
    crashes = sorted(p.name for p in (d / "crashes").iterdir())
    assert p.returncode == 0 and not crashes, f"rc={p.returncode} crashes={crashes}\n{p.stderr[-6000:]}"
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    print("\nfuzz_parsers:", json.dumps(summary))
    return {"summary": summary, "emit": d / "emit", "n_seeds": len(seeds)}


def test_parsers_survive_fuzzing(fuzz_run):
    s = fuzz_run["summary"]
    assert s["bugs"] == 0 and s["coverage"] is True
    # ~3000 inputs/s on one shared core: a 20 s run is ~50k inputs; 2000 is the floor
    # that still means "ran", however loaded the machine is.
    assert s["iterations"] >= min(2000, 100 * SECONDS), s
    assert s["corpus"]["npy"] + s["corpus"]["manifest"] > fuzz_run["n_seeds"] + 5 + 20, "coverage never grew"
    for kind in ("npy", "manifest"):
        assert s["accepted"][kind] > 0 and s["refused"][kind] > 0, s


def _one_line(s: str) -> str:
    return "".join("?" if ord(c) < 0x20 or ord(c) == 0x7F else c for c in s)


def test_python_and_cpp_manifest_readers_agree(fuzz_run):
    from blockforge.compile.artifact.manifest import parse_manifest
    from blockforge.errors import BlockforgeError

    lines = (fuzz_run["emit"] / "verdicts.txt").read_bytes().decode("utf-8", "replace").splitlines()
    assert len(lines) == EMIT
    disagree, verdicts, typed = [], {"accepted": 0, "refused": 0}, 0
    for line in lines:
        name, verdict, *rest = line.split(" ", 2)
        cpp_msg = rest[0] if rest else ""
        verdicts[verdict] += 1
        typed += verdict == "refused" and not cpp_msg.startswith("corrupt manifest")
        data = (fuzz_run["emit"] / name).read_bytes()
        try:
            parse_manifest(data, "manifest.json")
            py_verdict, py_msg = "accepted", ""
        except BlockforgeError as e:
            py_verdict, py_msg = "refused", _one_line(str(e).removeprefix("manifest.json: "))
        same = py_verdict == verdict and (
            verdict == "accepted" or py_msg == cpp_msg
            or (py_msg.startswith("corrupt manifest") and cpp_msg.startswith("corrupt manifest")))
        if not same:
            disagree.append(f"{name}: C++ {verdict} {cpp_msg!r} / Python {py_verdict} {py_msg!r}")
    print(f"\ndifferential: {len(lines)} manifests, {verdicts}, {typed} refused by the type checks "
          "(messages compared word for word)")
    assert not disagree, "\n".join(disagree[:10])
    # Both outcomes, and refusals past the JSON layer, must be exercised, or the comparison proves little.
    assert verdicts["accepted"] >= 10 and verdicts["refused"] >= 100 and typed >= 20, (verdicts, typed)


def test_run_survives_hostile_npz(tmp_path_factory, tmp_path):
    art = symbolic_artifact(tmp_path_factory)
    worker = Path(__file__).with_name("npz_fuzz_worker.py")
    out = tmp_path / "npz.json"
    p = subprocess.run([sys.executable, str(worker), str(art), str(NPZ_N), str(SEED), str(out)],
                       capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, f"npz fuzz worker died (rc {p.returncode}): {p.stderr[-3000:]}"
    res = json.loads(out.read_text())
    assert res["inputs"] == NPZ_N and res["bad"] == [], json.dumps(res["bad"][:3], indent=1)
    # some hostile files must be accepted and run, most refused
    assert res["codes"].get("0", 0) > 0 and res["codes"].get("2", 0) > 0, res["codes"]
    print("\nnpz fuzz:", json.dumps({k: v for k, v in res.items() if k != "bad"}))
