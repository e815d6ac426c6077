"""The prelude every verb shares: one entry from a model path to a buildable model.

    resolve target -> can it build here? -> isolated load + check -> bind dims -> import (once)

`open_model()` returns a `Session`; `Session.relax()` imports the model into Relax the
first time it is asked and reuses that module for every later build (compile, verify,
bench's untuned/tuned contenders, tune's A/B builds), instead of re-importing per build.
Relax passes are functional (they return new modules), so reuse is safe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import onnx

from blockforge.errors import BlockforgeError
from blockforge.graph.model_io import TensorSig
from blockforge.logs import native_output_to_log
from blockforge.targets import ResolvedTarget, resolve

from .frontend import bound_signature, import_onnx
from .isolate import load_untrusted
from .pipeline import BuildResult, build


@dataclass
class Session:
    path: Path
    model: onnx.ModelProto  # as loaded and checked (dims not bound)
    dims: dict[str, int]
    target: ResolvedTarget
    inputs: list[TensorSig]  # the signature at the bound dims
    outputs: list[TensorSig]
    _relax: object = field(default=None, repr=False)

    def relax(self):
        """The imported Relax module (weights embedded), imported once."""
        if self._relax is None:
            with native_output_to_log():
                self._relax = import_onnx(self.model, self.dims)
        return self._relax

    def build(self, *, database=None, dump_ir: Path | None = None, default_schedules: bool = True) -> BuildResult:
        with native_output_to_log():
            return build(self.relax(), self.target, database=database, dump_ir=dump_ir,
                         default_schedules=default_schedules)


def open_model(model: str | Path, target: str | dict | ResolvedTarget = "host",
               dims: dict[str, int] | None = None, *, tvm_probe: bool = True) -> Session:
    """Resolve the target, check it can be built here, load the model (checked in a child
    process first: `tvm_probe` also runs TVM's importer there) and bind its dims."""
    t = target if isinstance(target, ResolvedTarget) else resolve(target)
    problem = t.build_problem()
    if problem:
        raise BlockforgeError(f"cannot build for {t.name}: {problem}")
    dims = dict(dims or {})
    proto = load_untrusted(model, tvm=tvm_probe, dims=dims)
    ins, outs = bound_signature(proto, dims)
    return Session(Path(model), proto, dims, t, ins, outs)
