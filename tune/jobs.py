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
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from blockforge.compile.pipeline import extract_tasks, run_phases
from blockforge.compile.records.reader import FAILED_RUN_SECS, default_db_dir, load_database, plan_apply
from blockforge.compile.artifact.runtime import tvm_device
from blockforge.compile.session import Session, open_model
from blockforge.errors import ArgumentError, BlockforgeError, raise_if_stopped
from blockforge.fsutil import INTO, Output, atomic_write_json, check_outputs, private_temp_root
from blockforge.graph.model_io import random_inputs
from blockforge.logs import native_output_to_log
from blockforge.settings import physical_cores, reuse_build_workers
from blockforge.targets import ResolvedTarget, resolve
from blockforge.targets.toolchain import cpu_id

from .builder import job_builder, shutdown_pool
from .database import DeviceDB
from .attention_tiles import LEDGER_KEY as ATTENTION_TILES
from .gemm_tiles import LEDGER_KEYS as GEMM_TILES
from .kernel_timing import wins
from .measure import time_direct
from .rpc import parse_tracker, wait_for_devices

DEFAULT_TRIALS_PER_TASK = 64
DEFAULT_ROUND_TRIALS = 32  # trials per task between database merges (what a kill can lose)
TRIALS_PER_ITER = 32  # candidates MetaSchedule measures per search iteration
POPULATION = 512  # evolutionary search population (TVM's default 2048 is slow for small rounds)
# Candidate timing (direct calls; see measure.run_direct): local and over RPC.
LOCAL_EVAL = dict(number=3, repeat=3, min_repeat_ms=10)
RPC_EVAL = dict(number=3, repeat=1, min_repeat_ms=20)
RUNNER_TIMEOUT_S = 30
RPC_SESSION_TIMEOUT_S = 60
BUILD_TIMEOUT_S = 60
CROSS_BUILD_TIMEOUT_S = 120
# Whole-model timing (tune's naive/untuned/tuned summary and the in-model A/B check).
MODEL_TIMING = dict(warmup=3, number=3, min_ms=20)
MODEL_REPEAT = 5
AB_ROUNDS = 3
AB_REPEAT = 3
IN_MODEL_MARGIN = 0.02  # a record must beat the default schedule by 2% inside the model


