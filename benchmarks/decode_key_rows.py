"""A decode step with the fused attention reading the cached K as it is (pipeline ablation
`attention-key-rows` left in) against the K^T form (left out: the graph's per-step transpose
of the whole cached K), interleaved in one process with ONNX Runtime, at each past length.

    flock /tmp/blockforge-bench.lock .venv/bin/python benchmarks/decode_key_rows.py \\
        --model /tmp/mv/models/gpt2_past_legacy_op17.onnx --past 128,512,1024

Outputs of both builds are checked against ORT first. Prints median ms and the ratios from
the same samples, with the 1-minute load average (on a shared machine only ratios mean anything).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

import blockforge


def point(model: Path, past: int, repeat: int) -> dict[str, float]:
    import onnx

    from blockforge.bench.contenders import BenchModel, Ort, TvmRunner
    from blockforge.bench.decode import cache_layout, shapes
    from blockforge.bench.harness import measure_interleaved
    from blockforge.compile.session import open_model
    from blockforge.graph.model_io import random_inputs

    cache = cache_layout(onnx.load(str(model), load_external_data=False))
    session = open_model(model, "host", shapes(cache, past, 1))
    feeds = random_inputs(session.inputs, seed=past)
    if "attention_mask" in feeds:
        feeds["attention_mask"] = np.ones_like(feeds["attention_mask"])
    threads = int(session.target.target_json.get("num-cores", 1))
    bm = BenchModel(session, session.model, None, session.dims)
    runners = {"ort": Ort().make_runner(bm, feeds, threads)}
    want = runners["ort"].outputs()
    for label, without in (("K rows", set()), ("K^T", {"attention-key-rows"})):
        r = TvmRunner(session.build(without=without).executable, session.target.device, session.inputs,
                      session.outputs, feeds)
        for g, w in zip(r.outputs(), want):
            np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-3)
        runners[label] = r
    samples = measure_interleaved(runners, repeat, warmup=2)
    return {k: float(np.median(v)) for k, v in samples.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--past", default="128,512")
    ap.add_argument("--repeat", type=int, default=20)
    a = ap.parse_args()
    blockforge.configure()  # TVM's pool = physical cores, as the CLI sets it
    for past in (int(p) for p in a.past.split(",")):
        ms = point(a.model, past, a.repeat)
        print(f"P={past}: K rows {ms['K rows'] / ms['K^T']:.3f}x the K^T build, {ms['K rows'] / ms['ort']:.3f}x ORT "
              f"(K^T {ms['K^T'] / ms['ort']:.3f}x ORT); load {os.getloadavg()[0]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
