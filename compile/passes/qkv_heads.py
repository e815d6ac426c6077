"""The combined QKV projection's split, head transposes and RoPE as one row kernel.

Decoder exports (after the frontend combined the q/k/v projections into one matmul) write

    x = matmul(h, W_qkv)                          (B, S, (H + 2 Hkv) d)
    q, k, v = split(x);  q = permute(reshape(q, [B, S, H, d]), [0, 2, 1, 3])   (B, H, S, d)
    q = q * cos + concat(-q[..., d/2:], q[..., :d/2]) * sin                     (RoPE, Llama family)
    k^T = permute(rope(k), [0, 1, 3, 2])         (the fused attention reads K^T)

Legalized, that is a split kernel (a copy of x) and one injective kernel per part whose
reshape/transpose index arithmetic (flattened div/mod per element) and concat (a select per
element) are scalar: Llama-style GQA 5.7% of kernel time, GPT-2 2.2% (issue #20, quiet profile
of 2026-12-01c). Here every layout / slice / negate / concat step from x is traced as index
arrays (numpy; a symbolic dim, seq in a decoder's one build, at two sample values: _groups), so
whatever op sequence an exporter wrote is recognised by what it computes: each output the rest of
the graph reads is x's columns [o, o + H d) as (B, H, S, d), (B, H, d, S) or (B, S, H, d),
optionally rotated. All of one x's outputs come from one kernel:
rows (b, s) parallel, x's row read once, each head's row (and its RoPE halves) vectorised.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from blockforge.compile.passes.exprs import op_name as _op, split_sections, static_shape as _static, users_of
from blockforge.compile.passes.kernels import add_kernel

KERNEL_ATTR = "blockforge.qkv_heads"  # PrimFunc attr: the kernel's outputs, for tests and tune
LAYOUTS = {"bhsd": (0, 1, 2, 3), "bhds": (0, 1, 3, 2), "bshd": (0, 2, 1, 3)}  # of (B, H, S, d)


@dataclass(frozen=True)
class Rope:
    """x's part pre_idx (B, H, S, d), rotated: t * cos + rotate_half(t) * sin."""
    pre: object  # np.ndarray: indices into x of the rotated tensor's input
    cos: object  # relax expr, broadcastable to (B, 1, S, d)
    sin: object


@dataclass(frozen=True)
class Traced:
    """A tensor computed from root x by layout steps only: idx[i] = the element of x (flat
    index) it holds, sign -1 where negated; with rope, idx indexes the rotated tensor instead."""
    root: object
    idx: object
    sign: object
    rope: Rope | None = None


@dataclass(frozen=True)
class _Summary:
    """A traced var as groups() uses it: its root, shape, head layout (or None), RoPE tables."""
    root: object
    shape: list
    lay: tuple | None
    rope: tuple | None  # (cos, sin)
    rotated: bool  # the RoPE's own result (its multiplies are internal)


@dataclass(frozen=True)
class HeadsOut:
    """One output of the kernel: x's columns [offset, offset + heads * d) in `layout`."""
    layout: str
    offset: int
    heads: int
    d: int
    rope: int | None  # index of its (cos, sin) pair among the kernel's inputs


def _ints(t) -> list[int]:
    return [int(v) for v in t]


def _head_layout(idx, shape_x) -> tuple[str, int, int, int] | None:
    """(layout, offset, heads, d) when idx (4-D, indices into x (B, S, N)) is a column range
    of x as (B, H, S, d), (B, H, d, S) or (B, S, H, d), else None."""
    bsz, s, n = shape_x
    if idx.ndim != 4 or idx.size == 0:
        return None
    o = int(idx.reshape(-1)[0] % n)
    for name, perm in LAYOUTS.items():
        # the layout's dims back in (B, H, S, d) order
        dims = [0] * 4
        for i, p in enumerate(perm):
            dims[p] = idx.shape[i]
        if dims[0] != bsz or dims[2] != s:
            continue
        b, h, q, j = np.ix_(*[np.arange(v) for v in dims])
        want = (b * s * n + q * n + o + h * dims[3] + j).transpose(perm)
        if want.shape == idx.shape and np.array_equal(want, idx):
            return name, o, dims[1], dims[3]
    return None


