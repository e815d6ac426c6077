"""Strided vector loads of kernel-local buffers as one contiguous load and a lane shuffle.

TVM's LLVM codegen scalarises a vector load whose index is a ramp of stride s > 1 (a load and
an insert per lane). Where the contiguous lanes * s elements from the ramp's base are provably
inside the buffer, the same values are one vector load of lanes * s and a shufflevector keeping
every s-th lane (vpermt2ps for s = 2): the depthwise kernel's stride-2 select
(compile/conv/depthwise.py) reads its row of stride-1 columns so. Measured alone on Zen 5 (2
threads, ms, medians of 7 interleaved, scalar -> shuffle): MobileViT's 3x3 stride-2 depthwise
convs + bias at 128 x 128 x 128 0.224 -> 0.182; at 256 x 64 x 64 and 384 x 32 x 32 no change
(0.072, 0.027: the select is a small part there). Only buffers allocated in the kernel, of constant size, are taken: their extent
is known, so reading the s - 1 elements past the last kept one cannot fault; a parameter's
buffer or a view is left alone.

Runs in the blockforge TIR pipeline (stack_allocs.tir_pipeline) after TVM's lowering, where the
vector loops are ramps and the buffers flat.
"""

from __future__ import annotations

from blockforge.compile.passes.kernels import map_prim_funcs

MAX_STRIDE = 4  # beyond, most of the loaded bytes are dropped


def rewrite(func):
    """func with each provably in-bounds strided load of a local buffer as a load + shuffle."""
    import tvm
    import tvm_ffi
    from tvm import tirx

    from blockforge.compile.passes.stack_allocs import constant_elements
    from blockforge.compile.passes.window_allocs import inline_lets

    sizes, ranges, lets = [], {}, {}

    def alloc(a):
        n = constant_elements(a.buffer)
        if n is not None and a.buffer.dtype.lanes == 1:
            sizes.append((a.buffer, n))

    def loop(f):
        ranges[f.loop_var] = tvm.ir.Range.from_min_extent(f.min, f.extent)

    tvm_ffi.structural_walk(func.body, [(tirx.AllocBuffer, alloc), (tirx.For, loop),
                                        (tirx.LetStmt, lambda x: lets.__setitem__(x.var, x.value))])
    if not sizes:
        return func

    def load(x):
        # the allocated buffer itself (a view of its memory is another Buffer: left alone)
        n = next((n for b, n in sizes if x.source.same_as(b)), None)
        if n is None or len(x.indices) != 1 or getattr(x, "predicate", None) is not None:
            return x
        i = x.indices[0]
        if not isinstance(i, tirx.Ramp) or not isinstance(i.stride, tirx.IntImm) \
                or not 2 <= int(i.stride.value) <= MAX_STRIDE or not isinstance(i.lanes, (int, tirx.IntImm)):
            return x
        view = x.source
        s, lanes = int(i.stride.value), int(i.lanes)
        ana = tvm.sym.Analyzer()
        for v, r in ranges.items():
            ana.bind(v, r)
        base = inline_lets(i.base, lets)  # (CSE's let chains: cse_v2 = cse_v1 + 1)
        if base is None:
            return x
        dt = i.stride.ty.dtype  # (the index type: int32 or int64)
        last = base + tirx.const(lanes * s - 1, dt)
        if not (ana.can_prove(base >= tirx.const(0, dt)) and ana.can_prove(last < tirx.const(n, dt))):
            return x
        wide = tirx.BufferLoad(view, [tirx.Ramp(i.base, tirx.const(1, dt), lanes * s)])
        return tirx.Shuffle([wide], [tirx.IntImm("int32", k * s) for k in range(lanes)])

    return tvm_ffi.structural_map(func, (tvm.ir.TensorLoad, load))


def strided_loads_pass():
    import tvm

    from blockforge.compile.passes.stack_allocs import on_cpu

    @tvm.transform.module_pass(opt_level=0, name="BlockforgeStridedLoads")
    def strided_loads(mod, _ctx):
        return map_prim_funcs(mod, lambda _gv, func: rewrite(func), where=on_cpu)

    return strided_loads
