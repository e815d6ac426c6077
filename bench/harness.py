"""`bench`: contenders measured side by side in one process, interleaved, equal threads.

Contenders: ort (ONNX Runtime, intra-op threads = the target's num-cores), untuned (TVM
with blockforge's default schedules, no records), tuned (TVM with the device database).
The SGEMM ceiling (numpy/BLAS on a large square) is measured in the same run, so
"% of ceiling" compares like with like on this machine, today.
"""

from __future__ import annotations

import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

import blockforge
from blockforge.errors import BlockforgeError
from blockforge.graph import ort as ort_runner
from blockforge.graph.analysis import matmul_flops
from blockforge.compile.records import open_for_apply
from blockforge.compile.runtime import tvm_device
from blockforge.compile.session import open_model
from blockforge.graph.model_io import random_inputs
from blockforge.logs import native_output_to_log
from blockforge.targets import resolve

CONTENDERS = ("ort", "untuned", "tuned")
SCHEMA = "blockforge.bench/1"


@dataclass
class BenchOptions:
    model: Path
    target: str = "host"
    against: tuple[str, ...] = CONTENDERS
    repeat: int = 30
    warmup: int = 2
    dims: dict = field(default_factory=dict)  # model_io.parse_dims(): dim names and/or input shapes
    # Bound only where the model has such a dim and `dims` left it open: the CLI's default
    # batch=1,seq=128 then fits blockforge's blocks without breaking a static model or an
    # export whose dims are named otherwise (s33, s50: those need --shape).
    default_dims: dict[str, int] = field(default_factory=dict)
    tuning_db: Path | None = None
    profile: bool = False
    gemm_n: int = 2048


@dataclass
class ContenderResult:
    name: str
    median_ms: float
    p90_ms: float
    min_ms: float
    gflops: float
    ratio_to_ort: float | None
    pct_of_sgemm: float
    samples_ms: list[float]


@dataclass
class KernelProfile:
    name: str
    calls: int
    total_ms: float
    pct: float


