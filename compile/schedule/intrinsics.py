"""Import TVM's tensor intrinsics (tvm.s_tir.tensor_intrin) without paying for inspect.stack(),
and, for a CPU target, without the GPU ones.

MetaSchedule's TuneContext imports tvm.s_tir.tensor_intrin, which parses ~250 TVMScript
PrimFuncs. Each `@T.prim_func` calls inspect.stack(), which reads the source line of every
frame on the stack and, for frames without a file (the import system's frozen frames), scans
all of sys.modules (inspect.getmodule). Measured: 57 s for that one import in a process with
1228 modules loaded (a tune job's parent; longer under pytest's deeper stack), 14 s with
only the source reads of the frames TVM reads replaced, most of a tiny tune's wall time.

TVM's parser reads of that stack only `frames[2].code_context`/`.lineno`
(utils.is_defined_in_class) and each entry's `.frame` (utils.resolve_closure_vars), so a
stack whose first three entries carry their source line and the rest none is the same to it.
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
import sys
import threading

_LINES_TVM_READS = 3  # frames[0..2]; is_defined_in_class reads frames[2]
_lock = threading.Lock()


def _frame_info(frame, with_line: bool) -> inspect.FrameInfo:
    filename, lineno = frame.f_code.co_filename, frame.f_lineno
    code_context, index = None, None
    if with_line:
        line = linecache.getline(filename, lineno, frame.f_globals)
        if line:
            code_context, index = [line], 0
    return inspect.FrameInfo(frame, filename, lineno, frame.f_code.co_name, code_context, index)


def shallow_stack(context: int = 1) -> list[inspect.FrameInfo]:
    """inspect.stack() for TVM's parser: the caller's frames outward, source lines on the first three."""
    frame, out = sys._getframe(1), []
    while frame is not None:
        out.append(_frame_info(frame, context > 0 and len(out) < _LINES_TVM_READS))
        frame = frame.f_back
    return out


@contextlib.contextmanager
def shallow_stacks():
    """inspect.stack is shallow_stack inside; restored on exit, however it exits."""
    with _lock:
        real = inspect.stack
        inspect.stack = shallow_stack
        try:
            yield
        finally:
            inspect.stack = real


# What a CPU (llvm) job's rules can name: VNNI (x86), SDOT/I8MM (arm_cpu), RVV (riscv_cpu),
# HVX (hexagon). The package's __init__ imports cuda.py first, whatever the target: 1.6 s of its
# 2.4 s alone, 3.5 of 4.8 s inside a tune job's parent (cProfile, tiny FFN tune: 4.8 of 14 s).
_CPU_MODULES = ("x86", "arm_cpu", "riscv_cpu", "hexagon")
_PACKAGE = "tvm.s_tir.tensor_intrin"
_CPU_ONLY = "_blockforge_cpu_only"  # set on a package module whose __init__ was not run


def import_tensor_intrinsics(cpu_only: bool = False) -> None:
    """Register TVM's tensor intrinsics (once per process) the fast way; TuneContext's own
    `import tvm.s_tir.tensor_intrin` then finds the package in sys.modules. cpu_only: only the
    modules a CPU target's rules use (_CPU_MODULES), the package entered without its __init__;
    a later call without it imports the rest."""
    import importlib
    import importlib.util

    have = sys.modules.get(_PACKAGE)
    if have is not None and not getattr(have, _CPU_ONLY, False):
        return
    with shallow_stacks():
        if have is None and not cpu_only:
            import tvm.s_tir.tensor_intrin  # noqa: F401
            return
        if have is None:
            import tvm.s_tir

            spec = importlib.util.find_spec(_PACKAGE)
            have = importlib.util.module_from_spec(spec)
            setattr(have, _CPU_ONLY, True)
            sys.modules[_PACKAGE] = have
            tvm.s_tir.tensor_intrin = have
            for name in _CPU_MODULES:
                importlib.import_module(f"{_PACKAGE}.{name}")
            return
        if not cpu_only:  # a GPU job after a CPU one: what the __init__ would have added
            spec = have.__spec__
            delattr(have, _CPU_ONLY)
            spec.loader.exec_module(have)
