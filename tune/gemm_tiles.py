"""Tile search for the hand-written GEMM kernels: the int8 GEMM (blockforge.compile.quant) and
the bf16 GEMM (blockforge.compile.bf16). Their micro-tile (rows x 16-lane vectors) and parallel
split are stored as MetaSchedule records of the kernel's workload (compile/records/choice.py).

The kernels are hand-scheduled and tensorized on their instructions (VPDPBUSD, SDOT, VDPBF16PS),
so MetaSchedule's search spaces do not apply; the tile space is small (at most ~30 per kernel)
and is timed whole: every candidate built with the job's builder, then timed with its runner
in turns (kernel_timing.time_candidates: the least sample). The fastest is then A/B-tested against the default tiles (both re-timed, taking
turns, AB_ROUNDS times): only a candidate that beats the default by AB_MARGIN in the median
and in every round (tune.kernel_timing.wins, the MetaSchedule records' in-model rule) wins;
otherwise this CPU's verdict keeps the default (the same in_model verdict the
MetaSchedule tasks' A/B writes, so compile/records' plan_apply leaves the record out).
The default's record goes into the database, and the winner's when there is one, each
with its A/B median; the ledger keeps every candidate's time (us per call).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np

from blockforge.compile.records.reader import FAILED_RUN_SECS

from .kernel_timing import run_kernel, time_candidates, wins

_log = logging.getLogger("blockforge")
AB_ROUNDS = 3  # default and challenger re-timed alternately, this many times each
AB_MARGIN = 0.02  # the challenger's median must beat the default's by 2%, and every round
INT8_LEDGER, BF16_LEDGER = "int8_tiles", "bf16_tiles"  # each family's ledger flag
LEDGER_KEYS = (INT8_LEDGER, BF16_LEDGER)  # jobs._measure_model: a kernel any family timed


@dataclass(frozen=True)
class GemmKernels:
    """One kernel family as the search sees it."""
    name: str  # in messages: "int8 GEMM"
    ledger_key: str  # the ledger's flag holding each candidate's time
    task: str  # the ledger's task name prefix
    phase: str  # the pipeline phase that writes the kernels
    specs: Callable  # module -> the kernels' specs
    candidates: Callable  # spec -> tiles, the default first
    default: Callable  # spec -> the untuned tiles
    kernel: Callable  # (spec, tiles, tvm target) -> the PrimFunc the phase would build
    workload: Callable  # spec -> the workload the phase looks records up by
    trace: Callable  # (spec, tiles, candidates) -> the record's trace


def int8_kernels() -> GemmKernels:
    from blockforge.compile.quant import gemm, tiles

    return GemmKernels("int8 GEMM", INT8_LEDGER, "int8_gemm", "int8-gemm", gemm.kernel_specs, gemm.tile_candidates,
                       gemm.default_tiles, lambda spec, t, tgt: gemm.kernel(spec, t, gemm.epilogue_for(tgt)),
                       tiles.workload, tiles.tile_trace)


def bf16_kernels() -> GemmKernels:
    from blockforge.compile.bf16 import gemm, tiles

    # gelu_segments: as the bf16-gemm phase builds them (its ablation's builds take no records)
    return GemmKernels("bf16 GEMM", BF16_LEDGER, "bf16_gemm", "bf16-gemm", gemm.kernel_specs, gemm.tile_candidates,
                       gemm.default_tiles, lambda spec, t, tgt: gemm.kernel(spec, True, t),
                       tiles.workload, tiles.tile_trace)


def _median(samples: list[float]) -> float:
    return float(np.median(samples))


def tune_gemm_tiles(kinds: GemmKernels, mod, db, target, builder, runner, dims: dict[str, int], job_id: str,
                    cpu: str | None, say=lambda line: None, candidates=None, round_base: int = 20000) -> int:
    """Time the tile candidates of every `kinds` kernel of `mod` (a module after its phase) not
    yet in the device database `db`; returns kernels tuned. cpu: the CPU the timings are this
    CPU's verdict for (None: a remote device, no verdict: the records' A/B medians alone then
    decide). candidates: spec -> tiles (tests)."""
    from tvm.s_tir import meta_schedule as ms

    tgt = target.tvm_target()
    done = 0
    for n, spec in enumerate(dict.fromkeys(kinds.specs(mod)), start=1):
        wl_mod = kinds.workload(spec)
        shash = ms.database.Workload(wl_mod).as_json()[0]
        if db.ledger().get(shash, {}).get(kinds.ledger_key):
            continue  # timed by an earlier job on this device
        cands = list(candidates(spec) if candidates else kinds.candidates(spec))
        default = kinds.default(spec)
        if default not in cands:
            cands.insert(0, default)
        funcs = {t: kinds.kernel(spec, t, tgt) for t in cands}  # as the phase builds them
        timed = time_candidates(funcs, target, builder, runner, dims, f"{kinds.name} {spec.describe()} tiles")
        secs = {t: s for t, (s, _) in timed.items() if s < FAILED_RUN_SECS}
        if default not in secs:
            _log.warning("%s %s: the default tiles did not run; nothing recorded", kinds.name, spec.describe())
            continue
        best = min(secs, key=secs.get)
        ab = {default: [], best: []}  # per round: the least of the runner's samples
        if best != default:  # the A/B: both again, taking turns (drift hits both alike)
            for r in range(AB_ROUNDS):
                for t in ((default, best) if r % 2 == 0 else (best, default)):
                    s = run_kernel(timed[t][1], funcs[t], target, runner, dims, f"{kinds.name} tiles {t.describe()}")
                    if s:
                        ab[t].append(min(s))
        if len(ab[best]) != AB_ROUNDS or len(ab[default]) != AB_ROUNDS:
            ab = {default: [secs[default]]}
        # the rule the MetaSchedule records' in-model A/B applies: in doubt, the default stays
        win = best != default and wins(ab[default], ab[best], AB_MARGIN)
        rnd = db.begin_round(job_id, round_base + n)
        scratch = ms.database.JSONDatabase(work_dir=str(rnd.path))
        wl = scratch.commit_workload(wl_mod)
        for t in (ab if win else [default]):  # a challenger that did not win is not a record to apply
            scratch.commit_tuning_record(ms.database.TuningRecord(
                kinds.trace(spec, t, cands), wl, [_median(ab[t])], tgt, None))
        db.commit_round(rnd)
        d_ms, b_ms = _median(ab[default]) * 1e3, _median(ab[best]) * 1e3
        db.set_ledger_flag(shash, "task", f"{kinds.task} ({spec.describe()})")
        db.set_ledger_flag(shash, kinds.ledger_key, {t.describe(): round(s * 1e6, 1) for t, s in secs.items()})
        if cpu is not None:
            db.set_verdict(shash, cpu, not win, d_ms, b_ms)
        say(f"{kinds.name} {spec.describe()}: tiles {(best if win else default).describe()} "
            f"({'A/B ' + f'{b_ms * 1e3:.1f} vs default {d_ms * 1e3:.1f} us' if best != default else 'the default is fastest'}; "
            + ", ".join(f"{t.describe()} {s * 1e6:.1f}" for t, s in secs.items()) + ")")
        done += 1
    return done
