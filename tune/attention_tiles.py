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

import logging

from blockforge.compile import attention
from blockforge.compile.records.reader import FAILED_RUN_SECS
from blockforge.graph.model_io import DEFAULT_DIMS

_log = logging.getLogger("blockforge")


def _args_info(func, dims: dict[str, int]):
    """Concrete argument shapes of a kernel: its symbolic dims at the job's bound dims."""
    from tvm import tirx
    from tvm.s_tir import meta_schedule as ms

    bound = {**DEFAULT_DIMS, **dims}
    out = []
    for p in func.params:  # buffer-typed parameters
        shape = [int(s.value) if isinstance(s, tirx.IntImm) else int(bound[s.name]) for s in p.shape]
        out.append(ms.arg_info.TensorInfo(str(p.dtype), shape))
    return out


def _time(func, target, builder, runner, dims) -> list[float] | None:
    import tvm
    from tvm.s_tir import meta_schedule as ms

    tgt = target.tvm_target()
    built = builder.build([ms.builder.BuilderInput(tvm.IRModule({"main": func}), tgt)])[0]
    if built.error_msg:
        _log.warning("attention tile candidate did not build: %s", str(built.error_msg)[-300:])
        return None
    device = "cpu" if tgt.kind.name == "llvm" else tgt.kind.name
    res = runner.run([ms.runner.RunnerInput(built.artifact_path, device, _args_info(func, dims))])[0].result()
    if res.error_msg or not res.run_secs:
        _log.warning("attention tile candidate failed to run: %s", str(res.error_msg)[-300:])
        return None
    return [float(x) for x in res.run_secs]


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
            secs = _time(attention.kernel(spec, tiles, lanes), target, builder, runner, dims)
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
