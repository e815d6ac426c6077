"""Decode-shape matmuls (M = 1..4 rows) against the memory bandwidth, measured in the same run.

    flock /tmp/blockforge-bench.lock .venv/bin/python benchmarks/matvec.py [--m 1] [--rounds 7]

A decode step streams every weight once, so a matvec is bound by the read bandwidth, and only
from DRAM: GPT-2 small's 768 x 768 panels (2.4 MB) sit in this machine's 32 MiB L3 when one
kernel is called in a loop, which measures the cache, not the decode. Here each shape is called
over rotating copies of its packed weights (>= 160 MB in all), as a decode step meets them.
Per shape it reports the kernel's GB/s next to a pure read of the same packed panels (parallel
over panels, vectorised sum, no FMA), and the machine's read bandwidth on one and two threads
(a 256 MiB read) and bench --decode's STREAM triad, all interleaved in rounds.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

import blockforge

blockforge.configure(redirect_native_output=False)

import tvm  # noqa: E402
from tvm import s_tir, te  # noqa: E402

from blockforge.bench.decode import triad_bandwidth  # noqa: E402
from blockforge.compile.passes.prepack import packed_matmul  # noqa: E402
from blockforge.compile.schedule.matmul import CPUMatmul  # noqa: E402
from blockforge.compile.schedule.matvec import CPUMatvec  # noqa: E402
from blockforge.targets import resolve  # noqa: E402

GPT2 = [(768, 768), (768, 2304), (768, 3072), (3072, 768), (768, 50257)]
NR = 64


def read_panels(tt, nb: int, k: int, parallel: bool = True):
    """Sum of (nb, K, 64) panels over K: the read the matvec does, without its FMAs."""
    x = te.placeholder((nb, k, NR), "float32", name="x")
    r = te.reduce_axis((0, k), name="r")
    y = te.compute((nb, NR), lambda p, j: te.sum(x[p, r, j], axis=r), name="y")
    sch = s_tir.Schedule(te.create_prim_func([x, y]))
    blk = sch.get_sblock("y")
    p, j, r = sch.get_loops(blk)
    sch.reorder(p, r, j)
    acc = sch.cache_write(blk, 0, "local")
    sch.reverse_compute_at(acc, p)
    if parallel:
        sch.parallel(p)
    sch.vectorize(j)
    return tvm.compile(sch.mod, target=tt)["main"]


# The schedules compared: CPUMatmul (the 6-row micro-tile, parallel over panels: before this
# rule), CPUMatvec on all cores, CPUMatvec on one thread.
VARIANTS = {"CPUMatmul": CPUMatmul(), "CPUMatvec": CPUMatvec(), "CPUMatvec 1 thread": CPUMatvec(parallel=False)}


def matvec(tt, m: int, k: int, n: int, rule):
    """The packed kernel as the pipeline builds it: packed_matmul (+ crop) + bias, scheduled by `rule`."""
    nb = -(-n // NR)
    a = te.placeholder((m, k), "float32", name="a")
    wp = te.placeholder((nb, k, NR), "float32", name="wp")
    b = te.placeholder((n,), "float32", name="b")
    y = packed_matmul(a, wp, n if nb * NR != n else None)
    z = te.compute((m, n), lambda i, j: y[i, j] + b[j], name="bias")
    f = te.create_prim_func([a, wp, b, z]).with_attr("global_symbol", "main")
    with tt:
        sch = rule.apply(f, tt, False)
    if sch is None:
        raise RuntimeError(f"{type(rule).__name__} does not schedule {m}x{k}x{n}")
    return tvm.compile(sch.mod, target=tt)["main"]


def decode_step(model: str, past: int, repeat: int) -> int:
    """One decode step of `model`: blockforge as it builds by default (CPUMatvec off) and with
    the matvec rule (BLOCKFORGE_MATVEC=1), ORT, OpenVINO, every output checked against ORT,
    timed interleaved (bench/harness.py)."""
    from blockforge.bench.contenders import REGISTRY, BenchModel, TvmRunner
    from blockforge.bench.decode import cache_layout, shapes, weight_bytes
    from blockforge.bench.harness import measure_interleaved
    from blockforge.compile.session import open_model
    from blockforge.graph.model_io import bind_dims, load_model, random_inputs

    onnx_model = load_model(model)
    cache = cache_layout(onnx_model)
    wbytes = weight_bytes(onnx_model)
    del onnx_model
    s = open_model(model, "host", shapes(cache, past, 1), static=True)
    inputs = random_inputs(s.inputs, {}, seed=0)
    threads = int(s.target.target_json.get("num-cores", 1))
    bm = BenchModel(s, bind_dims(s.model, s.dims, strict=False), None, dict(s.dims))
    runners = {"blockforge": TvmRunner(s.build().executable, s.target.device, s.inputs, s.outputs, inputs)}
    from blockforge import settings

    os.environ[settings.MATVEC] = "1"  # the opt-in rule (core/settings.py), this build only
    try:
        runners["with matvec"] = TvmRunner(s.build().executable, s.target.device, s.inputs, s.outputs, inputs)
    finally:
        del os.environ[settings.MATVEC]
    for peer in ("ort", "openvino"):
        if REGISTRY[peer].available():
            runners[peer] = REGISTRY[peer].make_runner(bm, inputs, threads)
    ref = runners["ort"].outputs()
    for name, r in runners.items():
        err = max(float(np.max(np.abs(g - w))) for g, w in zip(r.outputs(), ref))
        print(f"{name}: max |out - ORT| {err:.2e}")
        assert err < 1e-3, name
    load0 = os.getloadavg()[0]
    bw = triad_bandwidth(s.target)
    samples = measure_interleaved(runners, repeat, 2)
    bw = max(bw, triad_bandwidth(s.target))
    med = {k: float(np.median(v)) for k, v in samples.items()}
    best = min(med[p] for p in med if p in ("ort", "openvino"))
    print(f"\n{Path(model).name}, P = {past}, {threads} threads, load {load0:.2f} -> {os.getloadavg()[0]:.2f}; "
          f"{wbytes / 1e6:.1f} MB of weights per token; triad {bw:.1f} GB/s; {repeat} interleaved samples")
    print("\n| contender | median ms | vs best peer | % of roofline (weights / triad) |\n|---|---|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v:.2f} | {v / best:.2f}x | {100 * wbytes / (bw * 1e9) * 1e3 / v:.0f}% |")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=1, help="rows (the decode step's tokens)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--mb", type=int, default=160, help="bytes of weight copies rotated per shape (MB)")
    ap.add_argument("--smoke", action="store_true", help="toy sizes, one round (tests)")
    ap.add_argument("--model", type=str, default=None,
                    help="a decoder with past_key_values inputs: one decode step (seq 1 after --past cached "
                         "positions), built as by default and with CPUMatvec (BLOCKFORGE_MATVEC=1), against ORT and "
                         "OpenVINO, interleaved, instead of the kernels")
    ap.add_argument("--past", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=20)
    a = ap.parse_args(argv)
    if a.model:
        return decode_step(a.model, a.past, a.repeat)
    shapes, big_mib = (GPT2, 256) if not a.smoke else ([(64, 64), (96, 4 * 64 + 17)], 4)
    rounds, mb = (a.rounds, a.mb) if not a.smoke else (1, 1)
    t = resolve("host")
    tt, dev = t.tvm_target(), tvm.cpu(0)
    rng = np.random.default_rng(0)
    cases = {}
    big_nb = 16
    big_k = (big_mib << 20) // 4 // NR // big_nb
    bigx = tvm.runtime.tensor(rng.standard_normal((big_nb, big_k, NR), dtype=np.float32), dev)
    bigy = tvm.runtime.tensor(np.empty((big_nb, NR), np.float32), dev)
    for label, par in (("read, 1 thread", False), ("read, all threads", True)):
        f = read_panels(tt, big_nb, big_k, par)
        cases[label] = (lambda f=f: f(bigx, bigy), bigx.numpy().nbytes)
    for k, n in shapes:
        nb = -(-n // NR)
        nbytes = nb * k * NR * 4
        copies = max(1, -(-mb * 1_000_000 // nbytes))
        base = rng.standard_normal((nb, k, NR), dtype=np.float32)
        ws = [tvm.runtime.tensor(base, dev) for _ in range(copies)]
        x = rng.standard_normal((a.m, k), dtype=np.float32)
        bias = rng.standard_normal(n, dtype=np.float32)
        xa, ba = tvm.runtime.tensor(x, dev), tvm.runtime.tensor(bias, dev)
        out = tvm.runtime.tensor(np.empty((a.m, n), np.float32), dev)
        ry = tvm.runtime.tensor(np.empty((nb, NR), np.float32), dev)
        rp = read_panels(tt, nb, k)
        cases[f"{k}x{n} read"] = (lambda rp=rp, ws=ws, ry=ry: [rp(w, ry) for w in ws], nbytes * copies)
        want = x.astype(np.float64) @ base.transpose(1, 0, 2).reshape(k, nb * NR)[:, :n] + bias
        for label, rule in VARIANTS.items():
            if label.startswith("CPUMatvec") and a.m > 4:
                continue
            f = matvec(tt, a.m, k, n, rule)
            f(xa, ws[0], ba, out)
            np.testing.assert_allclose(out.numpy(), want, rtol=1e-3, atol=1e-3)
            cases[f"{k}x{n} {label}"] = (lambda f=f, ws=ws, xa=xa, ba=ba, out=out: [f(xa, w, ba, out) for w in ws],
                                         nbytes * copies)
    rates: dict[str, list[float]] = {k: [] for k in cases}
    load0 = os.getloadavg()[0]
    triad = [triad_bandwidth(t, big_mib // 4 or 1)]
    for _ in range(rounds):
        for k, (fn, nbytes) in cases.items():
            fn()
            t0 = time.perf_counter()
            fn()
            rates[k].append(nbytes / (time.perf_counter() - t0) / 1e9)
    triad.append(triad_bandwidth(t, big_mib // 4 or 1))
    ref = float(np.median(rates["read, all threads"]))
    print(f"M = {a.m}, {t.name}, load average {load0:.2f} -> {os.getloadavg()[0]:.2f}; "
          f"triad {max(triad):.1f} GB/s; {rounds} rounds, median (best)")
    print("\n| case | GB/s | best | % of the all-threads read |\n|---|---|---|---|")
    for k, v in rates.items():
        print(f"| {k} | {np.median(v):.1f} | {max(v):.1f} | {100 * np.median(v) / ref:.0f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
