"""Kernel-local buffers of symbolic size shrunk to the constant window their accesses use.

A GEMM over a symbolic row count (the prompt of a decoder's one-build artifact: M = seq)
keeps CPUMatmul's accumulator tile at the shape TVM's CompactBufferAllocation leaves it: the
tile's rows carry the tail guard `io * 6 + ii < seq`, so the compacted extent would be
min(6, seq - io * 6), which is not a constant, and the pass keeps the whole (seq, 64) buffer.
A buffer of symbolic size is not a stack alloca (stack_allocs.py): it costs an
AllocWorkspace / FreeWorkspace pair per row tile, and LLVM cannot keep an accumulator held in
such memory in registers (the workspace pointer may alias the weights: it stores every
accumulator after each FMA). Measured (2026-12-04, Zen 4, 2 threads, quiet): a 128 x 768 x 3072
GEMM built with seq symbolic ran 8.9 ms against 3.3 ms for the same GEMM bound to seq = 128.

After TVM's TIR pipeline (buffers flattened, tail tiles split off by LoopPartition, and the
allocation hoisted by StorageRewrite to the top of the parallel task) such a buffer is declared
in a statement list and accessed in one loop L of it (the row tiles): at iteration v every
index is `base + (v - L.min) * S + offset`, `base` fixed where the buffer is declared, S a
constant stride, `offset` ranging over the loops inside L in a constant [lo, hi]. Where the
windows of two iterations cannot overlap (hi - lo + 1 <= |S|, or S = 0), no iteration reads what
another wrote, so every iteration can use the same hi - lo + 1 elements: the buffer becomes that
size and each index `index - base - (v - L.min) * S - lo`. The window covers every access the
loops could make (guards are ignored: never too small). A buffer accessed outside that one loop
(values that flow between loops), through another view, or whose pointer is used any other way
(an address taken, a call argument), is left alone. The stack pass then puts the now constant
buffer on the stack (stack_allocs.py), where LLVM keeps the tile in registers.
"""

from __future__ import annotations

from blockforge.compile.passes.kernels import map_prim_funcs

MAX_ELEMENTS = 1 << 14  # elements of the window (a vector dtype's element is a whole vector)
_LET_DEPTH = 16  # rounds of let-inlining an index may need (CSE chains: cse_v6 = cse_v2 + 1, ...)


def _symbolic(buffer) -> bool:
    from tvm import tirx

    return any(not isinstance(e, tirx.IntImm) for e in buffer.shape)


class _Scope:
    """What the statements after an allocation do with its buffer."""

    def __init__(self, stmts, buf):
        import tvm
        import tvm_ffi
        from tvm import tirx

        from blockforge.compile.passes.exprs import var_count

        self.lets, self.loads, self.stores = {}, [], []
        for s in stmts:
            tvm_ffi.structural_walk(s, [(tirx.LetStmt, lambda x: self.lets.__setitem__(x.var, x.value)),
                                        (tvm.ir.TensorLoad, lambda x: self.loads.append(x) if x.source.same_as(buf) else None),
                                        (tirx.BufferStore, lambda x: self.stores.append(x) if x.buffer.same_as(buf) else None)])
        # every mention of the buffer is one of those accesses: no view, no address taken
        zero = tirx.IntImm("int64", 0)
        per_load = var_count(tirx.BufferLoad(buf, [zero]), buf)
        per_store = var_count(tirx.BufferStore(buf, tirx.BufferLoad(buf, [zero]), [zero]), buf) - per_load
        self.escaped = sum(var_count(s, buf) for s in stmts) != per_load * len(self.loads) + per_store * len(self.stores)
        # an element's address taken (then read past the element, by a call or a vector load)
        for s in stmts:
            tvm_ffi.structural_walk(s, (tvm.ir.Call, lambda c: self._address(c, buf)))
        self.users = [s for s in stmts if var_count(s, buf)]  # the statements of the list that touch it

    def _address(self, call, buf) -> None:
        import tvm

        from blockforge.compile.passes.exprs import var_count

        if isinstance(call.op, tvm.ir.Op) and call.op.name == "tirx.address_of" and any(var_count(a, buf) for a in call.args):
            self.escaped = True

    def inline(self, e):
        """e with the lets bound in the scope substituted (their values refer to loop vars)."""
        import tvm_ffi
        from tvm import tirx

        for _ in range(_LET_DEPTH):
            hit = [False]

            def sub(v):
                if v in self.lets:
                    hit[0] = True
                    return self.lets[v]
                return v
            e = tvm_ffi.structural_map(e, (tirx.Var, sub))
            if not hit[0]:
                return e
        return None


def _loops(stmt) -> list:
    import tvm_ffi
    from tvm import tirx

    out = []
    tvm_ffi.structural_walk(stmt, (tirx.For, lambda f: out.append(f)))
    return out


def _unit_step(f) -> bool:
    from tvm import tirx

    step = getattr(f, "step", None)
    return step is None or (isinstance(step, tirx.IntImm) and int(step.value) == 1)


