"""The artifact a decode loop runs (`run --decode`, the edge app: one build, past and seq
symbolic) against a build specialised per past length and ONNX Runtime, interleaved in one
process, at each past length; then the loop against its bare step, and the prompt.

    flock /tmp/blockforge-bench.lock .venv/bin/python benchmarks/decode_entries.py \\
        --model /tmp/mv/models/gpt2_past_legacy_op17.onnx --past 128,512

Contenders per decode point (seq 1 after P cached positions):
  loop main   the loop artifact's `main` at seq 1: what every step ran before the step entry
              (an older single-entry artifact; the same function, built in the same module)
  loop step   the loop artifact's `decode` entry (compile/decode/entries.py): what steps run now
  static P    a build with past = P and seq = 1 bound (`bench --decode`'s blockforge row)
  ort         ONNX Runtime on the same file
Every contender's outputs are checked against ORT first. Then `decode()` (the loop `run
--decode` runs) from a P-long cache, rounds of 20 steps alternating with 20 bare calls of the
step entry at P + 10: the loop's per-step time over the bare call's. Prefill: `main` at seq =
--prompt from an empty cache vs a build bound at that seq and past 0, and ORT. Prints median
ms and ratios from the same samples, with the load average (on a shared machine only the
ratios mean anything).
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from pathlib import Path

import numpy as np

import blockforge
from blockforge.bench.decode import EntryRunner


def _feeds(session, seed: int) -> dict:
    from blockforge.graph.model_io import random_inputs

    feeds = random_inputs(session.inputs, seed=seed)
    if "attention_mask" in feeds:
        feeds["attention_mask"] = np.ones_like(feeds["attention_mask"])
    return feeds


def _static(model: Path, shape: dict, feeds: dict):
    from blockforge.bench.contenders import TvmRunner
    from blockforge.compile.session import open_model

    s = open_model(model, "host", shape)
    return TvmRunner(s.build().executable, s.target.device, s.inputs, s.outputs, feeds)


def _ort(model: Path, session, feeds: dict, threads: int):
    from blockforge.bench.contenders import BenchModel, Ort

    return Ort().make_runner(BenchModel(session, session.model, None, session.dims), feeds, threads)


def _check(runners: dict, want: list) -> None:
    for name, r in runners.items():
        for g, w in zip(r.outputs(), want):
            np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-3, err_msg=name)


def decode_point(model: Path, mod, past: int, repeat: int, threads: int) -> dict[str, float]:
    import onnx

    from blockforge.bench.decode import cache_layout, shapes
    from blockforge.bench.harness import measure_interleaved
    from blockforge.compile.session import open_model

    shape = shapes(cache_layout(onnx.load(str(model), load_external_data=False)), past, 1)
    session = open_model(model, "host", shape, prepare=False)
    feeds = _feeds(session, seed=past)
    runners = {"ort": _ort(model, session, feeds, threads)}
    want = runners["ort"].outputs()
    runners["loop main"] = EntryRunner(mod, feeds, "main")
    runners["loop step"] = EntryRunner(mod, feeds, "decode")
    runners["static P"] = _static(model, shape, feeds)
    _check(runners, want)
    samples = measure_interleaved(runners, repeat, warmup=2)
    return {k: float(np.median(v)) for k, v in samples.items()}


def loop_vs_bare(model: Path, mod, past: int, rounds: int = 3, steps: int = 20) -> tuple[float, float]:
    """(median loop step ms, median bare step-entry call ms at past + steps / 2)."""
    import onnx

    from blockforge.bench.decode import cache_layout, shapes
    from blockforge.compile.decode import DecodeOptions, decode
    from blockforge.compile.session import open_model

    layout = cache_layout(onnx.load(str(model), load_external_data=False))
    start = _feeds(open_model(model, "host", shapes(layout, past, 1), prepare=False), seed=1)
    bare = EntryRunner(mod, _feeds(open_model(model, "host", shapes(layout, past + steps // 2, 1),
                                                   prepare=False), seed=2), "decode")
    loop_ms, bare_ms = [], []
    for _ in range(rounds):
        res = decode(mod, start, DecodeOptions(steps=steps + 1))
        assert all(s.entry == "decode" for s in res.steps)
        loop_ms += [s.ms for s in res.steps[1:]]
        time.sleep(0.05)
        for _ in range(2):
            bare()
        for _ in range(steps):
            t0 = time.perf_counter()
            bare()
            bare_ms.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(loop_ms)), float(np.median(bare_ms))


def cache_copy(model: Path, mod, past: int, runs: int = 30) -> dict:
    """The step entry's cache copies at `past`: kernels per step, MB they move (read past and the
    new row, write present), their ms per step and the whole instrumented step's, medians over
    `runs` calls. Time by thread CPU time when TVM runs one thread (the calls run on this one)."""
    import onnx

    from blockforge.bench.decode import cache_layout, shapes
    from blockforge.compile.session import open_model

    clock = time.thread_time if os.environ.get("TVM_NUM_THREADS") == "1" else time.perf_counter
    layout = cache_layout(onnx.load(str(model), load_external_data=False))
    feeds = _feeds(open_model(model, "host", shapes(layout, past, 1), prepare=False), seed=3)
    run = EntryRunner(mod, feeds, "decode")
    started, copy, per_run = {}, [], []

    def instrument(func, name, before, ret, *args):
        if "concatenate" in name:
            if before:
                started[name] = clock()
            else:
                copy[-1][0] += 1
                copy[-1][1] += clock() - started.pop(name)
        return 0

    for _ in range(3):
        run()
    mod.vm.set_instrument(instrument)
    try:
        for _ in range(runs):
            copy.append([0, 0.0])
            t0 = clock()
            run()
            per_run.append(clock() - t0)
    finally:
        mod.vm.set_instrument(None)
    pasts = [a for s, a in zip(mod.inputs, run.args) if s.name.startswith("past")]
    # each copy reads P + 1 rows (the past, the new row) and writes P + 1
    moved = sum(2 * math.prod(a.shape) // past * (past + 1) * np.dtype(str(a.dtype)).itemsize for a in pasts)
    return {"kernels": copy[0][0], "bytes": moved, "copy_ms": float(np.median([c[1] for c in copy])) * 1e3,
            "step_ms": float(np.median(per_run)) * 1e3, "clock": clock.__name__}


def prefill_point(model: Path, mod, seq: int, repeat: int, threads: int) -> dict[str, float]:
    import onnx

    from blockforge.bench.decode import cache_layout, shapes
    from blockforge.bench.harness import measure_interleaved
    from blockforge.compile.session import open_model

    shape = shapes(cache_layout(onnx.load(str(model), load_external_data=False)), 0, seq)
    session = open_model(model, "host", shape, prepare=False)
    feeds = _feeds(session, seed=seq)
    runners = {"ort": _ort(model, session, feeds, threads)}
    want = runners["ort"].outputs()
    runners["loop main"] = EntryRunner(mod, feeds, "main")
    runners["static"] = _static(model, shape, feeds)
    _check(runners, want)
    samples = measure_interleaved(runners, repeat, warmup=1)
    return {k: float(np.median(v)) for k, v in samples.items()}


def main() -> int:
    import onnx

    from blockforge.compile import CompileOptions, compile_model
    from blockforge.compile.artifact.runtime import load_artifact

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--past", default="128,512")
    ap.add_argument("--prompt", type=int, default=128, help="prefill length (0: none)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--cache-copy", action="store_true", help="only the step entry's per-step cache copy at each past")
    a = ap.parse_args()
    blockforge.configure(redirect_native_output=True)  # TVM's pool = physical cores, as the CLI sets it
    m = onnx.load(str(a.model), load_external_data=False)
    batch = {i.type.tensor_type.shape.dim[0].dim_param: 1 for i in m.graph.input
             if i.name in ("input_ids", "attention_mask")}
    threads = blockforge.settings.physical_cores()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        res = compile_model(CompileOptions(model=a.model, shape=batch, output=Path(tmp) / "loop", use_tuning=False))
        print(f"loop artifact (past, seq symbolic; step {res.manifest.get('step')}): built in {time.time() - t0:.0f} s",
              flush=True)
        mod = load_artifact(res.artifact)
        for past in (int(p) for p in a.past.split(",")):
            load = os.getloadavg()[0]
            if a.cache_copy:
                c = cache_copy(a.model, mod, past)
                print(f"P={past} (load {load:.1f}, TVM threads {os.environ.get('TVM_NUM_THREADS')}, {c['clock']}): "
                      f"{c['kernels']} cache copies per step move {c['bytes'] / 1e6:.1f} MB ({c['bytes']} B) in "
                      f"{c['copy_ms']:.2f} ms of a "
                      f"{c['step_ms']:.2f} ms instrumented step ({100 * c['copy_ms'] / c['step_ms']:.0f}%)", flush=True)
                continue
            ms = decode_point(a.model, mod, past, a.repeat, threads)
            print(f"P={past} (load {load:.1f}, {os.getloadavg()[0]:.1f} after): "
                  + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()), flush=True)
            print(f"  loop step / loop main {ms['loop step'] / ms['loop main']:.3f}x; loop step / static P "
                  f"{ms['loop step'] / ms['static P']:.3f}x; loop step / ORT {ms['loop step'] / ms['ort']:.3f}x; "
                  f"loop main / ORT {ms['loop main'] / ms['ort']:.3f}x; "
                  f"static P / ORT {ms['static P'] / ms['ort']:.3f}x",
                  flush=True)
            load = os.getloadavg()[0]
            loop, bare = loop_vs_bare(a.model, mod, past)
            print(f"  run --decode loop from P={past}: step {loop:.2f} ms vs bare step entry {bare:.2f} ms = "
                  f"{loop / bare:.3f}x (load {load:.1f})", flush=True)
        if a.prompt and not a.cache_copy:
            load = os.getloadavg()[0]
            ms = prefill_point(a.model, mod, a.prompt, max(5, a.repeat // 4), threads)
            print(f"prefill seq={a.prompt} (load {load:.1f}): " + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items())
                  + f"; loop main / static {ms['loop main'] / ms['static']:.3f}x, "
                  f"/ ORT {ms['loop main'] / ms['ort']:.3f}x",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
