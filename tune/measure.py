"""Functions MetaSchedule's builder workers run (imported by module path in each worker).

TVM's default_build imports tvm.s_tir.tensor_intrin first, which registers ~500
TVMScript intrinsics through inspect.stack() and costs ~11 s in every fresh worker;
LocalBuilder starts fresh workers for every batch. CPU float schedules use none of
those intrinsics, so CPU builds skip the import.
"""

from __future__ import annotations


def build_cpu(mod, target, _params):
    """A candidate as compile builds its kernels: TVM's TIR pipeline and blockforge's stack and
    window passes (compile/passes/stack_allocs.py). With TVM's alone, an accumulator tile of
    1 KiB or more took a workspace alloc/free per output tile: the bf16 GEMM's default at
    128x768x3072 +gelu ran 0.85 ms built that way against 0.71 ms as compile builds it (Zen 5, 2
    threads, interleaved), so the search ranked candidates partly by their allocations."""
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    from blockforge.compile.passes.stack_allocs import tir_pipeline

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm_build(mod, target=target, pipeline=tir_pipeline())


def run_direct(rt_mod, device, evaluator_config, repeated_args):
    """Time candidates by calling them directly, as the VM does.

    rt_mod.time_evaluator drives the kernel in a way that leaves TVM's parallel thread
    pool cold: measured on 2 cores, a 128x768x768 GEMM took 0.59-1.2 ms under
    time_evaluator and 0.31 ms called directly. Rankings then favour kernels that are
    fast in the evaluator, not in the model.

    The result is the least sample, once: MetaSchedule ranks candidates by the mean of what
    this returns, and single samples of a run read up to 2x the kernel's time (a 128x768x3072
    bf16 GEMM: runs of [1177, 1124, 607] and [1200, 804, 614] us among [595-619] ones, Zen 5,
    2 threads). Interference only ever slows a sample.
    """
    f = rt_mod[rt_mod.entry_name]
    costs = []
    for args in repeated_args:
        costs += time_direct(lambda: f(*args), device.sync, warmup=2, repeat=max(1, evaluator_config.repeat),
                             number=max(1, evaluator_config.number),
                             min_ms=evaluator_config.min_repeat_ms or 0)
    return [min(costs)] if costs else costs


def time_direct(call, sync, *, warmup: int, repeat: int, number: int, min_ms: float) -> list[float]:
    """Seconds per call, `repeat` samples of >= `number` calls and >= `min_ms` each, called
    directly on this thread after `warmup` calls (shared by the tuning runner and tune's
    whole-model timing)."""
    import time

    for _ in range(warmup):
        call()
    sync()
    samples = []
    for _ in range(repeat):
        n, t0 = 0, time.perf_counter()
        while n < number or (time.perf_counter() - t0) * 1e3 < min_ms:
            call()
            n += 1
        sync()
        samples.append((time.perf_counter() - t0) / n)
    return samples


def export_local(root: str, mod) -> str:
    """MetaSchedule's default export (a tar the runner links), but under the job's own
    temporary root, which the job removes: TVM's default leaves a tmp* directory in TMPDIR
    per candidate."""
    import os
    import tempfile

    from tvm.support.tar import tar

    path = os.path.join(tempfile.mkdtemp(dir=root), "tvm_tmp_mod." + tar.output_format)
    mod.export_library(path, fcompile=tar)
    return path


def export_cross(compiler: str, root: str, mod) -> str:
    """A cross-linked candidate (.so for the RPC device), under the job's temporary root."""
    import os
    import tempfile

    from tvm.support import cc

    path = os.path.join(tempfile.mkdtemp(dir=root), "tuned.so")
    mod.export_library(path, fcompile=cc.cross_compiler(compiler))
    return path
