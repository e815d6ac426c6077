"""`tune`: MetaSchedule jobs that resume, survive kill -9, and measure on remote devices.

Budget semantics (stated in --help and the README):
  * every task of the model gets its own budget of trials; none is starved;
  * --trials-per-task M sets that budget (default 64);
  * --trials T caps the job: each task's budget becomes min(M, T // tasks); T < tasks is refused;
  * trials already spent on a workload (this or another model, same device database) count
    toward its budget: a rerun spends 0, a raised budget spends only the difference.
Trials run in rounds (<= --round-trials per task per round, round-robin across tasks);
each finished round is merged into the device database atomically.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from blockforge.errors import BlockforgeError, error_line
from blockforge.fsutil import atomic_write_json
from blockforge.graph.model_io import random_inputs
from blockforge.logs import native_output_to_log
from blockforge.targets import ResolvedTarget, resolve

from ._ms_worker import time_direct
from .frontend import bound_signature, import_onnx
from .isolate import load_untrusted
from .pipeline import build, extract_tasks, run_phases
from .tuning_db import RECORDS, WORKLOADS, FAILED_RUN_SECS, DeviceDB, default_db_dir

DEFAULT_TRIALS_PER_TASK = 64


@dataclass
class TuneOptions:
    model: Path
    target: str | dict = "host"
    trials: int | None = None
    trials_per_task: int | None = None
    db: Path | None = None
    rpc_tracker: str | None = None
    rpc_key: str | None = None
    dims: dict[str, int] = field(default_factory=dict)
    round_trials: int = 32
    measure: bool = True
    progress: bool = True
    rpc_wait_s: float = 10.0
    seed: int | None = None
    population: int = 512  # evolutionary search population (TVM's default 2048 is slow for small rounds)


@dataclass
class TaskSummary:
    name: str
    workload: str
    flops: float
    budget: int
    trials_before: int
    trials_new: int
    best_us: float | None
    gflops: float | None

    @property
    def status(self) -> str:
        if self.trials_new == 0:
            return "reused"
        return "extended" if self.trials_before else "new"


@dataclass
class TuneSummary:
    model: str
    target: str
    device_key: str
    db: str
    budget_per_task: int
    tasks: list[TaskSummary]
    salvaged: int = 0
    seeded: int = 0  # workloads given their default-schedule record in this job
    kept_default: list[str] = field(default_factory=list)  # tasks whose record lost inside the model
    naive_ms: float | None = None  # TVM's own lowering, no blockforge schedules
    untuned_ms: float | None = None  # blockforge's default schedules, no records
    tuned_ms: float | None = None
    rpc: str | None = None
    wall_s: float = 0.0

    @property
    def trials_new(self) -> int:
        return sum(t.trials_new for t in self.tasks)

    @property
    def trials_reused(self) -> int:
        return sum(min(t.trials_before, t.budget) for t in self.tasks)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tasks"] = [{**asdict(t), "status": t.status} for t in self.tasks]
        d.update(trials_new=self.trials_new, trials_reused=self.trials_reused)
        return d


# ---------------------------------------------------------------- budgets

def check_trials(trials: int | None, trials_per_task: int | None) -> None:
    for name, v in (("--trials", trials), ("--trials-per-task", trials_per_task)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise BlockforgeError(f"{name} must be a positive integer, got {v!r}")


def per_task_budget(n_tasks: int, trials: int | None, trials_per_task: int | None) -> int:
    check_trials(trials, trials_per_task)
    if n_tasks == 0:
        raise BlockforgeError("the model has no tunable tasks")
    budget = trials_per_task or DEFAULT_TRIALS_PER_TASK
    if trials is not None:
        if trials < n_tasks:
            raise BlockforgeError(f"--trials {trials} is less than the model's {n_tasks} tasks; "
                                  "every task needs at least one trial")
        budget = min(budget, trials // n_tasks) if trials_per_task else trials // n_tasks
    return budget


# ---------------------------------------------------------------- RPC

def parse_tracker(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise BlockforgeError(f"bad --rpc-tracker {text!r}: expected HOST:PORT")
    try:
        p = int(port)
    except ValueError:
        raise BlockforgeError(f"bad --rpc-tracker {text!r}: port {port!r} is not an integer") from None
    if not 0 < p < 65536:
        raise BlockforgeError(f"bad --rpc-tracker {text!r}: port out of range")
    return host, p


def wait_for_devices(host: str, port: int, key: str, wait_s: float) -> int:
    """Number of servers behind `key`; a clear error after at most `wait_s` seconds."""
    from tvm import rpc

    deadline = time.monotonic() + wait_s
    try:
        with socket.create_connection((host, port), timeout=min(3.0, max(wait_s, 0.1))):
            pass
    except OSError as e:
        raise BlockforgeError(f"no RPC tracker at {host}:{port} ({e.strerror or e}); start one with "
                              f"`blockforge rpc tracker --port {port}`") from None
    while True:
        try:
            summary = rpc.connect_tracker(host, port).summary()
        except Exception as e:
            raise BlockforgeError(f"RPC tracker at {host}:{port} does not answer: {error_line(e, limit=200)}") from None
        servers = [s for s in summary.get("server_info", []) if s.get("key", "").split(":", 1)[-1] == key]
        if servers:
            return len(servers)
        if time.monotonic() >= deadline:
            keys = sorted({s.get("key", "").split(":", 1)[-1] for s in summary.get("server_info", [])})
            raise BlockforgeError(f"RPC tracker {host}:{port} has no device for key {key!r} after "
                                  f"{wait_s:.0f}s (keys present: {', '.join(keys) or 'none'})")
        time.sleep(0.5)


# ---------------------------------------------------------------- the job

def _terminal():
    """A writable handle on the real stderr, valid while fds 1/2 go to the log."""
    return os.fdopen(os.dup(2), "w", buffering=1)


def _best(run_secs_lists: list) -> float | None:
    best = None
    for rs in run_secs_lists:
        if not rs:
            continue
        mean = float(np.mean(rs))
        if mean < FAILED_RUN_SECS and (best is None or mean < best):
            best = mean
    return best


def _make_runner(opts: TuneOptions, target: ResolvedTarget, n_servers: int):
    from tvm.s_tir import meta_schedule as ms

    if opts.rpc_tracker:
        host, port = parse_tracker(opts.rpc_tracker)
        cfg = ms.runner.RPCConfig(tracker_host=host, tracker_port=port, tracker_key=opts.rpc_key,
                                  session_timeout_sec=60, session_priority=1)
        ev = ms.runner.EvaluatorConfig(number=3, repeat=1, min_repeat_ms=20, enable_cpu_cache_flush=False)
        return ms.runner.RPCRunner(rpc_config=cfg, evaluator_config=ev, max_workers=max(1, n_servers))
    from ._ms_worker import run_direct

    ev = ms.runner.EvaluatorConfig(number=3, repeat=3, min_repeat_ms=10, enable_cpu_cache_flush=False)
    return ms.runner.LocalRunner(evaluator_config=ev, timeout_sec=30, f_run_evaluator=run_direct)


def _make_builder(target: ResolvedTarget):
    from tvm.s_tir import meta_schedule as ms

    from ._ms_worker import build_cpu

    f_build = build_cpu if target.kind == "llvm" else None
    if target.cross_compiler:
        from tvm.support import cc

        def f_export(mod) -> str:
            import tempfile

            path = os.path.join(tempfile.mkdtemp(), "tuned.so")
            mod.export_library(path, fcompile=cc.cross_compiler(target.cross_compiler))
            return path

        return ms.builder.LocalBuilder(f_build=f_build, f_export=f_export, max_workers=_cores(), timeout_sec=120)
    return ms.builder.LocalBuilder(f_build=f_build, max_workers=_cores(), timeout_sec=60)


def _cores() -> int:
    from blockforge.targets.resolve import physical_cores

    return physical_cores()


def measure_latency_ms(executable, target: ResolvedTarget, model, dims: dict, repeat: int = 5) -> float:
    from tvm import relax

    from .runtime import tvm_device

    import tvm

    dev = tvm_device(target.device)
    ins, _ = bound_signature(model, dims)
    inputs = random_inputs(ins, dims, seed=0)
    vm = relax.VirtualMachine(executable, dev)
    args = [tvm.runtime.tensor(inputs[s.name], dev) for s in ins]
    fn = vm["main"]
    # Direct calls: vm.time_evaluator runs on another thread and defeats the thread
    # pool's warm workers (measured 2x slower for sub-ms kernels).
    samples = time_direct(lambda: fn(*args), dev.sync, warmup=3, repeat=max(repeat, 5), number=3, min_ms=20)
    return float(np.median(samples)) * 1e3


def default_schedule(task, target: ResolvedTarget):
    """blockforge's untuned schedule for a task (the one a plain compile would use), or None."""
    from tvm.s_tir import dlight as dl  # noqa: F401

    func = task.dispatched[0]["main"]
    tgt = target.tvm_target()
    if target.kind == "llvm":
        from .cpu_schedule import default_cpu_rules

        rules = default_cpu_rules()
    else:
        from tvm.s_tir import dlight as dl

        rules = [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]
    with tgt:
        for rule in rules:
            try:
                sch = rule.apply(func, tgt, False)
            except Exception:
                sch = None
            if sch is not None:
                return sch[0] if isinstance(sch, list) else sch
    return None


