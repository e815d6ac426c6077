"""The bf16 GEMM kernel: float32 activations rounded to bf16 in the kernel, weights bf16
(converted and prepacked at compile time), float32 accumulation on VDPBF16PS, bias and
activation fused into the write-back, float32 out.

    ab[i, k]  = bf16(A[i, k])          round to nearest even (as OpenVINO's bf16 and
                                        VCVTNEPS2BF16 do); NaN stays NaN; k >= K: 0
    acc[i, j] = sum_k f32(ab[i, k]) f32(Wp[j/16, k/2, j%16, k%2])   (VDPBF16PS, fp32 sums)
    out[i, j] = act(acc[i, j] + bias[j])          j < N (N padded to 16 in Wp only)

Weights are prepacked (Np/16, Kp/2, 16, 2) uint16 (bf16 bits; K padded to even, N to a
multiple of 16, with zeros): for each pair of k, 16 columns' 2 values are the 64 contiguous
bytes one VDPBF16PS reads. The micro-kernel is the int8 kernel's (compile/quant/gemm.py):
MR rows x NV vectors of 16 float32 in zmm registers (4 x 6 where a static M fits those better:
Bf16GemmSpec.tile), the A pair broadcast per row.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np

from blockforge.compile.quant.gemm import GemmTiles, micro_tile_candidates

MR = 6  # rows per micro-tile
NV = 4  # 16-lane float32 vectors per row of the micro-tile
PARALLEL_MACS = 1 << 22  # below this (static M) one thread: the pool's wake-up costs more
KERNEL_ATTR = "blockforge.bf16_gemm"  # PrimFunc attr: the spec (tests and dumps count these)
TILES_ATTR = KERNEL_ATTR + ".tiles"  # PrimFunc attr: the tiles it was scheduled with (describe())
ACTIVATIONS = ("none", "relu", "gelu")


@dataclass(frozen=True)
class Bf16GemmSpec:
    k: int
    n: int
    m: int | None = None  # None: symbolic rows (a symbolic seq)
    bias: bool = False
    activation: str = "none"  # after the bias: "none", "relu", "gelu" (fast_math's)
    row_fit: bool = True  # a static M no 6-row tile divides in 4 x 6-vector tiles where they fit (tile())

    def __post_init__(self):
        if self.k <= 0 or self.n <= 0 or (self.m is not None and self.m <= 0):
            raise ValueError(f"bf16 GEMM needs positive sizes, got M={self.m} K={self.k} N={self.n}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation: {self.activation!r}")

    @property
    def kp(self) -> int:
        return self.k + self.k % 2

    @property
    def np_(self) -> int:
        return -(-self.n // 16) * 16

    def to_json(self) -> str:
        d = asdict(self)
        if d["row_fit"]:  # written only when off: the specs of dumps and tests keep their text
            del d["row_fit"]
        return json.dumps(d, sort_keys=True)

    def tile(self) -> tuple[int, int]:
        """(rows, 16-lane vectors) of the micro-tile: MR x NV (24 accumulators), or 4 x 6 when
        a static M is a multiple of 4 but not of 6 and N of 96 (BERT's 128 rows: 32 whole
        tiles, not 22 of 6 whose last computes 4 clamped rows; the same 10 loads per 24
        VDPBF16PS). Measured, kernel alone, interleaved, load 7.5, x the 6 x 4 kernel: 1 thread
        (CPU time) 128x768x3072 +gelu 0.98x, 128x3072x768 0.97x, 128x768x768 0.96x,
        512x768x768 0.98x; 2 threads 0.97x, 1.00x, 0.95x, 0.99x; outputs bit-equal (the
        same sums in the same order). Ablation bf16-row-fit."""
        n16 = self.np_ // 16
        if self.row_fit and self.m is not None and self.m % MR and self.m % 4 == 0 and n16 % 6 == 0:
            return 4, 6
        return MR, _nv(n16)

    def describe(self) -> str:
        m = "M" if self.m is None else str(self.m)
        return f"{m}x{self.k}x{self.n}{' +bias' if self.bias else ''}" + \
            (f" +{self.activation}" if self.activation != "none" else "")


def default_tiles(spec: Bf16GemmSpec) -> GemmTiles:
    """The untuned kernel's tiles: spec.tile(); row tiles parallel beside the column panels
    for a static M, column panels alone for a symbolic one."""
    mr, nv = spec.tile()
    return GemmTiles(mr, nv, "panels" if spec.m is None else "tiles")


def tile_candidates(spec: Bf16GemmSpec) -> list[GemmTiles]:
    """What tune times for a spec (the default first): the micro-tiles whose vectors divide
    the padded N, under each split the spec allows."""
    return micro_tile_candidates(default_tiles(spec), spec.np_ // 16, spec.m is None)


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even; NaN stays a (quiet) NaN."""
    b = np.ascontiguousarray(x, np.float32).view(np.uint32)
    r = ((b + np.uint32(0x7FFF) + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((b >> 16) | 0x40).astype(np.uint16), r)


def from_bf16_bits(u: np.ndarray) -> np.ndarray:
    return (np.asarray(u, np.uint16).astype(np.uint32) << 16).view(np.float32)


def pack_weights(w: np.ndarray) -> np.ndarray:
    """(K, N) float32 -> (Np/16, Kp/2, 16, 2) uint16 bf16 bits, the layout the intrinsic reads."""
    k, n = w.shape
    kp, np_ = k + k % 2, -(-n // 16) * 16
    wz = np.zeros((kp, np_), np.float32)
    wz[:k, :n] = w
    return np.ascontiguousarray(to_bf16_bits(wz).reshape(kp // 2, 2, np_ // 16, 16).transpose(2, 0, 3, 1))


def _nv(n16: int) -> int:
    return next(v for v in (NV, 2, 1) if n16 % v == 0)


def _round_bits(x):
    """The in-kernel float32 -> bf16 rounding: to_bf16_bits in TIR (vectorizes to integer ops)."""
    from blockforge.compile.bf16.intrin import round_bits

    return round_bits(x).astype("uint16")


def compute(spec: Bf16GemmSpec, gelu_segments: bool = False, mr: int | None = None):
    """The TE definition: (inputs, output) tensors, in the kernel's argument order;
    `gelu_segments`: a gelu as compile/quant/gelu.py computes it where the write-back is
    vectorized by 16 (N % 16 == 0), else fast_math's; mr: rows per micro-tile (None: the
    default tile's)."""
    from tvm import te, tirx

    from blockforge.compile.bf16.intrin import widen

    i64 = lambda v: tirx.IntImm("int64", v)  # noqa: E731  Relax shapes are int64
    m = tirx.Var("m", "int64") if spec.m is None else i64(spec.m)
    K, N, Kp, Np = spec.k, spec.n, spec.kp, spec.np_
    a = te.placeholder((m, i64(K)), "float32", name="A")
    wp = te.placeholder((i64(Np // 16), i64(Kp // 2), i64(16), i64(2)), "uint16", name="Wp")
    bias = te.placeholder((i64(N),), "float32", name="bias") if spec.bias else None
    ins = [a, wp] + ([bias] if bias is not None else [])
    # Whole MR-row tiles: the rows past M re-read row M-1 and are never written out (as the
    # int8 kernel: a guarded tile is what tensorize cannot match).
    mr = mr or spec.tile()[0]
    rows = (m + i64(mr - 1)) // i64(mr) * i64(mr)
    ragged = spec.m is None or spec.m % mr != 0
    row = (lambda i: tirx.min(i, m - i64(1))) if ragged else (lambda i: i)
    if K == Kp:
        ab = te.compute((rows, i64(Kp)), lambda i, k: _round_bits(a[row(i), k]), name="a_bf16")
    else:  # odd K: the pad column is 0 (not a clamped re-read: inf * 0 would be NaN)
        ab = te.compute((rows, i64(Kp)), lambda i, k: tirx.Select(
            k < i64(K), _round_bits(a[row(i), tirx.min(k, i64(K - 1))]), tirx.const(0, "uint16")), name="a_bf16")
    r = te.reduce_axis((i64(0), i64(Kp)), name="k")
    acc = te.compute((rows, i64(Np)), lambda i, j: te.sum(
        widen(ab[i, r]) * widen(wp[j // 16, r // 2, j % 16, r % 2]), axis=r), name="acc")
    out = te.compute((m, i64(N)), (lambda i, j: acc[i, j] + bias[j]) if bias is not None else
                     (lambda i, j: acc[i, j]), name="out")
    if spec.activation == "relu":
        from tvm import topi

        out = topi.nn.relu(out)
    elif spec.activation == "gelu" and gelu_segments and spec.n % 16 == 0:
        from blockforge.compile.quant.gelu import gelu_segments as segmented

        out = segmented(out)
    elif spec.activation == "gelu":
        from blockforge.compile.passes.fast_math import gelu

        out = gelu(out)  # the same polynomial the float build's gelu uses
    return ins, out


def kernel(spec: Bf16GemmSpec, gelu_segments: bool = False, tiles: GemmTiles | None = None):
    """The scheduled, tensorized PrimFunc (needs an AVX512_BF16 target to build);
    `gelu_segments`: see compute (what the bf16-gemm phase builds unless its ablation);
    tiles: the micro-tile and parallel split (None: default_tiles(spec); tune times the rest)."""
    from tvm import s_tir, te

    from blockforge.compile.schedule.base import PARTITION_HINT
    from blockforge.compile.bf16.intrin import IMPORT_PRAGMA, LLVM_IR, dpbf16_16x2

    tiles = tiles or default_tiles(spec)
    if not tiles.fits(spec.np_ // 16, spec.m is None):
        raise ValueError(f"bf16 GEMM tiles {tiles.describe()} do not fit {spec.describe()}")
    ins, out = compute(spec, gelu_segments, tiles.mr)
    func = te.create_prim_func([*ins, out])
    sch = s_tir.Schedule(func)
    mm, ab = sch.get_sblock("acc"), sch.get_sblock("a_bf16")
    steps = [b for b in sch.get_child_blocks(sch.get_sblock("root", "main"))
             if sch.get(b).name_hint not in ("acc", "a_bf16")]
    for b in steps[:-1]:
        sch.compute_inline(b)
    ep = steps[-1]
    big = spec.m is None or spec.m * spec.k * spec.n >= PARALLEL_MACS
    # The rounding pass over A: once, before the GEMM (per column panel it would repeat
    # N/64 times), rows in parallel, 16 lanes at a time.
    ai, ak = sch.get_loops(ab)
    if spec.kp % 16 == 0:
        sch.vectorize(sch.split(ak, [None, 16])[1])
    if big:
        sch.parallel(ai)
    i, j, k = sch.get_loops(mm)
    mr, nv = tiles.mr, tiles.nv
    io, ii = sch.split(i, [None, mr])
    jo, jv, ji = sch.split(j, [None, nv, 16])
    ko, ki = sch.split(k, [None, 2])
    sch.reorder(jo, io, ko, ii, jv, ji, ki)
    sch.reverse_compute_at(ep, io, preserve_unit_loops=True)
    *_, ei, ej = sch.get_loops(ep)
    if spec.n % 16 == 0:
        sch.vectorize(sch.split(ej, [None, 16])[1])
    if tiles.split == "panels":
        # column panels parallel, row tiles serial inside (a symbolic M: the guarded last one
        # split off by LoopPartition)
        if big:
            sch.parallel(jo)
        if spec.m is None:
            sch.annotate(io, PARTITION_HINT, 1)
        outer = jo
    else:
        outer = sch.fuse(jo, io)
        if big:
            sch.parallel(outer)
    sch.annotate(outer, IMPORT_PRAGMA, LLVM_IR)  # the LLVM function the intrinsic calls
    sch.unroll(ii)
    sch.unroll(jv)
    init = sch.decompose_reduction(mm, ko)
    sch.vectorize(sch.get_loops(init)[-1])
    sch.tensorize(ji, dpbf16_16x2())
    f = sch.mod["main"]
    return f.with_attr({"tirx.noalias": True, "tirx.is_scheduled": True, KERNEL_ATTR: spec.to_json(),
                        TILES_ATTR: tiles.describe()})


def reference(a: np.ndarray, w: np.ndarray, bias=None) -> np.ndarray:
    """numpy, what the kernel computes: A and W rounded to bf16 exactly as the kernel rounds
    them, products exact, float32 sums in VDPBF16PS's order (per pair: the odd k, then the
    even k, each added to the float32 accumulator with one rounding). The instruction
    treats denormal inputs as zero and flushes denormal results (DAZ/FTZ: measured on
    Zen 4, 2^-130 x 1 gives 0), and so does this."""
    tiny = np.float32(2.0**-126)
    daz = lambda v: np.where(np.abs(v) < tiny, np.float32(0), v)  # noqa: E731  (also flushes the sums)
    ab, wb = daz(from_bf16_bits(to_bf16_bits(a))), daz(from_bf16_bits(to_bf16_bits(w)))
    k = a.shape[1]
    if k % 2:
        ab = np.pad(ab, ((0, 0), (0, 1)))
        wb = np.pad(wb, ((0, 1), (0, 0)))
    acc = np.zeros((a.shape[0], w.shape[1]), np.float32)
    for p in range(0, ab.shape[1], 2):
        acc = daz(acc + ab[:, p + 1, None] * wb[None, p + 1])
        acc = daz(acc + ab[:, p, None] * wb[None, p])
    return acc + bias.astype(np.float32) if bias is not None else acc


def kernel_specs(mod) -> list[Bf16GemmSpec]:
    """The specs of the bf16 GEMM kernels in a module (after the bf16-gemm phase)."""
    from tvm import tirx

    return [Bf16GemmSpec(**json.loads(str(f.attrs[KERNEL_ATTR]))) for _, f in mod.functions_items()
            if isinstance(f, tirx.PrimFunc) and is_kernel(f)]


def is_kernel(func) -> bool:
    return func.attrs is not None and KERNEL_ATTR in func.attrs
