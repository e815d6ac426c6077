"""The tuning job's candidate builder (tune/builder.py): one worker process serves the job's
successive build calls (TVM's LocalBuilder starts a new one, which imports TVM, per call),
with LocalBuilder's results and error texts; BLOCKFORGE_BUILDER=fresh is LocalBuilder."""

from __future__ import annotations

import os

import pytest
import tvm
from tvm import te
from tvm.s_tir import meta_schedule as ms

from blockforge.targets import resolve
from blockforge.settings import reuse_build_workers
from blockforge.tune.builder import BUILDS_PER_WORKER
from blockforge.tune.jobs import make_builder

HOST = resolve("host")


def _add():
    a = te.placeholder((64,), "float32", name="a")
    return te.create_prim_func([a, te.compute((64,), lambda i: a[i] + 1.0, name="b")])


def _gpu_bound():
    """A kernel bound to threadIdx.x: LLVM's CPU codegen refuses it (an error in the worker)."""
    from tvm.s_tir import Schedule

    sch = Schedule(tvm.IRModule({"main": _add()}))
    (i,) = sch.get_loops(sch.get_sblock("b"))
    sch.bind(i, "threadIdx.x")
    return sch.mod


def _inputs(n: int) -> list:
    return [ms.builder.BuilderInput(tvm.IRModule({"main": _add()}), HOST.tvm_target()) for _ in range(n)]


def _worker_pids(builder) -> set[int]:
    return {w._proc.pid for w in builder.pool._worker_map.values() if w._proc is not None}


def test_successive_builds_share_one_worker(tmp_path, monkeypatch):
    monkeypatch.delenv("BLOCKFORGE_BUILDER", raising=False)
    builder = make_builder(HOST, str(tmp_path))
    assert getattr(builder, "reuses_workers", False), type(builder).__name__
    try:
        pids = []
        for _ in range(3):  # three build calls, as a job's seed and two 1-trial rounds make
            (res,) = builder.build(_inputs(1))
            assert res.error_msg is None, res.error_msg
            assert os.path.isfile(res.artifact_path) and str(res.artifact_path).startswith(str(tmp_path))
            pids.append(_worker_pids(builder))
        assert len(pids[0]) == 1 and pids[0] == pids[1] == pids[2], pids
        assert BUILDS_PER_WORKER >= 32  # at least one of LocalBuilder's 32-candidate batches per worker
    finally:
        builder.close()
    assert builder.pool._shutdown


def test_a_failed_build_is_an_error_result_and_the_next_build_works(tmp_path, monkeypatch):
    monkeypatch.delenv("BLOCKFORGE_BUILDER", raising=False)
    builder = make_builder(HOST, str(tmp_path))
    try:
        bad = ms.builder.BuilderInput(_gpu_bound(), HOST.tvm_target())
        bad_res, good_res = builder.build([bad, *_inputs(1)])
        assert bad_res.artifact_path is None and bad_res.error_msg.startswith("LocalBuilder: An exception occurred")
        assert good_res.error_msg is None and os.path.isfile(good_res.artifact_path)
    finally:
        builder.close()


def test_fresh_is_tvms_local_builder(tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKFORGE_BUILDER", "fresh")
    assert not reuse_build_workers()
    assert type(make_builder(HOST, str(tmp_path))).__name__ == "LocalBuilder"
    monkeypatch.setenv("BLOCKFORGE_BUILDER", "sometimes")
    with pytest.raises(ValueError, match="BLOCKFORGE_BUILDER"):
        reuse_build_workers()


def test_a_runner_stopped_in_its_init_has_its_pool_shut(monkeypatch):
    """Ctrl-C at a job's start lands in LocalRunner's __init__ (its sanity check waits on a fresh
    worker): the half-made runner's pool is shut there, not left to garbage collection (which ran
    its __del__ from the pool's own thread: 'cannot join current thread' after the last line)."""
    import gc

    from tvm.support.popen_pool import PopenPoolExecutor

    from blockforge.tune.jobs import TuneOptions, make_runner

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(ms.runner.LocalRunner._cls, "_sanity_check", interrupted)
    gc.collect()
    before = {id(o) for o in gc.get_objects() if isinstance(o, PopenPoolExecutor)}
    with pytest.raises(KeyboardInterrupt):
        make_runner(TuneOptions(model="m.onnx", target="host"), HOST, 1)
    made = [o for o in gc.get_objects() if isinstance(o, PopenPoolExecutor) and id(o) not in before]
    assert made and all(p._shutdown for p in made)


def test_pool_shutdown_that_races_a_dying_worker_leaves_no_held_lock():
    """TVM's shutdown raises when one of the pool's threads ends a worker at the same moment
    ('NoneType' object has no attribute 'kill'), with the pool's lock held: its __del__ at exit
    then waited forever. shutdown_pool finishes by hand: lock free, pool marked shut."""
    from tvm.support.popen_pool import PopenPoolExecutor

    from blockforge.tune.builder import shutdown_pool

    class Racing:  # a worker whose process the pool's thread has just cleared
        _proc = None

        def kill(self):
            None.kill()

    pool = PopenPoolExecutor(max_workers=1)
    pool._worker_map[0] = Racing()
    shutdown_pool(pool)
    assert not pool._lock.locked() and pool._shutdown
    assert pool._lock.acquire(timeout=1)  # what __del__ or a later shutdown would wait on
    pool._lock.release()


def test_the_runner_reports_a_candidates_least_sample(monkeypatch):
    """MetaSchedule ranks by the mean of what run_direct returns; a run's single samples read up
    to 2x the kernel's time under interference, which only ever slows a sample: one number,
    the least."""
    from types import SimpleNamespace

    from blockforge.tune import measure

    samples = iter([[3e-3, 1e-3, 2e-3], [1.5e-3, 1.2e-3, 4e-3]])
    monkeypatch.setattr(measure, "time_direct", lambda *a, **k: next(samples))
    rt = type("M", (), {"entry_name": "main", "__getitem__": lambda self, k: (lambda *a: None)})()
    cfg = SimpleNamespace(repeat=3, number=3, min_repeat_ms=10)
    dev = SimpleNamespace(sync=lambda: None)
    assert measure.run_direct(rt, dev, cfg, [(), ()]) == [1e-3]