def seed_default(task, target: ResolvedTarget, builder, runner, scratch: Path) -> bool:
    """Measure the default schedule and record it, so the search starts from it and a
    tuned build can never be slower than an untuned one (the best record wins)."""
    from tvm.s_tir import meta_schedule as ms

    sch = default_schedule(task, target)
    if sch is None:
        return False
    tgt = target.tvm_target()
    built = builder.build([ms.builder.BuilderInput(sch.mod, tgt)])[0]
    if built.error_msg:
        return False
    args = ms.arg_info.ArgInfo.from_prim_func(task.dispatched[0]["main"])
    device = "cpu" if tgt.kind.name == "llvm" else tgt.kind.name
    res = runner.run([ms.runner.RunnerInput(built.artifact_path, device, args)])[0].result()
    if res.error_msg or not res.run_secs:
        logging.getLogger("blockforge").warning("default-schedule seed failed: %s", str(res.error_msg)[-500:])
        return False
    db = ms.database.JSONDatabase(work_dir=str(scratch))
    wl = db.commit_workload(task.dispatched[0])
    db.commit_tuning_record(ms.database.TuningRecord(sch.trace, wl, [float(x) for x in res.run_secs], tgt, args))
    return True


IN_MODEL_MARGIN = 0.02  # a record must beat the default schedule by 2% inside the model


