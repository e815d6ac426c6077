"""Import TVM's tensor intrinsics (tvm.s_tir.tensor_intrin) without paying for inspect.stack().

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


def import_tensor_intrinsics() -> None:
    """Import tvm.s_tir.tensor_intrin (once per process) the fast way; TuneContext's own
    import then finds it in sys.modules."""
    if "tvm.s_tir.tensor_intrin" in sys.modules:
        return
    with shallow_stacks():
        import tvm.s_tir.tensor_intrin  # noqa: F401
