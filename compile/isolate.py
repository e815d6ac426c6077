"""Untrusted models are parsed, checked and imported by TVM in a child process first.

The ONNX checker and TVM's importer are native code; a malformed model that crashes or
hangs them must not take down a long job (a tuning run, a service). The child loads,
checks, binds and prepares the model once and hands back what it made (prepare_untrusted):
the parent reads the prepared model and its binding instead of redoing them. A crash
(signal) or a hang (time limit) becomes one clear error.

    python -m blockforge.compile.isolate MODEL.onnx (--sizes | --prepare | --tvm) --request JSON --out DIR
    python -m blockforge.compile.isolate MODEL.onnx --ort FOLDER [--device cpu|cuda]

--sizes: bind the request (the shape, input shapes, defaults) and refuse the sizes folding
would materialise (prepare.check_sizes); --prepare: also run prepare (compile/frontend/prepare.py:
its constant folding evaluates subgraphs natively); --tvm: prepare and TVM's import, the
whole prelude. DIR gets result.json (the binding, prepare's report) and prepared.onnx with
its weights as external data (the parent's importer reads them a tensor at a time: the
model is never held twice). --ort FOLDER: run the model in ONNX Runtime on FOLDER/in.npz
(verify's reference run).

The child's data memory is limited (settings.memory_limit_bytes(), RLIMIT_DATA): a model
that needs more ends in "the model needs more than N GiB to ..." instead of taking the
machine's memory; so does a child the kernel's OOM killer ended.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from typing import Callable

from blockforge import settings
from blockforge.errors import ArgumentError, BlockforgeError, raise_if_stopped

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


def _run_child(cmd: list[str], timeout: float, meanwhile: Callable[[], None] | None = None) -> _Child:
    """Run an isolation child (it limits its own memory: _limit_memory), wait for it with
    os.wait4 to learn its peak RSS, kill it past `timeout` (subprocess.TimeoutExpired).
    Output goes to files, not pipes: a chatty child cannot block on a full pipe.
    meanwhile: the parent's own work, run while the child works; if it raises, the child is
    killed and its verdict never asked for."""
    env = {**os.environ, settings.ISOLATE: "0"}  # the child trusts itself
    ooms = settings.cgroup_oom_kills()
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env)
        try:
            if meanwhile is not None:
                meanwhile()
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
# A C extension whose malloc failed and that returned NULL without raising: CPython reports
# it as this SystemError (seen from TVM's importer under a 0.1 GiB limit, 1 run in ~3). Read
# as memory only when the child had used most of the limit, so a real bug keeps its message.
_NULL_RETURN = "SystemError: error return without exception set"


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
    text = "\n".join(reason)
    near_limit = c.peak_rss >= 0.5 * settings.memory_limit_bytes()
    if c.rc != 0 and (_NO_MEMORY.search(text) or (_NULL_RETURN in text and near_limit)):
        return BlockforgeError(f"{path}: the model needs more than {limit:.1f} GiB to {verb} "
                               f"(the memory limit, {settings.MEMORY_LIMIT}); refusing it")
    return None


# The child's last stdout line for an ArgumentError: its template and arguments as JSON.
_ARGUMENT_ERROR = "blockforge-argument-error: "


def _run_checked(path: Path, cmd: list[str], what: str, verb: str, timeout: float | None = None,
                 meanwhile: Callable[[], None] | None = None) -> _Child:
    """_run_child, every way it can fail as one BlockforgeError: `what` failed, `verb` the
    memory message's."""
    timeout = timeout or settings.isolate_timeout_s()
    try:
        c = _run_child(cmd, timeout, meanwhile)
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
        if lines and lines[-1].startswith(_ARGUMENT_ERROR):  # crosses as data: the CLI names its flags
            try:
                raise ArgumentError.from_dict(json.loads(lines[-1][len(_ARGUMENT_ERROR):]))
            except (ValueError, KeyError, TypeError):
                lines = lines[:-1]
        raise BlockforgeError(lines[-1] if lines else f"{path}: rejected")
    if c.rc != 0:
        # An exception the child did not expect: its last line is the reason (TVM puts it last).
        tail = [ln.strip() for ln in (c.stderr or "").splitlines() if ln.strip()]
        reason = f": {tail[-1][:300]}" if tail else ""
        raise BlockforgeError(f"{path}: {what} failed in a child process (exit {c.rc}){reason}")
    return c


