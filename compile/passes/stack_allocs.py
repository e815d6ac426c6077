"""Kernel-local buffers on the stack, not TVM's workspace allocator.

TVM's LowerTVMBuiltin serves every CPU allocation of 1 KiB or more (runtime::kMaxStackAlloca)
with a TVMBackendAllocWorkspace / FreeWorkspace pair, placed where the buffer is allocated: for
a GEMM's accumulator tile (CPUMatmul's 6 x 4 vectors = 1536 B, the bf16 kernel's likewise)
that is inside the parallel loop over tiles, one call pair per output tile. The int8 kernel
measured what it costs: 0.87-0.91x per GEMM without it (compile/quant/gemm.py STACK_BYTES,
where the tile was shrunk under 1 KiB instead). Here every constant-size kernel-local buffer up
to STACK_LIMIT keeps its allocation as a stack alloca (the `disable_lower_builtin` annotation
LowerTVMBuiltin reads), which LLVM places in the entry of the function it runs in -- for a
parallel body, once per task, not per tile. 64 KiB: the largest kernel-local buffer of a BERT
block's build is the fused attention's 64 x 64 score tile (16 KiB); the bf16 attention's 128 x 128
tile is 64 KiB. Thread stacks are glibc's default (ulimit -s, 8 MiB on this VM), not measured
for headroom beyond that. Larger buffers and symbolic sizes stay with the allocator.

It runs after TVM's own TIR pipeline and before its host finalization (where LowerTVMBuiltin
is), as the named TIR pipeline `blockforge-stack` (register_tir_pipeline: TVM's pipeline plus
this pass, not a copy of its list)."""

from __future__ import annotations

from blockforge.compile.passes.kernels import map_prim_funcs

STACK_LIMIT = 64 * 1024  # bytes
PIPELINE = "blockforge-stack"
_ANNOTATION = "disable_lower_builtin"  # read by tirx.transform.LowerTVMBuiltin


def constant_elements(buffer) -> int | None:
    """The buffer's element count where its shape is constant (None: symbolic)."""
    from tvm import tirx

    n = 1
    for e in buffer.shape:
        if not isinstance(e, tirx.IntImm):
            return None
        n *= int(e.value)
    return n


def _constant_bytes(buffer) -> int | None:
    n = constant_elements(buffer)
    dtype = buffer.dtype
    return None if n is None else n * ((dtype.bits * dtype.lanes + 7) // 8)


def on_cpu(func) -> bool:
    target = func.attrs.get("target") if func.attrs is not None else None
    return target is not None and target.kind.name in ("llvm", "c")


def stack_allocs_pass():
    import tvm
    import tvm_ffi
    from tvm import tirx

    def annotate(alloc):
        size = _constant_bytes(alloc.buffer)
        if size is None or not 0 < size <= STACK_LIMIT or alloc.buffer.scope() not in ("global", "local"):
            return alloc
        ann = dict(alloc.annotations or {})
        if ann.get(_ANNOTATION):
            return alloc
        ann[_ANNOTATION] = tirx.IntImm("bool", 1)  # LowerTVMBuiltin reads it as a Bool
        return tirx.AllocBuffer(alloc.buffer, annotations=ann, span=alloc.span)

    @tvm.transform.module_pass(opt_level=0, name="BlockforgeStackAllocs")
    def stack_allocs(mod, _ctx):
        return map_prim_funcs(mod, lambda _gv, func: tvm_ffi.structural_map(func, (tirx.AllocBuffer, annotate)),
                              where=on_cpu)

    return stack_allocs


_registered: set = set()


def tir_pipeline(window: bool = True, partitioned: bool = True) -> str:
    """The name of TVM's default TIR pipeline followed by the stack pass (registered on first
    use), and before it, `window`, the compaction of symbolic-size buffers (window_allocs.py;
    `partitioned`: also those LoopPartition shares between a main loop and its tail)."""
    import tvm
    from tvm import tirx

    name = PIPELINE + ("" if window else "-no-window") + ("" if partitioned or not window else "-one-loop")
    if name not in _registered:
        def factory():
            from blockforge.compile.passes.strided_loads import strided_loads_pass
            from blockforge.compile.passes.window_allocs import window_allocs_pass

            lower, host, device = tirx.get_tir_pipeline("default")
            passes = ([lower, strided_loads_pass()] + ([window_allocs_pass(partitioned)] if window else [])
                      + [stack_allocs_pass()])
            return tvm.transform.Sequential(passes), host, device
        tirx.register_tir_pipeline(name, factory)
        _registered.add(name)
    return name
