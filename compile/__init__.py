"""How it becomes code: TVM import, phased pipeline, artifacts, loading, verify."""

from .artifact import CompileOptions, CompileResult, compile_model
from .runtime import LoadedModule, load_artifact
from .verify import VerifyOptions, verify

__all__ = ["CompileOptions", "CompileResult", "LoadedModule", "VerifyOptions", "compile_model",
           "load_artifact", "verify"]
