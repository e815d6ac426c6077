"""What `bench` reports: per-contender statistics from the interleaved samples, the ratio to
the BEST PEER (the fastest non-blockforge contender: the headline), markdown, JSON and PNG.

Every ratio is a ratio of medians from the same run, so all contenders saw the same drift."""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

# /2: ratio_to_best_peer (the headline), best_peer, peer flags, host facts;
# /3: unchecked (outputs no reference could compute: then no headline);
# /4: sgemm_before (the ceiling before the timing too), quiet_ceiling, quotable
SCHEMA = "blockforge.bench/4"
# A run is quotable when every SGEMM ceiling it measured is at least this fraction of the
# machine's quiet value: a run at load 5-13 read 22-44 GFLOP/s against ~200 quiet, and its
# ratios to the peers were off by up to 1.5x.
QUOTABLE_FRACTION = 0.9


@dataclass
class ContenderResult:
    name: str
    peer: bool  # not blockforge
    median_ms: float
    p90_ms: float
    min_ms: float
    gflops: float
    ratio_to_best_peer: float | None  # median / the best peer's median; < 1 is faster
    ratio_to_ort: float | None
    pct_of_sgemm: float
    samples_ms: list[float]


@dataclass
class KernelProfile:
    name: str
    calls: int
    total_ms: float
    pct: float


# Where a model's time goes, by kind of kernel (bench --profile, benchmarks/whole_models.py).
# A fused kernel is named after its ops (fused_matmul2_divide_erf_...): the first rule that
# matches a word of the name decides, so a matmul with its gelu epilogue is a GEMM and
# conv-gemm's im2col/GEMM pair is conv. An unfused softmax is attention's.
KERNEL_CLASSES = ("GEMM", "attention", "conv", "elementwise/norm", "other")
_CLASS_WORDS = (
    ("attention", ("attention", "softmax")),
    ("conv", ("conv", "conv1d", "conv2d", "im2col")),
    ("GEMM", ("matmul", "gemm", "dense", "bmm", "packed")),
    ("elementwise/norm", ("norm", "layer_norm", "group_norm", "rms_norm", "mean", "variance", "rsqrt", "sqrt",
                          "power", "square", "cube", "add", "subtract", "multiply", "divide", "erf", "tanh",
                          "sigmoid", "exp", "relu", "gelu", "silu", "maximum", "minimum", "where", "cast", "negative",
                          "clip", "fast", "sum", "max", "min")),
)


def kernel_class(name: str) -> str:
    """The class of one profiled kernel: GEMM, attention, conv, elementwise/norm or other
    (layout and data movement: reshape, transpose, split, concatenate, take, ...)."""
    words = name.lower().split("_")
    low = name.lower()
    for cls, keys in _CLASS_WORDS:
        # whole words (add1 counts as add: a numeric suffix is TVM's uniquifier)
        if any(w.rstrip("0123456789") in keys for w in words) or any(k in low for k in keys if "_" in k):
            return cls
    return "other"


def class_shares(kernels: list["KernelProfile"]) -> dict[str, float]:
    """Percent of the profiled kernel time per class (every class present, summing to 100)."""
    total = sum(k.total_ms for k in kernels)
    shares = {c: 0.0 for c in KERNEL_CLASSES}
    for k in kernels:
        shares[kernel_class(k.name)] += k.total_ms
    return {c: (100 * v / total if total else 0.0) for c, v in shares.items()}


def summarize(samples: dict[str, list[float]], peers: set[str], flops: int,
              sgemm_gflops: float) -> tuple[list[ContenderResult], str | None]:
    """Results in `samples` order, and the best peer's name (None when no peer ran)."""
    med = {k: float(np.median(s)) for k, s in samples.items()}
    ran_peers = [k for k in samples if k in peers]
    best = min(ran_peers, key=lambda k: med[k]) if ran_peers else None
    results = []
    for k, s in samples.items():
        gf = flops / (med[k] / 1e3) / 1e9
        results.append(ContenderResult(
            k, k in peers, med[k], float(np.percentile(s, 90)), float(np.min(s)), gf,
            med[k] / med[best] if best else None, med[k] / med["ort"] if "ort" in med else None,
            100 * gf / sgemm_gflops if sgemm_gflops else 0.0, [float(x) for x in s]))
    return results, best