@dataclass
class TuneOptions:
    model: Path
    target: str | dict = "host"
    trials: int | None = None
    trials_per_task: int | None = None
    tuning_db: Path | None = None  # None: the device's database in the per-user cache
    rpc_tracker: str | None = None
    rpc_key: str | None = None
    shape: "ShapeRequest | dict | None" = None  # dim names and/or whole input shapes (graph/shape.py)
    round_trials: int = DEFAULT_ROUND_TRIALS
    measure: bool = True
    progress: bool = True
    rpc_wait_s: float = 10.0
    seed: int | None = None
    population: int = POPULATION
    # No search: re-run the in-model A/B of the database's records on this CPU and record
    # the verdicts (how records tuned on another CPU become usable here).
    check_only: bool = False
    # What the GEMMs compute in (targets.precision): bf16 tunes the bf16 GEMM kernels' tiles
    # and the float32 tasks left beside them, and measures the bf16 build. None: fp32.
    precision: str | None = None
    # Bound where the model has such a dim and `shape` left it open (the CLI: batch=1, seq=128
    # without --shape). Every dim must end up bound: MetaSchedule times tasks at fixed shapes
    # (a symbolic one was an internal error in its ArgInfo, `tune MODEL --target host` on any
    # export with a symbolic seq).
    default_dims: dict = field(default_factory=dict)


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
    cpu: str | None = None  # the CPU the in-model verdicts were made on
    refused: list[str] = field(default_factory=list)  # one line per record record_policy refused
    rpc: str | None = None
    wall_s: float = 0.0
    precision: str = "fp32"  # what the GEMMs computed in (the tiles timed, the builds measured)

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
    for name, v in (("trials", trials), ("trials_per_task", trials_per_task)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise ArgumentError(f"{{{name}}} must be a positive integer, got {v!r}", name)


def per_task_budget(n_tasks: int, trials: int | None, trials_per_task: int | None) -> int:
    check_trials(trials, trials_per_task)
    if n_tasks == 0:
        raise BlockforgeError("the model has no tunable tasks")
    budget = trials_per_task or DEFAULT_TRIALS_PER_TASK
    if trials is not None:
        if trials < n_tasks:
            raise ArgumentError(f"{{trials}} {trials} is less than the model's {n_tasks} tasks; "
                                "every task needs at least one trial", "trials")
        budget = min(budget, trials // n_tasks) if trials_per_task else trials // n_tasks
    return budget


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


def make_runner(opts: TuneOptions, target: ResolvedTarget, n_servers: int):
    from tvm.s_tir import meta_schedule as ms

    if opts.rpc_tracker:
        host, port = parse_tracker(opts.rpc_tracker)
        cfg = ms.runner.RPCConfig(tracker_host=host, tracker_port=port, tracker_key=opts.rpc_key,
                                  session_timeout_sec=RPC_SESSION_TIMEOUT_S, session_priority=1)
        ev = ms.runner.EvaluatorConfig(**RPC_EVAL, enable_cpu_cache_flush=False)
        return _pool_safe(lambda: ms.runner.RPCRunner(rpc_config=cfg, evaluator_config=ev,
                                                      max_workers=max(1, n_servers)))
    from .measure import run_direct

    ev = ms.runner.EvaluatorConfig(**LOCAL_EVAL, enable_cpu_cache_flush=False)
    return _pool_safe(lambda: ms.runner.LocalRunner(evaluator_config=ev, timeout_sec=RUNNER_TIMEOUT_S,
                                                    f_run_evaluator=run_direct))


def _pool_safe(make):
    """make() with its worker pool shut down if it is stopped half-way. LocalRunner's __init__
    waits on a fresh worker (its sanity check: the worker's TVM import, ~2 s), so a Ctrl-C at a
    job's start lands there and the job never holds the runner to end it; garbage collection
    then shut the pool from one of its own threads: "Exception ignored in
    PopenPoolExecutor.__del__ ... cannot join current thread" after "blockforge: interrupted"
    (test_second_signal_does_not_break_the_cleanup, once in a clean-clone run)."""
    from tvm.support.popen_pool import PopenPoolExecutor

    try:
        return make()
    except BaseException as e:
        tb, seen = e.__traceback__, set()
        while tb is not None:  # the half-made object is `self` in its __init__'s frames
            try:  # its own __dict__: TVM's derived-object wrapper recurses in __getattr__ until built
                pool = object.__getattribute__(tb.tb_frame.f_locals.get("self"), "__dict__").get("pool")
            except Exception:
                pool = None
            if isinstance(pool, PopenPoolExecutor) and id(pool) not in seen:
                seen.add(id(pool))
                shutdown_pool(pool)
            tb = tb.tb_next
        raise


def make_builder(target: ResolvedTarget, tmp_root: str):
    """Candidates are built in worker processes and exported under `tmp_root` (removed by the job)."""
    from functools import partial

    from tvm.s_tir import meta_schedule as ms

    from .measure import build_cpu, export_cross, export_local

    f_build = build_cpu if target.kind == "llvm" else None
    if target.cross_compiler:
        f_export, timeout = partial(export_cross, target.cross_compiler, tmp_root), CROSS_BUILD_TIMEOUT_S
    else:
        f_export, timeout = partial(export_local, tmp_root), BUILD_TIMEOUT_S
    # One pool of build workers for the job (tune/builder.py: a fresh worker imports TVM,
    # ~3.3 s of CPU, and LocalBuilder starts new ones for every batch); BLOCKFORGE_BUILDER=fresh: LocalBuilder.
    cls = job_builder if reuse_build_workers() else ms.builder.LocalBuilder
    return cls(f_build=f_build, f_export=f_export, max_workers=physical_cores(), timeout_sec=timeout)


def measure_latency_ms(executable, session: Session, repeat: int = MODEL_REPEAT) -> float:
    import tvm
    from tvm import relax

    dev = tvm_device(session.target.device)
    inputs = random_inputs(session.inputs, session.dims, seed=0)
    vm = relax.VirtualMachine(executable, dev)
    args = [tvm.runtime.tensor(inputs[s.name], dev) for s in session.inputs]
    fn = vm["main"]
    # Direct calls: vm.time_evaluator runs on another thread and defeats the thread
    # pool's warm workers (measured 2x slower for sub-ms kernels).
    samples = time_direct(lambda: fn(*args), dev.sync, repeat=max(repeat, MODEL_REPEAT), **MODEL_TIMING)
    return float(np.median(samples)) * 1e3


def default_schedule(task, target: ResolvedTarget):
    """blockforge's untuned schedule for a task (the one a plain compile would use), or None."""
    from blockforge.compile.pipeline import default_rules

    func = task.dispatched[0]["main"]
    tgt = target.tvm_target()
    with tgt:
        for rule in default_rules(target):
            try:
                sch = rule.apply(func, tgt, False)
            except Exception as e:  # a rule that cannot apply says why, and the next one tries
                raise_if_stopped()  # unless it was a stop signal TVM wrapped in a RuntimeError
                logging.getLogger("blockforge").info("rule %s on %s: %s", type(rule).__name__, task.task_name, e)
                sch = None
            if sch is not None:
                return sch[0] if isinstance(sch, list) else sch
    return None


def seed_default(task, target: ResolvedTarget, builder, runner, work_dir: Path) -> bool:
    """Measure the default schedule and record it, so the search starts from it and a
    tuned build can never be slower than an untuned one (the best record wins)."""
    from tvm.s_tir import meta_schedule as ms

    log = logging.getLogger("blockforge")
    sch = default_schedule(task, target)
    if sch is None:
        return False
    tgt = target.tvm_target()
    built = builder.build([ms.builder.BuilderInput(sch.mod, tgt)])[0]
    if built.error_msg:
        log.warning("default-schedule seed of %s did not build: %s", task.task_name, str(built.error_msg)[-500:])
        return False
    args = ms.arg_info.ArgInfo.from_prim_func(task.dispatched[0]["main"])
    device = "cpu" if tgt.kind.name == "llvm" else tgt.kind.name
    res = runner.run([ms.runner.RunnerInput(built.artifact_path, device, args)])[0].result()
    if res.error_msg or not res.run_secs:
        log.warning("default-schedule seed of %s failed: %s", task.task_name, str(res.error_msg)[-500:])
        return False
    db = ms.database.JSONDatabase(work_dir=str(work_dir))
    wl = db.commit_workload(task.dispatched[0])
    db.commit_tuning_record(ms.database.TuningRecord(sch.trace, wl, [float(x) for x in res.run_secs], tgt, args))
    return True


def _ab_ms(a, b, session: Session) -> tuple[list[float], list[float]]:
    """Per-round latencies of two executables, measured alternately (drift hits both)."""
    ta, tb = [], []
    for _ in range(AB_ROUNDS):
        ta.append(measure_latency_ms(a, session, repeat=AB_REPEAT))
        tb.append(measure_latency_ms(b, session, repeat=AB_REPEAT))
    return ta, tb


def validate_in_model(db: DeviceDB, session: Session, tasks, workloads, untuned, cpu: str) -> list[str]:
    """Keep a task's tuned record only if it makes the whole model faster on this CPU.

    Candidates are timed alone, with their weights hot in cache; inside the model a
    record can lose to blockforge's default schedule (measured: BERT-base MHA QKV GEMM
    1.69 ms tuned vs 1.31 ms default per run, although the record timed faster alone).
    Each task with records is A/B-tested in the whole model (an exported database keeps
    one record per task, which may or may not be the seed); the verdict is recorded for
    `cpu` in the ledger, and builds on that CPU use the default schedule for the losers.
    Returns the names of the tasks that kept the default."""
    kept_default = []
    by_w = db.contents().by_workload()
    for task, w in zip(tasks, workloads):
        if not by_w.get(w):
            continue  # no record: the default schedule applies anyway
        one_db, _ = load_database(db.path, only={w}, exclude=set())
        with_record = session.build(database=one_db).executable
        t_default, t_record = _ab_ms(untuned, with_record, session)
        prefer = not wins(t_default, t_record, IN_MODEL_MARGIN)
        db.set_verdict(w, cpu, prefer, float(np.median(t_default)), float(np.median(t_record)))
        if prefer:
            kept_default.append(task.task_name)
    return kept_default


def _check_options(opts: TuneOptions, target: ResolvedTarget) -> int:
    """Everything that can be refused before the slow import; returns the RPC server count."""
    if not isinstance(opts.round_trials, int) or opts.round_trials <= 0:
        raise ArgumentError("{round_trials} must be a positive integer", "round_trials")
    # 16: the smallest population the suite tunes with (test_real_models); below it is untried.
    if isinstance(opts.population, bool) or not isinstance(opts.population, int) or opts.population < 16:
        raise ArgumentError(f"{{population}} must be an integer >= 16, got {opts.population!r}", "population")
    check_trials(opts.trials, opts.trials_per_task)
    if opts.check_only and (opts.rpc_tracker or opts.rpc_key):
        raise ArgumentError("{check_only} measures on this machine; drop {rpc_tracker}/{rpc_key}",
                            "check_only", "rpc_tracker", "rpc_key")
    if opts.rpc_tracker or opts.rpc_key:
        if not (opts.rpc_tracker and opts.rpc_key):
            raise ArgumentError("{rpc_tracker} and {rpc_key} go together", "rpc_tracker", "rpc_key")
        host, port = parse_tracker(opts.rpc_tracker)
        return wait_for_devices(host, port, opts.rpc_key, opts.rpc_wait_s)
    rp = target.run_problem()
    if rp and opts.check_only:
        raise ArgumentError(f"{{check_only}} times the model on this machine, and {target.name} cannot run here ({rp})",
                            "check_only")
    if rp:
        raise ArgumentError(f"cannot measure {target.name} on this machine ({rp}); "
                            "tune through a device: {rpc_tracker} HOST:PORT {rpc_key} KEY", "rpc_tracker", "rpc_key")
    return 0


@dataclass
class _Job:
    """One tuning job's state: tasks, their workloads, and trials per workload."""
    opts: TuneOptions
    session: Session
    db: DeviceDB
    tasks: list
    workloads: list[str]
    flops: list[float]
    budget: int
    before: dict[str, int]
    new: dict[str, int]
    id: str = field(default_factory=lambda: f"{os.getpid()}-{int(time.time())}")
    n_round: int = 0
    seeded: int = 0
    n_servers: int = 0

    def todo(self) -> list[tuple]:
        return [(t, w, f) for t, w, f in zip(self.tasks, self.workloads, self.flops)
                if self.before[w] + self.new[w] < self.budget]

    def to_spend(self) -> int:
        return sum(max(0, self.budget - self.before[w]) for w in self.workloads)


def _plan(opts: TuneOptions, session: Session, db: DeviceDB) -> _Job:
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.analysis import estimate_tir_flops

    legal, _ = run_phases(session.relax(), session.target, stop_after="legalize", precision=session.precision.name)
    tasks = sorted(extract_tasks(legal, session.target), key=lambda t: t.task_name)
    budget = per_task_budget(len(tasks), opts.trials, opts.trials_per_task)
    workloads = [ms.database.Workload(t.dispatched[0]).as_json()[0] for t in tasks]
    contents = db.contents()
    before = {w: db.spent(w, contents) for w in workloads}
    flops = [float(estimate_tir_flops(t.dispatched[0])) for t in tasks]
    return _Job(opts, session, db, tasks, workloads, flops, budget, before, {w: 0 for w in workloads})


def _seed_all(job: _Job, builder, runner) -> None:
    """Seed every workload once with blockforge's default schedule, measured like any
    candidate: the search then starts from it, and the best record can never be slower
    than an untuned build. Seeds do not count against the budget."""
    ledger = job.db.ledger()
    for task, w in zip(job.tasks, job.workloads):
        if ledger.get(w, {}).get("seeded"):
            continue
        job.n_round += 1
        rnd = job.db.begin_round(job.id, job.n_round)
        if seed_default(task, job.session.target, builder, runner, rnd.path):
            job.db.commit_round(rnd)
            job.db.mark_seeded(w, task.task_name)
            job.seeded += 1
        else:
            job.db.commit_round(rnd)  # nothing in it; drops the scratch directory
            logging.getLogger("blockforge").warning("no default-schedule seed for %s", task.task_name)


def _attention_tiles(job: _Job, builder, runner, term) -> None:
    """Time the fused attention kernels' tile candidates (not MetaSchedule tasks; see
    blockforge.tune.attention_tiles). Like seeds, they do not count against the budget."""
    from blockforge.compile.pipeline import phases

    from .attention_tiles import tune_attention_tiles

    target = job.session.target
    if "fuse-attention" not in [p.name for p in phases(target)]:
        return
    precision = job.session.precision.name
    mod, _ = run_phases(job.session.relax(), target, stop_after="fuse-attention", precision=precision)
    tune_attention_tiles(mod, job.db, target, builder, runner, job.session.dims, job.id,
                         say=lambda line: print(f"blockforge tune: {line}", file=term) if job.opts.progress else None,
                         bf16=precision == "bf16")


def _gemm_tiles(job: _Job, builder, runner, term) -> None:
    """Time the int8 and bf16 GEMM kernels' tile candidates (not MetaSchedule tasks; see
    blockforge.tune.gemm_tiles). Like seeds, they do not count against the budget."""
    from blockforge.compile.pipeline import has_int8_matmul, phases

    from .gemm_tiles import bf16_kernels, int8_kernels, tune_gemm_tiles

    target, relax_mod, precision = job.session.target, job.session.relax(), job.session.precision.name
    names = [p.name for p in phases(target, int8=has_int8_matmul(relax_mod), precision=precision)]
    for base, kinds in ((20000, int8_kernels()), (30000, bf16_kernels())):
        if kinds.phase not in names:
            continue
        mod, _ = run_phases(relax_mod, target, stop_after=kinds.phase, precision=precision)
        tune_gemm_tiles(kinds, mod, job.db, target, builder, runner, job.session.dims, job.id, job.db.cpu,
                        say=lambda line: print(f"blockforge tune: {line}", file=term) if job.opts.progress else None,
                        round_base=base)


def _tune_round(job: _Job, task, w: str, builder, runner, cost_model) -> int:
    """One round of one task into a scratch database, merged when complete; returns trials."""
    from tvm.s_tir import meta_schedule as ms

    from blockforge.compile.schedule.intrinsics import import_tensor_intrinsics  # imports TVM: not at import time

    opts = job.opts
    k = min(opts.round_trials, job.budget - job.before[w] - job.new[w])
    import_tensor_intrinsics()  # TuneContext imports them; this way costs a quarter (intrinsics.py)
    job.n_round += 1
    rnd = job.db.begin_round(job.id, job.n_round)
    strategy = ms.search_strategy.EvolutionarySearch(population_size=opts.population)
    ctxs, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(
        [task], work_dir=str(rnd.path), seed=opts.seed, num_threads=physical_cores(), strategy=strategy)
    try:
        ms.tune.tune_tasks(
            tasks=ctxs, task_weights=weights, work_dir=str(rnd.path),
            max_trials_global=k, max_trials_per_task=k, num_trials_per_iter=min(k, TRIALS_PER_ITER),
            builder=builder, runner=runner, cost_model=cost_model,
            database=ms.database.JSONDatabase(work_dir=str(rnd.path)), task_scheduler="round-robin")
    except Exception as e:
        raise_if_stopped()  # TVM turns a KeyboardInterrupt in its callbacks into RuntimeError('')
        raise BlockforgeError(f"tuning task {task.task_name} failed: "
                              f"{(str(e).strip().splitlines() or [type(e).__name__])[-1][:300]}") from None
    job.db.commit_round(rnd)
    # A finished round spends its whole request even when the search space ran out
    # early, so a rerun does not retry an exhausted task forever.
    job.db.add_to_ledger({w: k}, {w: task.task_name})
    job.new[w] += k
    return k


def _search(job: _Job, term) -> None:
    from tvm.s_tir import meta_schedule as ms

    opts = job.opts
    bar = None
    if opts.progress:
        from tqdm import tqdm

        bar = tqdm(total=job.to_spend(), file=term, unit="trial", dynamic_ncols=True,
                   desc=f"tune {Path(opts.model).name}", mininterval=0.5)
        print(f"blockforge tune: {len(job.tasks)} tasks, {job.budget} trials per task, {job.to_spend()} to spend, "
              f"{sum(min(b, job.budget) for b in job.before.values())} reused; database {job.db.path}; "
              f"TVM log {job.db.path / 'tune.log'}", file=term)
    # The job's temporary root is TMPDIR for this process and the builder/runner workers:
    # candidates, TVM's own tmp* export directories and the compilers' files land in it,
    # and it goes when the job ends, however it ends.
    started, runner, builder = time.time(), None, None
    with private_temp_root("blockforge-tune-") as tmp_root:
        try:
            runner = make_runner(opts, job.session.target, job.n_servers)
            builder = make_builder(job.session.target, str(tmp_root or tempfile.gettempdir()))
            cost_model = ms.cost_model.XGBModel(num_tuning_cores=physical_cores())
            _seed_all(job, builder, runner)
            _attention_tiles(job, builder, runner, term)
            _gemm_tiles(job, builder, runner, term)
            while job.todo():
                for task, w, fl in job.todo():
                    if bar:
                        bar.set_postfix_str(f"{task.task_name} {job.before[w] + job.new[w]}/{job.budget}", refresh=True)
                    k = _tune_round(job, task, w, builder, runner, cost_model)
                    if bar:
                        best = _best(job.db.contents().by_workload().get(w, []))
                        info = f"{task.task_name} {job.before[w] + job.new[w]}/{job.budget}"
                        if best:
                            info += f" best {best * 1e6:.1f} us {fl / best / 1e9:.1f} GFLOP/s"
                        bar.set_postfix_str(info, refresh=False)
                        bar.update(k)
        finally:
            if bar:
                bar.close()
            if getattr(builder, "reuses_workers", False):
                builder.close()
            _end_workers(runner, started)
            job.db.salvage()  # interrupted (Ctrl-C, error): keep whatever the current round finished


def _end_workers(runner, since: float) -> None:
    """Stop the builder/runner worker processes now, not when garbage collection finds the
    pools: an interrupted build leaves its pool (and the workers' compilers) running."""
    import psutil

    pool = getattr(runner, "pool", None)
    if pool is not None:
        shutdown_pool(pool)
    try:
        mine = [p for p in psutil.Process().children(recursive=True) if p.create_time() >= since - 1.0]
        workers = {p.pid for p in mine if "tvm.exec.popen_worker" in " ".join(p.cmdline())}
        doomed = [p for p in mine if p.pid in workers or any(a.pid in workers for a in p.parents())]
    except psutil.Error:
        return
    for p in doomed:  # a worker and what it runs (a compiler); their files are in the job's temporary root
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(doomed, timeout=5)


def _summarize(job: _Job, salvaged: dict) -> TuneSummary:
    by_w = job.db.contents().by_workload()
    tasks = []
    for task, w, fl in zip(job.tasks, job.workloads, job.flops):
        best = _best(by_w.get(w, []))
        tasks.append(TaskSummary(task.task_name, w, fl, job.budget, job.before[w], job.new[w],
                                 best * 1e6 if best else None, fl / best / 1e9 if best else None))
    t = job.session.target
    return TuneSummary(str(job.opts.model), t.name, t.key(), str(job.db.path), job.budget, tasks,
                       salvaged=sum(salvaged.values()), seeded=job.seeded, rpc=job.opts.rpc_key,
                       refused=list(job.db.refused), precision=job.session.precision.name)


def _measure_model(job: _Job, summary: TuneSummary, naive: bool = True) -> None:
    """Whole-model latency: TVM's naive lowering, untuned, and tuned (after the A/B checks).

    Records that each won alone are then A/B-tested together against the untuned build:
    unless the combination wins (kernel_timing.wins, no margin) on this CPU, every one of them is marked
    to keep the default here, so a tuned build is never slower than an untuned one where
    applied. untuned_ms/tuned_ms are then that A/B's medians (same rounds, interleaved)."""
    session, db, cpu = job.session, job.db, cpu_id()
    summary.cpu = cpu
    if naive:
        summary.naive_ms = measure_latency_ms(session.build(default_schedules=False).executable, session)
    untuned = session.build().executable
    summary.untuned_ms = measure_latency_ms(untuned, session)
    summary.kept_default = validate_in_model(db, session, job.tasks, job.workloads, untuned, cpu)
    plan = plan_apply(db.path, cpu)
    by_w = db.contents().by_workload()
    applied = [(t.task_name, w) for t, w in zip(job.tasks, job.workloads) if by_w.get(w) and w not in plan.exclude]
    # the hand-written kernels' tile records are in the tuned build too: the int8 and bf16 GEMMs'
    # (tune/gemm_tiles.py) and the fused attention's (tune/attention_tiles.py: before, its records
    # applied in every tuned build while this A/B left them out and reported tuned = untuned)
    applied += [(str(e.get("task", sh)), sh) for sh, e in db.ledger().items()
                if any(e.get(k) for k in (ATTENTION_TILES, *GEMM_TILES)) and by_w.get(sh) and sh not in plan.exclude]
    summary.tuned_ms = summary.untuned_ms  # nothing applies: the tuned build is the untuned one
    if applied:
        tuned_db, _ = load_database(db.path, exclude=plan.exclude)
        t_untuned, t_tuned = _ab_ms(untuned, session.build(database=tuned_db).executable, session)
        summary.untuned_ms = summary.tuned_ms = float(np.median(t_untuned))
        if wins(t_untuned, t_tuned, 0.0):
            summary.tuned_ms = float(np.median(t_tuned))
        else:
            for name, w in applied:
                db.set_verdict(w, cpu, True, float(np.median(t_untuned)), float(np.median(t_tuned)), scope="model")
                summary.kept_default.append(name)


def tune(opts: TuneOptions) -> TuneSummary:
    t_start = time.monotonic()
    target = resolve(opts.target)
    problem = target.build_problem()
    if problem:
        raise BlockforgeError(f"cannot build for {target.name}: {problem}")
    n_servers = _check_options(opts, target)  # before the slow import, not after
    db_arg = opts.tuning_db if opts.tuning_db is not None else default_db_dir(target, opts.rpc_key)
    check_outputs([Output("tuning_db", db_arg, INTO, "tuning database")], [opts.model])  # refused: costs nothing
    db_dir = Path(db_arg)
    session = open_model(opts.model, target, opts.shape, precision=opts.precision, default_dims=opts.default_dims,
                         static=True)
    local = not opts.rpc_tracker and target.run_problem() is None
    db = DeviceDB(db_dir, target, create=not opts.check_only, cpu=cpu_id() if local else None)
    term = _terminal()
    try:
        # TVM's logs for this job (and its builder/runner workers) go beside its records.
        with db.lock(), native_output_to_log(path=db_dir / "tune.log"):
            salvaged = db.salvage()
            job = _plan(opts, session, db)
            job.n_servers = n_servers
            if not opts.check_only:
                _search(job, term)
            summary = _summarize(job, salvaged)
            if opts.check_only or (opts.measure and target.run_problem() is None):
                _measure_model(job, summary, naive=not opts.check_only)
    finally:
        term.close()
    summary.wall_s = time.monotonic() - t_start
    atomic_write_json(db_dir / "summaries" / f"{Path(opts.model).stem}.json", summary.to_dict())
    return summary
