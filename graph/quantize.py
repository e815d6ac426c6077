"""`quantize`: int8 models from float ones through onnxruntime.quantization (not a quantizer of
our own), with transformer-safe defaults.

    quant_pre_process (shape inference, ORT's basic fusions)
      -> dynamic: quantize_dynamic, QInt8 weights (DynamicQuantizeLinear + MatMulInteger)
      -> static:  quantize_static, QDQ, S8S8 or U8S8, calibrated (MinMax) on --calibration
                  batches or on random inputs drawn from the model's signature

What is quantized: MatMul (and Gemm in static mode): the GEMMs the int8 kernel runs; with
`bias_adds` (static), the bias Add right after each of them too (ORT's default op list has
Add): a requantize then sits before the activation, and the int8 kernel reads the activation
and the next quantize from a 256-entry table (compile/quant/gemm.py lut_tail), at one more
rounding step of error per GEMM. What
stays float, as Hugging Face Optimum's exclusions learned (ExcludeLayerNormNodes,
ExcludeGeLUNodes, ExcludeNodeAfter/FollowedBy for residual and mask Adds): LayerNorm, Softmax,
the Erf-Gelu chain and residual Adds; their error is not one rounding step but the
normalisation's amplification of it. The list is passed to ORT as nodes_to_exclude, so it
still holds if ORT's default op list grows.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnx

from blockforge.errors import ArgumentError, BlockforgeError, error_line
from blockforge.fsutil import Output, atomic_write_bytes, check_outputs, write_error

from .model_io import check_inputs, load_model, load_npz, random_inputs, resolve_dims, signature

MODES = ("dynamic", "static")
ACTIVATION_TYPES = ("s8", "u8")  # static: S8S8 (as issue #19 measured) or U8S8
QUANT_KEY = "blockforge.quantization"  # metadata: how the file was quantized (JSON)
RANDOM_BATCHES = 8
# Ops whose presence makes a model quantized (compared with ORT on the same file, not fp32).
QUANTIZED_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "MatMulInteger",
                           "QLinearMatMul", "MatMulIntegerToFloat", "QGemm", "ConvInteger", "QLinearConv",
                           "DynamicQuantizeMatMul", "QAttention"})
_GELU_CHAIN = ("Erf", "Gelu", "FastGelu", "BiasGelu")

_log = logging.getLogger("blockforge.quantize")


@dataclass
class QuantizeOptions:
    model: Path
    output: Path
    mode: str = "dynamic"  # "dynamic" | "static"
    calibration: Path | None = None  # static: .npz of inputs (one batch, or batches stacked on a new axis 0)
    per_channel: bool = False
    activation_type: str = "s8"  # static only
    shape: object = None  # random calibration: the shape request (graph/shape.ShapeRequest, a mapping or text)
    batches: int = RANDOM_BATCHES
    seed: int = 0
    force: bool = False
    # static: also the bias Add after each quantized MatMul/Gemm (constant other operand). BERT-base
    # FFN (blockforge export, seq 128 / 512, against OpenVINO on each file, two runs): 0.76-0.86x
    # against 0.86-0.90x; rel L2 against the float FFN 2.94e-2 against 2.44e-2 (ORT the same).
    bias_adds: bool = False
    # 7-bit weights ([-64, 63], ORT's reduce_range): what x86 without VNNI (Haswell to Ice Lake
    # clients, Skylake-SP, Zen 1-3) runs on VPMADDUBSW exactly; full-range weights could
    # saturate its int16 pair sums, so compile puts those on VPMADDWD (compile/quant/isa.py):
    # BERT-base FFN kernels 0.85x the speed; rel L2 against float 3.6e-2, not 2.2e-2 (dynamic).
    reduce_range: bool = False


@dataclass
class QuantizeResult:
    output: Path
    mode: str
    quantized_nodes: int  # MatMul/Gemm nodes ORT turned into int8 ones
    kept_float: dict[str, int]  # why -> how many nodes were excluded
    calibration: str  # where the calibration batches came from ("" for dynamic)
    notes: list[str] = field(default_factory=list)


def is_quantized(model: onnx.ModelProto) -> bool:
    return any(n.op_type in QUANTIZED_OPS for n in model.graph.node)


_INT8_GEMMS = frozenset({"MatMulInteger", "QLinearMatMul", "MatMulIntegerToFloat", "QGemm", "ConvInteger",
                         "QLinearConv", "DynamicQuantizeMatMul", "QAttention"})
_FLOAT_GEMMS = frozenset({"MatMul", "Gemm", "Conv"})  # quantized when fed by a DequantizeLinear (QDQ)


def quantized_depth(model: onnx.ModelProto) -> int:
    """The most quantized GEMMs on one path from the graph's inputs to an output: how many
    roundings a flip can pass through and grow (a MatMul/Gemm/Conv with a DequantizeLinear
    operand counts, as QDQ writes them). One BERT-base layer: 4 dynamic, 6 QDQ."""
    depth: dict[str, int] = {}
    producer = {o: n.op_type for n in model.graph.node for o in n.output}
    for n in model.graph.node:  # ONNX graphs are topologically sorted
        d = max((depth.get(i, 0) for i in n.input), default=0)
        if n.op_type in _INT8_GEMMS or (n.op_type in _FLOAT_GEMMS
                                        and any(producer.get(i) == "DequantizeLinear" for i in n.input)):
            d += 1
        for o in n.output:
            depth[o] = d
    return max((depth.get(o.name, 0) for o in model.graph.output), default=0)


def float_exclusions(model: onnx.ModelProto) -> dict[str, list[str]]:
    """Nodes kept in float, by reason (Optimum's exclusions): LayerNorm, Softmax, the Gelu/Erf
    chain (Erf and the Div/Add/Mul around it), residual Adds (both operands computed) and the
    Adds feeding a Softmax (masks)."""
    inits = {t.name for t in model.graph.initializer}
    consts = {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    producer = {o: n for n in model.graph.node for o in n.output}
    users: dict[str, list] = {}
    for n in model.graph.node:
        for i in n.input:
            users.setdefault(i, []).append(n)
    out: dict[str, list[str]] = {"layernorm": [], "softmax": [], "gelu": [], "residual add": [], "mask add": []}

    def computed(name: str) -> bool:
        return bool(name) and name not in inits and name not in consts

    for n in model.graph.node:
        name = n.name or n.output[0]
        if n.op_type in ("LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization"):
            out["layernorm"].append(name)
        elif n.op_type == "Softmax":
            out["softmax"].append(name)
        elif n.op_type in _GELU_CHAIN:
            out["gelu"].append(name)
            if n.op_type == "Erf":  # x/sqrt2 -> Erf -> +1 -> *x -> *0.5
                before = producer.get(n.input[0])
                chain = [before] if before is not None and before.op_type in ("Div", "Mul") else []
                nxt = users.get(n.output[0], [])
                while len(nxt) == 1 and nxt[0].op_type in ("Add", "Mul") and len(chain) < 4:
                    chain.append(nxt[0])
                    nxt = users.get(nxt[0].output[0], [])
                out["gelu"] += [c.name or c.output[0] for c in chain]
        elif n.op_type == "Add" and len(n.input) == 2:
            if any(u.op_type == "Softmax" for u in users.get(n.output[0], [])):
                out["mask add"].append(name)
            elif computed(n.input[0]) and computed(n.input[1]):
                out["residual add"].append(name)
    return {k: list(dict.fromkeys(v)) for k, v in out.items() if v}


def bias_adds(model: onnx.ModelProto) -> tuple[list[str], list[str]]:
    """(the bias Adds: an Add of a MatMul/Gemm output and a constant, the other Adds): what
    `bias_adds` quantizes, and what it keeps float besides float_exclusions (a decomposed
    LayerNorm's epsilon and beta Adds have a constant operand too, but no GEMM before them)."""
    consts = {t.name for t in model.graph.initializer} | \
        {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    producer = {o: n.op_type for n in model.graph.node for o in n.output}
    bias, other = [], []
    for n in model.graph.node:
        if n.op_type != "Add":
            continue
        ins = list(n.input)
        gemm_fed = len(ins) == 2 and any(producer.get(x) in ("MatMul", "Gemm") and y in consts
                                         for x, y in (ins, ins[::-1]))
        (bias if gemm_fed else other).append(n.name or n.output[0])
    return bias, other


def _calibration_batches(opts: QuantizeOptions, model: onnx.ModelProto) -> tuple[list[dict], str]:
    ins, _ = signature(model)
    if opts.calibration is not None:
        arrays = load_npz(opts.calibration)
        ranks = {s.name: len(s.dims) for s in ins}
        stacked = [k for k, v in arrays.items() if k in ranks and v.ndim == ranks[k] + 1]
        if stacked and len(stacked) != len(arrays):
            raise ArgumentError(f"{{calibration}} {opts.calibration}: either every array is one batch (the inputs' "
                                "ranks) or every array stacks batches on a new axis 0, not a mix", "calibration")
        if stacked:
            n = {v.shape[0] for v in arrays.values()}
            if len(n) != 1 or 0 in n:
                raise ArgumentError(f"{{calibration}} {opts.calibration}: the arrays stack different numbers of "
                                    f"batches ({', '.join(map(str, sorted(n)))})", "calibration")
            batches = [{k: np.ascontiguousarray(v[i]) for k, v in arrays.items()} for i in range(n.pop())]
        else:
            batches = [arrays]
        for i, b in enumerate(batches):
            check_inputs(ins, b, f"{{calibration}} {opts.calibration} batch {i}", argument="calibration")
        return batches, f"{len(batches)} batch(es) from {opts.calibration}"
    if opts.batches < 1:
        raise BlockforgeError("the number of random calibration batches must be at least 1")
    from .shape import ShapeRequest

    dims = resolve_dims(ins, ShapeRequest.of(opts.shape).as_spec())
    batches = [random_inputs(ins, dims, seed=opts.seed + i) for i in range(opts.batches)]
    shapes = ", ".join(f"{s.name}={'x'.join(map(str, batches[0][s.name].shape))}" for s in ins)
    return batches, (f"{opts.batches} RANDOM batches drawn from the model's signature ({shapes}); give "
                     "--calibration inputs.npz with real data for a calibration that means something")


class _Reader:
    """onnxruntime.quantization's CalibrationDataReader protocol over a list of batches."""

    def __init__(self, batches: list[dict], progress: Callable[[str], None]):
        self.batches, self.i, self.progress = batches, 0, progress

    def get_next(self):
        if self.i >= len(self.batches):
            return None
        self.i += 1
        self.progress(f"calibrating: batch {self.i}/{len(self.batches)}")
        return self.batches[self.i - 1]

    def rewind(self):
        self.i = 0


def _pre_process(src: Path, dst: Path, notes: list[str]) -> None:
    from onnxruntime.quantization.shape_inference import quant_pre_process

    try:
        quant_pre_process(str(src), str(dst))
    except Exception as e:  # symbolic shape inference refuses some exports: the plain one still helps
        notes.append(f"quant_pre_process failed ({error_line(e)}); quantized without its optimization and "
                     "symbolic shape inference")
        quant_pre_process(str(src), str(dst), skip_optimization=True, skip_symbolic_shape=True)


def quantize_model(model: onnx.ModelProto, opts: QuantizeOptions,
                   progress: Callable[[str], None] = lambda s: None) -> tuple[bytes, QuantizeResult]:
    """The quantized model's bytes (nothing written to opts.output) and what was done."""
    import json

    if opts.mode not in MODES:
        raise BlockforgeError(f"unknown quantization mode {opts.mode!r}; choose from {', '.join(MODES)}")
    if opts.activation_type not in ACTIVATION_TYPES:
        raise BlockforgeError(f"unknown activation type {opts.activation_type!r}; choose from {', '.join(ACTIVATION_TYPES)}")
    if opts.mode == "dynamic" and opts.calibration is not None:
        raise ArgumentError("{calibration} is for {mode} static (dynamic quantization computes activation "
                            "scales at run time)", "calibration", "mode")
    if opts.mode == "dynamic" and opts.bias_adds:
        raise ArgumentError("{bias_adds} is for {mode} static (dynamic quantization quantizes MatMul inputs "
                            "only)", "bias_adds", "mode")
    if is_quantized(model):
        raise BlockforgeError(f"{opts.model}: the model is already quantized (it has "
                              f"{sorted({n.op_type for n in model.graph.node if n.op_type in QUANTIZED_OPS})[0]})")
    try:
        from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static
    except ImportError as e:
        raise BlockforgeError(f"quantize needs onnxruntime.quantization ({error_line(e)})") from None
    notes: list[str] = []
    batches, source = _calibration_batches(opts, model) if opts.mode == "static" else ([], "")
    with tempfile.TemporaryDirectory(prefix="blockforge-quantize-") as tmp:
        src, pre, dst = Path(tmp) / "in.onnx", Path(tmp) / "pre.onnx", Path(tmp) / "out.onnx"
        src.write_bytes(model.SerializeToString())
        progress("pre-processing (quant_pre_process: shape inference, basic fusions)")
        try:
            # ORT's pre-processing writes sym_shape_infer_temp.onnx and <uuid>.data (the whole
            # weights) into the current directory and leaves them there: run it in ours.
            with contextlib.chdir(tmp):
                _pre_process(src, pre, notes)
            pre_model = onnx.load(str(pre))
            excluded = float_exclusions(pre_model)
            exclude = [n for names in excluded.values() for n in names]
            ops = ["MatMul", "Gemm"]
            if opts.bias_adds:  # (static only: refused above for dynamic)
                bias, other = bias_adds(pre_model)
                ops.append("Add")
                exclude = list(dict.fromkeys(exclude + other))
                notes.append(f"{sum(b not in exclude for b in bias)} bias Adds quantized too (bias_adds)")
            if opts.mode == "dynamic":
                progress("quantizing: dynamic, QInt8 weights")
                quantize_dynamic(str(pre), str(dst), op_types_to_quantize=["MatMul"], per_channel=opts.per_channel,
                                 reduce_range=opts.reduce_range, weight_type=QuantType.QInt8, nodes_to_exclude=exclude)
            else:
                act = QuantType.QInt8 if opts.activation_type == "s8" else QuantType.QUInt8
                progress(f"quantizing: static QDQ {opts.activation_type.upper()}S8, calibration: {source}")
                quantize_static(str(pre), str(dst), _Reader(batches, progress), quant_format=QuantFormat.QDQ,
                                op_types_to_quantize=ops, per_channel=opts.per_channel, reduce_range=opts.reduce_range,
                                activation_type=act, weight_type=QuantType.QInt8, nodes_to_exclude=exclude)
            out = onnx.load(str(dst))
        except BlockforgeError:
            raise
        except Exception as e:  # ORT's quantizer on a model it cannot handle: one line, not its traceback
            raise BlockforgeError(f"{opts.model}: onnxruntime.quantization failed: {error_line(e)}") from None
    info = {"mode": opts.mode, "per_channel": opts.per_channel, "calibration": source,
            **({"reduce_range": True} if opts.reduce_range else {}),
            **({"activation_type": opts.activation_type, "bias_adds": opts.bias_adds} if opts.mode == "static" else {})}
    props = {p.key: p.value for p in model.metadata_props}  # the spec of a blockforge export survives
    props[QUANT_KEY] = json.dumps(info, sort_keys=True)
    onnx.helper.set_model_props(out, props)
    int8 = sum(n.op_type in ("MatMulInteger", "QLinearMatMul", "QGemm") for n in out.graph.node)
    if opts.mode == "static":  # QDQ: a quantized MatMul is one whose operands are both dequantized
        producer = {o: n.op_type for n in out.graph.node for o in n.output}
        int8 = sum(n.op_type in ("MatMul", "Gemm") and all(producer.get(i) == "DequantizeLinear" for i in n.input[:2])
                   for n in out.graph.node)
    if not int8:
        notes.append("no MatMul/Gemm was quantized: the output computes as the input did")
    return out.SerializeToString(), QuantizeResult(opts.output, opts.mode, int8, {k: len(v) for k, v in excluded.items()},
                                                   source, notes)


def quantize(opts: QuantizeOptions, progress: Callable[[str], None] = lambda s: None) -> QuantizeResult:
    """Quantize opts.model into opts.output: written whole (atomically) or not at all."""
    if str(opts.output) == "" or Path(opts.output).suffix != ".onnx":
        raise BlockforgeError(f"-o {opts.output}: the output must be a path ending in .onnx")
    check_outputs([Output("output", opts.output, what="quantized model")], [opts.model, opts.calibration],
                  force=opts.force)
    model = load_model(opts.model)
    data, res = quantize_model(model, opts, progress)
    try:
        atomic_write_bytes(opts.output, data)
    except OSError as e:
        raise write_error(opts.output, e) from None
    return res
