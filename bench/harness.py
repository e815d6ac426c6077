"""`bench`: contenders measured side by side in one process, interleaved, equal threads.

Contenders come from the registry in bench/contenders.py (ONNX Runtime, ORT's fused
kernels, OpenVINO, blockforge untuned and tuned); every output of each one is checked
against the reference before it is timed (the oracle for blockforge models, ONNX Runtime
otherwise): a contender with different math must not win, and a report whose outputs no
reference could check has no headline. Reports (bench/report.py) give every
contender's ratio to the best peer, the headline. The SGEMM ceiling (numpy/BLAS on a large
square) is measured in the same run, so "% of ceiling" compares like with like on this
machine, today.
"""

from __future__ import annotations

import math
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import blockforge
from blockforge.errors import ArgumentError, BlockforgeError
from blockforge.graph import ort as ort_runner
from blockforge.graph.analysis import matmul_flops
from blockforge.graph.model_io import bind_dims, model_spec, random_inputs
from blockforge.graph.parity import model_precision, oracle_outputs, tolerance_kind
from blockforge.graph.tolerance import OrtSpread, compare, compare_accuracy, output_tolerance
from blockforge.graph.shape import ShapeRequest
from blockforge.compile.session import open_model
from blockforge.logs import native_output_to_log
from blockforge.settings import physical_cores
from blockforge.targets import resolve
from blockforge.targets.toolchain import cpu_id, package_version

from .contenders import CONTENDERS, PEERS, REGISTRY, BenchModel, TvmRunner, Unavailable, peer_failure, skip_note
from .report import BenchReport, KernelProfile, summarize

ENGINES = ("apache-tvm", "onnxruntime-gpu", "onnxruntime", "openvino", "onnx", "numpy")


@dataclass
class BenchOptions:
    model: Path
    target: str = "host"
    against: tuple[str, ...] = CONTENDERS
    repeat: int = 30
    warmup: int = 2
    shape: ShapeRequest | dict | None = None  # dim names and/or whole input shapes (graph/shape.py)
    # Bound only where the model has such a dim and `dims` left it open: the CLI's default
    # batch=1,seq=128 then fits blockforge's blocks without breaking a static model or an
    # export whose dims are named otherwise (s33, s50: those need --shape).
    default_dims: dict[str, int] = field(default_factory=dict)
    tuning_db: Path | None = None
    profile: bool = False
    gemm_n: int = 2048
    precision: str = "fp32"  # targets.precision: blockforge's builds; OpenVINO gets the matching hint
    # name -> a callable timed in the same interleaved rounds as the contenders, neither checked nor
    # ranked: what a report relates the contenders to under the same machine state (bench --decode's
    # memory bandwidth); their samples are the report's `probes`
    probes: dict = field(default_factory=dict)
    # the machine's SGEMM GFLOP/s when quiet: the report says whether this run is quotable
    # (report.QUOTABLE_FRACTION of it, before and after the timing)
    quiet_ceiling: float | None = None
    extra: tuple = ()  # contenders outside the registry, after its rows (bench --decode's loop artifact)


