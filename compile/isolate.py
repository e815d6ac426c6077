"""Untrusted models are parsed, checked and imported by TVM in a child process first.

The ONNX checker and TVM's importer are native code; a malformed model that crashes or
hangs them must not take down a long job (a tuning run, a service). The child does the
same work the parent is about to do; only when it exits cleanly does the parent repeat
it in-process. A crash (signal) or a hang (time limit) becomes one clear error.

    python -m blockforge.compile.isolate MODEL.onnx [--prepare | --tvm] [--request JSON]

--prepare: the child also resolves the request's dims (--shape, input shapes, defaults) and
runs prepare (compile/prepare.py: its constant folding evaluates subgraphs natively);
--tvm: prepare and TVM's import, the whole prelude.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from blockforge import settings
from blockforge.errors import BlockforgeError, raise_if_stopped

# A child ended by one of these was stopped from outside (a terminal's Ctrl-C reaches the
# whole process group), not crashed by the model.
_STOPPED_BY = {signal.SIGINT, signal.SIGTERM, signal.SIGKILL, signal.SIGHUP}

def probe(path: Path, *, tvm: bool = False, prepare: bool = False, request: dict | None = None,
          timeout: float | None = None) -> None:
    """Raise BlockforgeError unless a child process loads (and TVM-imports) the model cleanly."""
    if not settings.isolate():
        return
    timeout = timeout or settings.isolate_timeout_s()
    cmd = [sys.executable, "-m", "blockforge.compile.isolate", str(path)]
    if tvm or prepare:
        cmd += ["--tvm" if tvm else "--prepare", "--request", json.dumps(request or {})]
    env = {**os.environ, settings.ISOLATE: "0"}  # the child trusts itself
    try:
        # On any exception here (KeyboardInterrupt, Terminated included) subprocess.run kills
        # and reaps the child before re-raising: no checker is left running.
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise BlockforgeError(f"{path}: checking the model did not finish within {timeout:.0f} s "
                              "(a hang in native code?); refusing it") from None
    raise_if_stopped()  # the same signal reached the child (its process group): a stop, not a verdict
    what = "TVM's importer" if tvm else ("prepare (constant folding)" if prepare else "the ONNX parser/checker")
    if p.returncode < 0:
        try:
            sig = signal.Signals(-p.returncode).name
        except ValueError:
            sig = f"signal {-p.returncode}"
        if -p.returncode in _STOPPED_BY:
            raise BlockforgeError(f"{path}: the child process checking the model was stopped from outside "
                                  f"({sig}); nothing was decided about the model")
        raise BlockforgeError(f"{path}: {what} crashed ({sig}) on this model; refusing it")
    if p.returncode == 2:
        lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
        raise BlockforgeError(lines[-1] if lines else f"{path}: rejected")
    if p.returncode != 0:
        # An exception the child did not expect: its last line is the reason (TVM puts it last).
        tail = [ln.strip() for ln in (p.stderr or "").splitlines() if ln.strip()]
        reason = f": {tail[-1][:300]}" if tail else ""
        raise BlockforgeError(f"{path}: {what} failed in a child process (exit {p.returncode}){reason}")


def load_untrusted(path: str | Path, *, tvm: bool = False, prepare: bool = False, request: dict | None = None):
    """probe() then load in-process; returns the checked ModelProto. `request`: open_model's
    dims/input_shapes/default_dims/static, as the child needs them to prepare and import."""
    from blockforge.graph.model_io import load_model

    probe(Path(path), tvm=tvm, prepare=prepare, request=request)
    return load_model(path)


def _main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tvm", action="store_true")
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--request", default="{}")
    a = ap.parse_args(argv)
    from blockforge.graph.model_io import load_model

    try:
        model = load_model(a.model)
        if a.tvm or a.prepare:
            from .frontend import bound_signature
            from .prepare import prepare
            from .session import bind_request, import_prepared

            dims = bind_request(model, **json.loads(a.request))
            prepared, _ = prepare(model, dims)
            if a.tvm:
                import_prepared(prepared, bound_signature(model, dims)[0])  # output captured by the parent
    except BlockforgeError as e:
        print(str(e))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
