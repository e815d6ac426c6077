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

from blockforge import settings
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
    """onnxslim's folding of `model`, its externally stored initializers kept out of reach.

    onnxslim mishandles tensors stored as ONNX external data (the isolation child stores
    every tensor over 1 KiB so, a user's model may too): one it touches comes back with
    both raw_data and the external flag, or with its location dropped, the checker refuses
    the result and the model was imported unfolded (BERT-base from the dynamo exporter then
    failed: a Reshape whose shape only folding computes). So they are graph inputs of their
    static shape while onnxslim runs (shape arithmetic on them still folds: their shapes are
    known) and initializers again after, the original references untouched."""
    import onnxslim

    g = model.graph
    external = [t for t in g.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    if not external:
        return onnxslim.slim(model, skip_optimizations=list(SKIPPED))
    listed = {vi.name for vi in g.input}  # IR < 4 models list initializers as inputs too
    hidden = {t.name for t in external}
    light = onnx.ModelProto()
    light.CopyFrom(model)  # the references only: the bytes are in the external file
    kept = [t for t in light.graph.initializer if t.name not in hidden]
    del light.graph.initializer[:]
    light.graph.initializer.extend(kept)
    light.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                             for t in external if t.name not in listed)
    slim = onnxslim.slim(light, skip_optimizations=list(SKIPPED))
    used = {i for n in _all_nodes(slim.graph) for i in n.input} | {o.name for o in slim.graph.output}
    inputs = [vi for vi in slim.graph.input if vi.name not in hidden or vi.name in listed]
    del slim.graph.input[:]
    slim.graph.input.extend(inputs)
    slim.graph.initializer.extend(t for t in external if t.name in used)
    return slim


def _all_nodes(graph: onnx.GraphProto):
    """Every node of `graph` and of its subgraphs (If/Loop/Scan bodies read outer names)."""
    for n in graph.node:
        yield n
        for a in n.attribute:
            for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                yield from _all_nodes(sub)


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


# Ops never folded: their value is not a function of their inputs.
_NOT_FOLDED = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}


# Elements of 1-D values ONNX's data propagation may compute (it carries each as a list of
# dims, ~64 bytes an element, copied at every Cast/Add/...: 20 Casts of a 1M-element Range
# took 1.5 GB and 5 s). Shape arithmetic needs a few dozen; past this, inference runs without.
DATA_PROP_MAX = 1 << 20


def _infer(bound: onnx.ModelProto, dims: dict[str, int], data_prop: bool) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(bound, strict_mode=False, data_prop=data_prop)
    except Exception as e:
        raise BlockforgeError(f"ONNX shape inference fails on this model at dims {dims}: {error_line(e)}") from None


def _bound_inferred(model: onnx.ModelProto, dims: dict[str, int],
                    label: str = "model") -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """(bound, shape-inferred bound) copies of `model` at `dims`, its sizes checked
    (_check_folded) before and after data propagation, which computes values."""
    bound = bind_dims(model, dims, strict=False)
    if bound is model:
        bound = onnx.ModelProto()
        bound.CopyFrom(model)
    del bound.graph.value_info[:]  # the exporter's, at symbolic dims: recomputed below
    plain = _infer(bound, dims, data_prop=False)  # shapes only: nothing is computed
    if _check_folded(plain, dims, label) > DATA_PROP_MAX:
        _log.warning("prepare: 1-D values of over %d elements: shape inference without data propagation",
                     DATA_PROP_MAX)
        return bound, plain
    inferred = _infer(bound, dims, data_prop=True)
    _check_folded(inferred, dims, label)  # sizes data propagation found (Shape arithmetic)
    return bound, inferred


def _elements(dims) -> int:
    n = 1
    for d in dims:
        n *= max(int(d), 0)  # Python ints: a bomb's 2**64 elements do not overflow
    return n


def _itemsize(elem_type: int) -> int:
    try:
        return onnx.helper.tensor_dtype_to_np_dtype(elem_type).itemsize
    except (KeyError, TypeError, ValueError):
        return 1