def _ratio(r: float | None) -> str:
    return f"{r:.2f}x" if r is not None else "-"


@dataclass
class BenchReport:
    model: str
    target: str
    dims: dict
    threads: int
    flops: int
    sgemm_gflops: float
    results: list[ContenderResult]
    best_peer: str | None = None
    profile: dict[str, list[KernelProfile]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    host: dict = field(default_factory=dict)  # cpu_model, physical_cores, machine, versions of every engine
    unchecked: list[str] = field(default_factory=list)  # outputs no reference computed: times of unverified results
    precision: str = "float"  # "int8": a quantized model (GFLOP/s are then int8 ops/s)
    probes: dict[str, list[float]] = field(default_factory=dict)  # BenchOptions.probes' samples, ms
    sgemm_before: float | None = None  # the ceiling measured before the timing (sgemm_gflops: after it)
    quiet_ceiling: float | None = None  # the machine's quiet SGEMM GFLOP/s, when given (--quiet-ceiling)

    @property
    def quotable(self) -> bool | None:
        """Every ceiling of the run >= QUOTABLE_FRACTION of the quiet one; None without a quiet value."""
        if self.quiet_ceiling is None:
            return None
        return min(self.ceilings()) >= QUOTABLE_FRACTION * self.quiet_ceiling

    def ceilings(self) -> list[float]:
        return [c for c in (self.sgemm_before, self.sgemm_gflops) if c is not None]

    def quotable_text(self) -> str | None:
        if self.quotable is None:
            return None
        low = min(self.ceilings())
        if self.quotable:
            return (f"quotable: every SGEMM ceiling of the run >= {QUOTABLE_FRACTION:.0%} of the quiet "
                    f"{self.quiet_ceiling:.0f} GFLOP/s")
        return (f"NOT QUOTABLE: SGEMM ceiling {low:.0f} GFLOP/s is below {QUOTABLE_FRACTION:.0%} of the quiet "
                f"{self.quiet_ceiling:.0f} GFLOP/s: the machine was not quiet; discard, do not quote")

    @property
    def headline(self) -> dict | None:
        """The fastest blockforge contender's ratio to the best peer; None unless every
        output of every timed contender was checked against a reference."""
        ours = [r for r in self.results if not r.peer]
        if self.best_peer is None or not ours or self.unchecked:
            return None
        best = min(ours, key=lambda r: r.median_ms)
        return {"contender": best.name, "best_peer": self.best_peer, "ratio_to_best_peer": best.ratio_to_best_peer}

    def headline_text(self) -> str:
        h = self.headline
        if h is None and self.unchecked:
            return (f"no headline: unchecked: no reference could compute {', '.join(self.unchecked)}, so the times "
                    "below are of results nobody verified")
        if h is None:
            missing = "no peer" if self.best_peer is None else "no blockforge contender"
            return f"no headline: {missing} ran"
        return f"blockforge ({h['contender']}) at {h['ratio_to_best_peer']:.2f}x the best peer ({h['best_peer']})"

    def to_dict(self) -> dict:
        d = asdict(self)
        del d["probes"]  # an API channel (bench --decode's bandwidths, in its own JSON), not bench's schema
        d["schema"] = SCHEMA
        d["headline"] = self.headline
        d["quotable"] = self.quotable
        return d

    def markdown(self) -> str:
        cpu = self.host.get("cpu_model")
        lines = [f"{Path(self.model).name} on {self.target}{f' ({cpu})' if cpu else ''}, {self.threads} threads, "
                 f"dims {self.dims}, {self.flops / 1e9:.3f} G{'OP' if self.precision == 'int8' else 'FLOP'}"
                 f"{f' ({self.precision})' if self.precision != 'float' else ''}; "
                 f"SGEMM ceiling {self.sgemm_gflops:.0f} GFLOP/s"
                 f"{f' ({self.sgemm_before:.0f} before the timing)' if self.sgemm_before is not None else ''}", "",
                 f"**{self.headline_text()}**", "",
                 *([f"**{q}**", ""] if (q := self.quotable_text()) else []),
                 "| contender | kind | median ms | p90 ms | GFLOP/s | vs best peer | % of SGEMM |",
                 "|---|---|---|---|---|---|---|"]
        for r in self.results:
            ratio = _ratio(r.ratio_to_best_peer)
            if r.name == self.best_peer:
                ratio += " (best peer)"
            lines.append(f"| {r.name} | {'peer' if r.peer else 'blockforge'} | {r.median_ms:.3f} | {r.p90_ms:.3f} | "
                         f"{r.gflops:.1f} | {ratio} | {r.pct_of_sgemm:.0f}% |")
        for name, kernels in self.profile.items():
            by_class = ", ".join(f"{c} {v:.0f}%" for c, v in class_shares(kernels).items() if v >= 0.5)
            lines += ["", f"profile of {name} (per run; by class: {by_class}):", ""]
            total = profile_sum_line(kernels, next((r.median_ms for r in self.results if r.name == name), None))
            lines += [total, ""] if total else []
            lines += ["| kernel | calls | ms | % |", "|---|---|---|---|"]
            lines += [f"| {k.name} | {k.calls} | {k.total_ms:.3f} | {k.pct:.1f}% |" for k in kernels]
        return "\n".join(lines)


# The instrumented runs' sum over the uninstrumented median above which the profile says it
# overstates: each kernel call pays a device sync and a Python callback, and a disturbed run
# shows here first (the BERT-base QDQ block at seq 512: its kernels summed to 1.4x the model's
# median in one profile, 1.01x in the next).
PROFILE_OVERSTATES = 1.1


def profile_sum_line(kernels: list[KernelProfile], median_ms: float | None) -> str:
    """What the profile's kernels sum to against the contender's timed median ("" without one):
    the per-kernel shares are read within a profile, its milliseconds against this line."""
    if not kernels or not median_ms:
        return ""
    total, calls = sum(k.total_ms for k in kernels), sum(k.calls for k in kernels)
    ratio = total / median_ms
    line = f"kernels sum to {total:.3f} ms per run, {ratio:.2f}x the median ({median_ms:.3f} ms), {calls} calls"
    if ratio > PROFILE_OVERSTATES:
        line += ("; each call's instrumentation (a device sync, a Python callback) counts in its kernel, so read "
                 "the shares, not the milliseconds")
    return line


def case_label(r: BenchReport) -> str:
    return f"{Path(r.model).stem}\n{'/'.join(f'{k}={v}' for k, v in r.dims.items())}"


def plot(reports: list[BenchReport], path: Path, labels: list[str] | None = None) -> None:
    """Bars of each contender's ratio to the best peer (1.0 = the best peer; lower is
    faster), labelled with the ratio and the median ms, one group per report."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from blockforge.fsutil import atomic_write_bytes

    names = labels or [case_label(r) for r in reports]
    order = []
    for r in reports:
        order += [x.name for x in r.results if x.name not in order]
    fig, ax = plt.subplots(figsize=(max(6.0, 2.4 * len(reports)), 4.8))
    width = 0.8 / max(1, len(order))
    for i, c in enumerate(order):
        xs, vals, text = [], [], []
        for j, r in enumerate(reports):
            x = next((x for x in r.results if x.name == c), None)
            if x is None or x.ratio_to_best_peer is None:
                continue
            xs.append(j + i * width)
            vals.append(x.ratio_to_best_peer)
            text.append(f"{x.ratio_to_best_peer:.2f}x\n{x.median_ms:.3g} ms")
        bars = ax.bar(xs, vals, width, label=c, hatch="" if c in {x.name for r in reports for x in r.results
                                                                   if x.peer} else "//")
        ax.bar_label(bars, labels=text, fontsize=6)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks([j + width * (len(order) - 1) / 2 for j in range(len(reports))], names, fontsize=8)
    ax.set_ylabel("median latency / best peer's (lower is faster)")
    cpu = reports[0].host.get("cpu_model", "")
    unchecked = "; UNCHECKED: no reference for some outputs" if any(r.unchecked for r in reports) else ""
    ax.set_title(f"ratio to the best peer: {reports[0].target}{f', {cpu}' if cpu else ''}, "
                 f"{reports[0].threads} threads{unchecked}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
