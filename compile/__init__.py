"""How it becomes code: the prelude (session), ONNX -> Relax import, the pipeline as named
phases, CPU schedules and passes, artifacts and their manifest, loading, tuning records
(read side) and `verify`.

Importing this package does nothing to the process (no environment variables, no TVM
import): see blockforge.settings.configure() for the process-wide settings.
"""

from blockforge.compile.artifact.write import CompileOptions, CompileResult, compile_model
from blockforge.compile.artifact.runtime import LoadedModule, load_artifact
from blockforge.compile.session import Session, open_model
from blockforge.compile.verify import VerifyOptions, verify

__all__ = ["CompileOptions", "CompileResult", "LoadedModule", "Session", "VerifyOptions", "compile_model",
           "load_artifact", "open_model", "verify"]
