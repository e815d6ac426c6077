"""`blockforge tune`: MetaSchedule autotuning into the device's database (resumable)."""

from __future__ import annotations

import sys

from .common import (DEFAULT_SHAPE, add_force, add_precision, add_shape, check_outputs, default_dims, shape,
                     print_table, write_json)


def add(sub) -> None:
    from blockforge.tune.jobs import DEFAULT_ROUND_TRIALS, DEFAULT_TRIALS_PER_TASK, POPULATION

    p = sub.add_parser("tune", help="MetaSchedule autotuning into the device's database (resumable)",
                       description=f"Every task gets --trials-per-task trials (default {DEFAULT_TRIALS_PER_TASK}); "
                                   "--trials caps the job at min(per-task, trials // tasks) each. Trials already "
                                   "in the database count: a rerun spends 0, a raised budget only the difference.")
    p.add_argument("model")
    p.add_argument("--target", required=True)
    p.add_argument("--trials", type=int, default=None, help="total budget for this job")
    p.add_argument("--trials-per-task", type=int, default=None, help=f"budget per task (default {DEFAULT_TRIALS_PER_TASK})")
    p.add_argument("--round-trials", type=int, default=DEFAULT_ROUND_TRIALS, help="trials per task between database merges")
    p.add_argument("--population", type=int, default=POPULATION,
                   help=f"candidates the evolutionary search keeps per round (default {POPULATION}); smaller is "
                        "cheaper per round: a 4-trial FFN tune took ~40%% less CPU with 32")
    p.add_argument("--tuning-db", "--db", dest="tuning_db", default=None,
                   help="tuning database dir (default: the device's, in the blockforge cache)")
    p.add_argument("--rpc-tracker", default=None, help="HOST:PORT of a TVM RPC tracker")
    p.add_argument("--rpc-key", default=None, help="device key registered at the tracker")
    p.add_argument("--rpc-wait", type=float, default=10.0, help="seconds to wait for a device")
    add_shape(p, default_note=f"{DEFAULT_SHAPE} for the dims the model has; tasks are timed at fixed shapes, so "
                              "every dim must end up bound")
    add_precision(p)
    p.add_argument("--no-measure", action="store_true", help="skip the untuned-vs-tuned whole-model timing")
    p.add_argument("--check-only", action="store_true",
                   help="no search: re-run the in-model A/B of the database's records on this CPU and record the "
                        "verdicts (makes records tuned on another CPU usable here; one build per tuned task)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", default=None, help="write the summary as JSON here")
    add_force(p)
    p.set_defaults(func=run)


def run(a) -> int:
    from blockforge.fsutil import INTO, Output

    # --json and the database together: one path for both is refused
    check_outputs(a, [a.model], Output("tuning_db", a.tuning_db, INTO, "tuning database")
                  if a.tuning_db is not None else None, json=a.json)
    from blockforge.tune import TuneOptions, tune

    s = tune(TuneOptions(model=a.model, target=a.target, trials=a.trials, trials_per_task=a.trials_per_task,
                         tuning_db=a.tuning_db, rpc_tracker=a.rpc_tracker, rpc_key=a.rpc_key,
                         shape=shape(a), round_trials=a.round_trials, measure=not a.no_measure,
                         progress=not a.no_progress, rpc_wait_s=a.rpc_wait, check_only=a.check_only,
                         population=a.population, precision=a.precision, default_dims=default_dims(a)))
    rows = [[t.name, f"{t.flops / 1e6:.2f}", f"{t.best_us:.1f}" if t.best_us else "-",
             f"{t.gflops:.1f}" if t.gflops else "-", f"{min(t.trials_before, t.budget) + t.trials_new}/{t.budget}",
             t.trials_new, t.status] for t in s.tasks]
    print_table(["task", "MFLOP", "best us", "GFLOP/s", "trials", "new", "status"], rows)
    print(f"spent {s.trials_new} new trials, reused {s.trials_reused}"
          + (f", salvaged {s.salvaged} records of an interrupted job" if s.salvaged else "")
          + f"; database {s.db}")
    if s.cpu:
        print(f"in-model verdicts recorded for this CPU: {s.cpu}")
    if s.kept_default:
        print(f"kept blockforge's default schedule (faster inside the model) for: {', '.join(s.kept_default)}")
    if s.untuned_ms is not None:
        naive = f"TVM naive {s.naive_ms:.3f} ms, " if s.naive_ms is not None else ""
        print(f"whole model on this device: {naive}blockforge untuned {s.untuned_ms:.3f} ms, tuned {s.tuned_ms:.3f} ms")
    for line in s.refused:
        print(f"warning: {line}", file=sys.stderr)
    write_json(a.json, s.to_dict())
    return 0
