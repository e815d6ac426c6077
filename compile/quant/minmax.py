"""The range of an activation tensor in parallel, vectorised passes: DynamicQuantizeLinear's
max(x) and min(x) over the whole tensor, which TVM's default lowering runs as two serial
scalar loops (measured in the BERT-base FFN at seq 128, on the 128x3072 gelu output:
0.2 ms each, shared machine; the int8 GEMMs next to them take ~1 ms).

    for i in parallel (rows):  pmax[i, 0:16] = max over ko of x[i, 16ko : 16ko+16]   (pmin alike)
    max(x) = max(pmax); min(x) = min(pmin)                                              (rows x 16)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

LANES = 16
KERNEL_ATTR = "blockforge.int8_minmax"
PARALLEL_ELEMS = 1 << 16


@dataclass(frozen=True)
class MinMaxSpec:
    cols: int  # the row length (static, a multiple of LANES)
    rows: int | None = None  # None: symbolic

    def __post_init__(self):
        if self.cols % LANES or self.cols <= 0:
            raise ValueError(f"min/max kernel needs a row length that is a multiple of {LANES}, got {self.cols}")


def supported(cols: int | None) -> bool:
    return cols is not None and cols > 0 and cols % LANES == 0


def kernel(spec: MinMaxSpec):
    from tvm import s_tir, te, tirx

    from blockforge.compile.schedule.base import schedule_lane_partials

    i64 = lambda v: tirx.IntImm("int64", v)  # noqa: E731
    m = tirx.Var("m", "int64") if spec.rows is None else i64(spec.rows)
    x = te.placeholder((m, i64(spec.cols)), "float32", name="x")
    ko = te.reduce_axis((i64(0), i64(spec.cols // LANES)), name="ko")
    pmax = te.compute((m, i64(LANES)), lambda i, l: te.max(x[i, ko * LANES + l], axis=ko), name="pmax")
    ko2 = te.reduce_axis((i64(0), i64(spec.cols // LANES)), name="ko2")
    pmin = te.compute((m, i64(LANES)), lambda i, l: te.min(x[i, ko2 * LANES + l], axis=ko2), name="pmin")
    r, rl = te.reduce_axis((i64(0), m), name="r"), te.reduce_axis((i64(0), i64(LANES)), name="rl")
    mx = te.compute((), lambda: te.max(pmax[r, rl], axis=[r, rl]), name="mx")
    r2, rl2 = te.reduce_axis((i64(0), m), name="r2"), te.reduce_axis((i64(0), i64(LANES)), name="rl2")
    mn = te.compute((), lambda: te.min(pmin[r2, rl2], axis=[r2, rl2]), name="mn")
    sch = s_tir.Schedule(te.create_prim_func([x, mx, mn]))
    # (a small static tensor: one thread, cheaper than waking the pool)
    parallel = spec.rows is None or spec.rows * spec.cols >= PARALLEL_ELEMS
    for name in ("pmax", "pmin"):
        # Two parallel row loops (merging them with sch.merge put the merged loop after the
        # first final reduction, which then read pmax before it was written).
        schedule_lane_partials(sch, sch.get_sblock(name), parallel)
    f = sch.mod["main"]
    return f.with_attr({"tirx.noalias": True, "tirx.is_scheduled": True, KERNEL_ATTR: json.dumps(asdict(spec))})


def is_kernel(func) -> bool:
    return func.attrs is not None and KERNEL_ATTR in func.attrs