def sgemm_ceiling(n: int = 2048, repeat: int = 5, clock=time.perf_counter) -> float:
    """Best GFLOP/s of numpy's float32 matmul on an n x n square (BLAS, all its threads)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b
    best = float("inf")
    for _ in range(repeat):
        t0 = clock()
        a @ b
        best = min(best, clock() - t0)
    return 2 * n**3 / best / 1e9


def chain_probe(update, a: np.ndarray, b: np.ndarray, acc: tuple[str, int], threads: int, iters: int,
                chains: int = 24, annotations: dict | None = None):
    """(call, its accumulators): `chains` independent `acc` = (dtype, lanes) vector accumulators
    per thread, each set to `update(acc, A, B)` `iters` times, A and B the whole vectors `a`
    and `b`, everything in registers, on `threads` threads: one instruction's rate as the cores
    give it now (no loads, no epilogue), timed beside the kernels that use it (benchmarks/
    int8_gemm.py's VPDPBUSD, bf16_gemm.py's VDPBF16PS). The accumulators, (threads, chains,
    lanes), hold the sums after each call, for the caller's check that the chains ran.
    `annotations`: the thread loop's (an instruction in imported LLVM IR needs its pragma)."""
    import tvm
    from tvm import tirx
    from tvm.script import tirx as T

    acc_dtype, lanes = acc
    a_vec, b_vec = f"{a.dtype}x{a.size}", f"{b.dtype}x{b.size}"
    zero = tirx.const(0, acc_dtype)

    @T.prim_func(s_tir=True)
    def probe(A: T.Buffer((a.size,), str(a.dtype)), B: T.Buffer((b.size,), str(b.dtype)),
              C: T.Buffer((threads, chains, lanes), acc_dtype)):
        T.func_attr({"tirx.noalias": True})
        for t in T.parallel(threads, annotations=annotations or {}):
            r = T.alloc_buffer((chains, lanes), acc_dtype, scope="local")
            for c in T.unroll(chains):
                r[c, T.ramp(0, 1, lanes)] = T.broadcast(zero, lanes)
            for _ in range(iters):
                for c in T.unroll(chains):
                    r[c, T.ramp(0, 1, lanes)] = update(r[c, T.ramp(0, 1, lanes)], A.vload([0], a_vec),
                                                       B.vload([0], b_vec))
            for c in T.unroll(chains):
                C[t, c, T.ramp(0, 1, lanes)] = r[c, T.ramp(0, 1, lanes)]

    lib = tvm.compile(tvm.IRModule({"main": probe}), target=resolve("host").tvm_target())
    args = [tvm.runtime.tensor(a), tvm.runtime.tensor(b), tvm.runtime.tensor(np.zeros((threads, chains, lanes), acc_dtype))]
    lib["main"](*args)
    return (lambda: lib["main"](*args)), args[2]


def profile_vm(runner: TvmRunner, runs: int = 5, warmup: int = 1, clock=time.perf_counter,
               sleep=time.sleep) -> list[KernelProfile]:
    """Per-kernel time through the VM's instrument hook (TVM removed vm.profile()): each
    kernel's median over `runs` runs of its per-run total.

    As measure_interleaved does, a pause and `warmup` uninstrumented calls first: the profile
    ran right after the last contender's burst, and ORT's spinning workers (or BLAS's, after the
    SGEMM ceiling) took the cores from the first kernels of the first run. Measured on the int8
    MHA at seq 512 (2 cores, `--against ort,untuned`): DynamicQuantizeLinear's range kernel read
    1.09 ms a call (24% of the profile; the kernel alone: 60 us) and the profile summed to 2x the
    model's median; the median over runs keeps one such run out.
    """
    starts: dict[str, float] = {}
    per_run: list[dict[str, list]] = []

    def instrument(func, name, before, ret, *args):
        if before:
            starts[name] = clock()
        else:
            runner.dev.sync()
            t = per_run[-1].setdefault(name, [0, 0.0])
            t[0] += 1
            t[1] += clock() - starts.pop(name, clock())
        return 0

    sleep(QUIET_S)
    for _ in range(warmup):
        runner()
    runner.vm.set_instrument(instrument)
    try:
        for _ in range(runs):
            per_run.append({})
            runner()
    finally:
        runner.vm.set_instrument(None)
    names = {k for r in per_run for k in r if not k.startswith("vm.builtin.")}
    ms = {k: float(np.median([r.get(k, [0, 0.0])[1] for r in per_run])) * 1e3 for k in names}
    calls = {k: max(r.get(k, [0])[0] for r in per_run) for k in names}
    total = sum(ms.values()) or 1.0
    rows = [KernelProfile(k, calls[k], ms[k], 100 * ms[k] / total) for k in names]
    return sorted(rows, key=lambda r: (-r.total_ms, r.name))


def host_facts() -> dict:
    """The machine and the engines a report was measured with."""
    # The 1-minute load average: on a shared machine it says how far to trust the digits.
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"cpu_model": cpu_id(), "physical_cores": physical_cores(), "machine": platform.machine(),
            "node": platform.node(), "load_avg_1m": load, "blockforge": blockforge.__version__,
            "versions": {k: v for k in ENGINES if (v := package_version(k))}}


BURST = 5
QUIET_S = 0.05
# After numpy's SGEMM: OpenBLAS's workers spin for tens of ms after a call and take the cores
# from the next engine (benchmarks/int8_gemm.py: TVM's kernel 1.89 ms alone, 4.91 ms right after one).
BLAS_QUIET_S = 0.5


