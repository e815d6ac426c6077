"""Mutation fuzzer for the model-reading paths (`inspect`, `verify`), run in one child process.

Each mutant is written to a file and handed to the CLI entry point in-process
(blockforge.cli.main), exactly as a user's file would be. A native crash kills this
process, which the test sees as a non-zero signal exit. Half of the mutants are byte-level
(bit flips, truncation, insertion, splices of two models), half structural (a field of the
parsed model changed: dims, op types, attributes, data types, initializer bytes, opsets).

    python tests/robustness/fuzz_worker.py N SEED OUT.json
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ["BLOCKFORGE_ISOLATE"] = "0"  # exercise the in-process parsers themselves

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import TensorProto  # noqa: E402

from blockforge.cli import main  # noqa: E402
from blockforge.graph import BlockSpec, FFNSpec, MHASpec, build  # noqa: E402

OPS = ["MatMul", "Relu", "Gelu", "Softmax", "Add", "Div", "Concat", "Transpose", "Reshape", "Where",
       "LayerNormalization", "Trilu", "Nonexistent", "", "Conv", "If"]


def seeds() -> list[bytes]:
    return [build(s)[0].SerializeToString() for s in (
        FFNSpec(d_model=8, d_ff=16), MHASpec(d_model=8, heads=2, causal=True, layout="packed"),
        MHASpec(d_model=8, heads=2, mask="bool", kv_seq=3), BlockSpec(d_model=8, heads=2, d_ff=16))]


def byte_mutant(rng: np.random.Generator, data: bytes, other: bytes) -> bytes:
    b = bytearray(data)
    kind = rng.integers(5)
    if kind == 0:  # bit flips
        for _ in range(int(rng.integers(1, 8))):
            i = int(rng.integers(len(b)))
            b[i] ^= 1 << int(rng.integers(8))
    elif kind == 1:  # truncation
        b = b[: int(rng.integers(len(b)))]
    elif kind == 2:  # random insertion
        i = int(rng.integers(len(b)))
        b[i:i] = rng.bytes(int(rng.integers(1, 64)))
    elif kind == 3:  # splice with another model
        i, j = int(rng.integers(len(b))), int(rng.integers(len(other)))
        b = b[:i] + bytearray(other[j:])
    else:  # overwrite a run with interesting varint bytes
        i = int(rng.integers(len(b)))
        run = bytes(rng.choice([0x00, 0x7F, 0x80, 0xFF, 0x01], size=int(rng.integers(1, 12))))
        b[i:i + len(run)] = run
    return bytes(b)


def structural_mutant(rng: np.random.Generator, data: bytes) -> bytes:
    m = onnx.ModelProto()
    m.ParseFromString(data)
    g = m.graph
    kind = rng.integers(9)
    if kind == 0 and g.node:
        g.node[int(rng.integers(len(g.node)))].op_type = str(rng.choice(OPS))
    elif kind == 1 and g.input:
        dims = g.input[int(rng.integers(len(g.input)))].type.tensor_type.shape.dim
        if dims:
            d = dims[int(rng.integers(len(dims)))]
            d.dim_value = int(rng.choice([0, 1, 2**31, 2**62, 3]))
    elif kind == 2 and g.initializer:
        t = g.initializer[int(rng.integers(len(g.initializer)))]
        t.raw_data = t.raw_data[: int(rng.integers(len(t.raw_data) + 1))]
    elif kind == 3 and g.initializer:
        t = g.initializer[int(rng.integers(len(g.initializer)))]
        t.data_type = int(rng.choice([TensorProto.INT8, TensorProto.STRING, TensorProto.DOUBLE, 0, 99]))
    elif kind == 4 and g.node:
        n = g.node[int(rng.integers(len(g.node)))]
        if n.input:
            del n.input[int(rng.integers(len(n.input)))]
    elif kind == 5:
        m.opset_import[0].version = int(rng.choice([1, 7, 13, 25, 999]))
    elif kind == 6 and g.node:
        n = g.node[int(rng.integers(len(g.node)))]
        a = n.attribute.add()
        a.name, a.type, a.i = "axis", onnx.AttributeProto.INT, int(rng.integers(-99, 99))
    elif kind == 7:
        m.ir_version = int(rng.choice([0, 3, 99]))
    elif g.output:
        g.output[0].type.tensor_type.elem_type = int(rng.choice([0, 9, 13, 16]))
    return m.SerializeToString()


def run(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    pool = seeds()
    codes: dict[str, int] = {}
    bad: list[dict] = []
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["BLOCKFORGE_LOG"] = str(Path(tmp) / "log")
        for i in range(n):
            base = pool[int(rng.integers(len(pool)))]
            try:
                data = (byte_mutant(rng, base, pool[int(rng.integers(len(pool)))]) if i % 2
                        else structural_mutant(rng, base))
            except Exception:
                data = base[: int(rng.integers(len(base)))]
            path = Path(tmp) / f"m{i}.onnx"
            path.write_bytes(data)
            for verb in ("inspect", "verify"):
                out, err = io.StringIO(), io.StringIO()
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    rc = main([verb, str(path), "--shape", "batch=1,seq=3"] if verb == "verify"
                              else [verb, str(path)])
                codes[f"{verb}:{rc}"] = codes.get(f"{verb}:{rc}", 0) + 1
                text = out.getvalue() + err.getvalue()
                if rc not in (0, 1, 2) or "Traceback" in text or "internal error" in text:
                    bad.append({"i": i, "verb": verb, "rc": rc, "text": text[-400:]})
            path.unlink()
    return {"inputs": n, "seed": seed, "codes": codes, "bad": bad, "seconds": round(time.time() - t0, 1)}


if __name__ == "__main__":
    n, seed, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    Path(out).write_text(json.dumps(run(n, seed), indent=1))
