"""Mutation fuzzer for `blockforge run` inputs: hostile .npz files against one artifact,
run in one child process (a native crash kills it; the test sees the signal).

Each mutant is handed to the CLI entry point in-process (blockforge.cli.main) as a user's
file would be. Kinds: arrays of other shapes (symbolic dims 0, 1, odd, up to the bound,
beyond it; other ranks), dtypes (float16/64, ints, bool, complex, strings, structured,
object), missing/extra/non-.npy members, compressed archives, .npy headers rewritten
with hostile shapes (sizes that wrap, beyond int64, negative, floats), byte-level damage
to the archive (stored, deflate, bzip2, lzma). Every run must end with exit 0, 1 or 2 and no traceback.

    python tests/robustness/npz_fuzz_worker.py ARTIFACT N SEED OUT.json
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np

from blockforge.cli import main

DTYPES = ["float32", "float16", "float64", "int8", "int64", "uint8", "bool", "complex64", "<U3", ">f4",
          [("a", "<f4"), ("b", "<i4")]]
HOSTILE_SHAPES = ["(1, 72057594037927937, 64)", "(1, 4611686018427387904, 64)", "(9223372036854775807,)",
                  "(99999999999999999999, 4, 64)", "(-1, 4, 64)", "(1e23, 4, 64)", "(1, 0, 64)", "(1, 4, 64)",
                  "()", "(4, 64)", "(1, 70000, 64)", "(1099511627776, 64)"]


def npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=True)
    return buf.getvalue()


def array(rng: np.random.Generator) -> np.ndarray:
    k = rng.integers(8)
    if k == 0:  # another dtype
        dt = DTYPES[int(rng.integers(len(DTYPES)))]
        return np.zeros((1, 4, 64), dtype=np.dtype(dt) if not isinstance(dt, list) else np.dtype(dt))
    if k == 1:  # symbolic dims at the edges
        b, s = (int(rng.choice([0, 1, 2, 3, 17, 100])) for _ in range(2))
        return rng.standard_normal((b, s, 64)).astype(np.float32)
    if k == 2:  # another rank or static dim
        shapes = [(), (64,), (4, 64), (1, 4, 64, 1), (1, 4, 63), (1, 4, 65), (1, 1, 1, 1, 1, 1)]
        return np.ones(shapes[int(rng.integers(len(shapes)))], np.float32)
    if k == 3:
        return np.array([{"pickled": 1}], dtype=object)
    if k == 4:  # non-finite values
        a = np.ones((1, 4, 64), np.float32)
        a[0, int(rng.integers(4)), int(rng.integers(64))] = rng.choice([np.nan, np.inf, -np.inf, 3.4e38])
        return a
    if k == 5:  # Fortran order, non-contiguous
        return np.asfortranarray(rng.standard_normal((1, 4, 64)).astype(np.float32))
    return rng.standard_normal((1, int(rng.integers(1, 9)), 64)).astype(np.float32)


def archive(rng: np.random.Generator) -> bytes:
    members: dict[str, bytes] = {"x.npy": npy_bytes(array(rng))}
    k = rng.integers(10)
    if k == 0:
        members = {"y.npy": members["x.npy"]}
    elif k == 1:
        members["extra.npy"] = npy_bytes(np.zeros(3))
    elif k == 2:
        members["notes"] = b"not an array"
    elif k == 3:
        members = {}
    elif k in (4, 5, 6):  # the header rewritten with a hostile shape, the data left as is
        text = members["x.npy"]
        hl = int.from_bytes(text[8:10], "little")
        header = text[10:10 + hl].decode("latin1")
        shape = HOSTILE_SHAPES[int(rng.integers(len(HOSTILE_SHAPES)))]
        header = re.sub(r"'shape': \([^)]*\)", f"'shape': {shape}", header)
        header = header.rstrip("\n").rstrip(" ")
        header += " " * ((64 - (10 + len(header) + 1) % 64) % 64) + "\n"
        data = text[10 + hl:]
        data = data[: int(rng.integers(len(data) + 1))] if rng.integers(2) else data
        members["x.npy"] = text[:8] + len(header).to_bytes(2, "little") + header.encode("latin1") + data
    buf = io.BytesIO()
    compression = [zipfile.ZIP_STORED, zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2,
                   zipfile.ZIP_LZMA][int(rng.integers(5))]
    with zipfile.ZipFile(buf, "w", compression=compression) as z:
        for name, data in members.items():
            z.writestr(name, data)
    raw = bytearray(buf.getvalue())
    if rng.integers(6) == 0 and raw:  # byte-level damage to the archive itself
        for _ in range(int(rng.integers(1, 6))):
            raw[int(rng.integers(len(raw)))] = int(rng.integers(256))
    if rng.integers(12) == 0:
        raw = raw[: int(rng.integers(len(raw) + 1))]
    return bytes(raw)


def run(artifact: str, n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    codes: dict[str, int] = {}
    bad: list[dict] = []
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["BLOCKFORGE_LOG"] = str(Path(tmp) / "log")
        for i in range(n):
            path, out = Path(tmp) / f"in{i}.npz", Path(tmp) / f"out{i}.npz"
            path.write_bytes(archive(rng))
            o, e = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
                rc = main(["run", artifact, "--inputs", str(path), "--output", str(out)])
            codes[str(rc)] = codes.get(str(rc), 0) + 1
            text = o.getvalue() + e.getvalue()
            if rc not in (0, 1, 2) or "Traceback" in text or "internal error" in text or (rc != 0 and out.exists()):
                bad.append({"i": i, "rc": rc, "text": text[-600:], "input": path.read_bytes()[:2000].hex()})
            path.unlink()
            out.unlink(missing_ok=True)
    return {"inputs": n, "seed": seed, "codes": codes, "bad": bad, "seconds": round(time.time() - t0, 1)}


if __name__ == "__main__":
    art, n, seed, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    Path(out).write_text(json.dumps(run(art, n, seed), indent=1))
