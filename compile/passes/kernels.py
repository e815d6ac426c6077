"""Hand-written kernels added to a module by the rewrite phases (fuse-attention, int8-gemm,
bf16-gemm)."""

from __future__ import annotations


def add_kernel(bb, func, name: str):
    """Add `func` to the module being built under `name` and return its GlobalVar. add_func
    makes the GlobalVar's name unique, but the global_symbol attr (what the build links by)
    must follow it, or two kernels of one family in a model are "duplicate global symbol"."""
    gv = bb.add_func(func, name)
    bb.update_func(gv, bb.get()[gv].with_attr("global_symbol", gv.name_hint))
    return gv
