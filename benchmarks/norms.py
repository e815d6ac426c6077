"""A/B of the rms-norm rewrite (compile/passes/norms.py) inside whole models, interleaved.

    nice .venv/bin/python benchmarks/norms.py [--repeat 10] MODEL.onnx:dim=v,dim=v [...]
    e.g. /tmp/peertable/cache/llama_gqa-*/llama_gqa.onnx:s33=1,s50=128,s6=1
    nice .venv/bin/python benchmarks/norms.py --micro   # Llama's RMSNorm (1, 128, 768) and SwiGLU
                                                        # (1, 128, 2 x 2048) alone, and the QKV
                                                        # split + heads (+ RoPE) of Llama / GPT-2
    nice .venv/bin/python benchmarks/norms.py --without matmul-reshape MODEL.onnx:dims

Each model is built twice (with and without the rewrite), both outputs compared with each
other, then timed interleaved (bench.harness.measure_interleaved); prints the medians, their
ratio and the load average before and after.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

import blockforge

blockforge.configure(redirect_native_output=False)


def main() -> None:
    import tvm
    from tvm import relax

    from blockforge.bench.harness import measure_interleaved
    from blockforge.compile import open_model
    from blockforge.compile.artifact.runtime import run_vm
    from blockforge.compile.pipeline import build
    from blockforge.graph.model_io import random_inputs

    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*")
    ap.add_argument("--micro", action="store_true", help="one exported-form RMSNorm (1, 128, 768) alone")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--without", default="rms-norm", help="the ablation to A/B")
    args = ap.parse_args()
    if args.micro:
        _micro(args.repeat)
        _micro_swiglu(args.repeat)
        for rope in (True, False):
            _micro_qkv(args.repeat, rope)
    for spec in args.models:
        path, _, dims = spec.partition(":")
        session = open_model(path, "host", dims or None)
        inputs = random_inputs(session.inputs, session.dims)
        dev = tvm.cpu(0)
        runners, outs = {}, {}
        for label, without in (("with", frozenset()), ("without", frozenset({args.without}))):
            vm = relax.VirtualMachine(build(session.relax(), session.target, without=without).executable, dev)
            outs[label] = run_vm(vm, dev, session.inputs, session.outputs, inputs)
            tensors = [tvm.runtime.tensor(np.ascontiguousarray(inputs[s.name]), dev) for s in session.inputs]
            runners[label] = (lambda f=vm["main"], a=tensors: f(*a))
        for k in outs["with"]:
            np.testing.assert_allclose(outs["with"][k], outs["without"][k], rtol=1e-3, atol=1e-3)
        load0 = os.getloadavg()[0]
        samples = measure_interleaved(runners, args.repeat, warmup=1)
        load1 = os.getloadavg()[0]
        med = {k: float(np.median(v)) for k, v in samples.items()}
        print(f"{os.path.basename(path)}: with {args.without} {med['with']:.1f} ms, without {med['without']:.1f} ms, "
              f"ratio {med['with'] / med['without']:.3f} (load {load0:.2f} -> {load1:.2f}, {args.repeat} samples each)")


def _micro(repeat: int) -> None:
    """Llama's exported RMSNorm spelling alone: x * (1 / sqrt(mean(x ** 2) + eps)) * w."""
    from tvm import relax

    rng = np.random.default_rng(0)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 128, 768), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            sq = bb.emit(relax.op.power(x, relax.const(2.0, "float32")))
            m = bb.emit(relax.op.mean(sq, axis=[-1], keepdims=True))
            inv = bb.emit(relax.op.divide(relax.const(1.0, "float32"),
                                          relax.op.sqrt(relax.op.add(m, relax.const(1e-6, "float32")))))
            y = bb.emit(relax.op.multiply(relax.const(rng.standard_normal(768).astype("float32")),
                                          relax.op.multiply(x, inv)))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    _ab(bb.get(), rng.standard_normal((1, 128, 768)).astype("float32"), "rms-norm", "RMSNorm (1, 128, 768)", repeat)


