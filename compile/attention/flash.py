"""The flash-style attention kernel: one TIR PrimFunc per AttentionSpec (shapes, mask,
causality, tiles), online softmax over key tiles."""

from __future__ import annotations

import logging
import math
import json
from dataclasses import asdict, dataclass


_log = logging.getLogger("blockforge.attention")


# (query tile, key tile). Key tiles are whole vectors of K^T: 4 vectors (64 keys with
# AVX-512, 32 with AVX2, 16 with NEON) by default. Measured (BERT-base, 12 heads, kernel
# alone, 1 thread CPU time, AVX-512) at seq 128 / 512: 32x64 0.70/10.3 ms, 48x64 0.77/10.6,
# 64x64 0.68/10.2, 96x64 1.00/11.6 (s + acc tiles outgrow L1), 128x64 0.67/10.2, 32x128
# 0.63/10.3, 64x128 0.62/10.0: within 10% but 96 rows; `tune` picks per device and shape.
def default_tiles(lanes: int) -> tuple[int, int]:
    return (64, 4 * lanes)


def tile_candidates(lanes: int) -> tuple[tuple[int, int], ...]:
    """What `tune` times per kernel (compile/attention/: the kernel; tune/attention_tiles.py)."""
    return ((32, 4 * lanes), (48, 4 * lanes), (64, 4 * lanes), (96, 4 * lanes), (128, 4 * lanes),
            (32, 8 * lanes), (64, 8 * lanes))


def acc_regs(lanes: int) -> int:
    """Accumulator vector registers a micro-kernel may hold: 24 of the 32 of AVX-512 and
    NEON (the rest carry the K^T / V loads and broadcasts); 12 of AVX2's 16."""
    return 12 if lanes == 8 else 24


KERNEL_ATTR = "blockforge.attention"  # PrimFunc attr: the spec, for tune and tests
# K layouts read as the cache holds them (keys x d), not as K^T: a decode step's scores are
# then dot products along d, and the graph's per-step transpose of the whole cached K goes
KEY_ROWS = ("bhsd", "bsd")


