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

from .kernel_timing import time_kernel


def tune_attention_tiles(mod, db, target, builder, runner, dims: dict[str, int], job_id: str,
                         say=lambda line: None) -> int:
    """Time the tile candidates of every fused attention kernel of `mod` (a module after the
    fuse-attention phase) not yet in the device database `db`; returns kernels tuned."""
    from tvm.s_tir import meta_schedule as ms

    from blockforge.compile.schedule.base import vector_lanes

    tgt = target.tvm_target()
    lanes = vector_lanes(tgt)
    done = 0
    for n, spec in enumerate(attention.kernel_specs(mod), start=1):
        wl_mod = attention.workload(spec, lanes)
        shash = ms.database.Workload(wl_mod).as_json()[0]
        entry = db.ledger().get(shash, {})
        if entry.get("attention_tiles"):
            continue  # timed by an earlier job on this device
        rnd = db.begin_round(job_id, 10000 + n)
        scratch = ms.database.JSONDatabase(work_dir=str(rnd.path))
        wl = scratch.commit_workload(wl_mod)
        times = {}
        candidates = attention.tile_candidates(lanes)
        for tiles in candidates:
            secs = time_kernel(attention.kernel(spec, tiles, lanes), target, builder, runner, dims,
                               "attention tile candidate")
            if secs is None:
                continue
            scratch.commit_tuning_record(ms.database.TuningRecord(
                attention.tile_trace(spec, lanes, tiles, candidates), wl, secs, tgt, None))
            times[f"{tiles[0]}x{tiles[1]}"] = round(sum(secs) / len(secs) * 1e6, 1)
        db.commit_round(rnd)
        if not times:
            continue
        best = min(times, key=times.get)
        if times[best] * 1e-6 >= FAILED_RUN_SECS:
            continue
        db.set_ledger_flag(shash, "task", f"fused_attention ({spec.describe()})")
        db.set_ledger_flag(shash, "attention_tiles", times)  # us per call, per candidate
        say(f"fused attention {spec.describe()}: tiles {best} ({times[best]:.1f} us; "
            + ", ".join(f"{k} {v:.1f}" for k, v in times.items()) + ")")
        done += 1
    return done