def _human(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 // 10 else f"{nbytes / 2**20:.1f} MiB"


def _nbytes(vi: onnx.ValueInfoProto) -> int | None:
    """Bytes of a tensor whose shape inference found every dim; None when not all known."""
    tt = vi.type.tensor_type
    if not tt.HasField("shape") or not all(d.HasField("dim_value") for d in tt.shape.dim):
        return None
    return _elements([d.dim_value for d in tt.shape.dim]) * _itemsize(tt.elem_type)


# Folded tensors in all may take the size cap plus this many times the model's own weights
# (exports Cast or Transpose weights: 1-2x); the folders keep every folded value alive
# (onnxslim: 120 Casts of a 1M-element Range, 8 MiB each, took 2.1 GB and 2.6 s).
FOLDED_PER_WEIGHT = 4


def _check_folded(inferred: onnx.ModelProto, dims: dict[str, int], label: str = "model") -> int:
    """Refuse a model that would materialise a tensor above settings.max_tensor_bytes() at
    compile time, before anything is allocated.

    A node whose inputs are all constants (initializers, Constant, Shape of a static tensor)
    is folded: by onnxslim here, by ONNX Runtime's session setup, by TVM's FoldConstant.
    ConstantOfShape/Expand/Tile/Range turn a few bytes into any size: a 207-byte model asking
    for ConstantOfShape([32768, 32768]) float32 made compile peak at 4.5 GB. Shape inference on the
    bound model gives each output's size first. Many tensors each under the cap are refused
    too when together they pass the cap plus FOLDED_PER_WEIGHT x the model's weights.

    Returns the elements ONNX's data propagation may carry: the 1-D (or scalar) folded
    values and integer initializers of known size."""
    cap = settings.max_tensor_bytes()
    g = inferred.graph
    info = {vi.name: vi for vi in (*g.input, *g.value_info, *g.output)}
    const = {t.name for t in g.initializer}
    weights = sum(_elements(t.dims) * _itemsize(t.data_type) for t in g.initializer)
    ints = {onnx.TensorProto.INT64, onnx.TensorProto.INT32}
    propagated = sum(_elements(t.dims) for t in g.initializer if t.data_type in ints and len(t.dims) <= 1)
    total, largest = 0, (0, None)
    at = f" at dims {dims}" if dims else ""
    for n in g.node:
        ins = [i for i in n.input if i]
        static_shape = n.op_type in ("Shape", "Size") and ins and info.get(ins[0]) is not None \
            and _nbytes(info[ins[0]]) is not None
        if n.op_type in _NOT_FOLDED or not (n.op_type == "Constant" or static_shape or (ins and all(i in const for i in ins))):
            continue
        stored = n.op_type == "Constant" and any(a.name == "value" for a in n.attribute)
        for o in n.output:
            size = _nbytes(info[o]) if o in info else None
            if stored:  # a dense Constant is weights the file holds (a sparse one is expanded: checked)
                weights += size or 0
                const.add(o)
                continue
            if size is not None and size > cap:
                raise BlockforgeError(
                    f"{label}: node '{n.name or o}' ({n.op_type}) would materialise a {_human(size)} "
                    f"tensor{at} (the limit is {_human(cap)}, {settings.MAX_TENSOR}); refusing it")
            total += size or 0
            largest = max(largest, (size or 0, n), key=lambda s: s[0])
            if size is not None and len(info[o].type.tensor_type.shape.dim) <= 1:
                propagated += size // _itemsize(info[o].type.tensor_type.elem_type)
            const.add(o)
    budget = cap + FOLDED_PER_WEIGHT * weights
    if total > budget:
        size, n = largest
        raise BlockforgeError(
            f"{label}: folding its constants would materialise {_human(total)}{at}, the largest "
            f"{_human(size)} at node '{n.name or n.output[0]}' ({n.op_type}) (the limit is "
            f"{_human(budget)}: {settings.MAX_TENSOR} plus {FOLDED_PER_WEIGHT}x the model's weights); refusing it")
    return propagated


def check_sizes(model: onnx.ModelProto, dims: dict[str, int], label: str = "model") -> None:
    """_check_folded() for a model not yet bound (verbs that do not prepare)."""
    _bound_inferred(model, dims, label)


def prepare(model: onnx.ModelProto, dims: dict[str, int], label: str = "model") -> tuple[onnx.ModelProto, PrepareReport]:
    """A copy of `model` with `dims` bound and its constant/shape arithmetic folded.

    `dims` are resolved symbolic dim names (model_io.resolve_dims); dims left unbound stay
    symbolic and are folded as far as shape inference can see. A folding failure is not
    fatal: the bound, shape-inferred model is returned and the report says why. A tensor
    folding would materialise above the size cap is (_check_folded; `label` names the model)."""
    from blockforge.compile.quant.forms import standard_forms

    t0 = time.perf_counter()
    before = len(model.graph.node), _shape_ops(model)
    notes = []
    model, forms = standard_forms(model)  # QLinearMatMul / QGemm / MatMulIntegerToFloat: ops TVM imports
    if forms:
        notes.append(f"{forms} QLinearMatMul/QGemm/MatMulIntegerToFloat node(s) rewritten as QDQ/MatMulInteger")
    bound, inferred = _bound_inferred(model, dims, label)
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