def window(alloc, stmts):
    """(shift, extent) for the buffer alloc declares, accessed in stmts: each index becomes
    index - shift (an expression of the one loop's variable), the buffer `extent` elements; or None."""
    import tvm
    import tvm_ffi
    from tvm import tirx

    buf = alloc.buffer
    if len(buf.shape) != 1 or buf.scope() not in ("local", "global") or not _symbolic(buf):
        return None
    scope = _Scope(stmts, buf)
    if scope.escaped or len(scope.users) != 1 or not (scope.loads or scope.stores):
        return None
    top = scope.users[0]
    moving = top if isinstance(top, tirx.For) else None
    if moving is not None and (int(moving.kind) not in (int(tirx.ForKind.SERIAL), int(tirx.ForKind.UNROLLED))
                               or not _unit_step(moving)):
        return None  # iterations of a parallel loop would share the window at once
    inner = [f for f in _loops(top) if not f.same_as(moving)]
    ana = tvm.sym.Analyzer()
    for f in inner:
        if not isinstance(f.min, tirx.IntImm) or not isinstance(f.extent, tirx.IntImm) or not _unit_step(f):
            return None  # a symbolic inner trip count: the offsets' range is not constant
        ana.bind(f.loop_var, tvm.ir.Range.from_min_extent(f.min, f.extent))
    at_min = {f.loop_var: f.min for f in inner}
    v = moving.loop_var if moving is not None else None

    def subst(e, m):
        return ana.simplify(tvm_ffi.structural_map(e, (tirx.Var, lambda x: m.get(x, x))))

    base0, stride, lo, hi = None, None, None, None
    for x in scope.loads + scope.stores:
        index = scope.inline(x.indices[0]) if len(x.indices) == 1 else None
        if index is None:
            return None
        if isinstance(index, tirx.Ramp):
            if not isinstance(index.stride, tirx.IntImm) or int(index.stride.value) <= 0:
                return None
            first, last = index.base, index.base + index.stride * (int(index.lanes) - 1)
        else:
            first = last = index
        b = subst(first, at_min)  # the window's start at iteration v
        if v is not None:
            b0 = subst(b, {v: moving.min})
            s = ana.simplify(subst(b, {v: v + 1}) - b)
            if not isinstance(s, tirx.IntImm) or not ana.can_prove_equal(b, b0 + (v - moving.min) * s):
                return None
            s = int(s.value)
        else:
            b0, s = b, 0
        if base0 is None:
            base0, stride = b0, s
        d = ana.simplify(b0 - base0)  # unrolled rows differ from the first access by a constant
        if s != stride or not isinstance(d, tirx.IntImm):
            return None
        for e in (first, last):
            bound = ana.const_int_bound(ana.simplify(e - b + d))
            if bound.min_value <= -(1 << 40) or bound.max_value >= (1 << 40):
                return None  # depends on something outside the loops: not a window
            lo = bound.min_value if lo is None else min(lo, bound.min_value)
            hi = bound.max_value if hi is None else max(hi, bound.max_value)
    extent = hi - lo + 1
    if not 0 < extent <= MAX_ELEMENTS or (stride and extent > abs(stride)):
        return None  # too large, or windows of two iterations overlap
    shift = base0 + lo
    if v is not None and stride:
        shift = shift + (v - moving.min) * stride
    return ana.simplify(shift), extent


def _rebased(stmts, old, new, shift):
    """stmts with every access of `old` through `new`, its index minus `shift`."""
    import tvm
    import tvm_ffi
    from tvm import tirx

    ana = tvm.sym.Analyzer()

    def index(i):
        if isinstance(i, tirx.Ramp):
            return tirx.Ramp(ana.simplify(i.base - shift), i.stride, i.lanes)
        return ana.simplify(i - shift)

    def load(x):
        return tirx.BufferLoad(new, [index(x.indices[0])]) if x.source.same_as(old) else x

    def store(x):
        return tirx.BufferStore(new, x.value, [index(x.indices[0])], x.span) if x.buffer.same_as(old) else x

    return [tvm_ffi.structural_map(s, [(tvm.ir.TensorLoad, load), (tirx.BufferStore, store)]) for s in stmts]


def compact_seq(seq):
    """A SeqStmt with each of its symbolic-size AllocBuffers shrunk to its window (or itself)."""
    from tvm import tirx

    items = list(seq.seq)
    changed = False
    for i, s in enumerate(items):
        if not isinstance(s, tirx.AllocBuffer):
            continue
        w = window(s, items[i + 1:])
        if w is None:
            continue
        shift, extent = w
        old = s.buffer
        new = tirx.decl_buffer((tirx.IntImm("int64", extent),), old.dtype, old.name, scope=old.scope(),
                               data_alignment=old.data_alignment)
        items[i] = tirx.AllocBuffer(new, annotations=s.annotations, span=s.span)
        items[i + 1:] = _rebased(items[i + 1:], old, new, shift)
        changed = True
    return tirx.SeqStmt(items) if changed else seq


def window_allocs_pass():
    import tvm
    import tvm_ffi
    from tvm import tirx

    from blockforge.compile.passes.stack_allocs import on_cpu

    @tvm.transform.module_pass(opt_level=0, name="BlockforgeWindowAllocs")
    def window_allocs(mod, _ctx):
        return map_prim_funcs(mod, lambda _gv, func: tvm_ffi.structural_map(func, (tirx.SeqStmt, compact_seq)),
                              where=on_cpu)

    return window_allocs
