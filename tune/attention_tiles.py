"""Tile search for the fused CPU attention kernel (blockforge.compile.attention).

The kernel is written by hand (a flash-attention loop nest), so MetaSchedule's search
spaces do not apply to it; what is tunable is its (query tile, key tile). Each candidate
is built and timed with the job's own builder and runner (so an RPC device times its
own), and stored as a MetaSchedule record of the kernel's workload (the kernel at the
default tiles) whose trace holds one decision: the candidate's index in a
SampleCategorical over the candidates. compile looks the workload up and takes the best
record's decision (attention.tile_record); MetaSchedule's own tools read the records.
"""

from __future__ import annotations

from blockforge.compile import attention
from blockforge.compile.records.reader import FAILED_RUN_SECS

from .kernel_timing import time_candidates

LEDGER_KEY = "attention_tiles"


def tune_attention_tiles(mod, db, target, builder, runner, dims: dict[str, int], job_id: str,
                         say=lambda line: None, bf16: bool = False) -> int:
    """Time the tile candidates of every fused attention kernel of `mod` (a module after the
    fuse-attention phase) not yet in the device database `db`; returns kernels tuned. bf16:
    the module was fused at `--precision bf16`: a kernel whose products run on VDPBF16PS
    has the bf16 kernel's candidates and workload (attention.tiles), the rest the float32 one's."""
    from tvm.s_tir import meta_schedule as ms

    from blockforge.compile.attention.flash import bf16_default
    from blockforge.compile.attention.tiles import candidates as tile_candidates
    from blockforge.compile.schedule.base import vector_lanes

    tgt = target.tvm_target()
    lanes = vector_lanes(tgt)
    done = 0
    for n, spec in enumerate(attention.kernel_specs(mod), start=1):
        on_bf16 = bf16 and bf16_default(spec, lanes) is not None  # as fuse-attention decides
        wl_mod = attention.workload(spec, lanes, on_bf16)
        shash = ms.database.Workload(wl_mod).as_json()[0]
        entry = db.ledger().get(shash, {})
        if entry.get(LEDGER_KEY):
            continue  # timed by an earlier job on this device
        rnd = db.begin_round(job_id, 10000 + n)
        scratch = ms.database.JSONDatabase(work_dir=str(rnd.path))
        wl = scratch.commit_workload(wl_mod)
        times = {}
        candidates = tile_candidates(spec, lanes, on_bf16)
        timed = time_candidates({t: attention.kernel(spec, t, lanes, bf16=on_bf16) for t in candidates},
                                target, builder, runner, dims, "attention tile candidate")
        for tiles, (secs, _) in timed.items():
            scratch.commit_tuning_record(ms.database.TuningRecord(
                attention.tile_trace(spec, lanes, tiles, candidates, bf16=on_bf16), wl, [secs], tgt, None))
            times[f"{tiles[0]}x{tiles[1]}"] = round(secs * 1e6, 1)
        db.commit_round(rnd)
        if not times:
            continue
        best = min(times, key=times.get)
        if times[best] * 1e-6 >= FAILED_RUN_SECS:
            continue
        db.set_ledger_flag(shash, "task", f"fused_attention ({spec.describe()}{' bf16' if on_bf16 else ''})")
        db.set_ledger_flag(shash, LEDGER_KEY, times)  # us per call, per candidate
        say(f"fused attention {spec.describe()}{' bf16' if on_bf16 else ''}: tiles {best} ({times[best]:.1f} us; "
            + ", ".join(f"{k} {v:.1f}" for k, v in times.items()) + ")")
        done += 1
    return done
