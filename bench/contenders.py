"""Who runs the model in `bench`: one class per contender, in one registry.

    name        kind        what runs
    ort         peer        ONNX Runtime, the model as given
    ort-fused   peer        ONNX Runtime's fused transformer kernels, same math (bench/ort_fused.py)
    openvino    peer        OpenVINO's CPU plugin (extra `[peers]`), f32 precision, latency hint
    untuned     blockforge  TVM with blockforge's default schedules, no records
    tuned       blockforge  TVM with the device's tuning records (those vouched for on this CPU)

Every contender gets the model with its dims bound (the static shapes TVM compiles for) and
the same thread count. A contender that is not installed (`available()`), or cannot take
the model (`make_runner` raises Unavailable), is skipped with a note by the harness.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from blockforge.errors import error_line
from blockforge.graph import Spec
from blockforge.graph import ort as ort_runner
from blockforge.compile.records.reader import open_for_apply, unvalidated_warning
from blockforge.compile.artifact.runtime import run_vm, tvm_device
from blockforge.compile.session import Session


class Unavailable(Exception):
    """This contender cannot take this model; the message says why (a bench note)."""


@dataclass
class BenchModel:
    """What contenders build from: blockforge's session and the ONNX model, dims bound."""
    session: Session  # the checked model and its Relax import (TVM contenders build from it)
    onnx: onnx.ModelProto  # dims bound
    spec: Spec | None  # blockforge's spec from the model's metadata, or None for foreign models
    dims: dict[str, int]
    tuning_db: Path | None = None
    notes: list[str] = field(default_factory=list)  # what contenders want said in the report


class Runner:
    """A prepared contender: call it to run once (timed); outputs() gives every output, in
    the model's order (the harness checks them all before timing)."""

    def __call__(self) -> None:
        raise NotImplementedError

    def outputs(self) -> list[np.ndarray]:
        raise NotImplementedError


class Contender:
    name = ""
    peer = True  # not blockforge: the ratio-to-best-peer headline compares against these
    install = ""  # how to get it, where available() can be False

    def available(self) -> bool:
        return True

    def make_runner(self, model: BenchModel, inputs: dict[str, np.ndarray], threads: int) -> Runner:
        raise NotImplementedError


# ---------------------------------------------------------------- peers

class _OrtRunner(Runner):
    def __init__(self, model: onnx.ModelProto, inputs: dict, threads: int):
        self.sess = ort_runner.session(model, threads=threads)  # BlockforgeError when ORT refuses it
        names = {i.name for i in self.sess.get_inputs()}
        self.feed = {k: v for k, v in inputs.items() if k in names}

    def __call__(self) -> None:
        self.sess.run(None, self.feed)

    def outputs(self) -> list[np.ndarray]:
        return list(self.sess.run(None, self.feed))


class Ort(Contender):
    name = "ort"

    def make_runner(self, model, inputs, threads):
        return _OrtRunner(model.onnx, inputs, threads)


class OrtFused(Contender):
    name = "ort-fused"
    install = "pip install 'blockforge[peers]' (sympy, for ORT's transformer optimizer)"

    def make_runner(self, model, inputs, threads):
        from .ort_fused import NotFusable, fused_model

        try:
            fused, how = fused_model(model.onnx, model.spec, model.dims)
        except NotFusable as e:
            raise Unavailable(str(e)) from None
        model.notes.append(f"ort-fused: {how}")
        return _OrtRunner(fused, inputs, threads)


OPENVINO_PRECISION = {"bf16": "bf16"}  # blockforge's precision -> OpenVINO's hint


