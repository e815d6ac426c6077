"""What is computed: block specs, ONNX builders, the numpy oracle, ORT parity."""

from .builders import build, build_block, build_ffn, build_mha
from .export import ExportResult, export
from .oracle import reference
from .spec import BlockSpec, FFNSpec, MHASpec, Spec, spec_from_dict
from .tolerance import TOLERANCES, Tolerance, tolerance_for
from .weights import make_weights

__all__ = [
    "BlockSpec", "ExportResult", "FFNSpec", "MHASpec", "Spec", "TOLERANCES", "Tolerance",
    "build", "build_block", "build_ffn", "build_mha", "export", "make_weights", "reference",
    "spec_from_dict", "tolerance_for",
]