@dataclass(frozen=True)
class AttentionSpec:
    """Everything that shapes the kernel (the tuning workload is the kernel of a spec).

    Layout letters: b batch, h head, s sequence, d feature. q/v/o: "bhsd", "bshd" or
    "bsd" (one head per call); k is K^T: "bhds" or "bds", or K itself: "bhsd" or "bsd"
    (KEY_ROWS: the short-query form, match.py). Mask dims name the score axis
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
    # torch's _safe_softmax (torch.export's decomposed SDPA): a row whose every score is -inf
    # comes out 0; a NaN or +inf score still gives NaN, as softmax does
    inf_rows_zero: bool = False
    # A preallocated cache (compile/decode/inplace.py): K and V are buffers of this many rows
    # on their s axis, of which the first Skv are read; Skv (symbolic) is then the kernel's
    # last input, a scalar after the tensors. None: K and V hold exactly Skv rows.
    kv_capacity: int | None = None
    # Logit soft-capping (Gemma 2; the ONNX Attention op's softcap): the scores are
    # softcap * tanh(Q K^T * scale), before the mask. None: Q K^T * scale.
    softcap: float | None = None

    def to_json(self) -> str:
        d = asdict(self)
        for k in ("inf_rows_zero", "kv_capacity", "softcap"):  # written only when set: older specs (tuning records) keep their text
            if not d[k]:
                del d[k]
        return json.dumps(d, sort_keys=True)

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
            (f" kv_capacity={self.kv_capacity}" if self.kv_capacity else "") + \
            (" nan-rows-zero" if self.nan_rows_zero else "") + (" inf-rows-zero" if self.inf_rows_zero else "") + \
            (f" softcap={self.softcap:g}" if self.softcap else "")
        return (f"{self.dtype} q:{self.q} k:{self.k} v:{self.v} o:{self.o} h={self.heads} d={self.d} "
                f"dv={self.dv} mask={mask}{extra}")


def _vec_width(n: int, lanes: int) -> int:
    """Widest power-of-two width <= lanes that divides n (1: scalar)."""
    w = lanes
    while w > 1 and n % w:
        w //= 2
    return w


def vec_chunks(n: int, lanes: int) -> list[tuple[int, int]]:
    """(offset, width) pieces of a row of n floats, each vectorised on its own: the row whole when
    n is a power of two, else whole vectors of `lanes` and power-of-two tails. A loop vectorised
    n = 48 or 36 wide (MobileViT's head sizes 36, 48, 60) was scalarised by LLVM: the kernel at
    (4, 256 tokens, 4 heads) took 6.9 / 8.2 / 10.3 ms at d = 36 / 48 / 60 against 0.77 at 64
    (22-25 GFLOP/s against 350, Zen 5, 2 threads)."""
    if n & (n - 1) == 0:
        return [(0, n)]
    out, off = [], 0
    while off < n:
        w = lanes
        while w > n - off:
            w //= 2
        out.append((off, w))
        off += w
    return out


def _row_loops(T, i64, chunks):
    """Yields d inside one vectorised loop per (offset, width) piece of `chunks` (vec_chunks):
    a caller's `for d in ...:` body is emitted once into each loop."""
    for off, w in chunks:
        with T.vectorized(i64(0), i64(w)) as e:
            yield i64(off) + e


def micro_rows(qt: int, vecs_per_row: int, lanes: int) -> int:
    """Micro-kernel rows: the largest divisor of qt whose accumulators fit the registers."""
    cap = max(1, acc_regs(lanes) // max(1, vecs_per_row))
    return max(r for r in range(1, min(qt, cap) + 1) if qt % r == 0)


def query_tile(qt: int, sq: int | None, widths: tuple[int, ...], lanes: int, short: bool = True) -> int:
    """The query tile for a static Sq: as many tiles as qt needs, balanced, so the last one is
    not mostly clamped rows (ViT's 197 in tiles of 64: 256 rows computed; in 4 of 50: 200;
    measured, 12 heads, 1 thread CPU time: 2.77 -> 2.12 ms, benchmarks/attention_qtile.py).
    A decode step (Sq = 1, or a short chunk) gets Sq rows, not a full tile of clamped ones.
    The smallest such tile whose micro-kernels (widths: the Q K^T and P V row lengths) get
    min(4, Sq) rows or more (24 tiles of 63 would run 3-row ones), from as many tiles as qt
    needs or one more, whichever computes fewer rows.
    An Sq below one tile is one tile of the same rule (short=False: Sq rows as they are, the
    ablation `attention-short-tile`): Wav2Vec2's 49 rows have no divisor from 2 to 6, so they
    ran 1-row micro-kernels (0.44 ms a layer, 17 GFLOP/s, against CLIP's 50 rows in 5-row ones:
    0.086 ms; quiet Zen 5, `bench --profile`); as 50, 5-row ones and a clamped row."""
    if sq is None or sq % qt == 0:
        return qt
    if sq < qt and not short:
        return sq

    def balanced(n):  # the tile for n tiles
        lo = -(-sq // n)  # ceil(sq / n)
        want = min(4, lo)
        for t in range(lo, max(qt, lo) + 1):
            if min(micro_rows(t, max(1, w // lanes), lanes) for w in widths) >= want:
                return t
        return min(qt, sq)

    # One tile more when it computes fewer rows: Whisper's 1500 as 25 x 60 (6-row
    # micro-kernels, no clamped row), not 24 x 64 = 1536 rows (measured, kernel alone,
    # 1 thread: 0.95x). Ties keep the fewer tiles (ViT's 197: 4 x 50, not 5 x 40).
    n = -(-sq // qt)
    return min((balanced(n), balanced(n + 1)), key=lambda t: -(-sq // t) * t)


def lane_reduce(tirx, buf, at: list, op, width: int):
    """buf[*at, 0:width] reduced to a scalar by a tree of vector halves held in registers
    (Shuffle): log2(width) steps, not width dependent scalar ones (the row reductions are
    latency-bound). Halving through memory (store the halves, reload) made LLVM split the
    buffer into 8-byte pieces: each step became lane extracts and inserts (vpextrq/vinsertps)."""
    if width == 1:
        return tirx.BufferLoad(buf, at + [tirx.const(0, "int64")])
    def step(v, width):
        if width == 1:
            return v
        x, w = tirx.Var(f"lanes{width}", f"{buf.dtype}x{width}"), width // 2  # bound once: both halves read it
        lo = tirx.Shuffle([x], [tirx.const(k, "int32") for k in range(w)])
        hi = tirx.Shuffle([x], [tirx.const(k + w, "int32") for k in range(w)])
        return tirx.Let(x, v, step(op(lo, hi), w))

    return step(tirx.BufferLoad(buf, at + [tirx.Ramp(tirx.const(0, "int64"), tirx.const(1, "int64"), width)]), width)


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


# 2^f on [-1/2, 1/2], degree 5 (relative weighted least squares iterated to minimax, float32
# coefficients): relative error 2.3e-7 evaluated in float32 (Horner)
EXP2_POLY = (1.0000001192092896, 0.6931469440460205, 0.24022120237350464, 0.05550713092088699,
             0.009675540961325169, 0.001327647129073739)
LOG2E = 1.44269504088896341


def fast_exp2(t):
    """2^t for t <= 0 as a TIR expression (float32): n = floor(t + 1/2), 2^n built in the
    exponent bits, 2^(t - n) by EXP2_POLY. The kernel's exp(s - m) is fast_exp2((s - m) *
    LOG2E): 15 vector instructions (AVX-512, LLVM's) of which 7 multiplies/FMAs, where
    fast_exp(s - m) takes 17 and 10 (its Cody-Waite reduction and degree-7 tail). exp(-inf)
    and anything below 2^-127 give exactly 0 (t is clamped at -127: n = -127 makes the
    exponent field 0); NaN stays NaN (t second in the clamp, as in fast_exp). Relative
    error ~2.5e-7, plus |t| * 6e-8 * ln 2 from rounding t = (s - m) * LOG2E (5e-6 at
    exp(-80), a weight a float32 sum of the row's max exp(0) = 1 does not keep). floor(t +
    1/2), not tirx.nearbyint: the kernel with nearbyint vectorised failed MakePackedAPI
    ("variables (v, v) are used, but are not passed in"). Measured: kernel()'s exp2."""
    from tvm import tirx

    f = lambda v: tirx.const(v, "float32")  # noqa: E731
    tv, nv = tirx.Var("exp2_t", "float32"), tirx.Var("exp2_n", "float32")
    rv = tirx.Var("exp2_r", "float32")
    p = f(EXP2_POLY[-1])
    for c in reversed(EXP2_POLY[:-1]):
        p = p * rv + f(c)
    two_n = tirx.reinterpret("float32", tirx.shift_left(tirx.Cast("int32", nv) + 127, 23))
    body = tirx.Let(rv, tv - nv, two_n * p)
    body = tirx.Let(nv, tirx.floor(tv + f(0.5)), body)
    return tirx.Let(tv, tirx.max(f(-127.0), t), body)


# tanh(x) = x P(x^2) / Q(x^2) on [-7.9053, 7.9053] (the float32 tanh is +-1 beyond): the
# 13/6 rational minimax approximation of Eigen's ptanh_float and TVM's topi.fast_tanh,
# relative error a few ulps over the whole range (no cancellation near 0)
TANH_P = (4.89352455891786e-03, 6.37261928875436e-04, 1.48572235717979e-05, 5.12229709037114e-08,
          -8.60467152213735e-11, 2.00018790482477e-13, -2.76076847742355e-16)  # x^1, x^3, .. x^13
TANH_Q = (4.89352518554385e-03, 2.26843463243900e-03, 1.18534705686654e-04, 1.19825839466702e-06)  # x^0 .. x^6
TANH_CLAMP = 7.90531110763549805


def fast_tanh(x):
    """tanh(x) as a TIR expression (float32) by TANH_P / TANH_Q: vectorises and inlines. A first
    form, sign(x) (1 - e) / (1 + e) with e = fast_exp2(-2|x|), lost the low bits near 0 to the
    cancellation: 8x the error against ORT on Gemma 2 (capped scores: the tanh's absolute
    error times the cap). tanh(+-inf) = +-1 (clamped); NaN stays NaN (x second in the clamps,
    as in fast_exp)."""
    from tvm import tirx

    f = lambda v: tirx.const(v, "float32")  # noqa: E731
    xv, x2 = tirx.Var("tanh_x", "float32"), tirx.Var("tanh_x2", "float32")
    p = f(TANH_P[-1])
    for c in reversed(TANH_P[:-1]):
        p = p * x2 + f(c)
    q = f(TANH_Q[-1])
    for c in reversed(TANH_Q[:-1]):
        q = q * x2 + f(c)
    body = tirx.Let(x2, xv * xv, xv * p / q)
    return tirx.Let(xv, tirx.max(f(-TANH_CLAMP), tirx.min(f(TANH_CLAMP), x)), body)


def tail_width(skv: int, kt: int, vk: int) -> int:
    """The width of the last key tile at a static Skv no key tile divides: the remainder's whole
    vectors (ViT's 197 = 3 x 64 + 5: 16 keys, not a full 64-key tile of which 59 are dropped)."""
    return min(kt, -(-(skv % kt) // vk) * vk)


# bf16 (`--precision bf16`): (128, 8 vectors). Measured (BERT-base, 12 heads, kernel alone, 1
# thread CPU time, interleaved, load 7, benchmarks/bf16_gemm.py's machine) at seq 128 / 512,
# x the bf16 kernel at 64x64: 128x128 0.86/0.89, 64x128 1.02/0.96, 128x256 -/0.91, 256x128
# 0.94/0.86, 96x128 2.17/1.62 (a 4-row micro-kernel of 96 rows); float32 64x64 was 1.13/1.33
# (the bf16 products at 64x64 0.89x/0.75x of it, at 128x128 0.70x/0.65x): the packing of
# K^T and V per key tile is shared by twice the query rows. Tuning records time the float32
# kernel, so at bf16 these tiles are used instead of them. A static key length below 128 gets
# the widest key tile of 4 or 2 vectors it holds: a key tile wider than Skv is one partial
# tile, and partial tiles stay float32; below 2 vectors, None (the float32 kernel's tiles).
def bf16_tiles(lanes: int, skv: int | None = None) -> tuple[int, int] | None:
    kt = next((w * lanes for w in (8, 4, 2) if skv is None or w * lanes <= skv), None)
    return None if kt is None else (128, kt)


def bf16_default(spec: "AttentionSpec", lanes: int) -> tuple[int, int] | None:
    """The untuned tiles of `spec`'s bf16 kernel where its products can run on VDPBF16PS
    (bf16_tiles, bf16_pairs), else None (`--precision bf16` builds the float32 kernel)."""
    bt = bf16_tiles(lanes, spec.skv)
    return bt if bt is not None and bf16_pairs(spec, bt[1], lanes) else None


def bf16_tile_candidates(lanes: int, skv: int | None = None) -> tuple[tuple[int, int], ...]:
    """What `tune --precision bf16` times per kernel (the default, bf16_tiles, first): query tiles
    of 64-256 rows, key tiles of 4-16 vectors that a static Skv holds (a wider one would be a
    single partial, float32, tile). The measurement above had 128 x 256 at 0.91x and 256 x 128
    at 0.86x of the default's time at seq 512 (load 7), 1.02x-2.17x at 128: per shape."""
    default = bf16_tiles(lanes, skv)
    if default is None:
        return ()
    out = [default]
    for qt in (64, 128, 256):
        for w in (4, 8, 16):
            t = (qt, w * lanes)
            if (skv is None or t[1] <= skv) and t not in out:
                out.append(t)
    return tuple(out)


def bf16_pairs(spec: AttentionSpec, kt: int, lanes: int) -> bool:
    """Whether the kernel can run Q K^T and P V on VDPBF16PS (`--precision bf16`, AVX-512:
    16 float32 lanes): float32 tensors, K^T (not key rows), d of whole vector pairs (a Q K^T
    pair is d and d + d/2), whole vectors of d_v, key tiles of whole 32-key blocks (a P V
    pair is keys j and j + 16 of a block)."""
    return lanes == 16 and spec.dtype == "float32" and spec.k not in KEY_ROWS and spec.d % (2 * lanes) == 0 \
        and spec.dv % 16 == 0 and kt % 32 == 0


def group_rows(spec: AttentionSpec, lanes: int) -> int:
    """Query rows of one job when a grouped-query decode step runs per key/value head
    (0: it does not). A short static query (Sq rows, K read as the cache holds it, no
    causal mask) over kv_heads < heads: the `group` query heads sharing one K/V head are
    one job's group * Sq rows, so each cached key and value row is loaded once for all of
    them (it was loaded once per query head), and P V has group x (dv / lanes)
    independent accumulator chains, not dv / lanes. Measured on the Llama-style GQA decoder
    (12 heads, 4 kv heads, d 64; AMD EPYC family 26, load 4.7-7.2, interleaved): the kernel
    alone at P = 512, one thread CPU time, 29.2 -> 18.3 us (0.63x); in the whole step (12
    layers), one thread CPU time, 0.461 -> 0.293 ms at P = 512 and 0.122 -> 0.086 ms at
    P = 128; two threads, best of 20 profiled steps, 1.70 -> 0.29 ms and 1.04 -> 0.08 ms.
    Ablation `attention-gqa-rows`: one job per query head."""
    if spec.k not in KEY_ROWS or spec.causal or spec.sq is None or not spec.kv_heads:
        return 0
    group = spec.heads // spec.kv_heads
    rows = group * spec.sq
    if group < 2 or rows > acc_regs(lanes):
        return 0
    return rows


def kernel(spec: AttentionSpec, tiles: tuple[int, int] | None = None, lanes: int = 16, balance: bool = True,
           key_tail: bool = True, exp2: bool = True, bf16: bool = False, gqa_rows: bool = True,
           short_tile: bool = True):
    """The fused attention PrimFunc for `spec` with (query tile, key tile) `tiles` (default:
    default_tiles), for a target with `lanes` float32 lanes per vector. balance=False: the
    query tile as given (benchmarks/attention_qtile.py's baseline), else query_tile's.
    key_tail=False: a static ragged Skv's last key tile is a whole one (ablation attention-key-tail).
    short_tile=False: an Sq below one query tile runs as its own tile (ablation attention-short-tile).
    exp2=False: the softmax's exps by fast_exp, not fast_exp2 (ablation attention-exp2). Measured
    at Whisper-base's attention (S = 1500, 8 heads, d 64, q/v/out (b, s, h, d); AMD EPYC family
    26, one thread CPU time, interleaved, benchmarks/attention_qtile.py --ab-exp2): fast_exp2 /
    fast_exp 0.993 (24.92 / 25.09 ms, 40 samples, load 6.6-7.1, numpy SGEMM 216-219 GFLOP/s a
    core), 0.971-0.995 in four shorter runs: the exps are ~10% of the kernel (identity in their
    place: 0.90x), its two products ~83% (21.0 ms at the core's measured 220 GFLOP/s FMA peak).
    bf16 (`--precision bf16` on a target with AVX512_BF16; bf16_pairs must hold, else the
    kernel stays float32): the two products on VDPBF16PS, float32 softmax and sums. Q, K^T,
    V and P are rounded to bf16 pairs in the kernel, as the bf16 GEMM rounds its A: per
    job Q's rows as pairs (d, d + d/2), per key tile K^T's rows as the same pairs and V's
    keys as pairs (j, j + 16) of each 32-key block, P's likewise after the exp; a product
    sums over its pairs in any order, so every pair is two whole vectors' lanes, no
    shuffle. A partial key tile (a symbolic or ragged Skv's last) stays float32."""
    from tvm import tirx
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    qt, kt = tiles or default_tiles(lanes)
    qt = query_tile(qt, spec.sq, (kt, spec.dv), lanes, short=short_tile) if balance else qt
    grouped = group_rows(spec, lanes) if gqa_rows else 0  # a job per kv head: its group's rows
    if grouped:
        qt = grouped
    tiles = (qt, kt)
    i64 = lambda v: tirx.const(v, "int64")  # noqa: E731
    f32 = lambda v: tirx.const(v, "float32")  # noqa: E731
    neg_inf = f32(-math.inf)
    vk = _vec_width(kt, lanes)  # key-tile vector width (kt is a multiple of lanes by choice)
    key_rows = spec.k in KEY_ROWS  # K untransposed (.., s, d): the short-query form
    vd = _vec_width(spec.d, lanes)
    mr_s = micro_rows(qt, max(1, kt // lanes), lanes)  # Q K^T micro-kernel rows
    dvc = vec_chunks(spec.dv, lanes)  # P V's row of dv floats as vectors
    mr_o = micro_rows(qt, sum(-(-w // lanes) for _, w in dvc), lanes)  # P V micro-kernel rows: registers a row holds

    def dv_row():
        """d over a row of dv, each vec_chunks piece vectorised: the body runs once per piece."""
        return _row_loops(T, i64, dvc)

    def exp_shifted(x):
        """exp(x) for x <= 0 (a score minus its row's running max)."""
        return fast_exp2(x * f32(LOG2E)) if exp2 else fast_exp(x, nonpositive=True)

    def dim(v, name):
        return i64(v) if v is not None else tirx.Var(name, "int64")

    B, Sq, Skv = dim(spec.batch, "batch"), dim(spec.sq, "seq"), dim(spec.skv, "kv_seq")
    if spec.same_len:
        Skv = Sq
    if spec.kv_capacity is not None and (spec.skv is not None or spec.same_len or spec.kv_capacity < 1):
        raise ValueError(f"kv_capacity needs a symbolic key length of its own: {spec.describe()}")
    Cap = i64(spec.kv_capacity) if spec.kv_capacity is not None else Skv  # K's and V's rows (s axis)
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

    kshape = [{"b": B, "h": Hk, "d": D, "s": Cap}[c] for c in spec.k]

    def kt_at(b, h, d, s):
        return [{"b": b, "h": h, "d": d, "s": s}[c] for c in spec.k]

    def to32(e, dtype=spec.dtype):
        return e if dtype == "float32" else tirx.Cast("float32", e)

    n_q = i64(1) if grouped else (Sq + i64(qt - 1)) // i64(qt)
    static_q_exact = grouped or (spec.sq is not None and spec.sq % qt == 0)
    static_k_exact = spec.skv is not None and spec.skv % kt == 0
    fill = f32(spec.fill if spec.fill is not None else 0.0)
    pairs = bf16 and bf16_pairs(spec, kt, lanes)
    if pairs:
        from blockforge.compile.bf16.intrin import IMPORT_PRAGMA, LLVM_IR, dpbf16, pack_pairs16

        hd = spec.d // 2

        def ramp(base):
            return tirx.Ramp(base, i64(1), lanes)

        def dot_pairs(r, ii, c, a, bload):
            """r[ii, c-th vector] += the bf16 pair products of a (one pair, broadcast) and bload."""
            at_r = [ii, ramp(c * i64(lanes))]
            T.buffer_store(r, dpbf16(tirx.BufferLoad(r, at_r), tirx.Broadcast(a, lanes), bload), at_r)

    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("fused_attention")
            Q = T.arg("q", T.buffer(shape(spec.q, Sq, D), spec.dtype))
            K = T.arg("k_t", T.buffer(kshape, spec.dtype))
            V = T.arg("v", T.buffer(shape(spec.v, Cap, Dv, Hk), spec.dtype))
            A = T.arg("add", T.buffer(mask_shape(spec.add), spec.add_dtype)) if spec.add else None
            M = T.arg("keep", T.buffer(mask_shape(spec.keep), "bool")) if spec.keep else None
            if spec.kv_capacity is not None:  # the rows read: a scalar input (Relax passes a PrimValue)
                T.arg("kv_seq", Skv)
            O = T.arg("out", T.buffer(shape(spec.o, Sq, Dv), spec.dtype))
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, KERNEL_ATTR: spec.to_json(),
                         KERNEL_ATTR + ".tiles": f"{qt}x{kt}", **({KERNEL_ATTR + ".bf16": True} if pairs else {})})
            # bf16: the LLVM function the products call, linked into the module (as the bf16 GEMM's)
            jobs = B * Hk if grouped else B * H * n_q
            with T.parallel(i64(0), jobs, annotations={IMPORT_PRAGMA: LLVM_IR} if pairs else None) as p:
                if grouped:  # row i: query head hk * group + i // Sq, query i % Sq
                    b, hk, q0 = p // Hk, p % Hk, i64(0)
                    h = None
                else:
                    b = p // (H * n_q)
                    h = p // n_q % H
                    hk = h // i64(group) if group > 1 else h  # the key/value head
                    q0 = p % n_q * i64(qt)

                def hrow(i):
                    """The query head of tile row i."""
                    return hk * i64(group) + i // i64(spec.sq) if grouped else h
                acc = T.alloc_buffer((qt, spec.dv), "float32", scope="local")
                s = T.alloc_buffer((qt, kt), "float32", scope="local")
                qtp = -(-qt // vk) * vk  # row buffers in whole vectors (alpha is computed so)
                m = T.alloc_buffer((qtp,), "float32", scope="local")
                el = T.alloc_buffer((qt,), "float32", scope="local")
                alpha = T.alloc_buffer((qtp,), "float32", scope="local")
                mnew = T.alloc_buffer((qtp,), "float32", scope="local")  # the new max, then the exp shift
                part = T.alloc_buffer((vk,), "float32", scope="local")
                pmax = T.alloc_buffer((qt, vk), "float32", scope="local")  # per-row partial maxima
                if pairs:  # bf16 pairs (int32 each): Q's rows, one key tile's K^T, V and P
                    qp = T.alloc_buffer((qt, hd), "int32", scope="local")
                    kp = T.alloc_buffer((hd, kt), "int32", scope="local")
                    vp = T.alloc_buffer((kt // 2, spec.dv), "int32", scope="local")
                    pp = T.alloc_buffer((qt, kt // 2), "int32", scope="local")
                with T.serial(i64(0), i64(qtp)) as i:
                    T.buffer_store(m, neg_inf, [i])
                    T.buffer_store(mnew, neg_inf, [i])  # padding rows: defined values, never read back
                with T.serial(i64(0), i64(qt)) as i:
                    T.buffer_store(el, f32(0), [i])
                    for d in dv_row():
                        T.buffer_store(acc, f32(0), [i, d])

                def qrow(i):
                    """Query row q0 + i, clamped for the last tile's rows past Sq (computed, not stored)."""
                    if grouped:
                        return i % i64(spec.sq)
                    return q0 + i if static_q_exact else tirx.min(q0 + i, Sq - i64(1))

                def halve(buf, op, width=vk, at=()):
                    """buf[*at, 0:width] reduced to a scalar (see lane_reduce)."""
                    return lane_reduce(tirx, buf, list(at), op, width)

                def tile(k0, valid, skip=0, kw=kt):
                    """One key tile of kw keys at k0 (valid: its key count when partial, else
                    None; skip: its first keys were visited by the previous tile and are
                    dropped here)."""
                    kidx = (lambda j: k0 + j) if valid is None else (lambda j: tirx.min(k0 + j, Skv - i64(1)))
                    tp = pairs and valid is None and not skip and kw % 32 == 0  # this tile on VDPBF16PS
                    if tp:  # K^T's rows d and d + d/2 as pairs, once per key tile
                        with T.serial(i64(0), i64(hd)) as e:
                            with T.unroll(i64(0), i64(kw // lanes)) as c:
                                j = ramp(k0 + c * i64(lanes))
                                T.buffer_store(kp, pack_pairs16(K[tuple(kt_at(b, hk, e, j))],
                                                                K[tuple(kt_at(b, hk, e + i64(hd), j))]),
                                               [e, ramp(c * i64(lanes))])
                    # scores: MR rows x KT keys in registers, reduced over d
                    with T.serial(i64(0), i64(qt // mr_s)) as io:
                        r = T.alloc_buffer((mr_s, kw), "float32", scope="local")
                        with T.unroll(i64(0), i64(mr_s)) as ii:
                          with T.unroll(i64(0), i64(kw // vk)) as c:
                            with T.vectorized(i64(0), i64(vk)) as jv:
                                T.buffer_store(r, f32(0), [ii, c * i64(vk) + jv])
                        if key_rows:
                            # K as the cache holds it (keys x d): each score a dot product
                            # vectorised along d (contiguous), then a tree sum; no K^T copy
                            # (per key, all micro rows: each key row is loaded once for them)
                            dot = T.alloc_buffer((mr_s, vd), "float32", scope="local")
                            with T.serial(i64(0), i64(kw)) as j:
                                with T.unroll(i64(0), i64(mr_s)) as ii:
                                    with T.vectorized(i64(0), i64(vd)) as e:
                                        T.buffer_store(dot, f32(0), [ii, e])
                                with T.serial(i64(0), D // i64(vd)) as c:
                                    with T.unroll(i64(0), i64(mr_s)) as ii:
                                        with T.vectorized(i64(0), i64(vd)) as e:
                                            d = c * i64(vd) + e
                                            i = io * i64(mr_s) + ii
                                            qv = to32(Q[tuple(at(spec.q, b, hrow(i), qrow(i), d))])
                                            kv = to32(K[tuple(kt_at(b, hk, d, kidx(j)))])
                                            T.buffer_store(dot, dot[ii, e] + qv * kv, [ii, e])
                                with T.unroll(i64(0), i64(mr_s)) as ii:
                                    T.buffer_store(r, halve(dot, lambda a, c: a + c, vd, at=(ii,)), [ii, j])
                        elif tp:
                          with T.serial(i64(0), i64(hd)) as e:
                            with T.unroll(i64(0), i64(mr_s)) as ii:
                                a = T.Bind(qp[io * i64(mr_s) + ii, e])
                                with T.unroll(i64(0), i64(kw // vk)) as c:
                                    dot_pairs(r, ii, c, a, tirx.BufferLoad(kp, [e, ramp(c * i64(vk))]))
                        else:
                          with T.serial(i64(0), D) as d:
                            with T.unroll(i64(0), i64(mr_s)) as ii:
                                i = io * i64(mr_s) + ii
                                qv = to32(Q[tuple(at(spec.q, b, hrow(i), qrow(i), d))])
                                with T.unroll(i64(0), i64(kw // vk)) as c:
                                  with T.vectorized(i64(0), i64(vk)) as jv:
                                    j = c * i64(vk) + jv
                                    kv = to32(K[tuple(kt_at(b, hk, d, kidx(j)))])
                                    T.buffer_store(r, r[ii, j] + qv * kv, [ii, j])
                        with T.unroll(i64(0), i64(mr_s)) as ii:
                            row = io * i64(mr_s) + ii
                            # the row max is taken here, from registers: one pass over s less
                            with T.vectorized(i64(0), i64(vk)) as j:
                                T.buffer_store(pmax, neg_inf, [row, j])
                            with T.unroll(i64(0), i64(kw // vk)) as c:
                              with T.vectorized(i64(0), i64(vk)) as jv:
                                j = c * i64(vk) + jv
                                x = r[ii, j] * f32(spec.scale)
                                if spec.softcap:
                                    x = f32(spec.softcap) * fast_tanh(x)
                                if A is not None:
                                    x = x + to32(A[tuple(mask_at(spec.add, b, hrow(row), qrow(row), kidx(j)))], spec.add_dtype)
                                keep = None
                                if M is not None:
                                    keep = M[tuple(mask_at(spec.keep, b, hrow(row), qrow(row), kidx(j)))]
                                if spec.causal:
                                    c = (k0 + j) <= (q0 + row)
                                    keep = c if keep is None else tirx.And(keep, c)
                                if keep is not None:
                                    x = tirx.Select(keep, x, fill)
                                if valid is not None:
                                    x = tirx.Select(j < valid, x, neg_inf)
                                if skip:
                                    x = tirx.Select(j >= i64(skip), x, neg_inf)
                                x = T.Bind(x)
                                T.buffer_store(s, x, [row, j])
                                T.buffer_store(pmax, tirx.max(pmax[row, jv], x), [row, jv])
                    # online softmax: new running max, p = exp(s - m'), rescale factor alpha
                    with T.serial(i64(0), i64(qt)) as i:
                        T.buffer_store(mnew, tirx.max(m[i], halve(pmax, tirx.max, at=(i,))), [i])
                    # alpha across rows, vectorised: one scalar exp per row and tile cost as
                    # much as the 16 lanes of one
                    # (in whole vectors: the row buffers are padded to qtp rows)
                    with T.serial(i64(0), i64(qtp // vk)) as c:
                      with T.vectorized(i64(0), i64(vk)) as iv:
                        i = c * i64(vk) + iv
                        # a row with no finite score yet keeps exp(-inf - 0) = 0, not NaN
                        mu = T.Bind(tirx.Select(mnew[i] == neg_inf, f32(0), mnew[i]))
                        T.buffer_store(alpha, exp_shifted(m[i] - mu), [i])
                        T.buffer_store(m, mnew[i], [i])
                        T.buffer_store(mnew, mu, [i])
                    with T.serial(i64(0), i64(qt)) as i:
                        mu = mnew[i]
                        with T.vectorized(i64(0), i64(vk)) as j:
                            T.buffer_store(part, f32(0), [j])
                        with T.serial(i64(0), i64(kw // vk)) as c:
                            with T.vectorized(i64(0), i64(vk)) as j:
                                e = T.Bind(exp_shifted(s[i, c * i64(vk) + j] - mu))
                                T.buffer_store(s, e, [i, c * i64(vk) + j])
                                T.buffer_store(part, part[j] + e, [j])
                        T.buffer_store(el, el[i] * alpha[i] + halve(part, lambda a, c: a + c), [i])
                    if tp:  # V's keys j and j + 16 of each 32-key block as pairs, and P's alike
                        with T.serial(i64(0), i64(kw // 32)) as c:
                            with T.serial(i64(0), i64(16)) as jl:
                                with T.unroll(i64(0), i64(spec.dv // lanes)) as dd:
                                    j, d = k0 + c * i64(32) + jl, ramp(dd * i64(lanes))
                                    T.buffer_store(vp, pack_pairs16(V[tuple(at(spec.v, b, hk, j, d))],
                                                                    V[tuple(at(spec.v, b, hk, j + i64(16), d))]),
                                                   [c * i64(16) + jl, d])
                        with T.serial(i64(0), i64(qt)) as i:
                            with T.unroll(i64(0), i64(kw // 32)) as c:
                                j = c * i64(32)
                                T.buffer_store(pp, pack_pairs16(s[i, ramp(j)], s[i, ramp(j + i64(16))]),
                                               [i, ramp(c * i64(16))])
                    # acc = acc * alpha + P V: MR rows x Dv in registers, reduced over the keys
                    with T.serial(i64(0), i64(qt // mr_o)) as io:
                        r = T.alloc_buffer((mr_o, spec.dv), "float32", scope="local")
                        with T.unroll(i64(0), i64(mr_o)) as ii:
                          for d in dv_row():
                                row = io * i64(mr_o) + ii
                                T.buffer_store(r, acc[row, d] * alpha[row], [ii, d])
                        if tp:
                          with T.serial(i64(0), i64(kw // 2)) as j2:
                            with T.unroll(i64(0), i64(mr_o)) as ii:
                                a = T.Bind(pp[io * i64(mr_o) + ii, j2])
                                with T.unroll(i64(0), i64(spec.dv // lanes)) as c:
                                    dot_pairs(r, ii, c, a, tirx.BufferLoad(vp, [j2, ramp(c * i64(lanes))]))
                        else:
                         with T.serial(i64(skip), i64(kw) if valid is None else valid) as j:
                            with T.unroll(i64(0), i64(mr_o)) as ii:
                                pv = s[io * i64(mr_o) + ii, j]
                                for d in dv_row():
                                    vv = to32(V[tuple(at(spec.v, b, hk, k0 + j, d))])
                                    T.buffer_store(r, r[ii, d] + pv * vv, [ii, d])
                        with T.unroll(i64(0), i64(mr_o)) as ii:
                          for d in dv_row():
                                T.buffer_store(acc, r[ii, d], [io * i64(mr_o) + ii, d])

                if pairs:  # Q's rows as pairs (d, d + d/2), once per job
                    with T.serial(i64(0), i64(qt)) as i:
                        with T.unroll(i64(0), i64(hd // lanes)) as c:
                            e = ramp(c * i64(lanes))
                            T.buffer_store(qp, pack_pairs16(Q[tuple(at(spec.q, b, hrow(i), qrow(i), e))],
                                                            Q[tuple(at(spec.q, b, hrow(i), qrow(i), e + i64(hd)))]), [i, e])
                n_full = Skv // i64(kt)
                if spec.causal:  # tiles right of this query tile's diagonal are all dropped
                    n_full = tirx.min(n_full, (q0 + i64(qt + kt - 1)) // i64(kt))
                with T.serial(i64(0), n_full) as t:
                    tile(t * i64(kt), None)
                if spec.skv is not None and spec.skv > kt and not static_k_exact:
                    # The ragged last tile as a whole tile ending at Skv, overlapping the one
                    # before: contiguous full-width K^T loads, where clamped key indices made
                    # every load of the partial tile a gather.
                    k_tail = spec.skv // kt * kt
                    cond = tirx.const(True, "bool")
                    if spec.causal:
                        cond = i64(k_tail) <= q0 + i64(qt - 1)
                    with T.If(cond):
                        with T.Then():
                            # only as many whole vectors as the rest needs (ViT's 197: 16
                            # keys; Whisper's 1500: 32, not 64 of which 36 are visited twice)
                            kw = tail_width(spec.skv, kt, vk) if key_tail else kt
                            tile(i64(spec.skv - kw), None, skip=kw - spec.skv % kt, kw=kw)
                elif not static_k_exact:
                    k_tail = Skv // i64(kt) * i64(kt)
                    cond = k_tail < Skv
                    if spec.causal:
                        cond = tirx.And(cond, k_tail <= q0 + i64(qt - 1))
                    with T.If(cond):
                        with T.Then():
                            tile(k_tail, Skv - k_tail)
                if spec.causal:
                    _causal_rest(T, tirx, spec, tiles, Skv, fill, q0, acc, m, el,
                                 lambda j, d: to32(V[tuple(at(spec.v, b, hk, j, d))]), dv_row)
                with T.serial(i64(0), i64(qt)) as i:
                    def store():
                        inv = T.alloc_buffer((1,), "float32", scope="local")
                        T.buffer_store(inv, f32(1) / el[i], [0])
                        for d in dv_row():
                            y = acc[i, d] * inv[0]
                            if spec.nan_rows_zero:  # el is 0 (all -inf) or NaN exactly when softmax is NaN
                                y = tirx.Select(el[i] > f32(0), y, f32(0))
                            elif spec.inf_rows_zero:
                                # el is exactly 0 only when every score is -inf (a row's max
                                # scores exp(0) = 1 otherwise); a NaN score makes it NaN
                                y = tirx.Select(el[i] == f32(0), f32(0), y)
                            T.buffer_store(O, y if spec.dtype == "float32" else tirx.Cast(spec.dtype, y),
                                           at(spec.o, b, hrow(i), qrow(i) if grouped else q0 + i, d))
                    if static_q_exact:
                        store()
                    else:
                        with T.If(q0 + i < Sq):
                            with T.Then():
                                store()
    func = ib.get()
    return func.with_attr("global_symbol", "fused_attention")


def _causal_rest(T, tirx, spec, tiles, Skv, fill, q0, acc, m, el, v_at, dv_row):
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
                        for d in dv_row():
                            T.buffer_store(acc, acc[i, d] * a, [i, d])
                        with T.serial(visited, Skv) as j:
                            for d in dv_row():
                                T.buffer_store(acc, acc[i, d] + w * v_at(j, d), [i, d])
                        T.buffer_store(el, el[i] * a + w * tirx.Cast("float32", Skv - visited), [i])
                        T.buffer_store(m, mn, [i])


def is_kernel(func) -> bool:
    return func.attrs is not None and KERNEL_ATTR in func.attrs
