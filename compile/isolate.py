"""Untrusted models are parsed, checked and imported by TVM in a child process first.

The ONNX checker and TVM's importer are native code; a malformed model that crashes or
hangs them must not take down a long job (a tuning run, a service). The child does the
same work the parent is about to do; only when it exits cleanly does the parent repeat
it in-process. A crash (signal) or a hang (time limit) becomes one clear error.

    python -m blockforge.compile.isolate MODEL.onnx [--tvm] [--dims JSON]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from blockforge.errors import BlockforgeError

ENV_SWITCH = "BLOCKFORGE_ISOLATE"  # "0": trust inputs, skip the child (e.g. inside the child)
DEFAULT_TIMEOUT_S = float(os.environ.get("BLOCKFORGE_ISOLATE_TIMEOUT", "300"))


def isolation_enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def probe(path: Path, *, tvm: bool = False, dims: dict | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Raise BlockforgeError unless a child process loads (and TVM-imports) the model cleanly."""
    if not isolation_enabled():
        return
    cmd = [sys.executable, "-m", "blockforge.compile.isolate", str(path)]
    if tvm:
        cmd += ["--tvm", "--dims", json.dumps(dims or {})]
    env = {**os.environ, ENV_SWITCH: "0"}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise BlockforgeError(f"{path}: checking the model did not finish within {timeout:.0f} s "
                              "(a hang in native code?); refusing it") from None
    what = "TVM's importer" if tvm else "the ONNX parser/checker"
    if p.returncode < 0:
        try:
            sig = signal.Signals(-p.returncode).name
        except ValueError:
            sig = f"signal {-p.returncode}"
        raise BlockforgeError(f"{path}: {what} crashed ({sig}) on this model; refusing it")
    if p.returncode == 2:
        lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
        raise BlockforgeError(lines[-1] if lines else f"{path}: rejected")
    if p.returncode != 0:
        raise BlockforgeError(f"{path}: {what} failed in a child process (exit {p.returncode})")


def load_untrusted(path: str | Path, *, tvm: bool = False, dims: dict | None = None):
    """probe() then load in-process; returns the checked ModelProto."""
    from blockforge.graph.model_io import load_model

    probe(Path(path), tvm=tvm, dims=dims)
    return load_model(path)


def _main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tvm", action="store_true")
    ap.add_argument("--dims", default="{}")
    a = ap.parse_args(argv)
    from blockforge.graph.model_io import load_model

    try:
        model = load_model(a.model)
        if a.tvm:
            from blockforge.logs import native_output_to_log

            from .frontend import import_onnx

            with native_output_to_log():
                import_onnx(model, json.loads(a.dims))
    except BlockforgeError as e:
        print(str(e))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