def measure_interleaved(runners: dict, repeat: int, warmup: int, clock=time.perf_counter) -> dict[str, list[float]]:
    """Interleaved in bursts: drift hits every contender alike, and no contender's idle
    thread pool spins on the cores while another is timed.

    Each round visits every contender (order rotated): a short pause lets the previous
    contender's workers stop spinning (ORT spins after each run by default; measured on
    2 cores: TVM 1.8 ms alone vs 4.0 ms right after ORT), `warmup` untimed calls, then a
    burst of timed calls. clock: time.thread_time times single-threaded calls in CPU time (a
    shared machine's descheduling then does not count).
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
                t0 = clock()
                fn()
                samples[k].append((clock() - t0) * 1e3)
        rnd += 1
    return samples


@dataclass
class Reference:
    """What every contender's outputs must match, output by output: the float64 oracle for
    blockforge models (it computes the first output), ONNX Runtime on the model as given
    for the rest and for foreign models. Outputs neither could compute are unchecked."""

    expected: dict[str, np.ndarray] = field(default_factory=dict)
    source: dict[str, str] = field(default_factory=dict)  # output name -> who computed it
    unchecked: list[str] = field(default_factory=list)
    # a quantized model: ORT's run with its graph optimizations off (its spread), made at most
    # once, only for a blockforge row beyond the int8 row
    spread: OrtSpread | None = None
    notes: list[str] = field(default_factory=list)  # what the checks passed on (the bench's notes)


def _reference(bm: BenchModel, inputs: dict, precision: str = "float") -> Reference:
    """A quantized model's reference is ONNX Runtime on the same quantized file: the float
    oracle would measure the quantization's error, which is the model's, not a contender's."""
    ref = Reference()
    names = [s.name for s in bm.session.outputs]
    if bm.spec is not None and precision == "float":
        for k, v in (oracle_outputs(bm.session.model, inputs) or {}).items():
            ref.expected[k], ref.source[k] = v, "the numpy oracle"
    missing = [n for n in names if n not in ref.expected]
    if missing:
        try:
            ort_outs = ort_runner.run(bm.onnx, inputs)
        except BlockforgeError as e:
            ort_outs = {}
            bm.notes.append(f"no reference for {', '.join(missing)} ({e}): those outputs are unchecked, "
                            "so no ratio is a headline")
        for n in missing:
            if n in ort_outs:
                ref.expected[n], ref.source[n] = ort_outs[n], "ONNX Runtime"
        if precision != "float":
            ref.spread = OrtSpread(lambda: ort_runner.run(bm.onnx, inputs, optimize=False))
    ref.unchecked = [n for n in names if n not in ref.expected]
    return ref


def _check(name: str, runner, ref: Reference, sigs, spec_kind: str | None, precision: str = "float",
           peer: bool = False, build: str = "fp32") -> str | None:
    """Why `runner`'s outputs do not match the reference, or None when every output that
    has a reference does: one wrong output is enough to refuse the contender. On a quantized
    model blockforge is held to the int8 parity row against ORT on the same file; a peer
    (OpenVINO runs QDQ with its own requantize placement) to the precision's accuracy gate
    against it: a peer computing the quantized model another way is timed, a wrong one not."""
    outs = runner.outputs()
    if len(outs) != len(sigs):
        return (f"gives {len(outs)} outputs, the model has {len(sigs)}: not timed, a different computation "
                "must not win")
    for sig, actual in zip(sigs, outs):
        if sig.name not in ref.expected:
            continue
        if precision != "float" and peer and ref.source[sig.name] == "ONNX Runtime":
            c = compare_accuracy(name, sig.name, actual, ref.expected[sig.name], precision, spec_kind)
            if not c.passed:
                return (f"output {sig.name!r} differs from {ref.source[sig.name]} on the same {precision} model "
                        f"beyond its accuracy gate ({c.note}): not timed, a different computation must not win")
            continue
        tol = output_tolerance(np.asarray(actual).dtype, spec_kind, build if precision == "float" else precision)
        c = compare(name, sig.name, actual, ref.expected[sig.name], tol)
        if not c.passed and precision != "float" and ref.source[sig.name] == "ONNX Runtime" \
                and ref.spread is not None:
            c = ref.spread.judge(c, actual, ref.expected[sig.name], sig.name)
            if c.passed:
                ref.notes.append(f"{name}: output {sig.name!r} {c.note} (timed)")
        if not c.passed:
            return (f"output {sig.name!r} differs from {ref.source[sig.name]} (max abs err {c.max_abs:.2e}, "
                    f"rtol {tol.rtol:g} atol {tol.atol:g}{f' step {tol.step:.3g}*max|expected|' if tol.step else ''}, "
                    f"{c.tol_used:.3g}x the allowance{'; ' + c.note if c.note else ''}): not timed, "
                    "a different computation must not win")
    return None