def _micro_swiglu(repeat: int) -> None:
    """Llama's SwiGLU after its combined gate/up projection: split, silu(gate) * up."""
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 128, 4096), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            t = bb.emit(relax.op.split(x, [2048], axis=2))
            g, u = bb.emit(relax.TupleGetItem(t, 0)), bb.emit(relax.TupleGetItem(t, 1))
            out = bb.emit_output(bb.emit(relax.op.multiply(relax.op.multiply(g, relax.op.sigmoid(g)), u)))
        bb.emit_func_output(out)
    x = np.random.default_rng(0).standard_normal((1, 128, 4096)).astype("float32") * 4
    _ab(bb.get(), x, "fast-sigmoid", "SwiGLU (1, 128, 2 x 2048)", repeat)


def _micro_qkv(repeat: int, rope: bool) -> None:
    """After the combined QKV projection (seq 128, d 64): Llama-style GQA 12/4 (split, heads,
    RoPE of q and k, K^T) or GPT-2 12/12 (split, q and v viewed as (B, S, H, d), K^T)."""
    from tvm import relax

    heads = (12, 4, 4) if rope else (12, 12, 12)
    n = sum(heads) * 64
    ang = np.arange(128)[:, None] * 10000.0 ** (-np.arange(0, 64, 2) / 64)
    cos, sin = (relax.const(f(np.concatenate([ang, ang], -1)).astype("float32")[None, None]) for f in (np.cos, np.sin))
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 128, n), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            parts = bb.emit(relax.op.split(x, [heads[0] * 64, (heads[0] + heads[1]) * 64], axis=2))
            outs = []
            for i, h in enumerate(heads):
                t = bb.emit(relax.op.reshape(relax.TupleGetItem(parts, i), [1, 128, h, 64]))
                if rope or i == 1:
                    t = bb.emit(relax.op.permute_dims(t, [0, 2, 1, 3]))
                if rope and i < 2:
                    half = [bb.emit(relax.op.strided_slice(t, [3], [a], [a + 32])) for a in (0, 32)]
                    rot = bb.emit(relax.op.concat([relax.op.negative(half[1]), half[0]], axis=-1))
                    t = bb.emit(relax.op.add(relax.op.multiply(t, cos), relax.op.multiply(rot, sin)))
                outs.append(bb.emit(relax.op.permute_dims(t, [0, 1, 3, 2])) if i == 1 else t)
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    x = np.random.default_rng(0).standard_normal((1, 128, n)).astype("float32")
    what = "QKV heads + RoPE, Llama GQA 12/4 (1, 128, 20 x 64)" if rope else "QKV heads, GPT-2 (1, 128, 36 x 64)"
    _ab(bb.get(), x, "qkv-heads", what, repeat)


def _ab(mod, x: np.ndarray, ablation: str, what: str, repeat: int) -> None:
    """mod built with and without `ablation`, same outputs, timed interleaved."""
    import tvm
    from tvm import relax

    from blockforge.bench.harness import measure_interleaved
    from blockforge.compile.pipeline import build
    from blockforge.targets import resolve

    dev = tvm.cpu(0)
    a = tvm.runtime.tensor(x, dev)
    runners, outs = {}, {}
    for label, without in (("with", frozenset()), ("without", frozenset({ablation}))):
        f = relax.VirtualMachine(build(mod, resolve("host"), without=without).executable, dev)["main"]
        r = f(a)
        outs[label] = r.numpy() if hasattr(r, "numpy") else np.concatenate([t.numpy().ravel() for t in r])
        runners[label] = (lambda f=f: f(a))
    np.testing.assert_allclose(outs["with"], outs["without"], rtol=1e-5, atol=1e-5)
    load0 = os.getloadavg()[0]
    samples = measure_interleaved(runners, repeat * 20, warmup=3)
    load1 = os.getloadavg()[0]
    med = {k: float(np.median(v)) for k, v in samples.items()}
    print(f"{what}: with {ablation} {med['with'] * 1e3:.1f} us, without {med['without'] * 1e3:.1f} us, "
          f"ratio {med['with'] / med['without']:.3f} (load {load0:.2f} -> {load1:.2f}, {repeat * 20} samples each)")


if __name__ == "__main__":
    main()
