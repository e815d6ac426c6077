"""The int8 GEMM kernel: u8 activations x s8 weights -> s32 on VPDPBUSD (x86), or s8 x s8 on
SDOT (aarch64 +dotprod), zero points folded through column/row sums, dequantize scale and bias
fused into the write-back. The instruction is a parameter (compile/quant/isa.py); the
layout, the folding and the epilogue are the same for both.

    C[i, j] = sum_k A[i, k] W[k, j]  - zp_a colsum(W)[j]  (+ rowcorr[i])
    out[i, j] = float(C[i, j]) * scale (scalar or per column) + bias[j]       (or C itself)

With A = u8 values and W = s8 values, (A - zp_a)(W - zp_w) = A W - zp_a colsum(W)
- zp_w rowsum(A) + K zp_a zp_w: the colsum term is a constant per column (computed when the
weights are packed), the rowsum term (only when zp_w != 0) is `rowcorr`, computed beside
the kernel. s8 activations become u8 by the +128 shift: (a + 128) - (zp_a + 128) (VNNI);
on SDOT u8 activations become s8 by -128 alike.

Weights are prepacked (N/16, K/4, 16, 4): for each group of 4 k, 16 columns' 4 bytes are
the 64 contiguous bytes one VPDPBUSD reads. The micro-kernel keeps MR rows x NV vectors of
16 int32 in zmm registers (5 x 3 = 15 of 32: a tile under STACK_BYTES, so the accumulator is a
stack alloca LLVM keeps in registers) and broadcasts 4 bytes of A per row and k-group:

    for (column panel jo, row tile io) in parallel:     # symbolic M: panels parallel, rows
        acc[MR][NV*16] = 0                              #   serial with a guarded tail
        for ko < K/4: for ii < MR: for jv < NV: acc[ii][jv] = vpdpbusd(acc, bcast(A[i, 4ko:4ko+4]), Wp[jo*NV+jv, ko])
        out[i, j] = epilogue(acc)

On SDOT (4 int32 lanes) the same loops run with MR = 5, NV = 1: each 16-column panel is four
SDOTs on consecutive 16-byte quarters of the (16, 4) group.

On SMMLA (`+i8mm`, isa.mmla) rows and columns go in pairs: the weights pack (N/16, K/8, 16, 8),
so a column pair's 8 k-bytes each are 16 contiguous bytes; A is packed per call into row pairs
(M/2, K/8, 2, 8), and the accumulator is (M/2, N/2, 2, 2), one register a 2 x 2 tile; the
epilogue reads it back as (M, N):

    Ap[ip, kp] = (A[2ip, 8kp:8kp+8], A[2ip+1, 8kp:8kp+8])      # parallel, once per call
    for (column panel jo, row tile io) in parallel:
        for kp < K/8: for ii < MR/2: for jc < 8: acc[ii, jc] = smmla(acc[ii, jc], Ap[ii, kp], Wp[jo, kp, 2jc:2jc+2])
        out[i, j] = epilogue(acc[i/2, j/2, i%2, j%2])
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np

from blockforge.compile.quant.isa import ISAS

MR = ISAS["vnni"].mr  # rows per micro-tile (VNNI's; each ISA has its own)
NV = ISAS["vnni"].nv  # 16-lane int32 vectors per row of the micro-tile
# TVM's LowerTVMBuiltin puts a constant-size buffer below this many bytes on the stack
# (runtime::kMaxStackAlloca) and serves a larger one with TVMBackendAllocWorkspace/FreeWorkspace,
# inside the parallel body: once per row tile. The default tiles' accumulators stay under it
# (5 x 3 vectors = 960 B; 7 x 2 = 896 B where 3 panels do not divide N). Measured, one thread
# CPU time, interleaved (load 5-8; the tile with its A-broadcast fix, compile/quant/intrin.py):
#   512x768x3072 +gelu   6x64 4.01 ms | 5x48 3.41 (0.85) | 4x48 3.43 | 7x32 3.46
#   512x3072x768 +bias   6x64 3.57 ms | 5x48 3.04 (0.85) | 4x48 3.13 | 7x32 3.16
STACK_BYTES = 1024
# The tile before the stack-sized default (1536 B of accumulators): the int8-stack-tiles ablation.
LEGACY_TILE = (6, 4)
# Below this many multiply-adds (static M) the kernel runs on one thread: waking the pool
# cost more than the work (16x64x128: 0.026-0.05 ms parallel on the loaded machine; the
# whole d_model 64 FFN took 0.034 ms on int8 vs 0.020 ms on TVM's int32 loops).
PARALLEL_MACS = 1 << 22
# ... unless the weights alone are this many bytes: a decode step (M = 1) is bound by reading
# them, and one core reads about half the machine's bandwidth (768 x 768 is 0.6 MB).
PARALLEL_WEIGHT_BYTES = 1 << 18
# The epilogue's table (lut_tail): the loop of 16 lookups the kernel marks for _permute_lookups.
LUT_LOOP = "blockforge.int8_gemm.lut_lookup"
KERNEL_ATTR = "blockforge.int8_gemm"  # PrimFunc attr: the spec (tests and dumps count these)
TILES_ATTR = KERNEL_ATTR + ".tiles"  # PrimFunc attr: the tiles it was scheduled with (describe())
ACTIVATIONS = ("none", "relu", "gelu")
# Steps after the scale (and bias/activation) that the epilogue computes too, in order: what a
# QDQ model writes between its MatMuls, so the elementwise chain never goes through memory in
# float32 (BERT-base FFN at seq 512: a 512x3072 float32 tensor written, then read by a second
# kernel that re-quantized it):
#   ("qdq", scale, zp, dtype)  QuantizeLinear then DequantizeLinear (per tensor): float -> float
#   ("q", scale, zp, dtype)    QuantizeLinear, the last step: the kernel writes int8/uint8
#   ("bias",) | ("relu",) | ("gelu",)   the bias input added here (not after the scale), an activation
#   ("add",)                   an addend input, (M, N) float32, the same for every GEMM of a batch:
#                              an attention mask after Q K^T (Hugging Face's (1, 1, S, S)), a residual
POST_STEPS = ("qdq", "q", "bias", "relu", "gelu", "add")
_QRANGE = {"int8": (-128, 127), "uint8": (0, 255)}
# The parallel split: "tiles" runs (column panel, row tile) pairs in parallel (static M);
# "panels" runs the column panels in parallel with their row tiles serial inside (the only
# split for a symbolic M: LoopPartition splits the guarded last row tile off the full ones).
SPLITS = ("tiles", "panels")
ZMM = 32  # vector registers the micro-tile must fit: MR*NV accumulators, NV weights, 1 broadcast
# (rows, vectors) per micro-tile that tune times (tune/gemm_tiles.py; the bf16 kernel too); each fits ZMM registers.
# K is not blocked: one panel (K x 16*NV bytes: 36 KiB at K=768, NV=3) streams from L2 per
# row tile and a row tile of A (MR x K bytes) stays in L1.
MICRO_TILES = ((6, 4), (4, 4), (5, 4), (4, 6), (5, 3), (4, 3), (6, 3), (8, 3), (9, 3), (7, 2), (8, 2), (12, 2),
               (14, 2))


@dataclass(frozen=True)
class Int8GemmSpec:
    k: int
    n: int
    m: int | None = None  # None: symbolic rows (a symbolic seq)
    scale: str = "none"  # "none" (int32 out), "scalar", "column"
    bias: bool = False
    rowcorr: bool = False  # weights' zero point != 0: a per-row int32 correction input
    activation: str = "none"  # after the bias, in the epilogue: "none", "relu", "gelu" (fast_math's)
    isa: str = "vnni"  # the dot-product instruction (compile/quant/isa.py): "vnni" (u8 A), "sdot" (s8 A)
    post: tuple = ()  # POST_STEPS after the activation (QDQ's requantizations; see above)
    # independent GEMMs in one call, each its own A rows and packed B (a batched-heads export's
    # attention products, (1, h, M, K) x (1, h, K, N)): every tensor but scale and bias gets a
    # leading (batch,) dim; the batches are an outer parallel loop
    batch: int = 1

    def __post_init__(self):
        # (JSON gives lists: the spec is a dict key, so tuples)
        object.__setattr__(self, "post", tuple(tuple(step) for step in self.post))
        _check_post(self)
        if self.isa not in ISAS:
            raise ValueError(f"isa: {self.isa!r}")
        g = ISAS[self.isa].kgroup
        if self.k % g or self.n % 16 or self.k <= 0 or self.n <= 0:
            raise ValueError(f"int8 GEMM needs K % {g} == 0 and N % 16 == 0, got K={self.k} N={self.n}")
        if not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"batch: {self.batch!r}")
        if self.scale not in ("none", "scalar", "column"):
            raise ValueError(f"scale: {self.scale!r}")
        if (self.bias or self.activation != "none") and self.scale == "none":
            raise ValueError("a bias or an activation needs a float epilogue (scale)")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation: {self.activation!r}")

    @property
    def out_dtype(self) -> str:
        if self.post and self.post[-1][0] == "q":
            return self.post[-1][3]
        return "int32" if self.scale == "none" else "float32"

    @property
    def bias_in_post(self) -> bool:
        return ("bias",) in self.post

    @property
    def addend(self) -> bool:
        """The kernel reads an (M, N) float32 addend (its input after the bias)."""
        return ("add",) in self.post

    def to_json(self) -> str:
        d = asdict(self)
        if d["batch"] == 1:
            del d["batch"]  # (the specs before batches serialised without it: tuning records keep their keys)
        return json.dumps(d, sort_keys=True)

    def describe(self) -> str:
        m = "M" if self.m is None else str(self.m)
        return (f"{self.batch} x " if self.batch > 1 else "") + f"{m}x{self.k}x{self.n} scale={self.scale}{' +bias' if self.bias else ''}{' +rowcorr' if self.rowcorr else ''}" + \
            (f" +{self.activation}" if self.activation != "none" else "") + \
            "".join(f" >{step[0]}" + (f"({step[3]})" if len(step) > 1 else "") for step in self.post) + \
            (f" [{self.isa}]" if self.isa != "vnni" else "")


def _check_post(spec: "Int8GemmSpec") -> None:
    import math

    if spec.post and spec.scale == "none":
        raise ValueError("post steps need a float epilogue (scale)")
    for i, step in enumerate(spec.post):
        kind = step[0] if step else None
        if kind not in POST_STEPS:
            raise ValueError(f"post step: {step!r}")
        if kind in ("qdq", "q"):
            if len(step) != 4 or step[3] not in _QRANGE or not isinstance(step[2], int) \
                    or not _QRANGE[step[3]][0] <= step[2] <= _QRANGE[step[3]][1] \
                    or not isinstance(step[1], float) or not (math.isfinite(step[1]) and step[1] > 0):
                raise ValueError(f"post step: {step!r}")
            if kind == "q" and i != len(spec.post) - 1:
                raise ValueError("a post quantize (int8 out) must be the last step")
        elif len(step) != 1 or (kind == "bias" and not spec.bias):
            raise ValueError(f"post step: {step!r}")
    if spec.post.count(("add",)) > 1:
        raise ValueError("one addend per kernel")


@dataclass(frozen=True)
class GemmTiles:
    """The micro-kernel's shape: rows per tile, 16-lane vectors per row, the parallel split
    (the int8 kernel's and the bf16 kernel's, compile/bf16/gemm.py: the same register budget)."""
    mr: int = MR
    nv: int = NV
    split: str = "tiles"

    def __post_init__(self):
        if self.mr < 1 or self.nv < 1 or self.mr * self.nv + self.nv + 1 > ZMM or self.split not in SPLITS:
            raise ValueError(f"GEMM tiles: {self}")

    def describe(self) -> str:
        return f"{self.mr}x{self.nv * 16} {self.split}"

    def code(self) -> int:
        """The integer a tuning record's decision stores (compile/records/choice.py)."""
        return self.mr * 100 + self.nv * 10 + SPLITS.index(self.split)

    def fits(self, panels: int, symbolic: bool) -> bool:
        """The tile's vectors divide the kernel's `panels` (16-column panels of N), and a
        symbolic M runs the column panels parallel (its guarded last row tile split off)."""
        return panels % self.nv == 0 and (not symbolic or self.split == "panels")

    @staticmethod
    def from_code(code) -> "GemmTiles | None":
        """code() inverted; None for an integer no GemmTiles encodes (too many registers, an
        unknown split, out of range): a database is untrusted input."""
        code = int(code)
        mr, nv, split = code // 100, code // 10 % 10, code % 10
        try:
            return GemmTiles(mr, nv, SPLITS[split]) if 0 <= code and split < len(SPLITS) else None
        except ValueError:
            return None


