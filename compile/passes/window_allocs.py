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
loops could make (guards are ignored: never too small). Where LoopPartition split the row tiles
into a main loop and a guarded tail (the tail declares its own view of the buffer, read as the
buffer itself), each loop is such a window and the two touch provably disjoint elements: the
main loop takes the window, the tail keeps the buffer (window()). A buffer whose loops may pass
values to each other, accessed through another kind of view, or whose pointer is used any other
way (an address taken, a call argument), is left alone. The stack pass then puts the now constant
buffer on the stack (stack_allocs.py), where LLVM keeps the tile in registers.
"""

from __future__ import annotations

from blockforge.compile.passes.kernels import map_prim_funcs

MAX_ELEMENTS = 1 << 14  # elements of the window (a vector dtype's element is a whole vector)
_LET_DEPTH = 16  # rounds of let-inlining an index may need (CSE chains: cse_v6 = cse_v2 + 1, ...)


def inline_lets(e, lets: dict):
    """e with every var bound in `lets` (var -> value) replaced by its value, through chains of
    lets up to _LET_DEPTH deep; None where a chain is deeper."""
    import tvm_ffi
    from tvm import tirx

    for _ in range(_LET_DEPTH):
        hit = [False]

        def sub(v):
            if v in lets:
                hit[0] = True
                return lets[v]
            return v
        e = tvm_ffi.structural_map(e, (tirx.Var, sub))
        if not hit[0]:
            return e
    return None


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
        self.users = [i for i, s in enumerate(stmts) if var_count(s, buf)]  # indices of the statements that touch it

    def _address(self, call, buf) -> None:
        import tvm

        from blockforge.compile.passes.exprs import var_count

        if isinstance(call.op, tvm.ir.Op) and call.op.name == "tirx.address_of" and any(var_count(a, buf) for a in call.args):
            self.escaped = True

    def inline(self, e):
        """e with the lets bound in the scope substituted (their values refer to loop vars)."""
        return inline_lets(e, self.lets)


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


def _loop_window(scope, buf, top, ana):
    """(shift, extent, first, last) of one statement `top` that accesses buf: each index in it
    is `shift + offset`, offset in [0, extent); first / last: the lowest / highest element the
    whole statement touches (over every iteration of its loop); or None."""
    import tvm
    import tvm_ffi
    from tvm import tirx

    moving = top if isinstance(top, tirx.For) else None
    if moving is not None and (int(moving.kind) not in (int(tirx.ForKind.SERIAL), int(tirx.ForKind.UNROLLED))
                               or not _unit_step(moving)):
        return None  # iterations of a parallel loop would share the window at once
    inner = [f for f in _loops(top) if not f.same_as(moving)]
    for f in inner:
        if not isinstance(f.min, tirx.IntImm) or not isinstance(f.extent, tirx.IntImm) or not _unit_step(f):
            return None  # a symbolic inner trip count: the offsets' range is not constant
        ana.bind(f.loop_var, tvm.ir.Range.from_min_extent(f.min, f.extent))
    at_min = {f.loop_var: f.min for f in inner}
    v = moving.loop_var if moving is not None else None

    def subst(e, m):
        return ana.simplify(tvm_ffi.structural_map(e, (tirx.Var, lambda x: m.get(x, x))))

    accesses = []
    tvm_ffi.structural_walk(top, [(tvm.ir.TensorLoad, lambda x: accesses.append(x) if x.source.same_as(buf) else None),
                                  (tirx.BufferStore, lambda x: accesses.append(x) if x.buffer.same_as(buf) else None)])
    base0, stride, lo, hi = None, None, None, None
    for x in accesses:
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
    if base0 is None:
        return None
    extent = hi - lo + 1
    if not 0 < extent <= MAX_ELEMENTS or (stride and extent > abs(stride)):
        return None  # too large, or windows of two iterations overlap
    shift = base0 + lo
    if v is None or not stride:
        return ana.simplify(shift), extent, ana.simplify(shift), ana.simplify(shift + (extent - 1))
    ends = (ana.simplify(shift), ana.simplify(shift + (moving.extent - 1) * stride))  # first and last iteration's
    lowest, highest = (ends if stride > 0 else ends[::-1])
    return ana.simplify(shift + (v - moving.min) * stride), extent, lowest, ana.simplify(highest + (extent - 1))


def _stored_under_a_guard(top, buf) -> bool:
    """Whether a store to buf in `top` sits under an if (LoopPartition's tail: row guards)."""
    import tvm_ffi
    from tvm import tirx

    hit = [False]

    def guarded(node):
        for branch in (node.then_case, node.else_case):
            if branch is not None:
                tvm_ffi.structural_walk(branch, (tirx.BufferStore, lambda x: hit.__setitem__(0, hit[0] or x.buffer.same_as(buf))))
    tvm_ffi.structural_walk(top, (tirx.IfThenElse, guarded))
    return hit[0]


def window(alloc, stmts, partitioned: bool = True):
    """([(i, shift), ...], extent) for the buffer alloc declares, accessed in stmts: in each
    listed statement stmts[i] every index becomes index - shift (an expression of that
    statement's loop variable), the window `extent` elements; or None. A statement that
    accesses the buffer and is not listed keeps the buffer as it was.

    Several statements may access it (LoopPartition's main row tiles and their guarded tail:
    two loops with one body) where each is a window on its own and the elements they touch,
    over all their iterations, are provably apart: then no value flows from one to another,
    and each can have its own storage. Then only the loops that store to it unguarded take
    the window: the tail's guarded stores into a stack window made LLVM keep that tile's
    accumulators in memory (a 131 x 768 x 3121 GEMM, 5-row tail: 1.036x the time; the main
    loop's window alone: 0.97-0.99x at 128 rows, its write-back then goes straight from the
    accumulators to the output)."""
    import tvm
    from tvm import tirx

    buf = alloc.buffer
    if len(buf.shape) != 1 or buf.scope() not in ("local", "global") or not _symbolic(buf):
        return None
    scope = _Scope(stmts, buf)
    if scope.escaped or not scope.users or not (scope.loads or scope.stores):
        return None
    users = [stmts[i] for i in scope.users]
    found = [_loop_window(scope, buf, top, tvm.sym.Analyzer()) for top in users]
    if any(w is None for w in found):
        return None
    take = list(range(len(found)))
    if len(found) > 1:
        if not partitioned or any(not isinstance(t, tirx.For) for t in users):
            return None
        ana = tvm.sym.Analyzer()
        spans = [(scope.inline(lo), scope.inline(hi)) for _, _, lo, hi in found]  # loop extents name lets
        if any(e is None for span in spans for e in span):
            return None
        for a in range(len(spans)):
            for b in range(a + 1, len(spans)):
                (alo, ahi), (blo, bhi) = spans[a], spans[b]
                if not (ana.can_prove(ahi < blo) or ana.can_prove(bhi < alo)):
                    return None  # one loop may read what another wrote
        take = [u for u, top in enumerate(users) if not _stored_under_a_guard(top, buf)]
        if not take:
            return None
    return [(scope.users[u], found[u][0]) for u in take], max(found[u][1] for u in take)


def _dealiased(stmts, buf):
    """stmts with each view of buf's memory declared in them (TVM's LoopPartition declares one
    in the tail it splits off: same dtype, 1-D, offset 0) replaced by buf itself."""
    import tvm
    import tvm_ffi
    from tvm import tirx

    views = []

    def is_view(d):
        b = d.buffer
        return (not b.same_as(buf) and len(b.shape) == 1 and b.dtype == buf.dtype
                and isinstance(b.elem_offset, (int, tirx.IntImm)) and int(b.elem_offset) == 0
                and tvm_ffi.structural_equal(d.data, buf.data))

    for s in stmts:
        tvm_ffi.structural_walk(s, (tirx.DeclBuffer, lambda d: views.append(d.buffer) if is_view(d) else None))
    if not views:
        return stmts

    def view(b):
        return any(b.same_as(v) for v in views)

    def load(x):
        return tirx.BufferLoad(buf, list(x.indices)) if view(x.source) else x

    def store(x):
        return tirx.BufferStore(buf, x.value, list(x.indices), x.span) if view(x.buffer) else x

    def decl(d):
        return tirx.Evaluate(tirx.IntImm("int32", 0)) if view(d.buffer) else d

    return [tvm_ffi.structural_map(s, [(tvm.ir.TensorLoad, load), (tirx.BufferStore, store), (tirx.DeclBuffer, decl)])
            for s in stmts]


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


def compact_seq(seq, partitioned: bool = True):
    """A SeqStmt with each of its symbolic-size AllocBuffers shrunk to its window (or itself;
    kept too where a statement window() leaves out still uses it)."""
    from tvm import tirx

    from blockforge.compile.passes.exprs import var_count

    items = list(seq.seq)
    changed = False
    i = 0
    while i < len(items):
        s = items[i]
        i += 1
        if not isinstance(s, tirx.AllocBuffer) or not _symbolic(s.buffer):
            continue
        # LoopPartition's tail is what declares views; the ablation keeps them (the buffer then escapes)
        rest = _dealiased(items[i:], s.buffer) if partitioned else items[i:]
        w = window(s, rest, partitioned)
        if w is None:
            continue
        shifts, extent = w
        old = s.buffer
        new = tirx.decl_buffer((tirx.IntImm("int64", extent),), old.dtype, old.name, scope=old.scope(),
                               data_alignment=old.data_alignment)
        for j, shift in shifts:
            rest[j] = _rebased([rest[j]], old, new, shift)[0]
        alloc = tirx.AllocBuffer(new, annotations=s.annotations, span=s.span)
        still = any(var_count(r, old) for r in rest)
        items[i - 1:] = [alloc] + ([s] if still else []) + rest
        i += still
        changed = True
    return tirx.SeqStmt(items) if changed else seq


def window_allocs_pass(partitioned: bool = True):
    import tvm
    import tvm_ffi
    from tvm import tirx

    from blockforge.compile.passes.stack_allocs import on_cpu

    @tvm.transform.module_pass(opt_level=0, name="BlockforgeWindowAllocs")
    def window_allocs(mod, _ctx):
        def compact(_gv, func):
            return tvm_ffi.structural_map(func, (tirx.SeqStmt, lambda seq: compact_seq(seq, partitioned)))
        return map_prim_funcs(mod, compact, where=on_cpu)

    return window_allocs
