"""Untrusted models are parsed, checked and imported by TVM in a child process first.

The ONNX checker and TVM's importer are native code; a malformed model that crashes or
hangs them must not take down a long job (a tuning run, a service). The child does the
same work the parent is about to do; only when it exits cleanly does the parent repeat
it in-process. A crash (signal) or a hang (time limit) becomes one clear error.

    python -m blockforge.compile.isolate MODEL.onnx [--sizes | --prepare | --tvm] [--request JSON]
    python -m blockforge.compile.isolate MODEL.onnx --ort FOLDER [--device cpu|cuda]

--prepare: the child also resolves the request's dims (--shape, input shapes, defaults) and
runs prepare (compile/prepare.py: its constant folding evaluates subgraphs natively);
--tvm: prepare and TVM's import, the whole prelude; --sizes: only bind and check the sizes
folding would materialise (prepare.check_sizes); --ort FOLDER: run the model in ONNX
Runtime on FOLDER/in.npz (verify's reference run).

The child's data memory is limited (settings.memory_limit_bytes(), RLIMIT_DATA): a model
that needs more ends in "the model needs more than N GiB to ..." instead of taking the
machine's memory; so does a child the kernel's OOM killer ended.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from blockforge import settings
from blockforge.errors import BlockforgeError, raise_if_stopped

_log = logging.getLogger("blockforge.isolate")
LOGGED_TAIL = 64 * 1024  # of a child's native output (ORT's, TVM's) kept in the log file

# A child ended by one of these was stopped from outside (a terminal's Ctrl-C reaches the
# whole process group), not crashed by the model.
_STOPPED_BY = {signal.SIGINT, signal.SIGTERM, signal.SIGKILL, signal.SIGHUP}

@dataclass
class _Child:
    rc: int
    stdout: str
    stderr: str
    peak_rss: int  # bytes (the child's ru_maxrss)
    oom_killed: bool  # SIGKILL while the kernel's OOM-kill count rose


def _run_child(cmd: list[str], timeout: float) -> _Child:
    """Run an isolation child (it limits its own memory: _limit_memory), wait for it with
    os.wait4 to learn its peak RSS, kill it past `timeout` (subprocess.TimeoutExpired).
    Output goes to files, not pipes: a chatty child cannot block on a full pipe."""
    env = {**os.environ, settings.ISOLATE: "0"}  # the child trusts itself
    ooms = settings.cgroup_oom_kills()
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env)
        try:
            while True:
                pid, status, ru = os.wait4(p.pid, os.WNOHANG)
                if pid:
                    break
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(cmd, timeout)
                time.sleep(0.02)
        except BaseException:  # a stop or the time limit: no checker is left running
            p.kill()
            p.wait()
            raise
        p.returncode = rc = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait
        out.seek(0)
        err.seek(0)
        text = [f.read().decode(errors="replace") for f in (out, err)]
    if text[1].strip():  # native logs (ORT's [E:onnxruntime:...], TVM's) go where the parent's go
        _log.info("child %s wrote:\n%s", " ".join(cmd[3:5]), text[1][-LOGGED_TAIL:].rstrip())
    return _Child(rc, *text, ru.ru_maxrss * 1024,
                  rc == -signal.SIGKILL and settings.cgroup_oom_kills() > ooms)


# What an allocation failure under RLIMIT_DATA looks like once Python, numpy, ONNX Runtime,
# TVM (C++ std::bad_alloc) or the dynamic loader (mapping a library) reports it.
_NO_MEMORY = re.compile(r"MemoryError|bad_alloc|Unable to allocate|Failed to allocate|out of memory|"
                        r"Cannot allocate memory|failed to map segment|cannot map zero-fill", re.IGNORECASE)


def _memory_error(path: Path, verb: str, c: _Child) -> BlockforgeError | None:
    """The error for a child stopped by memory: its allocation failed under the limit, or
    the kernel's OOM killer ended it (the machine had less memory than the limit)."""
    limit = settings.memory_limit_bytes() / 2**30
    if c.oom_killed:
        return BlockforgeError(
            f"{path}: the model needs more than {c.peak_rss / 2**30:.1f} GiB to {verb}: the kernel's "
            f"out-of-memory killer stopped the child process (the limit is {limit:.1f} GiB, "
            f"{settings.MEMORY_LIMIT}: set it below the memory this machine or container has)")
    # the reason, not the whole log: the child's error line, the end of its traceback
    reason = [ln for ln in c.stdout.splitlines() if ln.strip()][-1:] + c.stderr.splitlines()[-6:]
    if c.rc != 0 and _NO_MEMORY.search("\n".join(reason)):
        return BlockforgeError(f"{path}: the model needs more than {limit:.1f} GiB to {verb} "
                               f"(the memory limit, {settings.MEMORY_LIMIT}); refusing it")
    return None


def _run_checked(path: Path, cmd: list[str], what: str, verb: str, timeout: float | None = None) -> _Child:
    """_run_child, every way it can fail as one BlockforgeError: `what` failed, `verb` the
    memory message's."""
    timeout = timeout or settings.isolate_timeout_s()
    try:
        c = _run_child(cmd, timeout)
    except subprocess.TimeoutExpired:
        raise BlockforgeError(f"{path}: checking the model did not finish within {timeout:.0f} s "
                              "(a hang in native code?); refusing it") from None
    raise_if_stopped()  # the same signal reached the child (its process group): a stop, not a verdict
    err = _memory_error(path, verb, c)
    if err:
        raise err
    if c.rc < 0:
        try:
            sig = signal.Signals(-c.rc).name
        except ValueError:
            sig = f"signal {-c.rc}"
        if -c.rc in _STOPPED_BY:
            raise BlockforgeError(f"{path}: the child process checking the model was stopped from outside "
                                  f"({sig}); nothing was decided about the model")
        raise BlockforgeError(f"{path}: {what} crashed ({sig}) on this model; refusing it")
    if c.rc == 2:
        lines = [ln for ln in c.stdout.splitlines() if ln.strip()]
        raise BlockforgeError(lines[-1] if lines else f"{path}: rejected")
    if c.rc != 0:
        # An exception the child did not expect: its last line is the reason (TVM puts it last).
        tail = [ln.strip() for ln in (c.stderr or "").splitlines() if ln.strip()]
        reason = f": {tail[-1][:300]}" if tail else ""
        raise BlockforgeError(f"{path}: {what} failed in a child process (exit {c.rc}){reason}")
    return c


