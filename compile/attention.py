"""Fused CPU attention: softmax(Q K^T * scale [+ mask]) V in one kernel, flash-style.

    for (batch, head, query tile) in parallel:           # QT query rows
        acc[QT, Dv] = 0;  m[QT] = -inf;  l[QT] = 0        # running max and sum
        for key tile k0 (KT keys; causal: only tiles at or left of the diagonal):
            s[QT, KT] = Q[q0:, :] K^T[:, k0:] * scale (+ add) (where keep else fill)
            m' = max(m, rowmax s);  p = exp(s - m');  alpha = exp(m - m')
            l = l alpha + rowsum p;  acc = acc alpha + p V[k0:, :];  m = m'
        O[q0:, :] = acc / l

The S x S scores never reach memory. Q K^T is a register-tiled micro-kernel (MR query
rows x KT keys, vectorised along the keys of K^T, which the graph already lays out as
(.., d, S)); P V is one too (MR rows x Dv, vectorised along Dv); exp is a vectorisable
polynomial (topi.fast_exp's). Accumulation is float32 for float16 models.

The Relax pass (`fuse_attention`) finds matmul(Q, K^T) -> [* or / const] -> [+ mask]
-> [where(keep, ., fill)] -> softmax(-1) -> [where(isnan(P), 0, P)] -> matmul(., V) (SDPA's
export also scales Q and K^T by sqrt(scale) each, and may repeat K/V for grouped-query
heads: both are read through, the kernel indexing the kv heads) and replaces it by a call_tir
of this kernel, reading Q, V and writing O in the layouts the graph has around it
(absorbing the head transposes), and merging the seed's h per-head attentions over
split projections into one multi-head call. Tile sizes come from the tuning database
(`tile_record`) or the defaults.
"""

from __future__ import annotations

import logging
import math
import json
from dataclasses import asdict, dataclass, replace

import numpy as np

_log = logging.getLogger("blockforge.attention")

# (query tile, key tile). Key tiles are whole vectors of K^T: 4 vectors (64 keys with
# AVX-512, 32 with AVX2, 16 with NEON) by default. Measured (BERT-base, 12 heads, kernel
# alone, 1 thread CPU time, AVX-512) at seq 128 / 512: 32x64 0.70/10.3 ms, 48x64 0.77/10.6,
# 64x64 0.68/10.2, 96x64 1.00/11.6 (s + acc tiles outgrow L1), 128x64 0.67/10.2, 32x128
# 0.63/10.3, 64x128 0.62/10.0: within 10% but 96 rows; `tune` picks per device and shape.
def default_tiles(lanes: int) -> tuple[int, int]:
    return (64, 4 * lanes)


def tile_candidates(lanes: int) -> tuple[tuple[int, int], ...]:
    """What `tune` times per kernel (compile/attention.py: the kernel; tune/attention_tiles.py)."""
    return ((32, 4 * lanes), (48, 4 * lanes), (64, 4 * lanes), (96, 4 * lanes), (128, 4 * lanes),
            (32, 8 * lanes), (64, 8 * lanes))


def acc_regs(lanes: int) -> int:
    """Accumulator vector registers a micro-kernel may hold: 24 of the 32 of AVX-512 and
    NEON (the rest carry the K^T / V loads and broadcasts); 12 of AVX2's 16."""
    return 12 if lanes == 8 else 24


KERNEL_ATTR = "blockforge.attention"  # PrimFunc attr: the spec, for tune and tests


@dataclass(frozen=True)
class AttentionSpec:
    """Everything that shapes the kernel (the tuning workload is the kernel of a spec).

    Layout letters: b batch, h head, s sequence, d feature. q/v/o: "bhsd", "bshd" or
    "bsd" (one head per call); k is K^T: "bhds" or "bds". Mask dims name the score axis
    each mask axis follows: "b", "h", "q", "k", or "1" (broadcast)."""
    dtype: str
    q: str
    k: str
    v: str
    o: str
    heads: int
    d: int
    dv: int
    scale: float
    batch: int | None = None  # None: symbolic
    sq: int | None = None
    skv: int | None = None
    add: tuple[str, ...] | None = None
    add_dtype: str = "float32"
    keep: tuple[str, ...] | None = None  # bool mask for where(keep, s, fill)
    causal: bool = False  # key j <= query i also kept (in-kernel; tiles above skipped)
    fill: float | None = None  # where's value for dropped scores
    same_len: bool = False  # symbolic query and key lengths are one variable
    # SDPA's guard where(isnan(P), 0, P): a row whose softmax is NaN (all scores -inf, or a
    # NaN/+inf score: its denominator is then 0 or NaN) comes out 0, not NaN
    nan_rows_zero: bool = False
    kv_heads: int | None = None  # grouped-query: K/V have this many heads (None: heads)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "AttentionSpec":
        d = json.loads(text)
        for k in ("add", "keep"):
            if d.get(k) is not None:
                d[k] = tuple(d[k])
        return AttentionSpec(**d)

    def describe(self) -> str:
        mask = "+".join(x for x in ("causal" if self.causal else "", "add" if self.add else "",
                                    "keep" if self.keep else "") if x) or "none"
        extra = (f" kv_heads={self.kv_heads}" if self.kv_heads else "") + \
            (" nan-rows-zero" if self.nan_rows_zero else "")
        return (f"{self.dtype} q:{self.q} k:{self.k} v:{self.v} o:{self.o} h={self.heads} d={self.d} "
                f"dv={self.dv} mask={mask}{extra}")


def _vec_width(n: int, lanes: int) -> int:
    """Widest power-of-two width <= lanes that divides n (1: scalar)."""
    w = lanes
    while w > 1 and n % w:
        w //= 2
    return w