@mutator
class _QKVHeads(PyExprMutator):
    def __init__(self, mod, lanes: int):
        super().__init__(mod)
        self.lanes = lanes
        self.plan: dict = {}  # sink var -> (group, output index)
        self.hoist: dict = {}  # group id -> the bindings to emit before its kernel (Plan._hoist)
        self.hoisted: set = set()  # their vars, skipped where the function binds them
        self.emitted: dict = {}  # group id -> the kernel call's tuple var
        self.kernels: dict = {}  # kernel key -> GlobalVar

    def visit_var_binding_(self, binding):
        if binding.var in self.hoisted:  # emitted already, before a kernel that reads it
            return None
        todo = self.plan.get(binding.var)
        if todo is None:
            return super().visit_var_binding_(binding)
        group, i = todo
        if id(group) not in self.emitted:
            for b in self.hoist.get(id(group), []):
                if b.var not in self.hoisted:
                    super().visit_var_binding_(b)
                    self.hoisted.add(b.var)
            self.emitted[id(group)] = self.builder_.emit(self._call(group))
        call = self.emitted[id(group)]
        # (a kernel of one output, a lone K^T, returns that tensor, not a tuple of it)
        value = relax.TupleGetItem(call, i) if isinstance(call.ty, tvm.ir.TupleType) else call
        self.builder_.emit_normalized(relax.VarBinding(binding.var, self.builder_.normalize(value)))

    def _call(self, group):
        x, outs, pairs, shapes = group
        args = [self.visit_expr(x)]
        for cos, sin in pairs:
            for c in (cos, sin):
                c = self.visit_expr(c)
                shp = list(c.ty.shape)
                if len(shp) < 4:
                    c = self.builder_.emit(relax.op.reshape(c, [1] * (4 - len(shp)) + shp))
                args.append(c)
        xs, tabs = _dims(x.ty.shape), [_dims(a.ty.shape) for a in args[1:]]
        # (a var in a key by its hash, the object's address: == on vars builds an expression)
        hkey = lambda dims: tuple(d if isinstance(d, int) else ("var", hash(d)) for d in dims)  # noqa: E731
        key = (hkey(xs), tuple(outs), tuple(hkey(t) for t in tabs))
        if key not in self.kernels:
            func = heads_kernel(list(xs), outs, [list(t) for t in tabs], self.lanes)
            self.kernels[key] = add_kernel(self.builder_, func, "qkv_heads")
        return relax.call_tir(self.kernels[key], args, out_ty=[relax.TensorType(s, "float32") for s in shapes])


