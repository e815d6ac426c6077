"""Building and timing hand-written kernels with a tuning job's own builder and runner (so an
RPC device times its own): the fused attention's and the int8 and bf16 GEMMs' tile searches."""

from __future__ import annotations

import logging

import numpy as np

from blockforge.graph.model_io import DEFAULT_DIMS

_log = logging.getLogger("blockforge")


def args_info(func, dims: dict[str, int]):
    """Concrete argument shapes of a kernel: its symbolic dims at the job's bound dims."""
    from tvm import tirx
    from tvm.s_tir import meta_schedule as ms

    bound = {**DEFAULT_DIMS, **dims}
    out = []
    for p in func.params:  # buffer-typed parameters
        shape = [int(s.value) if isinstance(s, tirx.IntImm) else int(bound[s.name]) for s in p.shape]
        out.append(ms.arg_info.TensorInfo(str(p.dtype), shape))
    return out


def build_kernel(func, target, builder, what: str):
    """The builder's artifact for `func`, or None (with a warning naming `what`)."""
    import tvm
    from tvm.s_tir import meta_schedule as ms

    built = builder.build([ms.builder.BuilderInput(tvm.IRModule({"main": func}), target.tvm_target())])[0]
    if built.error_msg:
        _log.warning("%s did not build: %s", what, str(built.error_msg)[-300:])
        return None
    return built.artifact_path


def run_kernel(artifact: str, func, target, runner, dims, what: str) -> list[float] | None:
    """Seconds per call (the runner's samples) of a built kernel, or None."""
    from tvm.s_tir import meta_schedule as ms

    kind = target.tvm_target().kind.name
    device = "cpu" if kind == "llvm" else kind
    res = runner.run([ms.runner.RunnerInput(artifact, device, args_info(func, dims))])[0].result()
    if res.error_msg or not res.run_secs:
        _log.warning("%s failed to run: %s", what, str(res.error_msg)[-300:])
        return None
    return [float(x) for x in res.run_secs]


PASSES = 2  # times each candidate is timed, in turns


def time_candidates(funcs: dict, target, builder, runner, dims, what: str) -> dict:
    """key -> (seconds per call, the built artifact) for each kernel in `funcs` (key -> PrimFunc;
    keys that did not build or run are left out): the least over every sample of PASSES turns.

    All are built before any is timed: the job's build workers (each a TVM import, ~3 s of
    CPU, and a compiler) otherwise shared the 2 cores with the timings. Interference only ever
    slows a sample, so the least is the kernel's own time: timed one after another, the runner's
    medians of 3 samples read up to 2x a kernel's time (a 128x768x3072 bf16 GEMM read 1.1-1.2 ms
    in single samples, 0.60-0.62 in the rest, on Zen 5; whole candidates read 6x at a job's start)."""
    built = {k: art for k, f in funcs.items() if (art := build_kernel(f, target, builder, f"{what} {k}")) is not None}
    samples: dict = {k: [] for k in built}
    keys = list(built)
    for p in range(PASSES):
        for k in (keys if p % 2 == 0 else keys[::-1]):
            s = run_kernel(built[k], funcs[k], target, runner, dims, f"{what} {k}")
            if s:
                samples[k] += s
    return {k: (min(s), built[k]) for k, s in samples.items() if s}


def wins(base: list[float], cand: list[float], margin: float) -> bool:
    """cand beats base by `margin` in the median AND is faster in every paired round. On a
    shared machine one round can swing 2x (measured: the same default build at 18 and
    45 ms, load 7 on 2 cores), so in doubt the default schedule stays."""
    return (float(np.median(cand)) < float(np.median(base)) * (1 - margin)
            and all(c < b for b, c in zip(base, cand)))
