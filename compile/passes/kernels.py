"""Hand-written kernels added to a module by the rewrite phases (fuse-attention, int8-gemm,
bf16-gemm), and the replace-functions step every module pass ends with."""

from __future__ import annotations


def add_kernel(bb, func, name: str):
    """Add `func` to the module being built under `name` and return its GlobalVar. add_func
    makes the GlobalVar's name unique, but the global_symbol attr (what the build links by)
    must follow it, or two kernels of one family in a model are "duplicate global symbol"."""
    gv = bb.add_func(func, name)
    bb.update_func(gv, bb.get()[gv].with_attr("global_symbol", gv.name_hint))
    return gv


def replace_functions(mod, new: dict):
    """`mod` with the functions in `new` (GlobalVar -> function) put in their place: a clone (a
    pass returns a new module; its caller may still hold this one), or `mod` itself when `new` is
    empty."""
    if not new:
        return mod
    out = mod.clone()
    for gv, func in new.items():
        out.update_func(gv, func)
    return out


def map_prim_funcs(mod, rewrite, where=lambda func: True):
    """`mod` with rewrite(gv, func) in place of each PrimFunc `where` accepts (only the ones the
    rewrite changed are replaced: an unchanged module comes back as itself)."""
    from tvm import tirx

    new = {}
    for gv, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc) and where(func):
            f = rewrite(gv, func)
            if not f.same_as(func):
                new[gv] = f
    return replace_functions(mod, new)