class _Plan:
    """Traces one function's bindings and groups the outputs to compute per root. A symbolic dim
    (seq in a build bound with seq left free) is traced at a sample value (`sample`: tirx var ->
    int); qkv_heads_pass keeps only what two different samples trace alike."""

    def __init__(self, func, sample: dict | None = None):
        self.sample = sample or {}
        self.analyzer = tvm.sym.Analyzer()
        for var, value in self.sample.items():
            self.analyzer.bind(var, value)
        self.v2v = relax.analysis.get_var2val(func)
        self.order: dict = {}
        self.block: dict = {}
        for bi, blk in enumerate(func.body.blocks):
            for b in blk.bindings:
                self.order[b.var] = len(self.order)
                self.block[b.var] = bi
        self.users = users_of(func)
        self.memo: dict = {}

    def _shape(self, shape) -> list[int] | None:
        """A shape's dims as ints, symbolic ones at their sample value; None when a dim reads a
        var with no sample (or there is no shape)."""
        if shape is None:
            return None
        out = _static(shape)
        if out is not None or not self.sample:
            return out
        try:
            dims = list(shape)
        except TypeError:
            return None
        out = []
        for d in dims:
            v = self.analyzer.simplify(d)
            if not isinstance(v, tvm.tirx.IntImm):
                return None
            out.append(int(v))
        return out

    def trace(self, e) -> Traced | None:
        if not isinstance(e, relax.Var):
            return None
        if e not in self.memo:
            self.memo[e] = None  # no cycles in dataflow, but be safe
            try:
                self.memo[e] = self._trace(e)
            except ValueError:  # numpy refused the shapes: at samples, free dims that do not fit each other
                if not self.sample:
                    raise
        return self.memo[e]

    def _trace(self, var) -> Traced | None:
        e = self.v2v.get(var)
        if e is None or getattr(var.ty, "dtype", None) != "float32" or self._shape(var.ty.shape) is None:
            return None
        if isinstance(e, relax.TupleGetItem):
            sp = self.v2v.get(e.tuple_value)
            if _op(sp) != "relax.split":
                return None
            x = sp.args[0]
            shp = self._shape(getattr(x.ty, "shape", None))
            if shp is None or len(shp) != 3 or int(sp.attrs.axis) not in (2, -1) or x.ty.dtype != "float32":
                return None
            parts = np.split(np.arange(int(np.prod(shp)), dtype=np.int32).reshape(shp), split_sections(sp), axis=2)
            idx = parts[int(e.index)]
            return Traced(x, idx, np.ones(idx.shape, np.int8))
        op = _op(e)
        if op == "relax.add":
            return self._rope(var, e)
        a = self.trace(e.args[0]) if op in ("relax.reshape", "relax.permute_dims", "relax.strided_slice",
                                            "relax.negative") else None
        out = self._shape(var.ty.shape)
        if op == "relax.reshape":
            if a is None:  # a new root: a (B, S, N) tensor viewed as heads
                x = e.args[0]
                shp = self._shape(getattr(x.ty, "shape", None))
                if shp is None or len(shp) != 3 or len(out) != 4 or getattr(x.ty, "dtype", None) != "float32":
                    return None
                a = Traced(x, np.arange(int(np.prod(shp)), dtype=np.int32).reshape(shp),
                           np.ones(shp, np.int8))
            return Traced(a.root, a.idx.reshape(out), a.sign.reshape(out), a.rope)
        if a is None and op != "relax.concat":
            return None
        if op == "relax.permute_dims":
            axes = None if e.attrs.axes is None else _ints(e.attrs.axes)
            return Traced(a.root, a.idx.transpose(axes), a.sign.transpose(axes), a.rope)
        if op == "relax.negative":
            return Traced(a.root, a.idx, -a.sign, a.rope)
        if op == "relax.strided_slice":
            try:
                axes, begin, end = (_ints(t) for t in e.args[1:4])
                strides = _ints(e.args[4]) if len(e.args) > 4 else [1] * len(axes)  # absent: all 1
            except (TypeError, ValueError):
                return None
            sl = [slice(None)] * a.idx.ndim
            for ax, b, en, st in zip(axes, begin, end, strides):
                sl[ax] = slice(b, min(en, a.idx.shape[ax]), st)
            sl = tuple(sl)
            return Traced(a.root, a.idx[sl], a.sign[sl], a.rope) if list(a.idx[sl].shape) == out else None
        if op == "relax.concat" and isinstance(e.args[0], relax.Tuple):
            ts = [self.trace(f) for f in e.args[0].fields]
            if not ts or any(t is None or not t.root.same_as(ts[0].root) or t.rope is not ts[0].rope for t in ts):
                return None
            ax = int(e.attrs.axis)
            return Traced(ts[0].root, np.concatenate([t.idx for t in ts], ax),
                          np.concatenate([t.sign for t in ts], ax), ts[0].rope)
        return None

    def _rope(self, var, add) -> Traced | None:
        """add(t * cos, rotate_half(t) * sin) (either order), t traced (B, H, S, d) from x."""
        muls = [self.v2v.get(a) if isinstance(a, relax.Var) else None for a in add.args]
        if any(_op(m) != "relax.multiply" for m in muls):
            return None
        shape = self._shape(var.ty.shape)
        for plain_mul, rot_mul in (muls, muls[::-1]):
            for t_e, c in (plain_mul.args, plain_mul.args[::-1]):
                t = self.trace(t_e)
                if t is None or t.rope is not None or t.idx.ndim != 4 or not np.all(t.sign == 1):
                    continue
                if list(t.idx.shape) != shape or t.idx.shape[-1] % 2:
                    continue
                for r_e, s in (rot_mul.args, rot_mul.args[::-1]):
                    r = self.trace(r_e)
                    if r is None or r.rope is not None or not r.root.same_as(t.root):
                        continue
                    h2 = shape[-1] // 2
                    want = np.concatenate([t.idx[..., h2:], t.idx[..., :h2]], -1)
                    sign = np.concatenate([-np.ones(h2, np.int8), np.ones(h2, np.int8)])
                    if r.idx.shape != want.shape or not np.array_equal(r.idx, want) or \
                            not np.all(r.sign == sign):
                        continue
                    if not (self._table(c, shape) and self._table(s, shape)):
                        continue
                    n = int(np.prod(shape))
                    return Traced(t.root, np.arange(n, dtype=np.int32).reshape(shape),
                                  np.ones(shape, np.int8), Rope(t.idx, c, s))
        return None

    def _table(self, c, shape) -> bool:
        """cos/sin: float32, broadcastable as (1 or B, 1, S, d) (S free or not), not traced from x."""
        shp = self._shape(getattr(c.ty, "shape", None))
        if shp is None or getattr(c.ty, "dtype", None) != "float32" or len(shp) > 4 or self.trace(c) is not None:
            return False
        shp = [1] * (4 - len(shp)) + shp
        return shp[0] in (1, shape[0]) and shp[1] == 1 and shp[2:] == shape[2:]

    def _summary(self, t: Traced) -> _Summary:
        """What groups() needs of a trace, without its index arrays."""
        shp = self._shape(t.root.ty.shape)
        lay = None
        if t.rope is None:
            lay = _head_layout(t.idx, shp) if np.all(t.sign == 1) else None
        else:
            pre = _head_layout(t.rope.pre, shp)
            if pre is not None and pre[0] == "bhsd" and np.all(t.sign == 1):
                base = np.arange(t.idx.size, dtype=np.int32).reshape(t.rope.pre.shape)
                lay = next(((name, *pre[1:]) for name, perm in LAYOUTS.items()
                            if base.transpose(perm).shape == t.idx.shape
                            and np.array_equal(base.transpose(perm), t.idx)), None)
        rotated = t.rope is not None and np.array_equal(t.idx.reshape(-1), np.arange(t.idx.size))
        return _Summary(t.root, list(t.idx.shape), lay, (t.rope.cos, t.rope.sin) if t.rope else None, rotated)

    def groups(self) -> list:
        """(x, [HeadsOut], [(cos, sin)], [out shapes], [sink vars], [vars to bind before the kernel])
        per root x worth rewriting."""
        traced, root = {}, None
        for v in self.order:
            t = self.trace(v)
            if t is None:
                continue
            traced[v] = self._summary(t)
            if root is None or not t.root.same_as(root):
                # a new root (the next layer): the earlier roots' index arrays go (a later
                # trace of them recomputes); the memo held every layer's at once
                root = t.root
                self.memo = {k: m for k, m in self.memo.items() if m is None or m.root.same_as(root)}
        ropes_inner = set()  # the multiplies of matched RoPEs: read only by their rotated result
        for v, t in traced.items():
            if t.rotated:
                for a in self.v2v[v].args:
                    ropes_inner.add(a)
        by_root: dict = {}
        for v, t in traced.items():
            users = self.users.get(v, [])
            if users and all(u is not None and (u in traced or (u in ropes_inner and all(
                    w is not None and w in traced for w in self.users.get(u, [])))) for u in users):
                continue  # only read by more layout steps (or its RoPE): not an output
            by_root.setdefault(t.root, []).append(v)
        out = []
        for x, sinks in by_root.items():
            outs, pairs, shapes, ok = [], [], [], True
            for v in sinks:
                t = traced[v]
                if t.lay is None:
                    ok = False
                    break
                rope = None
                if t.rope is not None:
                    rope = next((i for i, (c, s) in enumerate(pairs)
                                 if c.same_as(t.rope[0]) and s.same_as(t.rope[1])), None)
                    if rope is None:
                        pairs.append(t.rope)
                        rope = len(pairs) - 1
                outs.append(HeadsOut(t.lay[0], t.lay[1], t.lay[2], t.lay[3], rope))
                shapes.append(list(v.ty.shape))  # as declared (symbolic dims stay symbolic)
            split_root = any(_op(self.v2v.get(self.v2v[v].tuple_value)) == "relax.split"
                             for v in traced if traced[v].root.same_as(x)
                             and isinstance(self.v2v.get(v), relax.TupleGetItem))
            # A root with no split and no RoPE is worth a kernel only for a K^T: a (B, S, H, d) or
            # (B, H, S, d) read of one projection is a view or TVM's own copy, but its transpose to
            # (B, H, d, S) was a scalar strided kernel (BERT-base 0.065 ms a layer, Whisper-base's
            # 1.2; this kernel writes whole vectors along S).
            if not ok or not (split_root or any(o.rope is not None or o.layout == "bhds" for o in outs)):
                continue
            # the kernel's buffers take x's and the tables' dims as they are: ints or plain vars
            if not all(_plain_dims(e.ty.shape) for e in [x, *(c for p in pairs for c in p)]):
                continue
            first = min(sinks, key=self.order.get)
            if len({self.block[v] for v in sinks}) != 1:
                continue
            hoist = self._hoist([c for p in pairs for c in p], first, traced)
            if hoist is None:
                continue
            out.append((x, outs, pairs, shapes, sinks, hoist))
        return out

    def _hoist(self, tables: list, first, traced) -> list | None:
        """The bindings a kernel emitted at `first` needs moved before it: the RoPE tables'
        chains bound after `first`, in order ([] where the tables come first, as in a bound
        build, whose tables are constants). A step entry (past symbolic) computes them from
        `past` after layer 0's split, so layer 0 kept its split and RoPE kernels (Llama, Qwen2:
        tests/test_decode_entries.py). None: a chain that reads x's trace or lies in another
        block (not moved)."""
        need, todo = set(), [c for c in tables if isinstance(c, relax.Var) and c in self.order]
        while todo:
            v = todo.pop()
            if v in need or self.order[v] < self.order[first]:
                continue
            if v in traced or self.block[v] != self.block[first]:
                return None
            need.add(v)
            todo += [u for u in relax.analysis.free_vars(self.v2v[v]) if u in self.order]
        return sorted(need, key=self.order.get)