def bench(opts: BenchOptions) -> BenchReport:
    unknown = [c for c in opts.against if c not in REGISTRY]
    if unknown or not opts.against:
        raise BlockforgeError(f"unknown contender(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(CONTENDERS)}")
    if opts.repeat < 3:
        raise ArgumentError("{repeat} must be at least 3", "repeat")
    if opts.quiet_ceiling is not None and not (math.isfinite(opts.quiet_ceiling) and opts.quiet_ceiling > 0):
        raise ArgumentError(f"{{quiet_ceiling}} must be a positive GFLOP/s, got {opts.quiet_ceiling}", "quiet_ceiling")
    target = resolve(opts.target)
    problem = target.run_problem()
    if problem:
        raise BlockforgeError(f"cannot benchmark {target.name} here: {problem}")
    # static: every dim must be bound for a benchmark; a clear error names the missing one.
    session = open_model(opts.model, target, opts.shape, default_dims=opts.default_dims, static=True,
                         precision=opts.precision)
    inputs = random_inputs(session.inputs, {}, seed=0)
    flops = matmul_flops(session.prepared, session.dims)  # after prepare: shapes are static
    threads = int(target.target_json.get("num-cores", 1))
    spec = model_spec(session.model)
    bm = BenchModel(session, bind_dims(session.model, session.dims, strict=False), spec, dict(session.dims),
                    opts.tuning_db)
    precision = model_precision(session.model)
    kind = tolerance_kind(session.model)  # the tolerance rows every contender's outputs are held to
    if precision != "float":
        bm.notes.append(f"precision {precision}: every contender runs the same quantized file; checked against "
                        "ONNX Runtime on it (blockforge at the int8 parity row: elementwise up to one encoder block's "
                        "depth, the whole output's rel L2 deeper; peers within the accuracy gate)")
    ref = _reference(bm, inputs, precision)
    runners = {}
    with native_output_to_log():
        for c in [REGISTRY[n] for n in CONTENDERS if n in opts.against] + list(opts.extra):  # peers first
            name = c.name
            if not c.available():
                bm.notes.append(skip_note(name, f"not installed ({c.install})"))
                continue
            try:
                runner = c.make_runner(bm, inputs, threads)
                # at bf16 every contender is held to the bf16 row (ORT, in fp32, passes it)
                why = _check(name, runner, ref, session.outputs, kind, precision, c.peer,
                             opts.precision)
            except Unavailable as e:
                why = str(e)
            except Exception as e:  # a peer engine that cannot take the model is a note, never an error
                if not c.peer:
                    raise
                why = peer_failure(e)
            if why:
                bm.notes.append(skip_note(name, why))
            else:
                runners[name] = runner
        bm.notes.extend(ref.notes)
        if not runners:
            raise BlockforgeError("no contender could run the model: " + "; ".join(bm.notes))
        clash = set(opts.probes) & set(runners)
        if clash:
            raise ValueError(f"probe(s) named like a contender: {sorted(clash)}")
        ceiling_before = sgemm_ceiling(opts.gemm_n)
        time.sleep(BLAS_QUIET_S)
        samples = measure_interleaved({**runners, **opts.probes}, opts.repeat, opts.warmup)
        probes = {k: samples.pop(k) for k in opts.probes}
        profile = {k: profile_vm(r) for k, r in runners.items() if opts.profile and isinstance(r, TvmRunner)}
    ceiling = sgemm_ceiling(opts.gemm_n)
    results, best = summarize(samples, set(PEERS), flops, ceiling)
    return BenchReport(str(opts.model), target.name, session.dims, threads, flops, ceiling, results, best, profile,
                       bm.notes, host_facts(), unchecked=ref.unchecked,
                       precision=precision if precision != "float" or opts.precision == "fp32" else opts.precision,
                       probes=probes, sgemm_before=ceiling_before, quiet_ceiling=opts.quiet_ceiling)