def _rows(qt: int, vecs_per_row: int, lanes: int) -> int:
    """Micro-kernel rows: the largest divisor of qt whose accumulators fit the registers."""
    cap = max(1, acc_regs(lanes) // max(1, vecs_per_row))
    return max(r for r in range(1, min(qt, cap) + 1) if qt % r == 0)


def fast_exp(x, nonpositive: bool = False):
    """topi.fast_exp's polynomial as a TIR expression (float32): vectorises and inlines,
    unlike libm's expf; relative error ~1e-7; exp(-inf) and anything below -88.38 give
    exactly 0. nonpositive: x <= 0 is known (scores minus their running max), so only the
    lower clamp is needed. NaN stays NaN (and so does inf - inf): TVM lowers max(a, b) to
    select(a > b, a, b), which returns b when either is NaN, so x goes second in the clamps
    (one max/min instruction all the same)."""
    from tvm import tirx

    f = lambda v: tirx.const(v, "float32")  # noqa: E731
    xv, nv, rv = (tirx.Var(n, "float32") for n in ("exp_x", "exp_n", "exp_r"))
    p = f(1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * rv + f(c)
    p = p * rv * rv + rv + f(1.0)
    two_n = tirx.reinterpret("float32", tirx.shift_left(tirx.Cast("int32", nv) + 127, 23))
    body = tirx.Let(rv, xv - nv * f(0.693147180559945), two_n * p)
    body = tirx.Let(nv, tirx.floor(xv * f(1.44269504088896341) + f(0.5)), body)
    clamped = tirx.max(f(-88.3762626647949), x if nonpositive else tirx.min(f(88.3762626647950), x))
    return tirx.Let(xv, clamped, body)


def kernel(spec: AttentionSpec, tiles: tuple[int, int] | None = None, lanes: int = 16):
    """The fused attention PrimFunc for `spec` with (query tile, key tile) `tiles` (default:
    default_tiles), for a target with `lanes` float32 lanes per vector."""
    from tvm import tirx
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    qt, kt = tiles or default_tiles(lanes)
    if spec.sq is not None and spec.sq < qt:
        # A decode step (Sq = 1, or a short chunk): a full query tile would compute qt rows
        # (clamped to the last, not stored) for the Sq real ones, qt/Sq times the work.
        qt = spec.sq
    tiles = (qt, kt)
    i64 = lambda v: tirx.const(v, "int64")  # noqa: E731
    f32 = lambda v: tirx.const(v, "float32")  # noqa: E731
    neg_inf = f32(-math.inf)
    vk = _vec_width(kt, lanes)  # key-tile vector width (kt is a multiple of lanes by choice)
    mr_s = _rows(qt, max(1, kt // lanes), lanes)  # Q K^T micro-kernel rows
    mr_o = _rows(qt, max(1, spec.dv // lanes), lanes)  # P V micro-kernel rows

    def dim(v, name):
        return i64(v) if v is not None else tirx.Var(name, "int64")

    B, Sq, Skv = dim(spec.batch, "batch"), dim(spec.sq, "seq"), dim(spec.skv, "kv_seq")
    if spec.same_len:
        Skv = Sq
    H = i64(spec.heads)
    Hk = i64(spec.kv_heads or spec.heads)
    group = spec.heads // (spec.kv_heads or spec.heads)  # query heads per key/value head
    D, Dv = i64(spec.d), i64(spec.dv)
    ext = {"b": B, "h": H, "q": Sq, "k": Skv}

    def shape(layout, s, d, heads=H):
        return [{"b": B, "h": heads, "s": s, "d": d}[c] for c in layout]

    def at(layout, b, h, s, d):
        return [{"b": b, "h": h, "s": s, "d": d}[c] for c in layout]

    def mask_shape(dims):
        return [i64(1) if c == "1" else ext[c] for c in dims]

    def mask_at(dims, b, h, q, k):
        return [i64(0) if c == "1" else {"b": b, "h": h, "q": q, "k": k}[c] for c in dims]

    kshape = [{"b": B, "h": Hk, "d": D, "s": Skv}[c] for c in spec.k]

    def kt_at(b, h, d, s):
        return [{"b": b, "h": h, "d": d, "s": s}[c] for c in spec.k]

    def to32(e, dtype=spec.dtype):
        return e if dtype == "float32" else tirx.Cast("float32", e)

    n_q = (Sq + i64(qt - 1)) // i64(qt)
    static_q_exact = spec.sq is not None and spec.sq % qt == 0
    static_k_exact = spec.skv is not None and spec.skv % kt == 0
    fill = f32(spec.fill if spec.fill is not None else 0.0)

    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("fused_attention")
            Q = T.arg("q", T.buffer(shape(spec.q, Sq, D), spec.dtype))
            K = T.arg("k_t", T.buffer(kshape, spec.dtype))
            V = T.arg("v", T.buffer(shape(spec.v, Skv, Dv, Hk), spec.dtype))
            A = T.arg("add", T.buffer(mask_shape(spec.add), spec.add_dtype)) if spec.add else None
            M = T.arg("keep", T.buffer(mask_shape(spec.keep), "bool")) if spec.keep else None
            O = T.arg("out", T.buffer(shape(spec.o, Sq, Dv), spec.dtype))
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, KERNEL_ATTR: spec.to_json(),
                         KERNEL_ATTR + ".tiles": f"{qt}x{kt}"})
            with T.parallel(i64(0), B * H * n_q) as p:
                b = p // (H * n_q)
                h = p // n_q % H
                hk = h // i64(group) if group > 1 else h  # the key/value head
                q0 = p % n_q * i64(qt)
                acc = T.alloc_buffer((qt, spec.dv), "float32", scope="local")
                s = T.alloc_buffer((qt, kt), "float32", scope="local")
                m = T.alloc_buffer((qt,), "float32", scope="local")
                el = T.alloc_buffer((qt,), "float32", scope="local")
                alpha = T.alloc_buffer((qt,), "float32", scope="local")
                part = T.alloc_buffer((vk,), "float32", scope="local")
                pmax = T.alloc_buffer((qt, vk), "float32", scope="local")  # per-row partial maxima
                with T.serial(i64(0), i64(qt)) as i:
                    T.buffer_store(m, neg_inf, [i])
                    T.buffer_store(el, f32(0), [i])
                    with T.vectorized(i64(0), i64(spec.dv)) as d:
                        T.buffer_store(acc, f32(0), [i, d])

                def qrow(i):
                    """Query row q0 + i, clamped for the last tile's rows past Sq (computed, not stored)."""
                    return q0 + i if static_q_exact else tirx.min(q0 + i, Sq - i64(1))

                def halve(buf, op):
                    """Reduce buf[0:vk] into buf[0] as a tree of vector halves (log2 steps, not
                    vk dependent scalar ones: the row reductions are latency-bound)."""
                    w = vk
                    while w > 1:
                        w //= 2
                        with T.vectorized(i64(0), i64(w)) as j:
                            T.buffer_store(buf, op(buf[j], buf[j + i64(w)]), [j])

                def tile(k0, valid):
                    """One key tile at k0 (valid: its key count when partial, else None)."""
                    kidx = (lambda j: k0 + j) if valid is None else (lambda j: tirx.min(k0 + j, Skv - i64(1)))
                    # scores: MR rows x KT keys in registers, reduced over d
                    with T.serial(i64(0), i64(qt // mr_s)) as io:
                        r = T.alloc_buffer((mr_s, kt), "float32", scope="local")
                        with T.unroll(i64(0), i64(mr_s)) as ii:
                            with T.vectorized(i64(0), i64(kt)) as j:
                                T.buffer_store(r, f32(0), [ii, j])
                        with T.serial(i64(0), D) as d:
                            with T.unroll(i64(0), i64(mr_s)) as ii:
                                qv = to32(Q[tuple(at(spec.q, b, h, qrow(io * i64(mr_s) + ii), d))])
                                with T.vectorized(i64(0), i64(kt)) as j:
                                    kv = to32(K[tuple(kt_at(b, hk, d, kidx(j)))])
                                    T.buffer_store(r, r[ii, j] + qv * kv, [ii, j])
                        with T.unroll(i64(0), i64(mr_s)) as ii:
                            row = io * i64(mr_s) + ii
                            # the row max is taken here, from registers: one pass over s less
                            with T.vectorized(i64(0), i64(vk)) as j:
                                T.buffer_store(pmax, neg_inf, [row, j])
                            with T.unroll(i64(0), i64(kt // vk)) as c:
                              with T.vectorized(i64(0), i64(vk)) as jv:
                                j = c * i64(vk) + jv
                                x = r[ii, j] * f32(spec.scale)
                                if A is not None:
                                    x = x + to32(A[tuple(mask_at(spec.add, b, h, qrow(row), kidx(j)))], spec.add_dtype)
                                keep = None
                                if M is not None:
                                    keep = M[tuple(mask_at(spec.keep, b, h, qrow(row), kidx(j)))]
                                if spec.causal:
                                    c = (k0 + j) <= (q0 + row)
                                    keep = c if keep is None else tirx.And(keep, c)
                                if keep is not None:
                                    x = tirx.Select(keep, x, fill)
                                if valid is not None:
                                    x = tirx.Select(j < valid, x, neg_inf)
                                x = T.Bind(x)
                                T.buffer_store(s, x, [row, j])
                                T.buffer_store(pmax, tirx.max(pmax[row, jv], x), [row, jv])
                    # online softmax: new running max, p = exp(s - m'), rescale factor alpha
                    with T.serial(i64(0), i64(qt)) as i:
                        with T.vectorized(i64(0), i64(vk)) as j:
                            T.buffer_store(part, pmax[i, j], [j])
                        halve(part, tirx.max)
                        mx = T.Bind(tirx.max(m[i], part[0]))
                        # a row with no finite score yet keeps exp(-inf - 0) = 0, not NaN
                        mu = T.Bind(tirx.Select(mx == neg_inf, f32(0), mx))
                        T.buffer_store(alpha, fast_exp(m[i] - mu, nonpositive=True), [i])
                        T.buffer_store(m, mx, [i])
                        with T.vectorized(i64(0), i64(vk)) as j:
                            T.buffer_store(part, f32(0), [j])
                        with T.serial(i64(0), i64(kt // vk)) as c:
                            with T.vectorized(i64(0), i64(vk)) as j:
                                e = T.Bind(fast_exp(s[i, c * i64(vk) + j] - mu, nonpositive=True))
                                T.buffer_store(s, e, [i, c * i64(vk) + j])
                                T.buffer_store(part, part[j] + e, [j])
                        halve(part, lambda a, c: a + c)
                        T.buffer_store(el, el[i] * alpha[i] + part[0], [i])
                    # acc = acc * alpha + P V: MR rows x Dv in registers, reduced over the keys
                    with T.serial(i64(0), i64(qt // mr_o)) as io:
                        r = T.alloc_buffer((mr_o, spec.dv), "float32", scope="local")
                        with T.unroll(i64(0), i64(mr_o)) as ii:
                            with T.vectorized(i64(0), Dv) as d:
                                row = io * i64(mr_o) + ii
                                T.buffer_store(r, acc[row, d] * alpha[row], [ii, d])
                        with T.serial(i64(0), i64(kt) if valid is None else valid) as j:
                            with T.unroll(i64(0), i64(mr_o)) as ii:
                                pv = s[io * i64(mr_o) + ii, j]
                                with T.vectorized(i64(0), Dv) as d:
                                    vv = to32(V[tuple(at(spec.v, b, hk, k0 + j, d))])
                                    T.buffer_store(r, r[ii, d] + pv * vv, [ii, d])
                        with T.unroll(i64(0), i64(mr_o)) as ii:
                            with T.vectorized(i64(0), Dv) as d:
                                T.buffer_store(acc, r[ii, d], [io * i64(mr_o) + ii, d])

                n_full = Skv // i64(kt)
                if spec.causal:  # tiles right of this query tile's diagonal are all dropped
                    n_full = tirx.min(n_full, (q0 + i64(qt + kt - 1)) // i64(kt))
                with T.serial(i64(0), n_full) as t:
                    tile(t * i64(kt), None)
                if not static_k_exact:
                    k_tail = Skv // i64(kt) * i64(kt)
                    cond = k_tail < Skv
                    if spec.causal:
                        cond = tirx.And(cond, k_tail <= q0 + i64(qt - 1))
                    with T.If(cond):
                        with T.Then():
                            tile(k_tail, Skv - k_tail)
                if spec.causal:
                    _causal_rest(T, tirx, spec, tiles, Skv, fill, q0, acc, m, el,
                                 lambda j, d: to32(V[tuple(at(spec.v, b, hk, j, d))]))
                with T.serial(i64(0), i64(qt)) as i:
                    def store():
                        inv = T.alloc_buffer((1,), "float32", scope="local")
                        T.buffer_store(inv, f32(1) / el[i], [0])
                        with T.vectorized(i64(0), Dv) as d:
                            y = acc[i, d] * inv[0]
                            if spec.nan_rows_zero:  # el is 0 (all -inf) or NaN exactly when softmax is NaN
                                y = tirx.Select(el[i] > f32(0), y, f32(0))
                            T.buffer_store(O, y if spec.dtype == "float32" else tirx.Cast(spec.dtype, y),
                                           at(spec.o, b, h, q0 + i, d))
                    if static_q_exact:
                        store()
                    else:
                        with T.If(q0 + i < Sq):
                            with T.Then():
                                store()
    func = ib.get()
    return func.with_attr("global_symbol", "fused_attention")


def _causal_rest(T, tirx, spec, tiles, Skv, fill, q0, acc, m, el, v_at):
    """Keys right of the visited tiles were all dropped (score = fill). They only matter
    for a row whose every visited score is dropped too (or -inf): exp(fill - m') is then
    not 0, and softmax spreads over them as well. Folded in exactly, per row, when so."""
    qt, kt = tiles
    i64 = lambda v: tirx.const(v, "int64")  # noqa: E731
    f32 = lambda v: tirx.const(v, "float32")  # noqa: E731
    visited = tirx.min(Skv, (q0 + i64(qt + kt - 1)) // i64(kt) * i64(kt))
    with T.If(visited < Skv):
        with T.Then():
            with T.serial(i64(0), i64(qt)) as i:
                mn = T.Bind(tirx.max(m[i], fill))
                w = T.Bind(tirx.exp(fill - mn))  # each skipped key's weight
                with T.If(w > f32(0)):
                    with T.Then():
                        a = T.Bind(tirx.exp(m[i] - mn))
                        with T.vectorized(i64(0), i64(spec.dv)) as d:
                            T.buffer_store(acc, acc[i, d] * a, [i, d])
                        with T.serial(visited, Skv) as j:
                            with T.vectorized(i64(0), i64(spec.dv)) as d:
                                T.buffer_store(acc, acc[i, d] + w * v_at(j, d), [i, d])
                        T.buffer_store(el, el[i] * a + w * tirx.Cast("float32", Skv - visited), [i])
                        T.buffer_store(m, mn, [i])


# ---------------------------------------------------------------- the Relax pass

def _is_call(e, *names):
    from tvm import relax

    return isinstance(e, relax.Call) and getattr(e.op, "name", None) in names


def _shape(e) -> list | None:
    ty = getattr(e, "ty", None)
    shape = getattr(ty, "shape", None)
    if shape is None or not hasattr(shape, "__len__"):
        return None
    return list(shape)


def _dtype(e) -> str | None:
    return str(getattr(getattr(e, "ty", None), "dtype", None))


def _static(d) -> int | None:
    from tvm import tirx

    return int(d.value) if isinstance(d, tirx.IntImm) else None


def _same_dim(a, b) -> bool:
    import tvm_ffi

    sa, sb = _static(a), _static(b)
    if sa is not None or sb is not None:
        return sa == sb
    return a.same_as(b) or tvm_ffi.structural_equal(a, b)


def _scalar_const(e) -> float | None:
    """The value of a constant with one element (shape () or all ones), else None."""
    value = getattr(e, "value", None)
    if value is None or not hasattr(value, "numpy"):
        return None
    a = value.numpy()
    return float(a.reshape(-1)[0]) if a.size == 1 and a.dtype.kind == "f" else None


@dataclass
class _Match:
    """One attention subgraph, as found: Relax expressions and the kernel spec they need."""
    out: object  # the var bound to the final matmul(P, V) (or the absorbed output permute)
    q: object
    kt: object
    v: object
    add: object
    keep: object
    spec: AttentionSpec
    out_shape: list
    chain: list  # the intermediate vars (scores .. probabilities, P V), each used once
    lead: list  # leading dims of the scores (batch[, heads])
    k_src: object = None  # grouped-query: K (B, Hkv, S, d), transposed at the call (kt unused)


class _Finder:
    """Matches attention subgraphs in one Relax function (by its bindings and use counts)."""

    def __init__(self, func):
        from tvm import relax

        self.v2v = relax.analysis.get_var2val(func)
        self.why: dict = {}  # softmax var -> why its attention is not fused
        self.uses: dict = {}  # var -> number of bindings (and the function result) using it
        self._users: dict = {}
        values = [b.value for blk in func.body.blocks for b in blk.bindings]
        bvars = [b.var for blk in func.body.blocks for b in blk.bindings]
        for bv, val in [*zip(bvars, values), (None, func.body.body)]:
            for v in relax.analysis.free_vars(val):
                self.uses[v] = self.uses.get(v, 0) + 1
                if bv is not None:
                    self._users.setdefault(v, []).append((bv, val))

    def value(self, e):
        from tvm import relax

        return self.v2v.get(e, e) if isinstance(e, relax.Var) else e

    def once(self, e) -> bool:
        return self.uses.get(e, 0) == 1

    def call(self, e, *names):
        c = self.value(e)
        return c if _is_call(c, *names) else None

    def users(self, var) -> list:
        """(bound var, value) of the bindings that use `var`."""
        return self._users.get(var, [])

    # -- the chain, from the final matmul back to the scores
    def match(self, out_var, value) -> _Match | None:
        from tvm import relax

        if not _is_call(value, "relax.matmul") or len(value.args) != 2:
            return None
        probs, v = value.args
        if not isinstance(probs, relax.Var) or not self.once(probs):
            return None
        chain = [probs]
        guard = self._nan_guard(probs)
        if guard is not None:
            probs, isnan = guard
            chain += [isnan, probs]
        sm = self.call(probs, "relax.nn.softmax")
        if sm is None:
            return None
        why = lambda reason: self.no(probs, reason)  # noqa: E731
        x = sm.args[0]
        rank = len(_shape(x) or [])
        if rank not in (3, 4) or int(sm.attrs.axis) not in (-1, rank - 1):
            return why(f"softmax over axis {int(sm.attrs.axis)} of a rank-{rank} tensor, not the keys of (B[, H], S, S)")
        keep = fill = None
        if not (isinstance(x, relax.Var) and self.once(x)):
            return why("the scores are used outside the attention")
        c = self.value(x)
        if _is_call(c, "relax.where"):
            fill = _scalar_const(c.args[2])
            if fill is None or _dtype(c.args[0]) != "bool":
                return why("where(mask, scores, fill) with a fill that is not a scalar constant")
            keep, x = c.args[0], c.args[1]
            chain.append(x)
            if not (isinstance(x, relax.Var) and self.once(x)):
                return None
            c = self.value(x)
        add = None
        if _is_call(c, "relax.add"):
            a, b = c.args
            if a.same_as(b):
                return None
            for s_, m_ in ((a, b), (b, a)):
                if isinstance(s_, relax.Var) and self.once(s_) and self._is_scores_side(s_):
                    x, add = s_, m_
                    break
            else:
                return why("an add before softmax whose scores side is not Q K^T [* scale]")
            chain.append(x)
            c = self.value(x)
        scale = 1.0
        if _is_call(c, "relax.divide", "relax.multiply"):
            a, b = c.args
            k = _scalar_const(b)
            if k is None and c.op.name == "relax.multiply":
                k, a = _scalar_const(a), b
            if k is None or not (isinstance(a, relax.Var) and self.once(a)) or (c.op.name == "relax.divide" and k == 0):
                return None
            scale = 1.0 / k if c.op.name == "relax.divide" else k
            x = a
            chain.append(x)
            c = self.value(x)
        if not _is_call(c, "relax.matmul") or len(c.args) != 2:
            return why(f"the scores come from {getattr(getattr(c, 'op', None), 'name', type(c).__name__)}, "
                       "not matmul(Q, K^T) [* or / a scalar constant] [+ mask] [where]")
        if c.attrs.out_dtype not in (None, "") and str(c.attrs.out_dtype) not in ("void", _dtype(c.args[0])):
            return why(f"Q K^T accumulates in {c.attrs.out_dtype}")
        q, kt = c.args
        # SDPA's export scales both operands by sqrt(scale): (Q*c)(K^T*c) = Q K^T c^2
        q, kq = self._peel_scale(q)
        kt, kk = self._peel_scale(kt)
        scale *= kq * kk
        m = self._shapes(out_var, value, q, kt, v, add, keep, fill, scale, chain)
        if m is None:
            return why("shapes the kernel does not take (dtype, rank, symbolic heads or d, broadcast batch, mask dims)")
        if guard is not None:
            m.spec = replace(m.spec, nan_rows_zero=True)
        return self._ungroup(m)

    def no(self, softmax_var, reason: str) -> None:
        """Record why the attention around `softmax_var` is not fused (find_attention logs it)."""
        self.why[softmax_var] = reason
        return None

    def _nan_guard(self, probs):
        """where(isnan(p), 0, p) over a softmax p (SDPA zeroes NaN rows so): (p, the isnan var), else None."""
        c = self.call(probs, "relax.where")
        if c is None or len(c.args) != 3 or _scalar_const(c.args[1]) != 0.0:
            return None
        cond, p = c.args[0], c.args[2]
        isnan = self.call(cond, "relax.isnan")
        if isnan is None or not isnan.args[0].same_as(p) or not self.once(cond) or self.uses.get(p, 0) != 2:
            return None
        return (p, cond) if self.call(p, "relax.nn.softmax") is not None else None

    def _peel_scale(self, e):
        """(x, k) when e = x * k, k * x or x / k for a scalar constant k used only here, else (e, 1)."""
        c = self.call(e, "relax.multiply", "relax.divide")
        if c is None or not self.once(e):
            return e, 1.0
        a, b = c.args
        k = _scalar_const(b)
        if k is None and c.op.name == "relax.multiply":
            k, a = _scalar_const(a), b
        if k is None or (c.op.name == "relax.divide" and k == 0) or not math.isfinite(k):
            return e, 1.0
        return a, (1.0 / k if c.op.name == "relax.divide" else k)

    def _ungroup(self, m: _Match) -> _Match:
        """Grouped-query attention: K and V each repeated from kv heads (expand_dims ->
        broadcast_to -> reshape, HF's repeat_kv). The kernel reads the kv heads instead."""
        if len(m.lead) != 2 or m.spec.v != "bhsd" or m.spec.k != "bhds":
            return m
        v = self._repeat_source(m.v)
        x = self._kt_source(m.kt)
        k = self._repeat_source(x) if x is not None else None
        if v is None or k is None or v[1] != k[1] or m.spec.heads % v[1]:
            if v is not None or k is not None:
                _log.info("grouped-query attention: the key/value repeat is kept (K and V not both a repeat "
                          "of the same kv heads)")
            return m
        m.v, m.k_src = v[0], k[0]
        m.spec = replace(m.spec, kv_heads=v[1])
        return m

    def _repeat_source(self, e):
        """(src (B, Hkv, S, d), Hkv) when e = reshape(broadcast_to(expand_dims(src, 2), (B, Hkv, g, S, d)), (B, Hkv*g, S, d))."""
        r = self.call(e, "relax.reshape")
        bc = self.call(r.args[0], "relax.broadcast_to") if r is not None else None
        ed = self.call(bc.args[0], "relax.expand_dims") if bc is not None else None
        if ed is None or [int(a) for a in ed.attrs.axis] != [2]:
            return None
        src, rs, bs = ed.args[0], _shape(e), _shape(r.args[0])
        ss = _shape(src)
        if ss is None or rs is None or bs is None or len(ss) != 4 or len(bs) != 5 or len(rs) != 4:
            return None
        hkv, g = _static(bs[1]), _static(bs[2])
        if hkv is None or g is None or _static(ss[1]) != hkv or _static(rs[1]) != hkv * g:
            return None
        if not all(_same_dim(a, b) for a, b in ((ss[0], rs[0]), (ss[2], rs[2]), (ss[3], rs[3]))):
            return None
        return src, hkv

    def _kt_source(self, kt):
        """X (B, H, S, d) when kt = X^T on its last two axes (one permute, or the dynamo
        exporter's reshape (B*H, S, d) -> permute -> reshape (B, H, d, S)), else None."""
        p = self.call(kt, "relax.permute_dims")
        if p is not None and p.attrs.axes is not None and [int(a) for a in p.attrs.axes] == [0, 1, 3, 2]:
            return p.args[0]
        r2 = self.call(kt, "relax.reshape")
        p = self.call(r2.args[0], "relax.permute_dims") if r2 is not None else None
        if p is None or p.attrs.axes is None or [int(a) for a in p.attrs.axes] != [0, 2, 1]:
            return None
        r1 = self.call(p.args[0], "relax.reshape")
        if r1 is None:
            return None
        x, xs, ks = r1.args[0], _shape(r1.args[0]), _shape(kt)
        if xs is None or ks is None or len(xs) != 4 or len(ks) != 4:
            return None
        same = all(_same_dim(a, b) for a, b in ((xs[0], ks[0]), (xs[1], ks[1]), (xs[2], ks[3]), (xs[3], ks[2])))
        return x if same else None

    def _is_scores_side(self, e) -> bool:
        c = self.value(e)
        return _is_call(c, "relax.divide", "relax.multiply", "relax.matmul")

    def _shapes(self, out_var, value, q, kt, v, add, keep, fill, scale, chain) -> _Match | None:
        sq_, sk_, sv_ = _shape(q), _shape(kt), _shape(v)
        dtype = _dtype(q)
        if dtype not in ("float32", "float16") or {_dtype(kt), _dtype(v), _dtype(out_var)} != {dtype}:
            return None
        if sq_ is None or sk_ is None or sv_ is None or not (len(sq_) == len(sk_) == len(sv_) in (3, 4)):
            return None
        rank = len(sq_)
        lead = sq_[:-2]
        if not all(_same_dim(a, b) for a, b in zip(lead, sk_[:-2])) or \
                not all(_same_dim(a, b) for a, b in zip(lead, sv_[:-2])):
            return None  # broadcast batch dims: not handled by the kernel
        d, dv = _static(sq_[-1]), _static(sv_[-1])
        if d is None or dv is None or not _same_dim(sq_[-1], sk_[-2]) or not _same_dim(sk_[-1], sv_[-2]):
            return None
        if rank == 4 and _static(lead[1]) is None:
            return None  # heads must be static
        sq, skv = sq_[-2], sk_[-1]
        scores = [*lead, sq, skv]
        letters = ["b", "h", "q", "k"] if rank == 4 else ["b", "q", "k"]
        add_dims = keep_dims = None
        causal = False
        if add is not None:
            if _dtype(add) not in ("float32", "float16"):
                return None
            add_dims = _mask_dims(add, scores, letters)
            if add_dims is None:
                return None
        if keep is not None:
            terms = self._and_terms(keep)
            rest = [t for t in terms if not self._is_causal(t, sq, skv)]
            causal = len(rest) < len(terms)
            if len(rest) > 1:
                rest, causal = [keep], False  # several mask tensors: pass their product
            keep = rest[0] if rest else None
            if keep is not None:
                keep_dims = _mask_dims(keep, scores, letters)
                if keep_dims is None:
                    return None
        same_len = _static(sq) is None and sq.same_as(skv)
        spec = AttentionSpec(
            dtype=dtype, q="bhsd" if rank == 4 else "bsd", k="bhds" if rank == 4 else "bds",
            v="bhsd" if rank == 4 else "bsd", o="bhsd" if rank == 4 else "bsd",
            heads=_static(lead[1]) if rank == 4 else 1, d=d, dv=dv, scale=float(scale),
            batch=_static(lead[0]), sq=_static(sq), skv=_static(skv),
            add=add_dims, add_dtype=_dtype(add) if add is not None else "float32", keep=keep_dims,
            causal=causal, fill=fill if (keep is not None or causal) else None, same_len=same_len)
        m = _Match(out_var, q, kt, v, add, keep, spec, [*lead, sq, dv], chain + [out_var], list(lead))
        return self._absorb(m) if rank == 4 else m

    def _and_terms(self, e) -> list:
        c = self.call(e, "relax.logical_and")
        if c is None:
            return [e]
        return self._and_terms(c.args[0]) + self._and_terms(c.args[1])

    def _is_causal(self, e, sq, skv) -> bool:
        """tril(all-true (S, S)) as the importer builds it for a symbolic seq, or its folded constant."""
        shape = _shape(e)
        if shape is None or len(shape) < 2 or not _same_dim(shape[-2], sq) or not _same_dim(shape[-1], skv):
            return False
        if any(_static(s) != 1 for s in shape[:-2]):
            return False
        value = getattr(self.value(e), "value", None)
        if value is not None and hasattr(value, "numpy"):
            a = value.numpy()
            a2 = a.reshape(a.shape[-2:])
            return a.dtype == np.bool_ and bool(np.array_equal(a2, np.tril(np.ones_like(a2))))
        c = self.call(e, "relax.tril")
        if c is None or len(c.args) < 2 or _static(c.args[1]) != 0:
            return False
        src = self.value(c.args[0])
        if _is_call(src, "relax.broadcast_to"):
            src = self.value(src.args[0])
        value = getattr(src, "value", None)
        return value is not None and hasattr(value, "numpy") and value.numpy().dtype == np.bool_ \
            and bool(value.numpy().all())

    def _absorb(self, m: _Match) -> _Match:
        """Read Q/V through the (B, S, H, d) -> (B, H, S, d) transposes around them, and write
        the output in (B, S, H, dv) when its one consumer transposes it so."""
        spec = m.spec
        for name in ("q", "v"):
            c = self.call(getattr(m, name), "relax.permute_dims")
            if c is not None and c.attrs.axes is not None and [int(a) for a in c.attrs.axes] == [0, 2, 1, 3]:
                setattr(m, name, c.args[0])
                spec = replace(spec, **{name: "bshd"})
        if self.once(m.out):
            users = self.users(m.out)
            if len(users) == 1:
                uv, uval = users[0]
                if _is_call(uval, "relax.permute_dims") and uval.attrs.axes is not None and \
                        [int(a) for a in uval.attrs.axes] == [0, 2, 1, 3]:
                    m.out = uv
                    m.chain.append(uv)
                    b, h, s, dv = m.out_shape
                    m.out_shape = [b, s, h, dv]
                    spec = replace(spec, o="bshd")
        m.spec = spec
        return m


def _mask_dims(mask, scores: list, letters: list) -> tuple[str, ...] | None:
    """Which score axis each mask axis follows (right-aligned broadcasting), or None."""
    shape = _shape(mask)
    if shape is None or len(shape) > len(scores):
        return None
    out = []
    for i, d in enumerate(shape):
        j = len(scores) - len(shape) + i
        if _static(d) == 1:
            out.append("1")
        elif _same_dim(d, scores[j]):
            out.append(letters[j])
        else:
            return None
    return tuple(out)


def _split_item(f: _Finder, e, rank: int):
    """(split call's input, item index, sections) when `e` is item i of an even split on
    the last axis of a rank-`rank` tensor, else None."""
    from tvm import relax

    item = f.value(e)
    if not isinstance(item, relax.TupleGetItem):
        return None
    sp = f.call(item.tuple_value, "relax.split")
    if sp is None or int(sp.attrs.axis) not in (-1, rank - 1):
        return None
    x = sp.args[0]
    shape = _shape(x)
    width = _static(shape[-1]) if shape else None
    ios = sp.attrs.indices_or_sections
    if width is None:
        return None
    if isinstance(ios, int) or _static(ios) is not None:
        n = int(ios) if isinstance(ios, int) else _static(ios)
    else:
        idx = [_static(i) for i in ios]
        n = len(idx) + 1
        if width % n or idx != [width // n * (k + 1) for k in range(n - 1)]:
            return None
    if width % n:
        return None
    return x, int(item.index), n, item.tuple_value


@dataclass
class _Heads:
    """h per-head attentions over an even split of packed projections, concatenated in order."""
    out: object  # the concat's var
    xq: object
    xk: object
    xv: object
    first: _Match


def _merge_heads(f: _Finder, matches: list[_Match]) -> tuple[list, set]:
    """Group the seed's per-head matches into multi-head calls; returns (groups, merged outs)."""
    from tvm import relax

    by_out = {m.out: m for m in matches if m.spec.q == "bsd"}
    groups, merged = [], set()
    for bv, val in f.v2v.items():
        if not _is_call(val, "relax.concat") or not isinstance(val.args[0], relax.Tuple):
            continue
        outs = list(val.args[0].fields)
        ms_ = [by_out.get(o) for o in outs]
        if len(outs) < 2 or any(m is None or not f.once(m.out) for m in ms_):
            continue
        if int(val.attrs.axis) not in (-1, 2):
            continue
        first = ms_[0]
        same = all(m.spec == first.spec and _same_expr(m.add, first.add) and _same_expr(m.keep, first.keep)
                   for m in ms_)
        if not same:
            continue
        srcs = []
        for m in ms_:
            kt = f.call(m.kt, "relax.permute_dims")
            if kt is None or kt.attrs.axes is None or [int(a) for a in kt.attrs.axes] != [0, 2, 1]:
                break
            q, k, v = _split_item(f, m.q, 3), _split_item(f, kt.args[0], 3), _split_item(f, m.v, 3)
            if q is None or k is None or v is None:
                break
            srcs.append((q, k, v))
        if len(srcs) != len(ms_):
            continue
        h = len(ms_)
        ok = all(s[1] == i and s[2] == h and s[3].same_as(srcs[0][j][3])
                 for i, qkv in enumerate(srcs) for j, s in enumerate(qkv))
        if not ok:
            continue
        groups.append(_Heads(bv, srcs[0][0][0], srcs[0][1][0], srcs[0][2][0], first))
        merged.update(m.out for m in ms_)
    return groups, merged


def _same_expr(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and a.same_as(b))


def find_attention(func) -> tuple[list[_Match], list[_Heads]]:
    """The attention subgraphs of a Relax function: single calls and per-head groups."""
    f = _Finder(func)
    matches = []
    for var, val in f.v2v.items():
        m = f.match(var, val)
        if m is not None:
            matches.append(m)
    groups, merged = _merge_heads(f, matches)
    fused = {v for m in matches for v in m.chain}
    for var, val in f.v2v.items():
        if _is_call(val, "relax.nn.softmax") and var not in fused:
            users = [u for _, u in f.users(var)]
            default = ("its probabilities are reshaped before P V (a (batch*heads) rank-3 form around a "
                       "rank-4 softmax, as BLOOM's ALiBi attention)" if users and _is_call(users[0], "relax.reshape")
                       else "its probabilities do not feed one matmul with V [through where(isnan(p), 0, p)]")
            _log.info("attention not fused: softmax %s: %s", var.name, f.why.get(var, default))
    return [m for m in matches if m.out not in merged], groups


def workload(spec: AttentionSpec, lanes: int):
    """The tuning workload of a spec: its kernel at the default tiles, as MetaSchedule keys it."""
    import tvm

    return tvm.IRModule({"main": kernel(spec, default_tiles(lanes), lanes)})


def encode_tiles(tiles: tuple[int, int]) -> int:
    return tiles[0] * 10000 + tiles[1]


def decode_tiles(code: int) -> tuple[int, int]:
    return int(code) // 10000, int(code) % 10000


def tile_trace(spec: AttentionSpec, lanes: int, tiles: tuple[int, int], candidates=None):
    """A MetaSchedule trace whose one decision is the tile choice (a categorical over the
    candidates, encoded qt*10000+kt): how a tile choice is stored as a tuning record."""
    from tvm import s_tir

    codes = [encode_tiles(t) for t in (candidates or tile_candidates(lanes))]
    sch = s_tir.Schedule(workload(spec, lanes))
    sch.sample_categorical(candidates=codes, probs=[1.0 / len(codes)] * len(codes),
                           decision=codes.index(encode_tiles(tiles)))
    return sch.trace


def tiles_from_trace(trace) -> tuple[int, int] | None:
    for inst in trace.insts:
        if inst.kind.name == "SampleCategorical":
            d = trace.decisions.get(inst)
            if d is not None:
                return decode_tiles(int(inst.attrs[0][int(d)]))
    return None


def tile_record(database, spec: AttentionSpec, target) -> tuple[int, int] | None:
    """The tuned tiles for `spec` on `target` from a MetaSchedule database, or None."""
    from .cpu_schedule import vector_lanes

    if database is None:
        return None
    mod = workload(spec, vector_lanes(target))
    if not database.has_workload(mod):
        return None
    rec = database.query_tuning_record(mod, target, "main")
    tiles = tiles_from_trace(rec.trace) if rec is not None else None
    # a database (untrusted input) picks among the tiles tune times, nothing else
    return tiles if tiles in tile_candidates(vector_lanes(target)) else None


def _reshape(bb, x, shape):
    from tvm import relax

    return bb.emit(relax.op.reshape(x, relax.ShapeExpr(shape)))


class _Rewrite:
    """Emits the kernel calls; kernels of one spec and tiles are shared."""

    def __init__(self, bb, target, database):
        from .cpu_schedule import vector_lanes

        self.bb, self.target, self.database = bb, target, database
        self.lanes = vector_lanes(target)
        self.funcs: dict = {}
        self.applied: list[str] = []

    def call(self, spec: AttentionSpec, args: list, out_shape: list):
        from tvm import relax

        tiles = tile_record(self.database, spec, self.target) or default_tiles(self.lanes)
        key = (spec, tiles)
        if key not in self.funcs:
            # One symbol per kernel: add_func makes the GlobalVar's name unique, but the
            # global_symbol attr (what the build links by) must follow it, or two attention
            # variants in one model are "duplicate global symbol: fused_attention".
            gv = self.bb.add_func(kernel(spec, tiles, self.lanes), f"fused_attention_{len(self.funcs)}")
            self.bb.update_func(gv, self.bb.get()[gv].with_attr("global_symbol", gv.name_hint))
            self.funcs[key] = gv
        self.applied.append(f"{spec.describe()} tiles={tiles[0]}x{tiles[1]}")
        return relax.call_tir(self.funcs[key], args, out_ty=relax.TensorType(out_shape, spec.dtype))

    def single(self, m: _Match, visit):
        from tvm import relax

        kt = self.bb.emit(relax.op.permute_dims(visit(m.k_src), [0, 1, 3, 2])) if m.k_src is not None else visit(m.kt)
        args = [visit(m.q), kt, visit(m.v)]
        args += [visit(x) for x in (m.add, m.keep) if x is not None]
        return self.call(m.spec, args, m.out_shape)

    def heads(self, g: _Heads, visit):
        from tvm import relax

        bb, sp = self.bb, g.first.spec
        xq, xk, xv = visit(g.xq), visit(g.xk), visit(g.xv)
        (b, sq, _), skv = _shape(xq), _shape(xk)[1]
        h = _static(_shape(xq)[-1]) // sp.d
        q = _reshape(bb, xq, [b, sq, h, sp.d])  # (B, S, h, d_k)
        kt = bb.emit(relax.op.permute_dims(_reshape(bb, xk, [b, skv, h, sp.d]), [0, 2, 3, 1]))  # (B, h, d_k, S_kv)
        v = _reshape(bb, xv, [b, skv, h, sp.dv])  # (B, S_kv, h, d_v)
        spec = replace(sp, q="bshd", k="bhds", v="bshd", o="bshd", heads=h)
        args = [q, kt, v] + [visit(x) for x in (g.first.add, g.first.keep) if x is not None]
        o = bb.emit(self.call(spec, args, [b, sq, h, sp.dv]))  # (B, S, h, d_v)
        return relax.op.reshape(o, relax.ShapeExpr([b, sq, h * sp.dv]))  # (B, S, h*d_v)


def fuse_attention(target, database=None):
    """The `fuse-attention` pass: attention subgraphs -> call_tir of the fused kernel."""
    import tvm
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    @mutator
    class _Fuse(PyExprMutator):
        def __init__(self, mod):
            super().__init__(mod)
            self.plan: dict = {}
            self.rw = _Rewrite(self.builder_, target, database)

        def visit_var_binding_(self, binding):
            todo = self.plan.get(binding.var)
            if todo is None:
                return super().visit_var_binding_(binding)
            value = todo(self.visit_expr)
            self.builder_.emit_normalized(relax.VarBinding(binding.var, self.builder_.normalize(value)))

    @tvm.transform.module_pass(opt_level=0, name="BlockforgeFuseAttention")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        m = _Fuse(mod)
        for gv, func in mod.functions_items():
            if not isinstance(func, relax.Function):
                continue
            singles, groups = find_attention(func)
            if not singles and not groups:
                continue
            m.plan = {s.out: (lambda visit, s=s: m.rw.single(s, visit)) for s in singles}
            m.plan.update({g.out: (lambda visit, g=g: m.rw.heads(g, visit)) for g in groups})
            new = m.visit_expr(func)
            m.builder_.update_func(gv, relax.analysis.remove_all_unused(new))
        out = m.builder_.get()
        for line in m.rw.applied:
            _log.info("fused attention: %s", line)
        return out

    return _pass


def kernel_specs(mod) -> list[AttentionSpec]:
    """The specs of the fused attention kernels in a module (after the fuse-attention phase)."""
    from tvm import tirx

    out = []
    for _, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc) and func.attrs is not None and KERNEL_ATTR in func.attrs:
            spec = AttentionSpec.from_json(str(func.attrs[KERNEL_ATTR]))
            if spec not in out:
                out.append(spec)
    return out


def is_kernel(func) -> bool:
    return func.attrs is not None and KERNEL_ATTR in func.attrs