def run_ort(path: str | Path, model, inputs: dict, device: str = "cpu", optimize: bool = True) -> dict:
    """ONNX Runtime's outputs for the model at `path` (= `model`, as loaded), run in a child
    process under the memory limit: the model is untrusted, and ORT's session setup folds
    constants and its run allocates whatever the graph asks for. optimize False: its graph
    optimizations off (graph/ort.py session)."""
    from blockforge.graph import ort as ort_runner

    if not settings.isolate():
        return ort_runner.run(model, inputs, device=device, optimize=optimize)
    import numpy as np

    path = Path(path)
    with tempfile.TemporaryDirectory(prefix="blockforge-ort-") as d:
        np.savez(Path(d) / "in.npz", **inputs)
        cmd = [sys.executable, "-m", "blockforge.compile.isolate", str(path), "--ort", d, "--device", device]
        cmd += [] if optimize else ["--as-written"]
        # no time limit: the run is the work itself (it had none in-process either)
        _run_checked(path, cmd, "ONNX Runtime", "run in ONNX Runtime", timeout=float("inf"))
        try:
            names = json.loads((Path(d) / "names.json").read_text())
            with np.load(Path(d) / "out.npz", allow_pickle=False) as z:
                return {name: z[f"o{i}"] for i, name in enumerate(names)}
        except (OSError, ValueError, KeyError) as e:
            raise BlockforgeError(f"{path}: ONNX Runtime's outputs could not be read back "
                                  f"from its child process: {e}") from None


@dataclass
class Prepared:
    """What the prelude's child hands back: the binding, and (unless only sizes were
    checked) the prepared model and its report. The prepared model's weights stay in
    `weights_dir` (ONNX external data, read by the importer a tensor at a time), which
    lives as long as this object (`_dir`)."""
    binding: "Binding"
    model: "onnx.ModelProto | None" = None
    report: "PrepareReport | None" = None
    weights_dir: Path | None = None
    _dir: object = None  # the TemporaryDirectory holding weights_dir


def prepare_untrusted(path: str | Path, request: dict, *, mode: str = "tvm",
                      meanwhile: Callable[[], None] | None = None) -> Prepared:
    """Load, check, bind and (mode "prepare"/"tvm") prepare the model once, in a child
    process when isolation is on; mode "tvm" also imports it into TVM there (whether it
    imports is part of what is checked), "sizes" only binds and refuses a tensor folding
    would make above the size cap. The child writes what it made (PREPARED, RESULT) and
    the parent reads it back instead of doing it again.

    request: the ShapeRequest as a dict (`shape`), input_shapes, defaults, static.
    meanwhile: the caller's work that does not need the model (session: the target, and
    TVM's import), run while the child works and before its verdict is read, so an error
    it raises comes first; isolation off, it runs first."""
    if not settings.isolate():
        if meanwhile is not None:
            meanwhile()
        return _prepare(Path(path), str(path), request, mode, out=None)
    out = tempfile.TemporaryDirectory(prefix="blockforge-prepared-")
    try:
        cmd = [sys.executable, "-m", "blockforge.compile.isolate", str(path), f"--{mode}",
               "--request", json.dumps(request), "--out", out.name]
        what = {"tvm": "TVM's importer", "prepare": "prepare (constant folding)"}.get(mode, "the ONNX parser/checker")
        _run_checked(Path(path), cmd, what, {"tvm": "import", "prepare": "prepare"}.get(mode, "load"),
                     meanwhile=meanwhile)
        got = _read_back(Path(out.name), str(path))
    except BaseException:
        out.cleanup()
        raise
    if got.model is None:
        out.cleanup()
    else:
        got._dir = out
    return got


PREPARED, RESULT = "prepared.onnx", "result.json"


