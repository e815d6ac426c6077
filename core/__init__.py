"""blockforge: seed-exact transformer blocks as ONNX, compiled with Apache TVM.

Sub-packages (each mapped from a top-level folder of the repository):
  blockforge.graph    what is computed (specs, ONNX builders, numpy oracle, ORT parity)
  blockforge.compile  how it becomes code (TVM import, pipeline, artifacts, tuning)
  blockforge.targets  where it runs (preset table, resolution to TVM targets)
"""

from importlib import metadata as _metadata

from .errors import BlockforgeError

try:
    __version__ = _metadata.version("blockforge")
except _metadata.PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+unknown"

__all__ = ["BlockforgeError", "__version__"]
