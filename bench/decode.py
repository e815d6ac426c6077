"""`bench --decode`: a decoder exported with its KV cache (inputs past_key_values.{i}.key /
.value, as tests/fixtures/models/*_past_* and Hugging Face's exports have them), timed as it
decodes: one token (seq 1) after P cached positions, for each P, and the prompt (prefill: seq =
the prompt length, an empty cache), every contender interleaved per point as `bench` does.

A decode step is bound by memory bandwidth, not FLOPs: it reads every weight matrix once and
the whole cache. The roofline is the bytes it must read over a bandwidth measured in the same
run (a STREAM triad, a[i] = b[i] + s * c[i], compiled with TVM for the target, on all its
cores), as the SGEMM ceiling is for prefill. Bytes read per token: the weights (initializers,
except tables only gathered from: an embedding reads one row per token) plus every past input.

The bandwidth is timed inside each point's interleaved rounds (BandwidthProbe: the triad and a
pure read of the same bytes, beside the contenders), not once before and after the run: this
VM's memory rate moves between minutes and processes while its SGEMM ceiling holds (2026-12-04/06,
Zen 4, quiet: the triad read 22-45 GB/s across runs; a GPT-2 step 32 GB/s under a 45 GB/s triad
taken before it, 44.6 GB/s under a 32.6 one), so a roofline taken apart from the steps it divides
said more about the minute than the kernels. The triad is the roofline (`% of roofline`); a decode
step only reads, so `% of read` sets it against the read beside it.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx

from blockforge.errors import ArgumentError, BlockforgeError
from blockforge.graph.model_io import TensorSig, load_model, signature
from blockforge.targets import resolve

from .contenders import CONTENDERS, Contender, Runner
from .harness import BenchOptions, bench, host_facts
from .report import ContenderResult

SCHEMA = "blockforge.bench-decode/2"  # 2: each point its own triad and read (triad_gbs, read_gbs)
PASTS = (16, 128, 512, 1024)


@dataclass
class DecodeOptions:
    model: Path
    target: str = "host"
    against: tuple[str, ...] = CONTENDERS
    repeat: int = 20
    warmup: int = 2
    pasts: tuple[int, ...] = PASTS
    prompt: int = 128  # prefill length (0: no prefill row)
    tuning_db: Path | None = None
    stream_mib: int = 64  # each of the triad's three arrays: well past any cache
    loop: bool = True  # the row of the artifact `run --decode` runs (LoopArtifact), beside the bound builds
    # that artifact compiled with --kv-capacity max(pasts) + 1 and a row for its `decode_inplace`
    # at each decode point (InplaceStep): the step `run --decode` runs after the prompt
    inplace: bool = True


@dataclass
class DecodePoint:
    phase: str  # "decode" (seq 1 after `past` cached positions) or "prefill" (seq = prompt, empty cache)
    past: int
    seq: int
    bytes_read: int  # weights + the past inputs
    results: list[ContenderResult]
    best_peer: str | None
    triad_gbs: float  # the bandwidth probes' medians in this point's rounds
    read_gbs: float

    @property
    def roofline_ms(self) -> float:  # bytes_read over the triad measured beside the contenders
        return self.bytes_read / (self.triad_gbs * 1e9) * 1e3

    def pct_of_roofline(self, r: ContenderResult) -> float:
        return 100 * self.roofline_ms / r.median_ms

    def pct_of_read(self, r: ContenderResult) -> float:
        return 100 * self.bytes_read / (self.read_gbs * 1e9) * 1e3 / r.median_ms


@dataclass
class DecodeReport:
    model: str
    target: str
    threads: int
    weight_bytes: int
    bandwidth_gbs: float  # the triad's best before and after the points (context: the roofline is each point's own)
    points: list[DecodePoint]
    notes: list[str] = field(default_factory=list)
    host: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["schema"] = SCHEMA
        for p, dp in zip(self.points, d["points"]):
            dp["roofline_ms"] = p.roofline_ms
            for r, dr in zip(p.results, dp["results"]):
                dr["pct_of_roofline"] = p.pct_of_roofline(r) if p.phase == "decode" else None
                dr["pct_of_read"] = p.pct_of_read(r) if p.phase == "decode" else None
        return d

    def markdown(self) -> str:
        cpu = self.host.get("cpu_model")
        load = self.host.get("load_avg_1m")
        lines = [f"{Path(self.model).name} on {self.target}{f' ({cpu})' if cpu else ''}, {self.threads} threads"
                 f"{f', load average {load:.2f}' if load is not None else ''}; weights read per token "
                 f"{self.weight_bytes / 1e6:.1f} MB; memory bandwidth (triad) {self.bandwidth_gbs:.1f} GB/s before "
                 "and after; each point's roofline is the triad timed in its own rounds", "",
                 "| phase | past | seq | MB read | triad / read GB/s | contender | median ms | vs best peer | "
                 "% of roofline | % of read |",
                 "|---|---|---|---|---|---|---|---|---|---|"]
        for p in self.points:
            for r in p.results:
                ratio = f"{r.ratio_to_best_peer:.2f}x" if r.ratio_to_best_peer is not None else "-"
                if r.name == p.best_peer:
                    ratio += " (best peer)"
                roof, read = (f"{p.pct_of_roofline(r):.0f}%", f"{p.pct_of_read(r):.0f}%") if p.phase == "decode" \
                    else ("-", "-")
                lines.append(f"| {p.phase} | {p.past} | {p.seq} | {p.bytes_read / 1e6:.1f} | "
                             f"{p.triad_gbs:.1f} / {p.read_gbs:.1f} | {r.name} | {r.median_ms:.3f} | {ratio} | {roof} | "
                             f"{read} |")
        return "\n".join(lines)


@dataclass
class _Cache:
    """Where the model keeps its cache: the past inputs (rank 4, axis 2 the past length)."""
    past: list[TensorSig]
    others: list[TensorSig]


def cache_layout(model: onnx.ModelProto) -> _Cache:
    ins, _ = signature(model)
    past = [s for s in ins if "past" in s.name and len(s.dims) == 4]
    if not past:
        raise ArgumentError(f"{{bench_decode}} needs a decoder exported with its KV cache (past_key_values.N.key / "
                            f".value inputs); its inputs are {', '.join(s.name for s in ins)}", "bench_decode")
    for s in past:
        if not (isinstance(s.dims[1], int) and isinstance(s.dims[3], int)):
            raise ArgumentError(f"{{bench_decode}}: past input {s.name!r} {list(s.dims)} needs fixed heads and head "
                                "size (axes 1 and 3)", "bench_decode")
    others = [s for s in ins if s not in past]
    if not any(s.name == "input_ids" for s in others):
        raise ArgumentError(f"{{bench_decode}} needs an input_ids input; its inputs are "
                            f"{', '.join(s.name for s in ins)}", "bench_decode")
    return _Cache(past, others)


def shapes(cache: _Cache, past: int, seq: int) -> dict[str, tuple]:
    """Whole input shapes at batch 1: the attention mask spans past + seq, the rest seq."""
    out = {s.name: (1, s.dims[1], past, s.dims[3]) for s in cache.past}
    for s in cache.others:
        if len(s.dims) != 2:
            raise ArgumentError(f"{{bench_decode}}: input {s.name!r} {list(s.dims)} is not (batch, length)",
                                "bench_decode")
        out[s.name] = (1, past + seq) if s.name == "attention_mask" else (1, seq)
    return out


def weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the initializers a token reads: all but those only ever gathered from (an
    embedding table is read one row per token; a tied LM head reads it all, so counts it)."""
    gathered, used = set(), set()
    for n in model.graph.node:
        for i, name in enumerate(n.input):
            (gathered if n.op_type == "Gather" and i == 0 else used).add(name)
    total = 0
    for t in model.graph.initializer:
        if t.name in used or t.name not in gathered:
            total += int(np.prod(t.dims, dtype=np.int64)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return total


def triad_bandwidth(target, mib: int = 64, repeat: int = 10) -> float:
    """GB/s of a[i] = b[i] + s * c[i] over three float32 arrays of `mib` MiB each, compiled
    for `target` (parallel over its cores, vectorised): 12 bytes moved per element, as
    STREAM counts them (the write-allocate read not counted). The best of `repeat` calls."""
    return BandwidthProbe(target, mib, read=False).best("triad", repeat)


class BandwidthProbe:
    """The memory kernels bench --decode times beside its contenders (BenchOptions.probes):
    `triad` (as triad_bandwidth) and `read`, a sum of one float32 array of 3 x `mib` MiB (the
    triad's footprint), each core summing its own contiguous share with 4 vector
    accumulators. Both compiled for `target` and checked once on their data."""

    def __init__(self, target, mib: int = 64, read: bool = True):
        import tvm

        self.n = (mib << 20) // 4
        dev = tvm.cpu(0)
        tgt = target.tvm_target()
        rng = np.random.default_rng(0)
        self._triad = tvm.compile(_triad_kernel(self.n), target=tgt)["main"]
        self._bc = [tvm.runtime.tensor(rng.standard_normal(self.n, dtype=np.float32), dev) for _ in range(2)]
        self._a = tvm.runtime.tensor(np.empty(self.n, np.float32), dev)
        self.triad()
        b, c = (x.numpy()[:64] for x in self._bc)
        np.testing.assert_allclose(self._a.numpy()[:64], b + 3 * c, rtol=1e-6)
        self.read_bytes = 0
        if read:
            cores = max(1, int(target.target_json.get("num-cores", 1)))
            rows = 3 * self.n // (cores * _LANES * 4) * 4  # whole groups of 4 vectors per core
            self._read = tvm.compile(_read_kernel(cores, rows), target=tgt)["main"]
            arr = rng.integers(-4, 5, (cores, rows, _LANES), dtype=np.int8).astype(np.float32)  # small ints: exact sums
            self._src = tvm.runtime.tensor(arr, dev)
            self._sum = tvm.runtime.tensor(np.zeros((cores, _LANES), np.float32), dev)
            self.read()
            np.testing.assert_array_equal(self._sum.numpy(), arr.sum(axis=1))
            self.read_bytes = arr.nbytes

    def triad(self) -> None:
        self._triad(*self._bc, self._a)

    def read(self) -> None:
        self._read(self._src, self._sum)

    def gbs(self, kind: str, ms: float) -> float:
        return (12 * self.n if kind == "triad" else self.read_bytes) / (ms * 1e-3) / 1e9

    def best(self, kind: str, repeat: int = 10) -> float:
        """GB/s of the fastest of `repeat` calls of `kind` ("triad" or "read")."""
        fn = self.triad if kind == "triad" else self.read
        fastest = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            fastest = min(fastest, time.perf_counter() - t0)
        return self.gbs(kind, fastest * 1e3)

    def probes(self) -> dict:
        """BenchOptions.probes: each kind under a name no contender has."""
        return {f"bandwidth: {k}": fn for k, fn in (("triad", self.triad), ("read", self.read))}

    def medians(self, samples: dict) -> dict[str, float]:
        """kind -> GB/s of the median of its samples (ms) in a report's probes."""
        return {k: self.gbs(k, float(np.median(samples[f"bandwidth: {k}"]))) for k in ("triad", "read")}


_LANES = 16  # float32 lanes of the read's accumulators (one AVX-512 vector; narrower ISAs split it)


def _triad_kernel(n: int):
    from tvm import s_tir, te, tirx

    b = te.placeholder((n,), "float32", name="b")
    c = te.placeholder((n,), "float32", name="c")
    a = te.compute((n,), lambda i: b[i] + tirx.const(3.0, "float32") * c[i], name="a")
    sch = s_tir.Schedule(te.create_prim_func([b, c, a]))
    (i,) = sch.get_loops(sch.get_sblock("a"))
    outer, inner = sch.split(i, factors=[None, 64])
    sch.parallel(outer)
    sch.vectorize(inner)
    return sch.mod


def _read_kernel(cores: int, rows: int):
    """out[t, v] = sum over k of x[t, k, v]: core t streams its own (rows, lanes) block once,
    4 partial sums (an rfactor over k mod 4) so the adds' latency does not bound the read."""
    from tvm import s_tir, te

    x = te.placeholder((cores, rows, _LANES), "float32", name="x")
    k = te.reduce_axis((0, rows), "k")
    out = te.compute((cores, _LANES), lambda t, v: te.sum(x[t, k, v], axis=k), name="out")
    sch = s_tir.Schedule(te.create_prim_func([x, out]))
    t, v, kk = sch.get_loops(sch.get_sblock("out"))
    ko, ki = sch.split(kk, factors=[None, 4])
    sch.reorder(t, ko, ki, v)
    rf = sch.rfactor(ki, 0)
    t_rf = sch.get_loops(rf)[0]
    sch.parallel(t_rf)
    sch.vectorize(sch.get_loops(rf)[-1])
    return sch.mod


class LoopArtifact(Contender):
    """The artifact `run --decode` and the edge app run: one build, past and seq symbolic (what
    `compile --shape batch=1` writes), each call through the function the loop calls (the step
    entry at seq 1, main for a prompt: compile/decode/entries.py). Its row sits beside the
    blockforge build bound at this point's shape."""

    name = "loop artifact"
    peer = False

    def __init__(self, mod):
        self.mod = mod  # compile.artifact.runtime.LoadedModule

    def make_runner(self, model, inputs, threads):
        return EntryRunner(self.mod, inputs)


class EntryRunner(Runner):
    """One function of a loaded artifact (LoadedModule) on fixed inputs; entry None: the one
    its run() would call on them."""

    def __init__(self, mod, inputs: dict, entry: str | None = None):
        import tvm

        self.mod, self.inputs = mod, inputs
        self.entry = entry or mod.entry({k: np.shape(v) for k, v in inputs.items()})
        self.fn = mod.vm[self.entry]
        self.args = [tvm.runtime.tensor(np.ascontiguousarray(inputs[s.name]), mod.device) for s in mod.inputs]

    def __call__(self) -> None:
        self.fn(*self.args, *self.mod.params)
        self.mod.device.sync()

    def outputs(self) -> list[np.ndarray]:
        from blockforge.compile.artifact.runtime import run_vm

        outs = [TensorSig(o["name"], tuple(o["shape"]), o["dtype"]) for o in self.mod.manifest["outputs"]]
        return list(run_vm(self.mod.vm, self.mod.device, self.mod.inputs, outs, self.inputs, self.mod.params,
                           entry=self.entry).values())


class InplaceStep(Contender):
    """The loop artifact's `decode_inplace` (compile --kv-capacity) at this point's P: the step
    `run --decode` and the edge app run after the prompt, on capacity buffers holding the point's
    cache, writing row P in place; no Concat rewrites the whole cache (the copying step's cost
    that grows with P: 12-13% of GPT-2 small's step at P = 512, benchmarks/decode_inplace.py)."""

    name = "in-place step"
    peer = False

    def __init__(self, mod, past: int):
        self.mod, self.past = mod, past

    def make_runner(self, model, inputs, threads):
        return InplaceRunner(self.mod, inputs, self.past)


class InplaceRunner(Runner):
    """`decode_inplace` alone at `past`: each cache input as a buffer of the artifact's capacity
    rows holding the feed's P rows; every call writes row P again (the same values), so calls are
    alike. outputs(): the presents as the buffers' P + 1 filled rows, as the copying step returns
    them."""

    def __init__(self, mod, feeds: dict, past: int):
        import tvm

        from blockforge.compile.decode import inplace as inplace_entry

        rec = mod.manifest[inplace_entry.KEY]
        if past + 1 > rec["capacity"]:
            raise BlockforgeError(f"in-place step at P = {past}: past the artifact's capacity {rec['capacity']}")
        pairs = mod.manifest["decode"]["pairs"]
        self.mod, self.past, self.fn = mod, past, mod.vm[inplace_entry.INPLACE_ENTRY]
        self.axis = {p["present"]: p["axis"] for p in pairs}
        past_axis = {p["past"]: p["axis"] for p in pairs}
        args = []
        for s in mod.inputs:
            a = np.asarray(feeds[s.name])
            if s.name in past_axis:
                a = inplace_entry.capacity_array(a, past_axis[s.name], rec["capacity"])
            args.append(tvm.runtime.tensor(np.ascontiguousarray(a), mod.device))
        self.args = [*args, tvm.runtime.ShapeTuple([past])]

    def __call__(self) -> None:
        self.fn(*self.args, *self.mod.params)
        self.mod.device.sync()

    def outputs(self) -> list[np.ndarray]:
        from blockforge.compile.decode import inplace as inplace_entry

        out = self.fn(*self.args, *self.mod.params)
        self.mod.device.sync()
        names = [o["name"] for o in self.mod.manifest["outputs"]]
        outs = list(out) if len(names) > 1 else [out]
        return [inplace_entry.filled_rows(t.numpy(), self.axis[name], self.past + 1) if name in self.axis
                else t.numpy() for name, t in zip(names, outs)]


def _loop_artifact(opts: DecodeOptions, model: onnx.ModelProto, tmp: Path):
    """Compiled as a user compiles a decoder for `run --decode`: only the batch dims bound (and,
    opts.inplace, --kv-capacity for the longest point)."""
    from blockforge.compile import CompileOptions, compile_model
    from blockforge.compile.artifact.runtime import load_artifact

    batch = {i.type.tensor_type.shape.dim[0].dim_param: 1 for i in model.graph.input
             if i.name in ("input_ids", "attention_mask") and i.type.tensor_type.shape.dim[0].dim_param}
    capacity = max(opts.pasts) + 1 if opts.inplace else None
    res = compile_model(CompileOptions(model=opts.model, target=opts.target, shape=batch, output=tmp / "loop",
                                       tuning_db=opts.tuning_db, use_tuning="tuned" in opts.against,
                                       kv_capacity=capacity))
    return load_artifact(res.artifact)


def bench_decode(opts: DecodeOptions) -> DecodeReport:
    if any(p < 1 for p in opts.pasts) or not opts.pasts or opts.prompt < 0:
        raise ArgumentError("{pasts} needs lengths >= 1 and {prompt} >= 0", "pasts", "prompt")
    target = resolve(opts.target)
    if target.is_gpu:
        raise ArgumentError("{bench_decode} measures a CPU's memory bandwidth: use a CPU {target}", "bench_decode",
                            "target")
    problem = target.run_problem()
    if problem:
        raise BlockforgeError(f"cannot benchmark {target.name} here: {problem}")
    model = load_model(opts.model)
    cache = cache_layout(model)
    wbytes = weight_bytes(model)
    probe = BandwidthProbe(target, opts.stream_mib)
    bandwidth = [probe.best("triad")]
    plan = [("decode", p, 1) for p in opts.pasts] + ([("prefill", 0, opts.prompt)] if opts.prompt else [])
    points, notes, threads = [], [], 1
    with tempfile.TemporaryDirectory(prefix="bench-decode-") as tmp:
        loop = [LoopArtifact(_loop_artifact(opts, model, Path(tmp)))] if opts.loop and \
            {"untuned", "tuned"} & set(opts.against) else []
        for phase, past, seq in plan:
            point, threads = _point(opts, cache, wbytes, phase, past, seq, loop, probe, notes)
            points.append(point)
    bandwidth.append(probe.best("triad"))
    return DecodeReport(str(opts.model), target.name, threads, wbytes, max(bandwidth), points, notes, host_facts())


def _point(opts: DecodeOptions, cache: _Cache, wbytes: int, phase: str, past: int, seq: int, loop: list,
           probe: BandwidthProbe, notes: list) -> tuple[DecodePoint, int]:
    extra = list(loop)
    from blockforge.compile.decode.inplace import KEY as INPLACE

    if loop and phase == "decode" and INPLACE in loop[0].mod.manifest:
        extra.append(InplaceStep(loop[0].mod, past))
    rep = bench(BenchOptions(model=opts.model, target=opts.target, against=opts.against, repeat=opts.repeat,
                             warmup=opts.warmup, shape=shapes(cache, past, seq), tuning_db=opts.tuning_db,
                             gemm_n=256, extra=tuple(extra), probes=probe.probes()))  # (the SGEMM
    # ceiling is not this report's roofline)
    notes += [f"{phase} P={past}: {n}" for n in rep.notes]
    cached = sum(int(np.prod((1, s.dims[1], past, s.dims[3]))) * np.dtype(s.dtype).itemsize for s in cache.past)
    gbs = probe.medians(rep.probes)
    return DecodePoint(phase, past, seq, wbytes + cached, rep.results, rep.best_peer, gbs["triad"],
                       gbs["read"]), rep.threads
