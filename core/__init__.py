"""blockforge: seed-exact transformer blocks as ONNX, compiled with Apache TVM.

Sub-packages (each mapped from a top-level folder of the repository):
  blockforge.graph    what is computed (specs, ONNX builders, numpy oracle, ORT parity)
  blockforge.targets  where it runs (preset table, toolchain facts, resolution to TVM targets)
  blockforge.compile  how it becomes code (prelude, import, pipeline, schedules, artifacts, verify)
  blockforge.tune     autotuning jobs, the database's write side, RPC
  blockforge.bench    contenders measured side by side
  blockforge.deploy   packaging and the C++ edge app
  blockforge.cli      the command line (one module per verb)

Importing blockforge does nothing to the process; `blockforge.configure()` applies the
process-wide settings the CLI uses (see blockforge.settings).
"""

from importlib import metadata as _metadata

from .errors import BlockforgeError
from .settings import configure

try:
    __version__ = _metadata.version("blockforge")
except _metadata.PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+unknown"

__all__ = ["BlockforgeError", "__version__", "configure"]
