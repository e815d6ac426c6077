"""Tile search for the int8 GEMM kernel (blockforge.compile.quant): its micro-tile (rows x
16-lane vectors) and parallel split, as MetaSchedule records of the kernel's workload
(compile/quant/tiles.py).

The kernel is hand-scheduled and tensorized on the VNNI intrinsic, so MetaSchedule's search
spaces do not apply; the tile space is small (gemm.tile_candidates: at most 20 per kernel)
and is timed whole, each candidate built once with the job's builder and timed with its
runner. The fastest is then A/B-tested against the default tiles (both re-timed, taking
turns, AB_ROUNDS times): only a candidate that beats the default by AB_MARGIN in the median
and in every round (tune.kernel_timing.wins, the MetaSchedule records' in-model rule) wins;
otherwise this CPU's verdict keeps the default (the same in_model verdict the
MetaSchedule tasks' A/B writes, so compile/records' plan_apply leaves the record out).
The default's record goes into the database, and the winner's when there is one, each
with its A/B median; the ledger keeps every candidate's time (us per call).
"""

from __future__ import annotations

import logging

import numpy as np

from blockforge.compile.quant import gemm, tiles as int8_tiles
from blockforge.compile.records.reader import FAILED_RUN_SECS

from .kernel_timing import build_kernel, run_kernel, wins

_log = logging.getLogger("blockforge")
AB_ROUNDS = 3  # default and challenger re-timed alternately, this many times each
AB_MARGIN = 0.02  # the challenger's median must beat the default's by 2%, and every round
LEDGER_KEY = "int8_tiles"


def _median(samples: list[float]) -> float:
    return float(np.median(samples))


def tune_int8_tiles(mod, db, target, builder, runner, dims: dict[str, int], job_id: str, cpu: str | None,
                    say=lambda line: None, candidates=None) -> int:
    """Time the tile candidates of every int8 GEMM kernel of `mod` (a module after the
    int8-gemm phase) not yet in the device database `db`; returns kernels tuned.
    cpu: the CPU the timings are this CPU's verdict for (None: a remote device, no verdict:
    the records' A/B medians alone then decide). candidates: spec -> tiles (tests)."""
    from tvm.s_tir import meta_schedule as ms

    tgt = target.tvm_target()
    done = 0
    for n, spec in enumerate(dict.fromkeys(gemm.kernel_specs(mod)), start=1):
        wl_mod = int8_tiles.workload(spec)
        shash = ms.database.Workload(wl_mod).as_json()[0]
        if db.ledger().get(shash, {}).get(LEDGER_KEY):
            continue  # timed by an earlier job on this device
        cands = list(candidates(spec) if candidates else gemm.tile_candidates(spec))
        default = gemm.default_tiles(spec)
        if default not in cands:
            cands.insert(0, default)
        built, secs = {}, {}
        for t in cands:
            func = gemm.kernel(spec, t, gemm.epilogue_for(tgt))  # as the int8-gemm phase builds it
            what = f"int8 GEMM {spec.describe()} tiles {t.describe()}"
            art = build_kernel(func, target, builder, what)
            s = run_kernel(art, func, target, runner, dims, what) if art is not None else None
            if s is not None and _median(s) < FAILED_RUN_SECS:
                built[t], secs[t] = (art, func), s
        if default not in secs:
            _log.warning("int8 GEMM %s: the default tiles did not run; nothing recorded", spec.describe())
            continue
        best = min(secs, key=lambda t: _median(secs[t]))
        ab = {default: [], best: []}  # per round: the median of the runner's samples
        if best != default:  # the A/B: both again, taking turns (drift hits both alike)
            for r in range(AB_ROUNDS):
                for t in ((default, best) if r % 2 == 0 else (best, default)):
                    s = run_kernel(*built[t], target, runner, dims, f"int8 GEMM tiles {t.describe()}")
                    if s:
                        ab[t].append(_median(s))
        if len(ab[best]) != AB_ROUNDS or len(ab[default]) != AB_ROUNDS:
            ab = {default: [_median(secs[default])]}
        # the rule the MetaSchedule records' in-model A/B applies: in doubt, the default stays
        win = best != default and wins(ab[default], ab[best], AB_MARGIN)
        rnd = db.begin_round(job_id, 20000 + n)
        scratch = ms.database.JSONDatabase(work_dir=str(rnd.path))
        wl = scratch.commit_workload(wl_mod)
        for t in (ab if win else [default]):  # a challenger that did not win is not a record to apply
            scratch.commit_tuning_record(ms.database.TuningRecord(
                int8_tiles.tile_trace(spec, t, cands), wl, [_median(ab[t])], tgt, None))
        db.commit_round(rnd)
        d_ms, b_ms = _median(ab[default]) * 1e3, _median(ab[best]) * 1e3
        db.set_ledger_flag(shash, "task", f"int8_gemm ({spec.describe()})")
        db.set_ledger_flag(shash, LEDGER_KEY, {t.describe(): round(_median(s) * 1e6, 1) for t, s in secs.items()})
        if cpu is not None:
            db.set_verdict(shash, cpu, not win, d_ms, b_ms)
        say(f"int8 GEMM {spec.describe()}: tiles {(best if win else default).describe()} "
            f"({'A/B ' + f'{b_ms * 1e3:.1f} vs default {d_ms * 1e3:.1f} us' if best != default else 'the default is fastest'}; "
            + ", ".join(f"{t.describe()} {_median(s) * 1e6:.1f}" for t, s in secs.items()) + ")")
        done += 1
    return done
