"""The preallocated in-place KV cache (compile --kv-capacity, compile/decode/inplace.py) against
the copying loop and the bare step, interleaved in rounds in one process, at each past length.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE TVM_NUM_THREADS=2 .venv/bin/python \\
        benchmarks/decode_inplace.py --artifact ART --model M.onnx --past 128,512

ART: M compiled with `--shape batch=1 --kv-capacity C` (C >= P + steps + 1). Per round, at P:
  copy loop     `decode()` (what `run --decode --copy-cache` runs) from a P-long cache, `steps`
                steps through `decode`: each step's ms (the call and the loop's bookkeeping)
  inplace loop  the same through `decode_inplace` (`run --decode`): each step's ms
  bare step     the `decode` entry alone on fixed inputs at P + steps / 2
  bare inplace  `decode_inplace` alone at P + steps / 2 (its rows re-written each call)
Medians over all rounds; the ratios come from the same samples. The loops' tokens are checked
equal first. Prints the load average, a TVM triad's GB/s and numpy's SGEMM GFLOP/s before and
after (on a shared machine only the same-run ratios mean anything).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

import blockforge
from blockforge.bench.decode import EntryRunner, InplaceRunner


def _start(model: Path, past: int, seed: int) -> dict:
    import onnx

    from blockforge.bench.decode import cache_layout, shapes
    from blockforge.compile.session import open_model
    from blockforge.graph.model_io import random_inputs

    layout = cache_layout(onnx.load(str(model), load_external_data=False))
    feeds = random_inputs(open_model(model, "host", shapes(layout, past, 1), prepare=False).inputs, seed=seed)
    feeds["attention_mask"] = np.ones_like(feeds["attention_mask"])
    return feeds


def point(model: Path, mod, past: int, rounds: int, steps: int) -> dict[str, list[float]]:
    from blockforge.compile.decode import DecodeOptions, decode

    start = _start(model, past, seed=1)
    mid = _start(model, past + steps // 2, seed=2)
    bare = {"bare step": EntryRunner(mod, mid, "decode"), "bare inplace": InplaceRunner(mod, mid, past + steps // 2)}
    a = decode(mod, start, DecodeOptions(steps=steps + 1, inplace=False))
    b = decode(mod, start, DecodeOptions(steps=steps + 1, inplace=True))
    assert a.tokens == b.tokens, (a.tokens, b.tokens)
    assert {s.entry for s in b.steps[1:]} == {"decode_inplace"} and {s.entry for s in a.steps[1:]} == {"decode"}
    out: dict[str, list[float]] = {"copy loop": [], "inplace loop": [], "bare step": [], "bare inplace": []}
    for r in range(rounds):
        order = [("copy loop", False), ("inplace loop", True)]
        for name, inplace in order if r % 2 == 0 else order[::-1]:
            res = decode(mod, start, DecodeOptions(steps=steps + 1, inplace=inplace))
            out[name] += [s.ms for s in res.steps[2:]]  # the first step after the prompt: the buffers' warm-up
        names = list(bare) if r % 2 == 0 else list(bare)[::-1]
        for name in names:
            for _ in range(2):
                bare[name]()
            for _ in range(steps):
                t0 = time.perf_counter()
                bare[name]()
                out[name].append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> int:
    from blockforge.bench.decode import triad_bandwidth
    from blockforge.bench.harness import sgemm_ceiling
    from blockforge.compile.artifact.runtime import load_artifact
    from blockforge.targets import resolve

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", type=Path, required=True)
    ap.add_argument("--model", type=Path, required=True, help="the ONNX file the artifact was compiled from")
    ap.add_argument("--past", default="128,512")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    blockforge.configure(redirect_native_output=True)
    mod = load_artifact(a.artifact)
    if "inplace" not in mod.manifest:
        raise SystemExit(f"{a.artifact} has no in-place entry: compile it with --kv-capacity")
    target = resolve("host")

    def machine() -> str:
        return (f"load {os.getloadavg()[0]:.1f}, triad {triad_bandwidth(target):.0f} GB/s, "
                f"SGEMM {sgemm_ceiling():.0f} GFLOP/s")

    print(f"{a.artifact} (capacity {mod.manifest['inplace']['capacity']}, TVM threads "
          f"{os.environ.get('TVM_NUM_THREADS')}): {machine()}", flush=True)
    for past in (int(p) for p in a.past.split(",")):
        load = os.getloadavg()[0]
        s = point(a.model, mod, past, a.rounds, a.steps)
        ms = {k: float(np.median(v)) for k, v in s.items()}
        print(f"P={past} (load {load:.1f} -> {os.getloadavg()[0]:.1f}): "
              + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()), flush=True)
        print(f"  inplace loop / copy loop {ms['inplace loop'] / ms['copy loop']:.3f}x; "
              f"copy loop / bare step {ms['copy loop'] / ms['bare step']:.3f}x; "
              f"inplace loop / bare step {ms['inplace loop'] / ms['bare step']:.3f}x; "
              f"inplace loop / bare inplace {ms['inplace loop'] / ms['bare inplace']:.3f}x; "
              f"bare inplace / bare step {ms['bare inplace'] / ms['bare step']:.3f}x", flush=True)
    print(f"after: {machine()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
