"""A whole ONNX model built with and without a pipeline ablation, interleaved in one process with
ORT and OpenVINO f32 (outputs checked against ORT first); prints median ms, the ratios, the load.

    nice .venv/bin/python benchmarks/whole_ab.py MODEL.onnx --dims s33=1 --ab row-tiles [--repeat 10]
    (T5-base encoder: --dims s33=1,s50=128,s6=1 --ab fuse-attention)
    TVM_NUM_THREADS=1 ... --cpu-time: one core, thread CPU time, no peers (a loaded machine)
    --abba: four builds (new, without, without, new), the geometric mean of the two pairs: two
    identical builds have read up to 1.067x apart by build order alone
(outputs are held to the row bench and verify use: graph/tolerance.output_tolerance)
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import onnx

import blockforge

blockforge.configure(redirect_native_output=False)


def main(argv=None) -> int:
    import tvm
    from tvm import relax

    from blockforge.bench.contenders import OpenVino, Ort
    from blockforge.bench.harness import measure_interleaved
    from blockforge.compile.session import open_model
    from blockforge.graph.parity import model_precision, tolerance_kind
    from blockforge.graph import ort as ort_runner
    from blockforge.graph.tolerance import OrtSpread, compare, output_tolerance
    from blockforge.targets import resolve

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--dims", default="", help="symbolic dims, name=value comma list")
    ap.add_argument("--ab", required=True, help="pipeline ablation(s), comma list")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                    help="what both builds compute in (bench's --precision); OpenVINO with the same hint")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--without-first", action="store_true",
                    help="build the ablated module first (two identical builds measured 1.067x apart, the first "
                         "built slower: run both orders)")
    ap.add_argument("--abba", action="store_true",
                    help="four builds in one process, new / without / without / new, all interleaved: the ratio "
                         "of each pair and their geometric mean (the build-order effect cancels)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time in thread CPU time (run with TVM_NUM_THREADS=1; no peers): a loaded machine's "
                         "descheduling and worker wake-ups then do not count")
    a = ap.parse_args(argv)
    dims = {k: int(v) for k, v in (kv.split("=") for kv in a.dims.split(",") if kv)}
    model = onnx.load(a.model)
    feeds = _inputs(model, dims)
    target = resolve("host")
    threads = int(target.target_json.get("num-cores", 1))
    # the peers get the model with its dims bound, as bench gives them (OpenVINO compiled
    # SegFormer-b0 with its batch dim symbolic read 56-63 ms in whole_ab, 21-30 in bench)
    from blockforge.graph.model_io import bind_dims

    bm = type("M", (), {"onnx": bind_dims(model, dims, strict=False)})()
    ort = Ort().make_runner(bm, feeds, threads)
    want = ort.outputs()[0]
    peers = not (a.no_peers or a.cpu_time)
    runners = {"ort": ort} if peers else {}
    if peers and OpenVino().available():
        runners["openvino"] = OpenVino().make_runner(bm, feeds, threads,
                                                     precision="bf16" if a.precision == "bf16" else "f32")
    builds = [("new", set()), (f"without {a.ab}", set(a.ab.split(",")))]
    builds = builds[::-1] if a.without_first else builds
    if a.abba:  # both orders in one process: new, without, without, new (each build's order effect cancels)
        builds = builds + [(f"{k} (2)", w) for k, w in builds[::-1]]
    # ORT's run of the file as written (optimizations off), made only if a row needs it
    spread = OrtSpread(lambda: ort_runner.run(model, feeds, optimize=False))
    for label, without in builds:
        # open_model + Session.build: the checked import and the build a user's compile runs (shape
        # constants, symbolic dims bound, the precision's phases, an int8-gemm ablation reaching the import)
        vm = relax.VirtualMachine(open_model(a.model, target, dims, precision=a.precision).build(
            without=frozenset(without)).executable, tvm.cpu())
        t = [tvm.runtime.tensor(x) for x in feeds.values()]
        got = vm["main"](*t)
        got = got[0] if not hasattr(got, "numpy") else got  # a tuple of outputs (a decoder's logits, presents)
        # the row bench and verify hold this output to (a quantized model: the int8 parity row)
        tol = output_tolerance(want.dtype, tolerance_kind(model),
                               a.precision if a.precision != "fp32" else model_precision(model))
        c = compare(label, "output 0", got.numpy(), want, tol)
        if not c.passed and model_precision(model) != "float":  # as bench: within ORT's own spread on the file
            c = spread.judge(c, got.numpy(), want, model.graph.output[0].name)
        if not c.passed:
            raise SystemExit(f"{label}: output 0 differs from ORT beyond {tol}: {c}")
        runners[label] = (lambda f=vm["main"], t=t: f(*t))
    ms = {k: float(np.median(v)) for k, v in measure_interleaved(runners, a.repeat, warmup=1,
                                                                         clock=time.thread_time if a.cpu_time else time.perf_counter).items()}
    best = min((v for k, v in ms.items() if k in ("ort", "openvino")), default=None)
    print({k: round(v, 2) for k, v in ms.items()})
    if a.abba:
        first, second = ms["new"] / ms[f"without {a.ab}"], ms["new (2)"] / ms[f"without {a.ab} (2)"]
        print(f"new / without {a.ab}: {first:.3f} (new built first), {second:.3f} (new built last), "
              f"geometric mean {np.sqrt(first * second):.3f}")
    print(f"new / without {a.ab}: {ms['new'] / ms[f'without {a.ab}']:.3f}"
          + (f"; new / best peer {ms['new'] / best:.3f}; without / best peer {ms[f'without {a.ab}'] / best:.3f}"
             if best else ""), "load", os.getloadavg())
    return 0


def _inputs(model, dims: dict) -> dict:
    """One array per graph input: float inputs random normal, token ids random below 100, an
    attention mask all ones (T5's encoder takes input_ids and attention_mask)."""
    from onnx import helper

    rng = np.random.default_rng(1)
    out = {}
    for inp in model.graph.input:
        shape = [d.dim_value or dims[d.dim_param] for d in inp.type.tensor_type.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(inp.type.tensor_type.elem_type)
        if dtype.kind == "f":
            out[inp.name] = rng.standard_normal(shape).astype(dtype)
        elif "mask" in inp.name:
            out[inp.name] = np.ones(shape, dtype)
        else:
            out[inp.name] = rng.integers(0, 100, shape).astype(dtype)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
