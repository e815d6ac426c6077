"""Export: build, validate (checker + strict shape inference), write atomically with a manifest."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import shape_inference

import blockforge
from blockforge.errors import BlockforgeError, error_line
from blockforge.fsutil import Output, atomic_write_group, check_outputs, json_bytes, sha256_bytes, write_error

from .analysis import analyze
from .builders import build
from .spec import Spec
from .weights import Weights


@dataclass(frozen=True)
class ExportResult:
    model_path: Path
    manifest_path: Path
    manifest: dict
    model: onnx.ModelProto
    weights: Weights


def default_name(spec: Spec) -> str:
    parts = [spec.kind, f"d{spec.d_model}"]
    if hasattr(spec, "heads"):
        parts.append(f"h{spec.heads}")
    if getattr(spec, "layout", "per-head") != "per-head":
        parts.append(spec.layout)  # packed, attention-op
    if hasattr(spec, "activation") and spec.kind != "mha":
        parts.append(spec.activation)
    if spec.kind == "block":
        parts.append(f"{spec.norm}ln")
    if spec.dtype != "float32":
        parts.append("fp16")
    return "_".join(parts) + ".onnx"


def validate(model: onnx.ModelProto) -> None:
    try:
        onnx.checker.check_model(model, full_check=True)
        shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    except Exception as e:
        # A builder bug, not user input: still one clear line.
        raise BlockforgeError(f"built model fails ONNX validation: {error_line(e)}") from None


def manifest_for(model: onnx.ModelProto, data: bytes, spec: Spec | None) -> dict:
    facts = analyze(model)
    return {
        "format": "blockforge.onnx-manifest/1",
        "sha256": sha256_bytes(data),
        "bytes": len(data),
        "spec": spec.to_dict() if spec else None,
        "blockforge_version": blockforge.__version__,
        "onnx_version": onnx.__version__,
        "ir_version": model.ir_version,
        **facts.to_dict(),
    }


def export(spec: Spec, output: str | Path | None = None, *, force: bool = False,
           quantize: str | None = None, per_channel: bool = False, bias_adds: bool = False,
           reduce_range: bool = False) -> ExportResult:
    """Build `spec`, validate it and write MODEL.onnx + MODEL.json: both or neither.
    `force`: replace symbolic links there (the links, not their targets). `quantize`:
    "dynamic" or "static" writes the model as graph/quantize.py quantizes it (static:
    calibrated on random inputs at the spec's dims); the manifest's facts are the written
    model's, with how it was quantized; `bias_adds`: QuantizeOptions.bias_adds."""
    if output == "":
        raise BlockforgeError("-o: the path is empty; name the model (MODEL.onnx) or leave -o out")
    name = default_name(spec) if not quantize else default_name(spec).replace(".onnx", f"_int8{quantize}.onnx")
    path = Path(output) if output is not None else Path("artifacts") / name
    if path.suffix != ".onnx":
        raise BlockforgeError(f"output path {path} must end in .onnx")
    mpath = path.with_suffix(".json")
    # before the build: a refused output costs nothing
    check_outputs([Output("output", path, what="model"), Output("output", mpath, what="model's manifest", suffix="'s manifest")],
                  force=force)
    model, weights = build(spec)
    validate(model)
    if quantize:
        from .quantize import QuantizeOptions, quantize_model

        opts = QuantizeOptions(model=path, output=path, mode=quantize, per_channel=per_channel, bias_adds=bias_adds,
                               reduce_range=reduce_range,
                               seed=spec.seed)  # (no shape: a static --batch/--seq is no symbolic dim to bind)
        qdata, qres = quantize_model(model, opts)
        model = onnx.load_from_string(qdata)
    data = model.SerializeToString()  # weights inline: no external-data files to trust
    manifest = manifest_for(model, data, spec)
    if quantize:
        manifest["quantization"] = {"mode": qres.mode, "per_channel": per_channel, "bias_adds": bias_adds,
                                    **({"reduce_range": True} if reduce_range else {}),
                                    "int8_gemms": qres.quantized_nodes,
                                    "kept_float": qres.kept_float, "calibration": qres.calibration}
    try:
        atomic_write_group({path: data, mpath: json_bytes(manifest)})
    except OSError as e:
        raise write_error(path, e) from None
    return ExportResult(path, mpath, manifest, model, weights)
