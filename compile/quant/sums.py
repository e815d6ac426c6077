"""Row and column sums of 8-bit tensors, the zero-point terms of an int8 GEMM with a runtime
second operand (compile/quant/rewrite.py: a QDQ model's attention products):

    (A - za)(B - zb) = A B - za colsum(B) - zb rowsum(A) + K za zb

TVM's lowering of sum(astype(x, int32)) ran them as scalar loops: in Hugging Face's BERT-base
exported with SDPA and quantized static QDQ, at seq 512, the row sums of P (12 x 512 x 512 bytes)
took 0.85 ms a layer beside a 2.8 ms FFN GEMM. Here each is one parallel pass with the int32
accumulators in vector lanes:

    rowsum: for i in parallel (rows):  part[0:16] = sum over ko of A[i, 16ko : 16ko+16];  rs[i] = sum(part)
    colsum: for (b, 16-column group) in parallel:  for k: cs[b, g] += B[b, k, g]        (16 lanes)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

LANES = 16
KERNEL_ATTR = "blockforge.int8_sums"
PARALLEL_ELEMS = 1 << 16
_DTYPES = ("int8", "uint8")


@dataclass(frozen=True)
class SumSpec:
    axis: str  # "rows": (R, K) -> (R,), sums along the last dim; "cols": (B, K, N) -> (B, N), along K
    k: int  # the summed length (static)
    dtype: str = "int8"
    rows: int | None = None  # "rows": R (None: symbolic)
    batch: int = 1  # "cols": B
    n: int = 16  # "cols": N (a multiple of LANES)

    def __post_init__(self):
        if self.axis not in ("rows", "cols") or self.dtype not in _DTYPES or self.k <= 0 or self.batch < 1:
            raise ValueError(f"8-bit sums: {self}")
        if self.axis == "rows" and self.k % LANES:
            raise ValueError(f"8-bit row sums need a row length that is a multiple of {LANES}, got {self.k}")
        if self.axis == "cols" and (self.n <= 0 or self.n % LANES):
            raise ValueError(f"8-bit column sums need N a multiple of {LANES}, got {self.n}")


def rows_supported(k: int | None) -> bool:
    return k is not None and k > 0 and k % LANES == 0


def kernel(spec: SumSpec):
    """The scheduled PrimFunc: (x, out) with x (rows, k) or (batch, k, n), out int32."""
    from tvm import s_tir, te, tirx

    from blockforge.compile.schedule.base import schedule_lane_partials

    i64 = lambda v: tirx.IntImm("int64", v)  # noqa: E731  Relax shapes are int64
    if spec.axis == "rows":
        m = tirx.Var("m", "int64") if spec.rows is None else i64(spec.rows)
        x = te.placeholder((m, i64(spec.k)), spec.dtype, name="x")
        ko = te.reduce_axis((i64(0), i64(spec.k // LANES)), name="ko")
        part = te.compute((m, i64(LANES)), lambda i, lane: te.sum(x[i, ko * LANES + lane].astype("int32"), axis=ko),
                          name="part")
        rl = te.reduce_axis((i64(0), i64(LANES)), name="rl")
        out = te.compute((m,), lambda i: te.sum(part[i, rl], axis=rl), name="rowsum")
        sch = s_tir.Schedule(te.create_prim_func([x, out]))
        part = sch.get_sblock("part")
        schedule_lane_partials(sch, part, spec.rows is None or spec.rows * spec.k >= PARALLEL_ELEMS)
        sch.reverse_compute_at(sch.get_sblock("rowsum"), sch.get_loops(part)[0])
    else:
        x = te.placeholder((i64(spec.batch), i64(spec.k), i64(spec.n)), spec.dtype, name="x")
        r = te.reduce_axis((i64(0), i64(spec.k)), name="r")
        out = te.compute((i64(spec.batch), i64(spec.n)), lambda b, j: te.sum(x[b, r, j].astype("int32"), axis=r),
                         name="colsum")
        sch = s_tir.Schedule(te.create_prim_func([x, out]))
        blk = sch.get_sblock("colsum")
        b, j, k = sch.get_loops(blk)
        jo, lane = sch.split(j, [None, LANES])
        sch.reorder(b, jo, k, lane)
        par = sch.fuse(b, jo)
        if spec.batch * spec.k * spec.n >= PARALLEL_ELEMS:
            sch.parallel(par)
        sch.vectorize(lane)
        init = sch.decompose_reduction(blk, k)
        sch.vectorize(sch.get_loops(init)[-1])
    f = sch.mod["main"]
    return f.with_attr({"tirx.noalias": True, "tirx.is_scheduled": True, KERNEL_ATTR: json.dumps(asdict(spec))})


def is_kernel(func) -> bool:
    return func.attrs is not None and KERNEL_ATTR in func.attrs
