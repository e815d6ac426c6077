"""The compiled LLVM IR of a TVM build, read by tests that count calls in it (stack_allocs,
int8 GEMM tiles)."""

from __future__ import annotations

import re

WORKSPACE_ALLOC = "@__TVMBackendAllocWorkspace"


def llvm_source(executable) -> str:
    """The LLVM IR of every module of a build (a VM executable or a tvm.compile'd library); the
    VM's own module has none."""
    out = []
    for m in [executable.mod, *executable.mod.imports]:
        try:
            out.append(m.inspect_source("ll"))
        except Exception:  # noqa: BLE001 - a module without LLVM source
            pass
    return "\n".join(out)


def workspace_allocs(ll: str) -> dict[str, int]:
    """TVMBackendAllocWorkspace calls per function (each one in a parallel body runs once per
    tile, with a FreeWorkspace beside it)."""
    cur, counts = None, {}
    for line in ll.splitlines():
        m = re.match(r'define .*@"?([\w.]+)"?\(', line)
        if m:
            cur = m.group(1)
        elif WORKSPACE_ALLOC in line and "load ptr" in line:
            counts[cur] = counts.get(cur, 0) + 1
    return counts