def default_tiles(spec: "Int8GemmSpec", stack: bool = True) -> GemmTiles:
    """The untuned kernel's tiles; stack False: the 6 x 4 tile before the stack-sized default
    (LEGACY_TILE, VNNI only: the int8-stack-tiles ablation)."""
    isa = ISAS[spec.isa]
    if stack or spec.isa != "vnni":
        nv = _nv(spec.n, isa.nv)
        # fewer panels than the ISA's (N/16 not a multiple of 3): more rows, still under STACK_BYTES
        mr = isa.mr if nv == isa.nv else min(7, (STACK_BYTES - 1) // (nv * isa.lanes * 4))
    else:
        mr, nv = LEGACY_TILE[0], _nv(spec.n, LEGACY_TILE[1])
    # A static M below the tile's rows (a decode step's M = 1) gets a tile of M rows: the
    # full tile re-reads row M-1 into MR - M dead rows (6x the VPDPBUSDs at M = 1).
    mr = mr if spec.m is None else min(mr, spec.m)
    mr += mr % 2 if isa.mmla else 0  # rows in pairs: M = 1 computes one clamped row beside it
    return GemmTiles(mr, nv, "panels" if spec.m is None else "tiles")


def micro_tile_candidates(default: GemmTiles, panels: int, symbolic: bool, spare: int = 0) -> list[GemmTiles]:
    """What tune times for a kernel (the int8 and the bf16 GEMM): `default` first, then the
    MICRO_TILES that fit (GemmTiles.fits) under each split a static or symbolic M allows, with
    `spare` registers beyond the accumulators, weights and broadcast."""
    out = [default]
    for mr, nv in MICRO_TILES:
        for split in ("panels",) if symbolic else SPLITS:
            t = GemmTiles(mr, nv, split)
            if t.fits(panels, symbolic) and mr * nv + nv + 1 + spare <= ZMM and t not in out:
                out.append(t)
    return out


def tile_candidates(spec: "Int8GemmSpec") -> list[GemmTiles]:
    """What tune times for a spec (the default first): the micro-tiles whose vectors divide
    N, under each split the spec allows."""
    # the micro-tiles are sized for 32 zmm: VNNI's, and VPMADDUBSW's / VPMADDWD's (AVX-512 BW)
    # with 3 more registers (the ones vector and two int16/int32 temporaries: isa.py); SDOT's,
    # SMMLA's and the ymm rows keep their one tile (isa.py)
    spare = {"vnni": 0, "avx512bw": 3, "avx512bw-wd": 3}.get(spec.isa)
    if spare is None:
        return [default_tiles(spec)]
    return micro_tile_candidates(default_tiles(spec), spec.n // 16, spec.m is None, spare)


def supported(k: int, n: int, isa: str = "vnni") -> bool:
    return k > 0 and n > 0 and k % ISAS[isa].kgroup == 0 and n % 16 == 0


def padded(n: int) -> int:
    """N rounded up to whole 16-column panels (the int8-gemm phase pads the weights' columns)."""
    return -(-n // 16) * 16


def int8_weights(w: np.ndarray) -> tuple[np.ndarray, int] | None:
    """(W8, c): integer weights as the kernel packs them, int8 with W = W8 - c (c = 0 where W
    fits int8, e.g. u8 weights less their zero point); None where W spans more than 256 values."""
    w = np.asarray(w).astype(np.int64)
    lo, hi = int(w.min()), int(w.max())
    if lo >= -128 and hi <= 127:
        return w.astype(np.int8), 0
    if hi - lo > 255:
        return None
    c = -128 - lo  # W + c fits int8; W = (W + c) - c
    return (w + c).astype(np.int8), c


def pack_weights(w: np.ndarray, kgroup: int = 4) -> np.ndarray:
    """(K, N) int8 -> (N/16, K/g, 16, g) int8, the layout the intrinsic reads (g: the ISA's
    kgroup, 8 on SMMLA)."""
    k, n = w.shape
    return np.ascontiguousarray(w.reshape(k // kgroup, kgroup, n // 16, 16).transpose(2, 0, 3, 1))


def column_sums(w: np.ndarray) -> np.ndarray:
    return w.astype(np.int32).sum(axis=0, dtype=np.int32)


def _parallel(spec: Int8GemmSpec) -> bool:
    """Whether a static-M kernel runs on the thread pool (see PARALLEL_MACS)."""
    return spec.batch * spec.m * spec.k * spec.n >= PARALLEL_MACS or spec.k * spec.n >= PARALLEL_WEIGHT_BYTES


def _nv(n: int, most: int) -> int:
    return next(v for v in (most, 2, 1) if v <= most and (n // 16) % v == 0)


def lut_tail(spec: Int8GemmSpec) -> int | None:
    """Where the epilogue's table starts: the index of the first post "qdq" step after which
    only per-tensor steps follow (no bias), a gelu among them, ending in an 8-bit quantize;
    else None. What comes out of a per-tensor requantize is one of 256 values, so the steps
    after it are a function of the level: a 256-byte table the kernel fills once per call (the
    same TE, so the same floats as per element) and reads with VPERMI2B (_permute_lookups).
    The QDQ FFN's first GEMM (128x768x3072, >qdq >bias >qdq >gelu >q): gelu + quantize cost
    0.17-0.18 ms of its 0.93 ms, 2 threads; read by VPGATHERDD the table cost 0.09-0.11 ms
    (Zen 4's gather), by VPERMI2B the kernel takes 0.76-0.78 ms against 0.87-0.89 per element;
    the FFN as ORT's quantize_static writes it, with / without, two runs: 0.96x and 1.00x at
    seq 128, 0.92x and 0.94x at 512. blockforge's own `export --quantize static` leaves the bias
    Add in float (no requantize after it): its gelu reads a per-column value and stays per
    element."""
    if spec.isa != "vnni" or not spec.post or spec.post[-1][0] != "q":
        return None
    for t, step in enumerate(spec.post):
        rest = spec.post[t + 1:]
        if step[0] == "qdq" and rest and ("gelu",) in rest and all(r[0] not in ("bias", "add") for r in rest):
            return t
    return None


@dataclass(frozen=True)
class Epilogue:
    """How kernel() computes a spec's post steps; every choice gives the same numbers within
    one quantization level. The defaults are the function MetaSchedule keys tile records by
    (tiles.workload): per element, dividing by the scale as TVM's legalization of
    relax.quantize does, so bit-exact with the unfused build."""
    lut: bool = False  # the steps after lut_tail(spec) read from a 256-byte table (has_lut)
    # quantize as round(x * (1/s)), the reciprocal rounded to float32 once, not round(x / s):
    # differs from the division only where x / s lies within an ulp or two of a half-integer
    # (then by one level). What ORT's fused QDQ kernels and OpenVINO do too (a multiplier).
    # vdivps is Zen 4's slowest vector op: the own-export QDQ FFN's first GEMM (128x768x3072,
    # >qdq >bias >gelu >q), kernel alone, 2 threads, medians of 20 interleaved: 0.856 -> 0.831
    # ms; the FFN (whole_ab --abba, new / dividing): 0.998 at seq 128, 0.985 at 512.
    reciprocal: bool = False
    # gelu per element in 32 cubic segments read with VPERMI2PS (compile/quant/gelu.py; AVX-512):
    # 13 instructions, no division, where fast_erf's takes 18 with a VDIVPS; within 5e-7 of gelu.
    gelu_segments: bool = False


def epilogue_for(target, lut: bool = True, reciprocal: bool = True, gelu_segments: bool = True) -> Epilogue:
    """The epilogue the int8-gemm phase builds on `target` (and so what tune times and the
    benchmark runs): the table where the target can read it, the reciprocal quantize, the
    segmented gelu on AVX-512; `lut` / `reciprocal` / `gelu_segments` False: their ablations."""
    from blockforge.targets.precision import tvm_target_has

    return Epilogue(lut=lut and target is not None and has_lut(target), reciprocal=reciprocal,
                    gelu_segments=gelu_segments and target is not None and tvm_target_has(target, "avx512f"))


def compute(spec: Int8GemmSpec, mr: int | None = None, epilogue: Epilogue = Epilogue()):
    """The TE definition: (inputs, output, table) tensors, inputs in the kernel's argument
    order; `mr` the micro-tile's rows (None: the instruction's default). With a table
    (epilogue.lut and lut_tail(spec)), the steps after lut_tail read it: table is
    (placeholder the output reads, the compute that fills it), which kernel() puts inside
    the function; else None (every post step per element)."""
    from tvm import te, tirx

    i64 = lambda v: tirx.IntImm("int64", v)  # noqa: E731  Relax shapes are int64
    m = tirx.Var("m", "int64") if spec.m is None else i64(spec.m)
    K, N = spec.k, spec.n
    isa = ISAS[spec.isa]
    mr = isa.mr if mr is None else mr
    lead = (i64(spec.batch),) if spec.batch > 1 else ()  # every per-GEMM tensor's leading dim
    a = te.placeholder((*lead, m, i64(K)), isa.act_dtype, name="A")
    g = isa.kgroup
    wp = te.placeholder((*lead, i64(N // 16), i64(K // g), i64(16), i64(g)), isa.w_dtype, name="Wp")
    colsum = te.placeholder((*lead, i64(N)), "int32", name="colsum")
    zpa = te.placeholder((), "int32", name="zp_a")
    ins = [a, wp, colsum, zpa]
    rowcorr = te.placeholder((*lead, m), "int32", name="rowcorr") if spec.rowcorr else None
    scale = None
    if spec.scale != "none":
        scale = te.placeholder((i64(N),) if spec.scale == "column" else (), "float32", name="scale")
    bias = te.placeholder((i64(N),), "float32", name="bias") if spec.bias else None
    addend = te.placeholder((m, i64(N)), "float32", name="addend") if spec.addend else None
    ins += [t for t in (rowcorr, scale, bias, addend) if t is not None]
    r = te.reduce_axis((i64(0), i64(K)), name="k")
    # The accumulator has whole MR-row tiles; the rows past M (in the last tile of a ragged M)
    # re-read row M-1 and are never written out. A guarded tile instead (the split's
    # predicate on the update block) is what TVM's tensorize cannot match.
    rows = (m + i64(mr - 1)) // i64(mr) * i64(mr)
    ragged = spec.m is None or spec.m % mr != 0
    row = (lambda i: tirx.min(i, m - i64(1))) if ragged else (lambda i: i)
    if isa.mmla:
        acc = _mmla_acc(a, wp, lead, rows, row, r, g)
    else:
        acc = te.compute((*lead, rows, i64(N)), _over_rows(len(lead), lambda b, i, j: te.sum(
            a[(*b, row(i), r)].astype("int32") * wp[(*b, j // 16, r // g, j % 16, r % g)].astype("int32"), axis=r)),
            name="acc")

    def dequantized(b, i, j):
        c = acc[(*b, i, j)] - zpa[()] * colsum[(*b, j)]
        if rowcorr is not None:
            c = c + rowcorr[(*b, i)]
        if scale is None:
            return c
        v = c.astype("float32") * (scale[j] if spec.scale == "column" else scale[()])
        return v + bias[j] if bias is not None and not spec.bias_in_post else v

    segments = epilogue.gelu_segments
    out = _activation(te.compute((*lead, m, i64(N)), _over_rows(len(lead), dequantized), name="out"), spec.activation,
                      segments)
    t = lut_tail(spec) if epilogue.lut else None
    for step in spec.post if t is None else spec.post[:t]:
        out = _post_step(out, step, bias, epilogue.reciprocal, segments, addend)
    if t is None:
        return ins, out, None
    out, table = _table_lookup(out, spec.post[t], spec.post[t + 1:], spec.out_dtype, epilogue.reciprocal)
    return ins, out, table


def _over_rows(batched: int, body):
    """A TE compute body over (i, j), body(b, i, j) with b the leading batch index as a tuple
    (empty unbatched: the loop names, and so the IR, of the kernels before batches)."""
    return (lambda b, i, j: body((b,), i, j)) if batched else (lambda i, j: body((), i, j))


def _mmla_acc(a, wp, lead: tuple, rows, row, r, g: int):
    """The accumulator on a matrix instruction (isa.mmla: SMMLA's 2 x g by g x 2): A's rows
    packed in pairs ("A_pairs", (rows/2, K/g, 2, g): the instruction's A operand is 16
    contiguous bytes), the 2 x 2 tiles ("acc", (rows/2, N/2, 2, 2): one register each), and
    the (rows, N) view the epilogue reads ("acc_rows", inlined into it)."""
    from tvm import te

    k = a.shape[-1]
    n = wp.shape[-4] * 16
    def pair(*x):  # (b?, ip, kp, di, dk)
        b, (ip, kp, di, dk) = x[:-4], x[-4:]
        return a[(*b, row(ip * 2 + di), kp * g + dk)]

    def tile(*x):  # (b?, ip, jp, di, dj)
        b, (ip, jp, di, dj) = x[:-4], x[-4:]
        col = jp * 2 + dj
        return te.sum(pairs[(*b, ip, r // g, di, r % g)].astype("int32")
                      * wp[(*b, col // 16, r // g, col % 16, r % g)].astype("int32"), axis=r)

    pairs = te.compute((*lead, rows // 2, k // g, 2, g), pair, name="A_pairs")
    tiles = te.compute((*lead, rows // 2, n // 2, 2, 2), tile, name="acc")
    return te.compute((*lead, rows, n), _over_rows(len(lead), lambda b, i, j: tiles[(*b, i // 2, j // 2, i % 2, j % 2)]),
                      name="acc_rows")


def _table_lookup(x, step: tuple, tail: tuple, out_dtype: str, reciprocal: bool):
    """x requantized by `step` (a per-tensor qdq) to its level 0..255, then the `tail` steps
    read from a table over the 256 levels (lut_tail): (output, (table placeholder, table))."""
    from tvm import te, tirx

    _, s, zp, dtype = step
    lo, hi = _QRANGE[dtype]
    f32 = lambda v: tirx.const(v, "float32")  # noqa: E731
    # the level, as the qdq step's clip(round(x / s) + zp) - lo: the table's index
    level = te.compute(x.shape, _over_rows(len(x.shape) - 2, lambda b, i, j: (
        te.max(te.min(te.round(_scaled(x[(*b, i, j)], s, reciprocal)), f32(hi - zp)), f32(lo - zp))
        + f32(zp - lo)).astype("int32")), name="post_level")
    # the table: each level dequantized exactly as the qdq step's float, then the tail
    table = te.compute((hi - lo + 1,), lambda v: (v + tirx.const(lo - zp, "int32")).astype("float32") * f32(s),
                       name="lut_dq")
    for st in tail:
        table = _post_step(table, st, None, reciprocal)
    # bytes, as VPERMI2B reads them (uint8 levels above 127 wrap; the lookup writes them back)
    table = te.compute(table.shape, lambda v: table[v].astype("int8"), name="lut")
    held = te.placeholder(table.shape, "int8", name="lut")
    lookup = _over_rows(len(x.shape) - 2, lambda b, i, j: held[level[(*b, i, j)]].astype(out_dtype))
    return te.compute(x.shape, lookup, name="post_lookup"), (held, table)


def _activation(x, kind: str, segments: bool = False):
    """`segments`: gelu as compile/quant/gelu.py computes it (x's last axis the epilogue's
    columns, vectorized by 16 from a multiple of 16)."""
    if kind == "relu":
        from tvm import topi

        return topi.nn.relu(x)
    if kind == "gelu" and segments:
        from blockforge.compile.quant.gelu import gelu_segments

        return gelu_segments(x)
    if kind == "gelu":
        from blockforge.compile.passes.fast_math import gelu

        return gelu(x)  # the same polynomial the float build's gelu uses
    return x


def reciprocal_scale(s: float) -> np.float32 | None:
    """1 / s rounded to float32 once (Epilogue.reciprocal; reference() uses the same), or None
    where that is not a normal float32 (a subnormal scale from a hostile file: 1 / s is inf and
    0 * inf a NaN; a scale above 2^126: a subnormal reciprocal): such a step divides."""
    with np.errstate(over="ignore", divide="ignore"):
        r = np.float32(1) / np.float32(s)
    return r if np.isfinite(r) and r >= np.finfo(np.float32).tiny else None


def _scaled(x, s: float, reciprocal: bool):
    """x / s, the quantize's quotient before rounding: divided, or times reciprocal_scale(s)."""
    from tvm import tirx

    r = reciprocal_scale(s) if reciprocal else None
    if r is not None:
        return x * tirx.const(float(r), "float32")
    return x / tirx.const(s, "float32")


def _post_step(x, step: tuple, bias, reciprocal: bool = False, segments: bool = False, addend=None):
    """One POST_STEPS step on the epilogue's tensor, as TVM's legalization of relax.quantize /
    dequantize computes it (round half to even of x / scale, + zp, clipped), so the fused
    epilogue is bit-exact with the unfused build; `reciprocal`: x times 1 / scale instead
    (Epilogue.reciprocal)."""
    from tvm import te, tirx

    kind = step[0]
    if kind == "bias":
        return te.compute(x.shape, _over_rows(len(x.shape) - 2, lambda b, i, j: x[(*b, i, j)] + bias[j]),
                          name="post_bias")  # (the table has none)
    if kind == "add":  # (every batch's GEMM adds the same rows)
        return te.compute(x.shape, _over_rows(len(x.shape) - 2, lambda b, i, j: x[(*b, i, j)] + addend[i, j]),
                          name="post_add")
    if kind not in ("qdq", "q"):
        return _activation(x, kind, segments)
    _, s, zp, dtype = step
    lo, hi = _QRANGE[dtype]
    f32 = lambda v: tirx.const(v, "float32")  # noqa: E731
    if kind == "qdq":
        # (clip(round(x / s) + zp, lo, hi) - zp) * s without the trip through int8: the same
        # float for every finite x (integers below 2^24 add exactly; a rounded value that large
        # clips either way), 8 instructions fewer per 16 lanes. QDQ FFN's 128x768x3072 kernel:
        # 0.94 -> 0.86-0.90 ms, 2 threads (the quotient itself: _scaled, Epilogue.reciprocal).
        return te.compute(x.shape, lambda *i: te.max(te.min(te.round(_scaled(x[i], s, reciprocal)), f32(hi - zp)),
                                                     f32(lo - zp)) * f32(s), name="post_qdq")
    return te.compute(x.shape, lambda *i: te.max(te.min(te.round(_scaled(x[i], s, reciprocal)) + f32(zp), f32(hi)),
                                                 f32(lo)).astype(dtype), name="post_q")


def kernel(spec: Int8GemmSpec, tiles: GemmTiles | None = None, epilogue: Epilogue = Epilogue()):
    """The scheduled, tensorized PrimFunc (needs a target with the spec's instruction to build:
    AVX-512 VNNI, or aarch64 +dotprod); `tiles` None: default_tiles (what an untuned build runs);
    `epilogue`: how the post steps are computed (what a build runs: epilogue_for(target); the
    default is the function MetaSchedule keys tile records by, tiles.workload)."""
    from tvm import s_tir, te

    from blockforge.compile.schedule.base import PARTITION_HINT

    isa = ISAS[spec.isa]
    tiles = tiles or default_tiles(spec)
    if not tiles.fits(spec.n // 16, spec.m is None):
        raise ValueError(f"int8 GEMM tiles {tiles.describe()} do not fit {spec.describe()}")
    if isa.mmla and tiles.mr % 2:
        raise ValueError(f"int8 GEMM tiles {tiles.describe()}: {isa.name} takes rows in pairs")
    ins, out, table = compute(spec, tiles.mr, epilogue)
    func = te.create_prim_func([*ins, *([table[0]] if table else []), out])
    sch = s_tir.Schedule(func)
    mm = sch.get_sblock("acc")
    steps = [b for b in sch.get_child_blocks(sch.get_sblock("root", "main"))
             if sch.get(b).name_hint not in ("acc", "A_pairs")]
    # The epilogue's elementwise steps (scale/bias, the activation's, the post steps) into its
    # last block; with a table, into the level's block, the lookup after it.
    lookup = steps.pop() if table else None
    for b in steps[:-1]:
        sch.compute_inline(b)
    ep = steps[-1]
    nv = tiles.nv
    batch = sch.get_loops(mm)[:1] if spec.batch > 1 else []  # (an outer loop, parallel with the tiles)
    if isa.mmla:
        # row pairs x column pairs, 8 of them per 16-column panel, one SMMLA each per k-group
        i, j, di, dj, k = sch.get_loops(mm)[len(batch):]
        io, ii = sch.split(i, [None, tiles.mr // 2])
        jo, jv, jq = sch.split(j, [None, nv, 8])
        ko, ki = sch.split(k, [None, isa.kgroup])
        sch.reorder(jo, io, ko, ii, jv, jq, di, dj, ki)
        ji = di  # (tensorized below)
        pack = sch.get_sblock("A_pairs")
        p0, *_, pk = sch.get_loops(pack)
        sch.vectorize(pk)  # a row's 8 bytes: one load and one store
        if spec.m is None or _parallel(spec):
            sch.parallel(p0)
    else:
        i, j, k = sch.get_loops(mm)[len(batch):]
        io, ii = sch.split(i, [None, tiles.mr])
        jo, jv, ji = sch.split(j, [None, nv, 16])
        ko, ki = sch.split(k, [None, isa.kgroup])
        # A narrower instruction (SDOT: 4 lanes) covers the 16-column group in 16 / lanes steps,
        # each on its 16 contiguous bytes of the packed group; the A broadcast is shared.
        jq, ji = sch.split(ji, [None, isa.lanes]) if isa.lanes < 16 else (None, ji)
        sch.reorder(jo, io, ko, ii, jv, *([jq] if jq is not None else []), ji, ki)
    # acc stays "global" (the intrinsic's buffers are): compacted to the MR x NV*16 tile
    # under the parallel loop, it lives in registers once the loops are unrolled.
    sch.reverse_compute_at(ep, io, preserve_unit_loops=True)
    *_, ei, ej = sch.get_loops(ep)
    # (unrolling these two loops, so the accumulator could be read from registers, measured
    # 1.03-1.08x slower at 5x48, one thread: 128/512x768x3072 +gelu, 128x3072x768)
    _, ejv = sch.split(ej, [None, 16])
    sch.vectorize(ejv)
    if lookup is not None:
        sch.reverse_compute_at(lookup, io, preserve_unit_loops=True)
        _, lj = sch.split(sch.get_loops(lookup)[-1], [None, 16])
        sch.annotate(lj, LUT_LOOP, 1)  # VPERMI2Bs, after scheduling (_permute_lookups)
    if tiles.split == "panels":
        # The column panels are the parallel work, the row tiles inside are serial (symbolic
        # rows: so LoopPartition, the hint, splits the guarded last tile off the full ones).
        if spec.m is None or _parallel(spec):
            sch.parallel(sch.fuse(*batch, jo) if batch else jo)
        if spec.m is None:
            sch.annotate(io, PARTITION_HINT, 1)
    else:
        par = sch.fuse(*batch, jo, io)
        if _parallel(spec):
            sch.parallel(par)
    sch.unroll(ii)
    sch.unroll(jv)
    if jq is not None:
        sch.unroll(jq)
    init = sch.decompose_reduction(mm, ko)
    zeroed = sch.get_loops(init)
    sch.vectorize(sch.fuse(*zeroed[-2:]) if isa.mmla else zeroed[-1])  # (a 2 x 2 tile: 4 lanes)
    sch.tensorize(ji, isa.intrin())
    f = sch.mod["main"]
    if table:
        f = _with_table(_permute_lookups(f), *table)
    return f.with_attr({"tirx.noalias": True, "tirx.is_scheduled": True, KERNEL_ATTR: spec.to_json(),
                        TILES_ATTR: tiles.describe()})


def has_lut(target) -> bool:
    """The target has what the epilogue's table is read with (AVX512_VBMI's VPERMI2B)."""
    from blockforge.targets.precision import tvm_target_has

    return tvm_target_has(target, "avx512vbmi")


def _permute_lookups(func):
    """Each LUT_LOOP (16 table reads out[i, j] = table[level[i, j]]) as two VPERMI2Bs: each
    looks 64 byte indices up in 128 bytes of the table (its two zmm), the index's bit 7 picks
    between them. TVM's vectorizer leaves a load at a computed index to LLVM as 16 scalar
    loads and inserts (~48 instructions) and tensorize cannot match a block whose read region
    is data-dependent, so the loop, its block and its binding are replaced here by the vector
    statement. (VPGATHERDD from a 1 KiB int32 table did it in one instruction, and cost more
    than the gelu it replaced on Zen 4: 0.09-0.11 ms of the 128x768x3072 kernel.)"""
    import tvm
    import tvm_ffi
    from tvm import tirx

    from blockforge.compile.passes.exprs import substitute_vars, var_count

    def permute(loop):
        realize = loop.body
        if not isinstance(realize, tvm.s_tir.stmt.SBlockRealize) or int(loop.extent) != 16:
            return None
        store = realize.block.body
        if not isinstance(store, tirx.BufferStore) or not isinstance(store.value, tirx.Cast):
            return None
        read = store.value.value  # table[level[i, j]]
        if not isinstance(read, tvm.ir.TensorLoad) or not isinstance(read.indices[0], tvm.ir.TensorLoad) \
                or str(read.source.dtype) != "int8" or int(read.source.shape[0]) != 256:
            return None
        if var_count(realize.predicate, loop.loop_var):
            return None  # a guard per lane: the loop stays as it was
        level = read.indices[0]
        lane0 = [(loop.loop_var, tirx.const(0, str(loop.loop_var.ty)))]
        bind = [(iv.var, substitute_vars(v, lane0)) for iv, v in zip(realize.block.iter_vars, realize.iter_values)]

        def lanes(idx, n=16):  # the indices of the first lane, the last one as n consecutive
            *rest, last = [substitute_vars(e, bind) for e in idx]
            return [*rest, tirx.Ramp(last, tirx.const(1, str(last.ty)), n)]

        byte = tirx.Cast("int8x16", tirx.BufferLoad(level.source, lanes(level.indices)))  # levels < 256: exact
        idx = tirx.Shuffle([byte] * 4, [tirx.const(i, "int32") for i in range(64)])  # (the low 16 are used)
        quarter = [tirx.BufferLoad(read.source, [tirx.Ramp(tirx.const(64 * q, "int32"), tirx.const(1, "int32"), 64)])
                   for q in range(4)]
        low, high = (tirx.call_llvm_pure_intrin("int8x64", "llvm.x86.avx512.vpermi2var.qi.512", quarter[2 * h],
                                                idx, quarter[2 * h + 1]) for h in (0, 1))
        picked = tirx.Select(idx < tirx.Broadcast(tirx.const(0, "int8"), 64), high, low)  # bit 7: the upper half
        out16 = tirx.Shuffle([picked], [tirx.const(i, "int32") for i in range(16)])
        out = tirx.BufferStore(store.buffer, tirx.reinterpret(f"{store.buffer.dtype}x16", out16), lanes(store.indices))
        guard = substitute_vars(realize.predicate, bind)
        return out if _is_true(guard) else tirx.IfThenElse(guard, out, None)

    def post(s):
        if isinstance(s, tirx.For) and LUT_LOOP in s.annotations:
            return permute(s) or s
        return s

    return tvm_ffi.structural_map(func, (tirx.For, post))


def _with_table(func, held, table):
    """func with its table parameter (`held`, last but one) made a buffer of its own, filled
    at the start by `table`'s compute: one vectorised loop over the 256 levels, once per call,
    before the parallel tiles. (Inside the TE function itself, the table would be a producer
    of the lookup outside the row tile, which reverse_compute_at refuses.)"""
    from tvm import s_tir, te, tirx

    from blockforge.compile.passes.exprs import substitute_vars

    tab = s_tir.Schedule(te.create_prim_func([table]))
    blocks = tab.get_child_blocks(tab.get_sblock("root", "main"))
    for b in blocks[:-1]:
        tab.compute_inline(b)
    _, lanes = tab.split(tab.get_loops(blocks[-1])[0], [None, 16])
    tab.vectorize(lanes)
    tf = tab.mod["main"]
    var = func.params[-2]
    fill = substitute_vars(tf.body.block.body, [(tf.params[0], var)])
    root = func.body.block
    block = s_tir.stmt.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint,
                              tirx.SeqStmt([fill, root.body]), root.init,
                              [*root.alloc_buffers, var, *tf.body.block.alloc_buffers], root.match_buffers,
                              root.annotations)
    params = [p for p in func.params if not p.same_as(var)]
    return tirx.PrimFunc(params, s_tir.stmt.SBlockRealize(func.body.iter_values, func.body.predicate, block),
                         func.ret_type, func.attrs)


def _is_true(expr) -> bool:
    from tvm import tirx

    return isinstance(expr, tirx.IntImm) and bool(expr.value)


def reference(spec: Int8GemmSpec, a: np.ndarray, w: np.ndarray, zp_a: int, zp_w: int = 0,
              scale=None, bias=None, reciprocal: bool = False, rowcorr=None, addend=None) -> np.ndarray:
    """numpy: what the kernel computes from the unpacked operands (tests, benchmarks); `a` in
    the spec's activation dtype (u8 for VNNI, s8 for SDOT), zp_a in the same range;
    `reciprocal`: as Epilogue.reciprocal quantizes; `rowcorr`: the kernel's per-row int32 input
    as given (the pass computes it from zp_w; here added as it is); `addend`: the (M, N) input
    of an ("add",) step."""
    c = (a.astype(np.int64) - zp_a) @ (w.astype(np.int64) - zp_w)
    if rowcorr is not None:
        c = c + np.asarray(rowcorr, np.int64)[:, None]
    if spec.scale == "none":
        return c.astype(np.int32)
    v = c.astype(np.float32) * np.asarray(scale, np.float32)
    v = v + bias if bias is not None and not spec.bias_in_post else v
    if spec.activation == "relu":
        v = np.maximum(v, np.float32(0))
    elif spec.activation == "gelu":
        raise ValueError("reference: gelu is fast_erf's polynomial (tests compare it with a tolerance)")
    for step in spec.post:
        if step[0] == "bias":
            v = v + bias
        elif step[0] == "add":
            v = v + np.asarray(addend, np.float32)
        elif step[0] == "relu":
            v = np.maximum(v, np.float32(0))
        elif step[0] in ("qdq", "q"):
            _, s, zp, dtype = step
            lo, hi = _QRANGE[dtype]
            r = reciprocal_scale(s) if reciprocal else None
            quotient = v * r if r is not None else v / np.float32(s)
            q = np.clip(np.round(quotient) + np.float32(zp), lo, hi).astype(dtype)  # half to even
            v = q if step[0] == "q" else (q.astype(np.int32) - zp).astype(np.float32) * np.float32(s)
        else:
            raise ValueError(f"reference: post step {step!r}")
    return v


def kernel_specs(mod) -> list[Int8GemmSpec]:
    """The specs of the int8 GEMM kernels in a module (after the int8-gemm phase)."""
    from tvm import tirx

    out = []
    for _, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc) and func.attrs is not None and KERNEL_ATTR in func.attrs:
            out.append(Int8GemmSpec(**json.loads(str(func.attrs[KERNEL_ATTR]))))
    return out


def is_kernel(func) -> bool:
    return func.attrs is not None and KERNEL_ATTR in func.attrs
