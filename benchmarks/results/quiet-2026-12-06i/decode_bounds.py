"""GPT-2's decode step (the artifact's `decode` entry at seq 1 after P cached positions) and its
prompt (`main` at seq S from an empty cache) from two artifacts, one compiled `--shape batch=1`
and one `--shape batch=1,seq=..B,past=..B`, timed interleaved in one process (medians).

    decode_bounds.py MODEL.onnx OUTDIR REPEAT BOUND PAST...
"""
import sys
from pathlib import Path

import numpy as np

import blockforge
from blockforge.bench.decode import EntryRunner
from blockforge.bench.harness import measure_interleaved, sgemm_ceiling
from blockforge.compile.artifact.runtime import load_artifact
from blockforge.compile.artifact.write import CompileOptions, compile_model
from blockforge.compile.session import open_model
from blockforge.graph.model_io import random_inputs


def feeds(inputs, seq: int, past: int, seed: int = 0) -> dict:
    f = random_inputs(inputs, {"batch": 1, "seq": seq, "past": past, "past_seq": past + seq}, seed=seed)
    f["attention_mask"] = np.ones_like(f["attention_mask"])
    return f


def main():
    model, out, repeat, ub, pasts = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \
        [int(p) for p in sys.argv[5:]]
    blockforge.configure(redirect_native_output=True)
    arts = {}
    for name, shape in (("sym", "batch=1"), ("bounded", f"batch=1,seq=..{ub},past=..{ub}")):
        arts[name] = out / name
        if not (arts[name] / "manifest.json").exists():
            compile_model(CompileOptions(model=str(model), target="host", shape=shape, output=str(arts[name])))
    mods = {k: load_artifact(p) for k, p in arts.items()}
    ins = open_model(model, "host", "batch=1", prepare=False).inputs
    points = [(1, p) for p in pasts] + [(128, 0)]
    for seq, past in points:
        f = feeds(ins, seq, past, seed=past)
        runners = {k: EntryRunner(m, f) for k, m in mods.items()}
        outs = {k: r.outputs() for k, r in runners.items()}
        assert all(np.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(outs["sym"], outs["bounded"]))
        before = sgemm_ceiling()
        med = {k: float(np.median(v)) for k, v in measure_interleaved(runners, repeat, warmup=2).items()}
        print(f"seq {seq} past {past} entry {runners['sym'].entry} SGEMM {before:.0f} / {sgemm_ceiling():.0f}: "
              + ", ".join(f"{k} {v:.3f} ms" for k, v in med.items())
              + f" | bounded/sym {med['bounded'] / med['sym']:.3f}", flush=True)


if __name__ == "__main__":
    main()