def _plain_dims(shape) -> bool:
    return shape is not None and all(isinstance(d, (tvm.tirx.IntImm, tvm.tirx.Var)) for d in shape)


def _dims(shape) -> tuple:
    """A shape as the kernel key and heads_kernel take it: ints, symbolic dims as their vars."""
    return tuple(int(d) if isinstance(d, tvm.tirx.IntImm) else d for d in shape)


def heads_kernel(shape_x: list, outs: list[HeadsOut], tables: list, lanes: int = 16):
    """The PrimFunc: x (B, S, N), the (cos, sin) tables (4-D), one buffer per output. A dim is an
    int or a symbolic var (seq in a build that leaves it free): each var becomes one of the
    kernel's own, bound by the buffers' shapes; the row tiles then end in a tail of S mod 16."""
    from tvm import tirx
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    own: dict = {}  # the function's dim var (by hash) -> the kernel's

    def i64(v):
        if isinstance(v, int):
            return tirx.const(v, "int64")
        return own.setdefault(hash(v), tirx.Var(v.name, "int64"))
    bsz, s_len, n = shape_x
    full_tiles = isinstance(s_len, int) and s_len % lanes == 0
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("qkv_heads")
            X = T.arg("x", T.buffer([i64(bsz), i64(s_len), i64(n)], "float32"))
            tabs = [T.arg(f"table{i}", T.buffer([i64(v) for v in shp], "float32")) for i, shp in enumerate(tables)]
            bufs = []
            for i, o in enumerate(outs):
                dims = {"b": bsz, "h": o.heads, "s": s_len, "d": o.d}
                bufs.append(T.arg(f"out{i}", T.buffer([i64(dims[c]) for c in o.layout], "float32")))
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8,
                         KERNEL_ATTR: ",".join(f"{o.layout}@{o.offset}:{o.heads}x{o.d}" + ("+rope" if o.rope is not None else "")
                                               for o in outs)})
            # Blocks of `lanes` rows: a K^T output (B, H, d, S) is stored from a row tile as
            # whole vectors along S (row by row, each of its d values was a strided scatter).
            sb = lanes
            seq = i64(s_len)
            n_sb = tirx.floordiv(seq + i64(sb - 1), i64(sb))
            with T.parallel(i64(0), i64(bsz) * n_sb) as p:
                b = tirx.floordiv(p, n_sb)
                s0 = tirx.floormod(p, n_sb) * i64(sb)
                rows = i64(sb) if full_tiles else tirx.min(i64(sb), seq - s0)
                for o, buf in zip(outs, bufs):
                    def at(h, s, j, o=o):
                        return [{"b": b, "h": h, "s": s, "d": j}[c] for c in o.layout]
                    with T.serial(i64(0), i64(o.heads)) as h:
                        base = i64(o.offset) + h * i64(o.d)
                        tile = T.alloc_buffer((sb, o.d), "float32", scope="local") if o.layout == "bhds" else None
                        with T.serial(i64(0), rows) as i:
                            s = s0 + i
                            put = (lambda j, v, i=i: T.buffer_store(tile, v, [i, j])) if tile is not None else \
                                (lambda j, v, h=h, s=s, at=at, buf=buf: T.buffer_store(buf, v, at(h, s, j)))
                            _row(T, X, b, s, base, o, tabs, put, i64)
                        if tile is not None:
                            with T.serial(i64(0), i64(o.d)) as j:
                                _store_tile(T, tirx, tile, buf, at, h, s0, j, sb, rows, full_tiles, seq, i64)
    return ib.get()


