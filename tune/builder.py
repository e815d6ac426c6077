"""The candidate builder of a tuning job: MetaSchedule's LocalBuilder with its worker
processes kept for the job.

LocalBuilder starts a new pool for every build() call (one search iteration, one seed, one
tile candidate) and one more for its sanity check, and every new worker is a fresh Python
that imports TVM: ~3.3 s of CPU before it builds anything (`python -c "import tvm"`, this
Zen 5 VM). Measured with strace on one tune of a small FFN (2 tasks, 2 trials per task in
1-trial rounds, --no-measure: the fault tests' job): LocalBuilder's job started 8 worker
processes and took 59.6 s of CPU (user + sys, strace's overhead in it); with this pool, 2
workers and 37.0 s. Side by side in the test suite (benchmarks/results/LOG.md, sixth pass): test_tune.py +
test_tune_faults.py 319 -> 223 s of CPU. Here the pool lives as long as the job (one
builder worker for that job's builds). TVM restarts its pool for "a memory leak after a
couple of uses" of a worker; each worker here is replaced after
BUILDS_PER_WORKER builds (PopenWorker's maximum_process_uses), four times what a worker
did in one of LocalBuilder's 32-candidate batches on 2 cores. A build past the timeout
kills its worker and the next build starts a new one, as in LocalBuilder.

BLOCKFORGE_BUILDER=fresh (core/settings.py) builds with TVM's LocalBuilder instead (the before/after).
"""

from __future__ import annotations

import functools
import logging

BUILDS_PER_WORKER = 64


def job_builder(*, max_workers: int, timeout_sec: float, f_build=None, f_export=None,
                builds_per_worker: int = BUILDS_PER_WORKER):
    """A JobBuilder (TVM is imported here, not when this module is)."""
    return _job_builder_class()(max_workers=max_workers, timeout_sec=timeout_sec, f_build=f_build,
                                f_export=f_export, builds_per_worker=builds_per_worker)


@functools.cache
def _job_builder_class():
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.builder import BuilderResult, PyBuilder
    from tvm.s_tir.meta_schedule.builder.local_builder import _serialize_params, _worker_func
    from tvm.support.popen_pool import PopenPoolExecutor, StatusKind

    @derived_object
    class JobBuilder(PyBuilder):
        """LocalBuilder's build (same worker function, f_build and f_export by value, results
        and error texts), on one PopenPoolExecutor for the builder's lifetime; close() ends it."""

        reuses_workers = True

        def __init__(self, *, max_workers: int, timeout_sec: float, f_build, f_export, builds_per_worker: int) -> None:
            super().__init__()
            self.max_workers = max_workers
            self.timeout_sec = timeout_sec
            self.f_build = f_build
            self.f_export = f_export
            self.pool = PopenPoolExecutor(max_workers=max_workers, timeout=timeout_sec,
                                          maximum_process_uses=builds_per_worker)

        def build(self, build_inputs) -> list:
            results = []
            for res in self.pool.map_with_error_catching(
                    lambda x: _worker_func(*x),
                    [(self.f_build, self.f_export, b.mod, b.target, _serialize_params(b.params))
                     for b in build_inputs]):
                if res.status == StatusKind.COMPLETE:
                    results.append(BuilderResult(res.value, None))
                elif res.status == StatusKind.TIMEOUT:
                    results.append(BuilderResult(None, f"LocalBuilder: Timeout, killed after {self.timeout_sec} seconds"))
                elif res.status == StatusKind.EXCEPTION:
                    results.append(BuilderResult(None, "LocalBuilder: An exception occurred\n" + str(res.value)))
                else:
                    raise ValueError(f"unexpected build result status: {res.status}")
            return results

        def close(self) -> None:
            shutdown_pool(self.pool)

    return JobBuilder


def shutdown_pool(pool) -> None:
    """TVM's PopenPoolExecutor.shutdown(wait=False), safe while the pool's threads are ending
    their workers. shutdown() takes the pool's lock and kills each worker; a pool thread that
    saw its worker die (a Ctrl-C reaches the whole process group) kills it too, and when the two
    race, shutdown raises ("'NoneType' object has no attribute 'kill'") with the lock still
    held: the pool's __del__ at exit then waited on it forever (a tune that never ended after
    Ctrl-C, tests/robustness/test_interrupts.py::test_second_signal_does_not_break_the_cleanup in
    a clean-clone run). Here the rest is finished by hand and the pool marked shut, so __del__
    does nothing (run from one of the pool's own threads, its shutdown(wait=True) cannot join)."""
    try:
        pool.shutdown(wait=False)
        return
    except Exception as e:
        logging.getLogger("blockforge").info("worker pool shutdown: %s", e)
    lock = getattr(pool, "_lock", None)
    if lock is not None and lock.locked():  # held by the shutdown that raised: no one else can hold it
        try:
            lock.release()
        except RuntimeError:
            pass
    for worker in list(getattr(pool, "_worker_map", {}).values()):
        proc = getattr(worker, "_proc", None)
        if proc is not None:
            try:
                proc.kill()
            except Exception:
                pass
    threads = getattr(pool, "_threadpool", None)
    if threads is not None:
        threads.shutdown(wait=False)
    pool._shutdown = True
