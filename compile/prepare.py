"""`prepare`: the ONNX-level phase before TVM's import. Bind dims, infer shapes, fold the
shape arithmetic that exporters write, so TVM's from_onnx sees static shapes.

    bind dims -> ONNX shape inference -> fold constants and shape arithmetic (onnxslim)
              -> graph inputs/outputs restored to the original's -> ONNX checker

Why: PyTorch exports compute reshape targets at run time (Shape -> Gather -> Concat ->
Reshape, Expand of masks): TVM's from_onnx refuses them ("Reshape expects the input tensor
to have known shape", "broadcast_to expects the input shape to have ... ndim"). Measured on
the 19 tiny exports of tests/fixtures/models (BERT, DistilBERT, RoBERTa, GPT-2, ViT; dynamo
and legacy exporters; opsets 17/18), dims bound (batch 1, seq 16), how many TVM imports:

    nothing (bound + shape inference only)              4 / 19  (only the ViTs)
    ONNX Runtime offline, ORT_ENABLE_BASIC             11 / 19  (the 8 BERT/RoBERTa models: ORT
                                                                 cannot load its own saved output,
                                                                 "AddInitializedOrtValue Attempt to
                                                                 replace the existing tensor")
    onnxscript.optimizer.optimize                      11 / 19  (the 8 legacy BERT/DistilBERT/
                                                                 RoBERTa/GPT-2 exports keep Shape/
                                                                 Expand chains TVM rejects)
    onnxslim, default (with its pattern fusions)       19 / 19
    onnxslim, fusions and weight tying skipped         19 / 19  <- chosen

Every prepared model matched the original in ONNX Runtime (max abs diff <= 7.2e-7, float32).
onnxslim is chosen with its graph fusions off (Conv+BN, MatMul+Add -> Gemm, Gelu, ...):
the fusions are not needed for import, and each is one more rewrite that could change a
model's numerics or produce an op TVM handles worse; what stays is constant folding, shape
inference, dead-node and common-subexpression elimination. Prepare took 0.1-1.5 s per tiny
model on a shared 2-core machine.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field

import onnx

from blockforge.errors import BlockforgeError, error_line
from blockforge.graph.model_io import bind_dims, check_model

# Skipped onnxslim optimizations (see the module docstring for the measurement).
SKIPPED = ("graph_fusion", "weight_tying")
# Nodes whose presence after prepare means shape arithmetic is still computed at run time.
SHAPE_OPS = ("Shape", "Size")

_log = logging.getLogger("blockforge.prepare")


@dataclass
class PrepareReport:
    dims: dict[str, int]
    tool: str
    nodes_before: int
    nodes_after: int
    shape_ops_before: int
    shape_ops_after: int
    seconds: float
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _shape_ops(model: onnx.ModelProto) -> int:
    return sum(1 for n in model.graph.node if n.op_type in SHAPE_OPS)


def _slim(model: onnx.ModelProto) -> onnx.ModelProto:
    import onnxslim

    return onnxslim.slim(model, skip_optimizations=list(SKIPPED))


def _tool() -> str:
    try:
        from importlib.metadata import version

        return f"onnxslim {version('onnxslim')}"
    except Exception:
        return "onnxslim"


def _restore_interface(prepared: onnx.ModelProto, bound: onnx.ModelProto) -> None:
    """The compiled function takes the original model's inputs, in the original order, even
    where folding made one unused (dead-node elimination drops unused graph inputs); the
    outputs must be the original's, in order."""
    inits = {t.name for t in prepared.graph.initializer}
    have = {vi.name: vi for vi in prepared.graph.input}
    want = [vi for vi in bound.graph.input if vi.name not in {t.name for t in bound.graph.initializer}]
    ordered = [have.get(vi.name, vi) for vi in want]
    rest = [vi for vi in prepared.graph.input if vi.name not in {v.name for v in want} and vi.name in inits]
    new_inputs = [onnx.ValueInfoProto() for _ in ordered + rest]
    for dst, src in zip(new_inputs, ordered + rest):
        dst.CopyFrom(src)
    del prepared.graph.input[:]
    prepared.graph.input.extend(new_inputs)
    got = [o.name for o in prepared.graph.output]
    expect = [o.name for o in bound.graph.output]
    if got != expect:
        raise BlockforgeError(f"prepare changed the model's outputs ({expect} -> {got})")


def prepare(model: onnx.ModelProto, dims: dict[str, int]) -> tuple[onnx.ModelProto, PrepareReport]:
    """A copy of `model` with `dims` bound and its constant/shape arithmetic folded.

    `dims` are resolved symbolic dim names (model_io.resolve_dims); dims left unbound stay
    symbolic and are folded as far as shape inference can see. A folding failure is not
    fatal: the bound, shape-inferred model is returned and the report says why."""
    t0 = time.perf_counter()
    before = len(model.graph.node), _shape_ops(model)
    bound = bind_dims(model, dims, strict=False)
    if bound is model:
        bound = onnx.ModelProto()
        bound.CopyFrom(model)
    del bound.graph.value_info[:]  # the exporter's, at symbolic dims: recomputed below
    try:
        inferred = onnx.shape_inference.infer_shapes(bound, strict_mode=False, data_prop=True)
    except Exception as e:
        raise BlockforgeError(f"ONNX shape inference fails on this model at dims {dims}: {error_line(e)}") from None
    notes = []
    try:
        prepared = _slim(inferred)
        _restore_interface(prepared, bound)
        check_model(prepared, "the prepared model")
    except Exception as e:  # folding is an optimisation: import the unfolded model instead
        notes.append(f"folding failed ({error_line(e)}); importing the model unfolded")
        _log.warning("prepare: %s", notes[-1])
        prepared = inferred
    report = PrepareReport(dict(dims), _tool(), before[0], len(prepared.graph.node), before[1],
                           _shape_ops(prepared), round(time.perf_counter() - t0, 3), notes)
    return prepared, report