@dataclass
class BenchReport:
    model: str
    target: str
    dims: dict
    threads: int
    flops: int
    sgemm_gflops: float
    results: list[ContenderResult]
    profile: dict[str, list[KernelProfile]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    host: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["schema"] = SCHEMA
        return d

    def markdown(self) -> str:
        lines = [f"{Path(self.model).name} on {self.target} ({self.threads} threads, dims {self.dims}, "
                 f"{self.flops / 1e9:.3f} GFLOP; SGEMM ceiling {self.sgemm_gflops:.0f} GFLOP/s)", "",
                 "| contender | median ms | p90 ms | GFLOP/s | vs ORT | % of SGEMM |",
                 "|---|---|---|---|---|---|"]
        for r in self.results:
            ratio = f"{r.ratio_to_ort:.2f}x" if r.ratio_to_ort is not None else "-"
            lines.append(f"| {r.name} | {r.median_ms:.3f} | {r.p90_ms:.3f} | {r.gflops:.1f} | {ratio} | "
                         f"{r.pct_of_sgemm:.0f}% |")
        for name, kernels in self.profile.items():
            lines += ["", f"profile of {name} (per run):", "", "| kernel | calls | ms | % |", "|---|---|---|---|"]
            lines += [f"| {k.name} | {k.calls} | {k.total_ms:.3f} | {k.pct:.1f}% |" for k in kernels]
        return "\n".join(lines)


def sgemm_ceiling(n: int = 2048, repeat: int = 5) -> float:
    """Best GFLOP/s of numpy's float32 matmul on an n x n square (BLAS, all its threads)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


class _TvmRunner:
    def __init__(self, executable, device_kind: str, ins, inputs):
        import tvm
        from tvm import relax

        self.dev = tvm_device(device_kind)
        self.vm = relax.VirtualMachine(executable, self.dev)
        self.args = [tvm.runtime.tensor(np.ascontiguousarray(inputs[s.name]), self.dev) for s in ins]
        self.fn = self.vm["main"]

    def __call__(self):
        self.fn(*self.args)
        self.dev.sync()

    def profile(self, runs: int = 5) -> list[KernelProfile]:
        """Per-kernel time through the VM's instrument hook (TVM removed vm.profile())."""
        starts: dict[str, float] = {}
        totals: dict[str, list] = {}

        def instrument(func, name, before, ret, *args):
            if before:
                starts[name] = time.perf_counter()
            else:
                self.dev.sync()
                t = totals.setdefault(name, [0, 0.0])
                t[0] += 1
                t[1] += time.perf_counter() - starts.pop(name, time.perf_counter())
            return 0

        self.vm.set_instrument(instrument)
        try:
            for _ in range(runs):
                self()
        finally:
            self.vm.set_instrument(None)
        total = sum(v[1] for v in totals.values()) or 1.0
        rows = [KernelProfile(k, v[0] // runs, v[1] / runs * 1e3, 100 * v[1] / total) for k, v in totals.items()
                if not k.startswith("vm.builtin.")]
        return sorted(rows, key=lambda r: -r.total_ms)


BURST = 5
QUIET_S = 0.05


def measure_interleaved(runners: dict, repeat: int, warmup: int) -> dict[str, list[float]]:
    """Interleaved in bursts: drift hits every contender alike, and no contender's idle
    thread pool spins on the cores while another is timed.

    Each round visits every contender (order rotated): a short pause lets the previous
    contender's workers stop spinning (ORT spins after each run by default; measured on
    2 cores: TVM 1.8 ms alone vs 4.0 ms right after ORT), `warmup` untimed calls, then a
    burst of timed calls.
    """
    names = list(runners)
    samples: dict[str, list[float]] = {k: [] for k in names}
    rnd = 0
    while min(len(v) for v in samples.values()) < repeat:
        order = names[rnd % len(names):] + names[: rnd % len(names)]
        for k in order:
            fn = runners[k]
            time.sleep(QUIET_S)
            for _ in range(warmup):
                fn()
            for _ in range(min(BURST, repeat - len(samples[k]))):
                t0 = time.perf_counter()
                fn()
                samples[k].append((time.perf_counter() - t0) * 1e3)
        rnd += 1
    return samples


def bench(opts: BenchOptions) -> BenchReport:
    unknown = [c for c in opts.against if c not in CONTENDERS]
    if unknown or not opts.against:
        raise BlockforgeError(f"unknown contender(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(CONTENDERS)}")
    if opts.repeat < 3:
        raise BlockforgeError("--repeat must be at least 3")
    target = resolve(opts.target)
    problem = target.run_problem()
    if problem:
        raise BlockforgeError(f"cannot benchmark {target.name} here: {problem}")
    # static: every dim must be bound for a benchmark; a clear error names the missing one.
    session = open_model(opts.model, target, opts.dims, default_dims=opts.default_dims, static=True)
    model, ins = session.model, session.inputs
    inputs = random_inputs(ins, {}, seed=0)
    flops = matmul_flops(session.prepared, session.dims)  # after prepare: shapes are static
    threads = int(target.target_json.get("num-cores", 1))
    runners, notes = {}, []
    if "ort" in opts.against:
        sess = ort_runner.session(model, threads=threads)
        runners["ort"] = lambda: sess.run(None, inputs)
    with native_output_to_log():
        if "untuned" in opts.against:
            ex = session.build().executable
            runners["untuned"] = _TvmRunner(ex, target.device, ins, inputs)
        if "tuned" in opts.against:
            db, info = open_for_apply(target, opts.tuning_db)
            if db is None:
                notes.append("tuned: no tuning records for this device (run `blockforge tune`); skipped")
            else:
                res = session.build(database=db)
                if res.untuned_tasks:
                    notes.append(f"tuned: {len(res.untuned_tasks)} of {res.tasks} tasks have no record "
                                 "(default schedules used for them)")
                runners["tuned"] = _TvmRunner(res.executable, target.device, ins, inputs)
        samples = measure_interleaved(runners, opts.repeat, opts.warmup)
        profile = {k: r.profile() for k, r in runners.items() if opts.profile and isinstance(r, _TvmRunner)}
    ceiling = sgemm_ceiling(opts.gemm_n)
    ort_med = float(np.median(samples["ort"])) if "ort" in samples else None
    results = []
    for k, s in samples.items():
        med = float(np.median(s))
        gf = flops / (med / 1e3) / 1e9
        results.append(ContenderResult(k, med, float(np.percentile(s, 90)), float(np.min(s)), gf,
                                       med / ort_med if ort_med else None, 100 * gf / ceiling, s))
    host = {"machine": platform.machine(), "node": platform.node(), "cpu": target.target_json.get("mcpu"),
            "blockforge": blockforge.__version__}
    return BenchReport(str(opts.model), target.name, session.dims, threads, flops, ceiling, results, profile, notes, host)


def plot(reports: list[BenchReport], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from blockforge.fsutil import atomic_write_bytes

    names = [f"{Path(r.model).stem}\n{'/'.join(f'{k}={v}' for k, v in r.dims.items())}" for r in reports]
    contenders = [c for c in CONTENDERS if any(x.name == c for r in reports for x in r.results)]
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(reports)), 4.5))
    width = 0.8 / max(1, len(contenders))
    for i, c in enumerate(contenders):
        vals = [next((x.median_ms for x in r.results if x.name == c), 0.0) for r in reports]
        xs = [j + i * width for j in range(len(reports))]
        bars = ax.bar(xs, vals, width, label=c)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks([j + width * (len(contenders) - 1) / 2 for j in range(len(reports))], names, fontsize=8)
    ax.set_ylabel("median latency (ms), lower is better")
    ax.set_title(f"blockforge vs ONNX Runtime on {reports[0].target} ({reports[0].threads} threads)")
    ax.legend()
    fig.tight_layout()
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
