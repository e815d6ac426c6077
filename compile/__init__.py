"""How it becomes code: TVM import, phased pipeline, artifacts, loading, verify."""

import os as _os

# TVM's CPU thread pool sizes itself when first used and, on this class of VM, picks a
# single thread (runtime.config_threadpool does not change it; the variable does).
# Measured: a 128x768x3072 GEMM runs at 252 GFLOP/s with 1 thread, 516 with 2.
if "TVM_NUM_THREADS" not in _os.environ:
    from blockforge.targets.resolve import physical_cores as _cores

    _os.environ["TVM_NUM_THREADS"] = str(_cores())
# Idle TVM workers spin before sleeping; the default spin is long enough to steal a core
# from ONNX Runtime (or the app) running next. 10k spins keeps back-to-back calls warm.
_os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "10000")

from .artifact import CompileOptions, CompileResult, compile_model
from .runtime import LoadedModule, load_artifact
from .verify import VerifyOptions, verify

__all__ = ["CompileOptions", "CompileResult", "LoadedModule", "VerifyOptions", "compile_model",
           "load_artifact", "verify"]