def _store_tile(T, tirx, tile, buf, at, h, s0, j, sb, rows, full_tiles, seq, i64):
    """Column j of a K^T row tile into buf: one vector of sb rows where the tile is whole (all
    tiles of an S that 16 divides; else all but the last), the last row by row."""
    def vector():
        with T.vectorized(i64(0), i64(sb)) as i:
            T.buffer_store(buf, tile[i, j], at(h, s0 + i, j))

    def rowwise():
        with T.serial(i64(0), rows) as i:
            T.buffer_store(buf, tile[i, j], at(h, s0 + i, j))
    if full_tiles:
        vector()
    else:
        with T.If(s0 + i64(sb) <= seq):
            with T.Then():
                vector()
            with T.Else():
                rowwise()


def _row(T, X, b, s, base, o: HeadsOut, tabs, put, i64):
    """One head's row of x (columns base .. base + d), rotated when o has RoPE, into put(j, v)."""
    if o.rope is None:
        with T.vectorized(i64(0), i64(o.d)) as j:
            put(j, X[b, s, base + j])
        return
    cos, sin = tabs[2 * o.rope], tabs[2 * o.rope + 1]

    def tab(t, j):  # a table of batch 1 is broadcast over b
        one = isinstance(t.shape[0], tvm.tirx.IntImm) and int(t.shape[0]) == 1
        return t[i64(0) if one else b, i64(0), s, j]
    h2 = i64(o.d // 2)
    with T.vectorized(i64(0), h2) as j:
        lo, hi = X[b, s, base + j], X[b, s, base + h2 + j]
        put(j, lo * tab(cos, j) - hi * tab(sin, j))
        put(j + h2, hi * tab(cos, j + h2) + lo * tab(sin, j + h2))


def is_kernel(func) -> bool:
    return func.attrs is not None and KERNEL_ATTR in func.attrs


# Sample values for symbolic dims: two sets, different and unlike any head count or width, so a
# trace that holds at both is one of the layouts above at every length, not a coincidence of one.
_SAMPLES = ((29, 31, 37, 41, 43), (47, 53, 59, 61, 67))


def _groups(func) -> list:
    """_Plan(func).groups(); with symbolic dims, the groups both sample sets find alike."""
    syms = list(relax.analysis.defined_symbolic_vars(func))
    if not syms:
        return _Plan(func).groups()
    if len(syms) > len(_SAMPLES[0]):
        return []
    found = []
    for vals in _SAMPLES:
        try:
            found.append(_Plan(func, {v: tvm.tirx.const(n, str(v.ty.dtype)) for v, n in zip(syms, vals)}).groups())
        except ValueError:  # past the traces (their own refusals are None): shapes the samples make unfit
            return []
    key = lambda g: (g[0], tuple(g[1]), tuple(g[4]))  # noqa: E731  (x, outputs, sinks)
    other = {key(g) for g in found[1]}
    return [g for g in found[0] if key(g) in other]


def qkv_heads_pass(lanes: int = 16) -> tvm.transform.Pass:
    """The rewrite above over every Relax function, then the dead chain removed."""

    @tvm.transform.module_pass(opt_level=0, name="BlockforgeQKVHeads")
    def qkv_heads(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        from blockforge.compile.passes.exprs import rewrite_functions

        def plan(m, func) -> bool:
            groups = _groups(func) if isinstance(func.body, relax.SeqExpr) else []
            # per function: `emitted` is keyed by id(group), and a freed group's id may come back
            # for the next function's group (then its kernel call would be another function's var:
            # "Var lv is not defined" with a third entry, compile/decode/inplace.py)
            m.plan, m.hoist, m.hoisted, m.emitted = {}, {}, set(), {}
            bindings = {b.var: b for blk in func.body.blocks for b in blk.bindings} if groups else {}
            for g in groups:
                x, outs, pairs, shapes, sinks, hoist = g
                grp = (x, outs, pairs, shapes)
                for i, v in enumerate(sinks):
                    m.plan[v] = (grp, i)
                m.hoist[id(grp)] = [bindings[v] for v in hoist]
            return bool(groups)

        return rewrite_functions(mod, _QKVHeads(mod, lanes), plan, dce=True)

    return qkv_heads