def _prepare(path: Path, label: str, request: dict, mode: str, out: Path | None) -> Prepared:
    """The prelude's work, once: in the child (out: the folder it hands back through) or,
    isolation off, in-process (out None: nothing written, the weights stay in memory)."""
    from blockforge.graph.model_io import check_model, load_model, signature
    from blockforge.graph.shape import Binding, ShapeRequest

    from blockforge.compile.frontend.prepare import check_sizes, prepare

    model = load_model(path, check=out is None)
    if out is not None:
        # Weights out of the proto before anything copies it (the checker serializes the
        # model, bind/shape inference/onnxslim copy it): every later copy is of the graph only.
        model = externalize(model, out, "weights.bin")
        os.chdir(out)  # this child's: onnxslim and the checker resolve external data from here
        check_model(model, label)
    ins, outs = signature(model)
    binding = Binding.resolve(ins, outs, ShapeRequest.of(request.get("shape")), input_shapes=request.get("input_shapes"),
                              defaults=request.get("defaults"), static=bool(request.get("static")))
    from blockforge.compile.decode.inputs import check_decoder_binding, mask_bound

    pairing = check_decoder_binding(ins, outs, binding.as_dict(), "inputs" if request.get("input_shapes") else "shape")
    derived = mask_bound(ins, pairing, binding.bounds_dict())
    if derived:
        binding = dataclasses.replace(binding, bounds=(*binding.bounds, *derived.items()))
    if mode == "sizes":
        check_sizes(model, binding.as_dict(), label)
        return Prepared(binding)
    prepared, report = prepare(model, binding.as_dict(), label)
    del model
    if mode == "tvm" and out is not None:  # in-process, the caller's import is the check
        from blockforge.compile.session import import_prepared

        import_prepared(prepared, binding, out)  # output captured by the parent
    return Prepared(binding, prepared, report, out)


def externalize(model, folder: Path, location: str):
    """`model` with every tensor over 1 KiB written to folder/location (ONNX external data)
    and a fresh proto of the rest: the weights' bytes leave memory (a protobuf message keeps
    its arena until it is freed whole, so clearing fields would not)."""
    import onnx
    from onnx import external_data_helper as edh

    edh.convert_model_to_external_data(model, all_tensors_to_one_file=True, location=location, size_threshold=1024)
    edh.write_external_data_tensors(model, str(folder))
    light = onnx.ModelProto()
    light.ParseFromString(model.SerializeToString())
    return light


def _write_back(p: Prepared, out: Path) -> None:
    if p.model is not None:
        light = externalize(p.model, out, "prepared.bin")
        (out / PREPARED).write_bytes(light.SerializeToString())
    (out / RESULT).write_text(json.dumps({"binding": p.binding.to_dict(),
                                          "report": p.report.to_dict() if p.report else None}))


def _read_back(folder: Path, label: str) -> Prepared:
    """The child's result. Its folder is ours, but the child worked on an untrusted model:
    the JSON is validated, and external tensors are read only from regular files inside the
    folder (model_io.load_model's policy), sizes checked when the importer reads them."""
    from blockforge.graph.model_io import load_model
    from blockforge.graph.shape import Binding

    from blockforge.compile.frontend.prepare import PrepareReport

    try:
        doc = json.loads((folder / RESULT).read_text())
        binding = Binding.from_dict(doc["binding"])
        report = PrepareReport(**doc["report"]) if doc.get("report") else None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BlockforgeError(f"{label}: the child process's result could not be read back: {e}") from None
    if report is None:
        return Prepared(binding)
    model = load_model(folder / PREPARED, check=False, external_data=False)  # the child checked it
    return Prepared(binding, model, report, folder)


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


def _run_ort(model, folder: Path, device: str, optimize: bool = True) -> None:
    import numpy as np

    from blockforge.graph import ort as ort_runner

    with np.load(folder / "in.npz", allow_pickle=False) as z:
        inputs = {k: z[k] for k in z.files}
    outs = ort_runner.run(model, inputs, device=device, optimize=optimize)
    np.savez(folder / "out.npz", **{f"o{i}": v for i, v in enumerate(outs.values())})
    (folder / "names.json").write_text(json.dumps(list(outs)))


def _main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tvm", action="store_true")
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--sizes", action="store_true")
    ap.add_argument("--request", default="{}")
    ap.add_argument("--out", default=None, help="folder: what the child made, for the parent (_read_back)")
    ap.add_argument("--ort", default=None, help="folder: run in ONNX Runtime, in.npz -> out.npz + names.json")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--as-written", action="store_true", help="with --ort: ORT's graph optimizations off")
    a = ap.parse_args(argv)
    _limit_memory()
    try:
        if a.ort:
            from blockforge.graph.model_io import load_model

            _run_ort(load_model(a.model), Path(a.ort), a.device, optimize=not a.as_written)
        else:
            mode = "tvm" if a.tvm else ("prepare" if a.prepare else "sizes")
            out = Path(a.out).resolve()
            _write_back(_prepare(Path(a.model), a.model, json.loads(a.request), mode, out), out)
    except ArgumentError as e:
        print(str(e))
        print(_ARGUMENT_ERROR + json.dumps(e.to_dict()))
        return 2
    except BlockforgeError as e:
        print(str(e))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