def _ab_ms(a, b, target, model, dims, rounds: int = 3) -> tuple[float, float]:
    """Median latencies of two executables, measured alternately (drift hits both)."""
    ta, tb = [], []
    for _ in range(rounds):
        ta.append(measure_latency_ms(a, target, model, dims, repeat=3))
        tb.append(measure_latency_ms(b, target, model, dims, repeat=3))
    return float(np.median(ta)), float(np.median(tb))


def validate_in_model(db, model, target: ResolvedTarget, dims: dict, tasks, workloads, untuned) -> list[str]:
    """Keep a task's tuned record only if it makes the whole model faster.

    Candidates are timed alone, with their weights hot in cache; inside the model a
    record can lose to blockforge's default schedule (measured: BERT-base MHA QKV GEMM
    1.69 ms tuned vs 1.31 ms default per run, although the record timed faster alone).
    Each task whose best record is not its default-schedule seed is A/B-tested in the
    whole model; losers are marked `prefer_default` in the ledger, and builds then use the
    default schedule for them. Returns the names of the tasks that kept the default."""
    from .tuning_db import load_database

    kept_default = []
    by_w = db.contents().by_workload()
    for task, w in zip(tasks, workloads):
        runs = by_w.get(w, [])
        if len(runs) < 2:
            continue  # only the seed (or nothing): the default schedule applies anyway
        one_db, _ = load_database(db.path, only={w}, exclude=set())
        with_record = build(import_onnx(model, dims), target, database=one_db).executable
        t_default, t_record = _ab_ms(untuned, with_record, target, model, dims)
        prefer = t_record > t_default * (1 - IN_MODEL_MARGIN)
        db.set_ledger_flag(w, "prefer_default", prefer)
        db.set_ledger_flag(w, "in_model_ms", {"default": round(t_default, 4), "record": round(t_record, 4)})
        if prefer:
            kept_default.append(task.task_name)
    return kept_default