class _OpenVinoRunner(Runner):
    def __init__(self, model: onnx.ModelProto, inputs: dict, threads: int, precision: str = "f32"):
        import openvino as ov

        core = ov.Core()
        # f32: OpenVINO would otherwise pick bf16 on CPUs that have it (not the same math;
        # benchmarks/bf16_gemm.py asks for it against --precision bf16);
        # the latency hint runs one request on one stream, like the other contenders.
        config = {"INFERENCE_PRECISION_HINT": precision, "INFERENCE_NUM_THREADS": int(threads),
                  "PERFORMANCE_HINT": "LATENCY"}
        self.compiled = core.compile_model(core.read_model(model.SerializeToString()), "CPU", config)
        self.req = self.compiled.create_infer_request()
        names = {n for i in self.compiled.inputs for n in i.get_names()}
        self.feed = {k: np.ascontiguousarray(v) for k, v in inputs.items() if k in names}

    def __call__(self) -> None:
        # Shared buffers: no copy in or out, as ORT and TVM get.
        self.req.infer(self.feed, share_inputs=True, share_outputs=True)

    def outputs(self) -> list[np.ndarray]:
        self()
        return [np.array(self.req.get_output_tensor(i).data, copy=True) for i in range(len(self.compiled.outputs))]


class OpenVino(Contender):
    name = "openvino"
    install = "pip install 'blockforge[peers]'"

    def available(self) -> bool:
        from importlib.util import find_spec

        return find_spec("openvino") is not None

    def make_runner(self, model, inputs, threads, precision: str | None = None):
        """precision: OpenVINO's INFERENCE_PRECISION_HINT ("f32", "bf16"); None: the one
        matching the session's (`bench --precision bf16`: OpenVINO's bf16)."""
        return _OpenVinoRunner(model.onnx, inputs, threads,
                               precision or OPENVINO_PRECISION.get(model.session.precision.name, "f32"))


# ---------------------------------------------------------------- blockforge

class TvmRunner(Runner):
    def __init__(self, executable, device_kind: str, ins, outs, inputs):
        import tvm
        from tvm import relax

        self.dev = tvm_device(device_kind)
        self.vm = relax.VirtualMachine(executable, self.dev)
        self.ins, self.outs, self.inputs = ins, outs, inputs
        self.args = [tvm.runtime.tensor(np.ascontiguousarray(inputs[s.name]), self.dev) for s in ins]
        self.fn = self.vm["main"]

    def __call__(self) -> None:
        self.fn(*self.args)
        self.dev.sync()

    def outputs(self) -> list[np.ndarray]:
        # as `run` gets them: count, dtypes and shapes checked against the signature
        return list(run_vm(self.vm, self.dev, self.ins, self.outs, self.inputs).values())


class Untuned(Contender):
    name = "untuned"
    peer = False

    def make_runner(self, model, inputs, threads):
        s = model.session
        return TvmRunner(s.build().executable, s.target.device, s.inputs, s.outputs, inputs)


class Tuned(Contender):
    name = "tuned"
    peer = False

    def make_runner(self, model, inputs, threads):
        s = model.session
        db, info = open_for_apply(s.target, model.tuning_db)
        model.notes.extend(f"tuned: {line}" for line in (info or {}).get("refused", []))
        if db is None:
            raise Unavailable("no tuning records for this device (run `blockforge tune`)")
        res = s.build(database=db)
        skipped = [t for t in res.untuned_tasks if t in info["unvalidated"]]
        line = unvalidated_warning(info, skipped, s.target.name)
        if line:
            model.notes.append(f"tuned: {line}")
        missing = [t for t in res.untuned_tasks if t not in info["unvalidated"]]
        if missing:
            model.notes.append(f"tuned: {len(missing)} of {res.tasks} tasks have no applicable record "
                               "(default schedules used for them)")
        return TvmRunner(res.executable, s.target.device, s.inputs, s.outputs, inputs)


REGISTRY: dict[str, Contender] = {c.name: c for c in (Ort(), OrtFused(), OpenVino(), Untuned(), Tuned())}
CONTENDERS = tuple(REGISTRY)
PEERS = tuple(n for n, c in REGISTRY.items() if c.peer)


def skip_note(name: str, why: str) -> str:
    return f"{name}: {why}; skipped"


def peer_failure(e: Exception) -> str:
    """A peer engine's own exception as one line (their messages run to pages)."""
    return f"cannot take this model: {error_line(e)[:300]}"
