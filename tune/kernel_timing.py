"""Building and timing one hand-written kernel with a tuning job's own builder and runner
(so an RPC device times its own): the fused attention's and the int8 GEMM's tile searches."""

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


def time_kernel(func, target, builder, runner, dims, what: str) -> list[float] | None:
    artifact = build_kernel(func, target, builder, what)
    return None if artifact is None else run_kernel(artifact, func, target, runner, dims, what)


def wins(base: list[float], cand: list[float], margin: float) -> bool:
    """cand beats base by `margin` in the median AND is faster in every paired round. On a
    shared machine one round can swing 2x (measured: the same default build at 18 and
    45 ms, load 7 on 2 cores), so in doubt the default schedule stays."""
    return (float(np.median(cand)) < float(np.median(base)) * (1 - margin)
            and all(c < b for b, c in zip(base, cand)))