def probe(path: Path, *, tvm: bool = False, prepare: bool = False, sizes: bool = False,
          request: dict | None = None, timeout: float | None = None) -> None:
    """Raise BlockforgeError unless a child process loads (and TVM-imports) the model cleanly.
    sizes: the child also binds the request's dims and refuses a tensor folding would make
    above the size cap (prepare.check_sizes; prepare and tvm include it)."""
    if not settings.isolate():
        return
    cmd = [sys.executable, "-m", "blockforge.compile.isolate", str(path)]
    mode = "--tvm" if tvm else ("--prepare" if prepare else ("--sizes" if sizes else None))
    if mode:
        cmd += [mode, "--request", json.dumps(request or {})]
    what = "TVM's importer" if tvm else ("prepare (constant folding)" if prepare else "the ONNX parser/checker")
    _run_checked(path, cmd, what, "import" if tvm else ("prepare" if prepare else "load"), timeout)


def run_ort(path: str | Path, model, inputs: dict, device: str = "cpu") -> dict:
    """ONNX Runtime's outputs for the model at `path` (= `model`, as loaded), run in a child
    process under the memory limit: the model is untrusted, and ORT's session setup folds
    constants and its run allocates whatever the graph asks for."""
    from blockforge.graph import ort as ort_runner

    if not settings.isolate():
        return ort_runner.run(model, inputs, device=device)
    import numpy as np

    path = Path(path)
    with tempfile.TemporaryDirectory(prefix="blockforge-ort-") as d:
        np.savez(Path(d) / "in.npz", **inputs)
        cmd = [sys.executable, "-m", "blockforge.compile.isolate", str(path), "--ort", d, "--device", device]
        # no time limit: the run is the work itself (it had none in-process either)
        _run_checked(path, cmd, "ONNX Runtime", "run in ONNX Runtime", timeout=float("inf"))
        try:
            names = json.loads((Path(d) / "names.json").read_text())
            with np.load(Path(d) / "out.npz", allow_pickle=False) as z:
                return {name: z[f"o{i}"] for i, name in enumerate(names)}
        except (OSError, ValueError, KeyError) as e:
            raise BlockforgeError(f"{path}: ONNX Runtime's outputs could not be read back "
                                  f"from its child process: {e}") from None


def load_untrusted(path: str | Path, *, tvm: bool = False, prepare: bool = False, sizes: bool = False,
                   request: dict | None = None):
    """probe() then load in-process; returns the checked ModelProto. `request`: open_model's
    dims/input_shapes/default_dims/static, as the child needs them to prepare and import.
    sizes: the size check (see probe) for verbs that do not prepare; the parent skips it
    when the child made it (its shape inference is part of what is bounded)."""
    from blockforge.graph.model_io import load_model

    probe(Path(path), tvm=tvm, prepare=prepare, sizes=sizes, request=request)
    model = load_model(path)
    if sizes and not settings.isolate():
        _check_sizes(model, str(path), request or {})
    return model


def _check_sizes(model, label: str, request: dict) -> None:
    from .prepare import check_sizes
    from .session import bind_request

    check_sizes(model, bind_request(model, **request), label)


def _limit_memory() -> None:
    """RLIMIT_DATA, not RLIMIT_AS: it counts what is written (heap, anonymous mappings), not
    the address space TVM/LLVM, ONNX Runtime and CUDA reserve or the libraries mapped (a
    TVM import of a tiny export: 0.23 GiB data, 0.67 GiB address space). An allocation
    past it fails at once (MemoryError, std::bad_alloc) instead of filling the machine."""
    import resource

    limit = settings.memory_limit_bytes()
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))


def _run_ort(model, folder: Path, device: str) -> None:
    import numpy as np

    from blockforge.graph import ort as ort_runner

    with np.load(folder / "in.npz", allow_pickle=False) as z:
        inputs = {k: z[k] for k in z.files}
    outs = ort_runner.run(model, inputs, device=device)
    np.savez(folder / "out.npz", **{f"o{i}": v for i, v in enumerate(outs.values())})
    (folder / "names.json").write_text(json.dumps(list(outs)))


def _main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tvm", action="store_true")
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--sizes", action="store_true")
    ap.add_argument("--request", default="{}")
    ap.add_argument("--ort", default=None, help="folder: run in ONNX Runtime, in.npz -> out.npz + names.json")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args(argv)
    _limit_memory()
    from blockforge.graph.model_io import load_model

    try:
        model = load_model(a.model)
        if a.ort:
            _run_ort(model, Path(a.ort), a.device)
        elif a.sizes:
            _check_sizes(model, a.model, json.loads(a.request))
        elif a.tvm or a.prepare:
            from .frontend import bound_signature
            from .prepare import prepare
            from .session import bind_request, import_prepared

            dims = bind_request(model, **json.loads(a.request))
            prepared, _ = prepare(model, dims, a.model)
            if a.tvm:
                import_prepared(prepared, bound_signature(model, dims)[0])  # output captured by the parent
    except BlockforgeError as e:
        print(str(e))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