def tune(opts: TuneOptions) -> TuneSummary:
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.analysis import estimate_tir_flops

    t_start = time.monotonic()
    target = resolve(opts.target)
    problem = target.build_problem()
    if problem:
        raise BlockforgeError(f"cannot build for {target.name}: {problem}")
    if not isinstance(opts.round_trials, int) or opts.round_trials <= 0:
        raise BlockforgeError("--round-trials must be a positive integer")
    check_trials(opts.trials, opts.trials_per_task)  # before the slow import, not after
    n_servers = 0
    if opts.rpc_tracker or opts.rpc_key:
        if not (opts.rpc_tracker and opts.rpc_key):
            raise BlockforgeError("--rpc-tracker and --rpc-key go together")
        host, port = parse_tracker(opts.rpc_tracker)
        n_servers = wait_for_devices(host, port, opts.rpc_key, opts.rpc_wait_s)
    else:
        rp = target.run_problem()
        if rp:
            raise BlockforgeError(f"cannot measure {target.name} on this machine ({rp}); "
                                  "tune through a device: --rpc-tracker HOST:PORT --rpc-key KEY")
    model = load_untrusted(opts.model, tvm=True, dims=opts.dims)
    db_dir = Path(opts.db) if opts.db else default_db_dir(target, opts.rpc_key)
    db = DeviceDB(db_dir, target, create=True)
    log_file = db_dir / "tune.log"
    term = _terminal()
    # TVM's logs for this job (and its builder/runner workers) go beside its records.
    with db.lock(), native_output_to_log(path=log_file):
        salvaged = db.salvage()
        mod = import_onnx(model, opts.dims)
        legal, _ = run_phases(mod, target, stop_after="legalize")
        tasks = sorted(extract_tasks(legal, target), key=lambda t: t.task_name)
        budget = per_task_budget(len(tasks), opts.trials, opts.trials_per_task)
        workloads = [ms.database.Workload(t.dispatched[0]).as_json()[0] for t in tasks]
        contents = db.contents()
        before = {w: db.spent(w, contents) for w in workloads}
        new = {w: 0 for w in workloads}
        flops = [float(estimate_tir_flops(t.dispatched[0])) for t in tasks]
        total_todo = sum(max(0, budget - before[w]) for w in workloads)

        bar = None
        if opts.progress:
            from tqdm import tqdm

            bar = tqdm(total=total_todo, file=term, unit="trial", dynamic_ncols=True,
                       desc=f"tune {Path(opts.model).name}", mininterval=0.5)
            print(f"blockforge tune: {len(tasks)} tasks, {budget} trials per task, "
                  f"{total_todo} to spend, {sum(min(b, budget) for b in before.values())} reused; "
                  f"database {db_dir}; TVM log {log_file}", file=term)
        runner = _make_runner(opts, target, n_servers)
        builder = _make_builder(target)
        cost_model = ms.cost_model.XGBModel(num_tuning_cores=_cores())
        job = f"{os.getpid()}-{int(time.time())}"
        n_round = seeded = 0
        log = logging.getLogger("blockforge")
        try:
            # Seed every workload once with blockforge's default schedule, measured like any
            # candidate: the search then starts from it, and the best record can never be
            # slower than an untuned build. Seeds do not count against the budget.
            ledger = db.ledger()
            for task, w in zip(tasks, workloads):
                if ledger.get(w, {}).get("seeded"):
                    continue
                n_round += 1
                scratch = db.scratch_dir(job, n_round)
                (scratch / "copied_records").write_text("0")
                ok = seed_default(task, target, builder, runner, scratch)
                if ok:
                    db.merge(scratch, 0)
                    db.mark_seeded(w, task.task_name)
                    seeded += 1
                else:
                    log.warning("no default-schedule seed for %s", task.task_name)
                shutil.rmtree(scratch, ignore_errors=True)
            while True:
                todo = [(t, w, f) for t, w, f in zip(tasks, workloads, flops)
                        if before[w] + new[w] < budget]
                if not todo:
                    break
                for task, w, fl in todo:
                    k = min(opts.round_trials, budget - before[w] - new[w])
                    n_round += 1
                    scratch = db.scratch_dir(job, n_round)
                    for f in (WORKLOADS, RECORDS):
                        if (db_dir / f).exists():
                            shutil.copyfile(db_dir / f, scratch / f)
                    copied = len(db.contents().records)
                    (scratch / "copied_records").write_text(str(copied))
                    strategy = ms.search_strategy.EvolutionarySearch(population_size=opts.population)
                    ctxs, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(
                        [task], work_dir=str(scratch), seed=opts.seed, num_threads=_cores(),
                        strategy=strategy)
                    if bar:
                        bar.set_postfix_str(f"{task.task_name} {before[w] + new[w]}/{budget}", refresh=True)
                    try:
                        ms.tune.tune_tasks(
                            tasks=ctxs, task_weights=weights, work_dir=str(scratch),
                            max_trials_global=k, max_trials_per_task=k, num_trials_per_iter=min(k, 32),
                            builder=builder, runner=runner, cost_model=cost_model,
                            database=ms.database.JSONDatabase(work_dir=str(scratch)),
                            task_scheduler="round-robin")
                    except Exception as e:
                        raise BlockforgeError(f"tuning task {task.task_name} failed: "
                                              f"{(str(e).strip().splitlines() or [type(e).__name__])[-1][:300]}") from None
                    db.merge(scratch, copied)
                    # A finished round spends its whole request even when the search space
                    # ran out early, so a rerun does not retry an exhausted task forever.
                    db.add_to_ledger({w: k}, {w: task.task_name})
                    shutil.rmtree(scratch, ignore_errors=True)
                    new[w] += k
                    if bar:
                        best = _best(db.contents().by_workload().get(w, []))
                        info = f"{task.task_name} {before[w] + new[w]}/{budget}"
                        if best:
                            info += f" best {best * 1e6:.1f} us {fl / best / 1e9:.1f} GFLOP/s"
                        bar.set_postfix_str(info, refresh=False)
                        bar.update(k)
        finally:
            if bar:
                bar.close()
            # Interrupted (Ctrl-C, error): keep whatever the current round finished.
            db.salvage()

        contents = db.contents()
        by_w = contents.by_workload()
        summaries = []
        for task, w, fl in zip(tasks, workloads, flops):
            best = _best(by_w.get(w, []))
            summaries.append(TaskSummary(task.task_name, w, fl, budget, before[w], new[w],
                                         best * 1e6 if best else None, fl / best / 1e9 if best else None))
        summary = TuneSummary(str(opts.model), target.name, target.key(), str(db_dir), budget, summaries,
                              salvaged=sum(salvaged.values()), seeded=seeded, rpc=opts.rpc_key)
        if opts.measure and target.run_problem() is None:
            from .tuning_db import load_database

            naive = build(import_onnx(model, opts.dims), target, default_schedules=False).executable
            summary.naive_ms = measure_latency_ms(naive, target, model, opts.dims)
            untuned = build(import_onnx(model, opts.dims), target).executable
            summary.untuned_ms = measure_latency_ms(untuned, target, model, opts.dims)
            summary.kept_default = validate_in_model(db, model, target, opts.dims, tasks, workloads, untuned)
            tuned_db, _ = load_database(db_dir)
            tuned = build(import_onnx(model, opts.dims), target, database=tuned_db).executable
            summary.tuned_ms = measure_latency_ms(tuned, target, model, opts.dims)
    term.close()
    summary.wall_s = time.monotonic() - t_start
    atomic_write_json(db_dir / "summaries" / f"{Path(opts.model).stem}.json", summary.to_dict())
    return summary
