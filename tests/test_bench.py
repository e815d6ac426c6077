"""The benchmark harness: the contender registry, skip notes, ratios to the best peer from
the same samples, ort-fused parity, interleaving, the JSON schema, profile, plot.
(Timings themselves are not asserted: they belong in benchmarks/.)"""

import json

import numpy as np
import onnxruntime as ort
import pytest

from blockforge.bench import CONTENDERS, PEERS, REGISTRY, SCHEMA, BenchOptions, bench, measure_interleaved, summarize
from blockforge.bench.report import BenchReport
from blockforge.errors import BlockforgeError
from blockforge.graph import FFNSpec, MHASpec, build, export, reference
from blockforge.graph.model_io import bind_dims, random_inputs, signature
from blockforge.graph.tolerance import compare, tolerance_for

from conftest import assert_user_error, run_cli


def test_interleaving_counts_and_rotation():
    calls = []
    runners = {k: (lambda k=k: calls.append(k)) for k in ("a", "b", "c")}
    samples = measure_interleaved(runners, repeat=12, warmup=1)
    assert {k: len(v) for k, v in samples.items()} == {"a": 12, "b": 12, "c": 12}
    # Bursts alternate between contenders rather than running one to completion.
    firsts = [calls.index(k) for k in "abc"]
    assert max(firsts) < len(calls) // 3
    switches = sum(1 for x, y in zip(calls, calls[1:]) if x != y)
    assert switches >= 3 * (12 // 5)


def test_registry_drives_the_cli(tmp_path):
    assert CONTENDERS == ("ort", "ort-fused", "openvino", "untuned", "tuned")
    assert PEERS == ("ort", "ort-fused", "openvino")
    assert all(REGISTRY[n].name == n and callable(REGISTRY[n].make_runner) for n in CONTENDERS)
    r = run_cli("bench", "--help", cwd=tmp_path)
    assert r.rc == 0 and ",".join(CONTENDERS) in " ".join(r.out.split())
    # Unknown names are refused before any work, naming the registry's contenders.
    assert_user_error(run_cli("bench", tmp_path / "none.onnx", "--against", "ort,tvm-magic", cwd=tmp_path),
                      "tvm-magic", "ort-fused", "openvino")


def test_ratio_to_best_peer_from_the_same_samples():
    samples = {"ort": [3.0, 3.2, 2.9, 3.1, 5.0], "ort-fused": [2.0, 2.1, 2.2, 1.9, 2.05],
               "openvino": [2.5, 2.4, 2.6, 2.7, 2.5], "untuned": [2.4, 2.3, 2.5, 2.2, 9.0],
               "tuned": [1.8, 1.9, 1.7, 1.85, 1.95]}
    flops, ceiling = 10**9, 500.0
    results, best = summarize(samples, set(PEERS), flops, ceiling)
    med = {k: float(np.median(v)) for k, v in samples.items()}
    assert best == "ort-fused" == min(PEERS, key=med.get)
    by = {r.name: r for r in results}
    assert [r.name for r in results] == list(samples)
    for k, r in by.items():
        assert r.peer == (k in PEERS)
        assert r.median_ms == pytest.approx(med[k])
        assert r.ratio_to_best_peer == pytest.approx(med[k] / med["ort-fused"])
        assert r.ratio_to_ort == pytest.approx(med[k] / med["ort"])
        assert r.gflops == pytest.approx(flops / (med[k] / 1e3) / 1e9)
        assert r.pct_of_sgemm == pytest.approx(100 * r.gflops / ceiling)
    assert by["ort-fused"].ratio_to_best_peer == 1.0 and by["tuned"].ratio_to_best_peer < 1.0
    rep = BenchReport("m.onnx", "host", {"seq": 8}, 2, flops, ceiling, results, best, host={"cpu_model": "CPU X"})
    assert rep.headline == {"contender": "tuned", "best_peer": "ort-fused",
                            "ratio_to_best_peer": pytest.approx(med["tuned"] / med["ort-fused"])}
    md = rep.markdown()
    assert "at 0.90x the best peer (ort-fused)" in md and "1.00x (best peer)" in md and "CPU X" in md
    # Without a peer there is no ratio and no headline; without blockforge, no headline.
    res, best = summarize({"untuned": [1.0, 2.0, 3.0]}, set(PEERS), flops, ceiling)
    assert best is None and res[0].ratio_to_best_peer is None
    assert BenchReport("m", "host", {}, 2, flops, ceiling, res, best).headline is None
    res, best = summarize({"ort": [1.0, 1.0, 1.0]}, set(PEERS), flops, ceiling)
    assert best == "ort" and BenchReport("m", "host", {}, 2, flops, ceiling, res, best).headline is None


def test_quotable_only_when_every_ceiling_is_near_the_quiet_one():
    """The brief's rule in the report: every SGEMM ceiling of the run (before and after the
    timing) at least 90% of the machine's quiet value; without one, no verdict."""
    res, best = summarize({"ort": [2.0] * 3, "untuned": [1.8] * 3}, set(PEERS), 10**9, 400.0)

    def report(before, after, quiet):
        return BenchReport("m.onnx", "host", {}, 2, 10**9, after, res, best, sgemm_before=before, quiet_ceiling=quiet)

    ok = report(380.0, 400.0, 420.0)  # 380 >= 0.9 x 420 = 378
    assert ok.quotable is True and ok.to_dict()["quotable"] is True
    assert "**quotable: every SGEMM ceiling of the run >= 90% of the quiet 420 GFLOP/s**" in ok.markdown()
    assert "SGEMM ceiling 400 GFLOP/s (380 before the timing)" in ok.markdown()
    for before, after in ((377.0, 400.0), (400.0, 377.0)):  # either reading low: the run was not quiet
        bad = report(before, after, 420.0)
        assert bad.quotable is False and bad.to_dict()["quotable"] is False
        assert "**NOT QUOTABLE: SGEMM ceiling 377 GFLOP/s is below 90% of the quiet 420 GFLOP/s" in bad.markdown()
    none = report(100.0, 400.0, None)
    assert none.quotable is None and none.to_dict()["quotable"] is None and "QUOTABLE" not in none.markdown().upper()


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_bad_quiet_ceiling_is_one_line(tmp_path, value):
    model = export(FFNSpec(d_model=16, d_ff=32), tmp_path / "f.onnx").model_path
    assert_user_error(run_cli("bench", model, "--quiet-ceiling", value, "--shape", "batch=1,seq=4", cwd=tmp_path),
                      "--quiet-ceiling must be a positive GFLOP/s")


MHA_VARIANTS = [
    MHASpec(d_model=64, heads=4),
    MHASpec(d_model=64, heads=4, kv_seq=24),
    MHASpec(d_model=64, heads=4, mask="additive"),
    MHASpec(d_model=64, heads=4, mask="bool", causal=True),
    MHASpec(d_model=64, heads=4, bias=False, layout="packed"),
]


@pytest.mark.parametrize("spec", MHA_VARIANTS, ids=lambda s: f"cross={s.cross},mask={s.mask},causal={s.causal},bias={s.bias}")
def test_ort_fused_mha_matches_the_oracle(spec):
    """The contrib-op graph computes the blockforge MHA with the spec's weights."""
    from blockforge.bench.ort_fused import fused_model

    model, weights = build(spec)
    dims = {"batch": 2, "seq": 16, **({"kv_seq": 24} if spec.cross and spec.kv_seq is None else {})}
    bound = bind_dims(model, dims)
    fused, how = fused_model(bound, spec, dims)
    assert any(n.op_type == "MultiHeadAttention" and n.domain == "com.microsoft" for n in fused.graph.node), how
    inputs = random_inputs(signature(bound)[0], {}, seed=3)
    out = ort.InferenceSession(fused.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, inputs)[0]
    c = compare("ort-fused", "output", out, reference(spec, weights, inputs), tolerance_for("float32", "mha"))
    assert c.passed, c


def test_ort_optimizer_fusion_that_changes_the_math_is_caught():
    """A real case: ORT's optimizer fuses the tanh-approximated gelu into BiasGelu (exact erf)."""
    pytest.importorskip("sympy")
    from blockforge.bench.ort_fused import fused_model

    spec = FFNSpec(d_model=64, d_ff=128, activation="gelu_tanh")
    model, weights = build(spec)
    bound = bind_dims(model, {"batch": 1, "seq": 16})
    fused, how = fused_model(bound, spec, {"batch": 1, "seq": 16})
    assert "BiasGelu" in how
    inputs = random_inputs(signature(bound)[0], {}, seed=0)
    out = ort.InferenceSession(fused.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, inputs)[0]
    assert not compare("ort-fused", "output", out, reference(spec, weights, inputs), tolerance_for("float32", "ffn")).passed


@pytest.fixture(scope="module")
def tiny_mha(tmp_path_factory):
    return export(MHASpec(d_model=64, heads=4), tmp_path_factory.mktemp("bench") / "mha.onnx").model_path


def test_missing_or_refusing_peers_are_notes(tiny_mha, monkeypatch):
    monkeypatch.setattr(REGISTRY["openvino"], "available", lambda: False)  # simulate: not installed

    def wrong_math(model, spec, dims):  # simulate a fused graph whose output projection is off by 1%
        from blockforge.bench import ort_fused

        m = ort_fused.mha_graph(spec, model)
        w = next(t for t in m.graph.initializer if t.name == "out_proj.weight")
        from onnx import numpy_helper

        w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w) * np.float32(1.01), w.name))
        return m, "perturbed"

    monkeypatch.setattr("blockforge.bench.ort_fused.fused_model", wrong_math)
    rep = bench(BenchOptions(model=tiny_mha, against=("ort", "ort-fused", "openvino"), shape={"batch": 1, "seq": 16},
                             repeat=3, gemm_n=256))
    assert [r.name for r in rep.results] == ["ort"] and rep.best_peer == "ort"
    notes = "\n".join(rep.notes)
    assert "openvino: not installed (pip install 'blockforge[peers]'); skipped" in notes
    assert "ort-fused: output 'output' differs from the numpy oracle" in notes and "not timed" in notes

    # A peer engine that raises on the model is a note too, never an error.
    def boom(model, inputs, threads):
        raise RuntimeError("[ONNXRuntimeError] cannot handle this graph\nmore lines")

    monkeypatch.setattr(REGISTRY["ort"], "make_runner", boom)
    with pytest.raises(BlockforgeError, match="no contender could run the model: ort: cannot take this model: "
                                                r"\[ONNXRuntimeError\] cannot handle this graph; skipped"):
        bench(BenchOptions(model=tiny_mha, against=("ort", "openvino"), shape={"batch": 1, "seq": 16}, repeat=3))


def test_probes_are_timed_in_the_rounds_and_never_ranked(tiny_mha):
    """A probe (bench --decode's memory bandwidth) runs in every interleaved round beside the
    contenders, its samples in report.probes, never a result row or the best peer; a probe named
    like a contender is refused."""
    calls = []
    rep = bench(BenchOptions(model=tiny_mha, against=("ort",), shape={"batch": 1, "seq": 16}, repeat=4, warmup=1,
                             gemm_n=128, probes={"p": lambda: calls.append(1)}))
    assert [r.name for r in rep.results] == ["ort"] and rep.best_peer == "ort"
    assert len(rep.probes["p"]) == 4 and all(t >= 0 for t in rep.probes["p"])
    assert len(calls) == 4 + 1  # its 4 samples, in one round (burst 5 >= 4), after 1 warm-up call
    with pytest.raises(ValueError, match="probe.*named like a contender.*'ort'"):
        bench(BenchOptions(model=tiny_mha, against=("ort",), shape={"batch": 1, "seq": 16}, repeat=3, gemm_n=128,
                           probes={"ort": lambda: None}))


def _foreign(tmp_path, name: str, nodes: list, outputs: list, dtype=None, inits=()) -> str:
    """A small foreign model (no blockforge spec: ONNX Runtime is the reference), x (2, 8)."""
    import onnx
    from onnx import TensorProto, helper

    dtype = dtype or TensorProto.FLOAT
    g = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", dtype, [2, 8])],
                          [helper.make_tensor_value_info(o, dtype, [2, 8]) for o in outputs], list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, tmp_path / f"{name}.onnx")
    return tmp_path / f"{name}.onnx"


def test_every_output_is_checked_before_timing(tmp_path, monkeypatch):
    """A two-output model; a contender (a peer injected through the registry: ORT's own
    result with the second output off by one) gets the first output right and the second
    wrong: refused, not timed, the note naming the output. TVM's two outputs both pass."""
    from onnx import helper, numpy_helper

    from blockforge.bench import contenders

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32), "w")
    model = _foreign(tmp_path, "two", [helper.make_node("MatMul", ["x", "w"], ["y1"]),
                                       helper.make_node("Tanh", ["y1"], ["y2"])], ["y1", "y2"], inits=[w])

    class SecondOutputWrong(contenders._OrtRunner):
        def outputs(self):
            outs = super().outputs()
            return [outs[0], outs[1] + np.float32(1.0)]

    monkeypatch.setattr(REGISTRY["openvino"], "available", lambda: True)
    monkeypatch.setattr(REGISTRY["openvino"], "make_runner", lambda m, i, t: SecondOutputWrong(m.onnx, i, t))
    rep = bench(BenchOptions(model=model, against=("ort", "openvino", "untuned"), repeat=3, gemm_n=128))
    notes = "\n".join(rep.notes)
    assert [r.name for r in rep.results] == ["ort", "untuned"], notes
    assert "openvino: output 'y2' differs from ONNX Runtime (max abs err 1.00e+00" in notes and "not timed" in notes
    assert rep.unchecked == [] and rep.headline is not None and rep.headline["best_peer"] == "ort"


def test_nothing_checked_no_headline(tmp_path, monkeypatch):
    """A model ONNX Runtime cannot run (Erf on float64: no CPU kernel) has no reference;
    a peer that runs it (injected: numpy's erf) and TVM are timed, but the report says
    unchecked and gives no ratio headline."""
    import math

    from onnx import TensorProto, helper

    model = _foreign(tmp_path, "erf64", [helper.make_node("Erf", ["x"], ["y"])], ["y"], dtype=TensorProto.DOUBLE)

    class NumpyErf:
        def __init__(self, inputs):
            self.x = inputs["x"]

        def __call__(self):
            return np.vectorize(math.erf)(self.x)

        def outputs(self):
            return [self()]

    monkeypatch.setattr(REGISTRY["openvino"], "available", lambda: True)
    monkeypatch.setattr(REGISTRY["openvino"], "make_runner", lambda m, i, t: NumpyErf(i))
    rep = bench(BenchOptions(model=model, against=("ort", "openvino", "untuned"), repeat=3, gemm_n=128))
    notes = "\n".join(rep.notes)
    assert [r.name for r in rep.results] == ["openvino", "untuned"], notes
    assert rep.headline is None and rep.to_dict()["headline"] is None, rep.headline_text()
    assert rep.unchecked == ["y"] and "no reference for y" in notes and "ort: cannot take this model" in notes
    assert "no headline: unchecked" in rep.markdown()


RESULT_KEYS = {"name", "peer", "median_ms", "p90_ms", "min_ms", "gflops", "ratio_to_best_peer", "ratio_to_ort",
               "pct_of_sgemm", "samples_ms"}
REPORT_KEYS = {"schema", "model", "target", "dims", "threads", "flops", "sgemm_gflops", "results", "best_peer",
               "headline", "profile", "notes", "host", "unchecked", "precision", "sgemm_before", "quiet_ceiling",
               "quotable"}


@pytest.mark.slow
def test_bench_cli_json_plot_profile(tmp_path):
    model = export(FFNSpec(d_model=64, d_ff=128), tmp_path / "f.onnx").model_path
    r = run_cli("bench", model, "--shape", "batch=1,seq=16", "--repeat", 6,  # every contender by default
                "--profile", "--json", tmp_path / "b.json", "--plot", tmp_path / "b.png", "--quiet-ceiling", "0.001",
                cwd=tmp_path)
    assert r.rc == 0, r.text
    assert "| ort | peer |" in r.out and "| untuned | blockforge |" in r.out and "profile of untuned" in r.out
    assert "the best peer" in r.out
    assert "tuned: no tuning records" in r.out  # no database: said, not faked
    assert "note: ort-fused:" in r.out  # relu FFN: nothing for ORT to fuse (or no optimizer): a note
    rep = json.loads((tmp_path / "b.json").read_text())
    assert set(rep) == REPORT_KEYS and rep["schema"] == SCHEMA and rep["unchecked"] == [] and rep["precision"] == "float"
    assert rep["flops"] == 2 * 2 * 16 * 64 * 128 and rep["threads"] >= 1 and rep["sgemm_gflops"] > 0
    assert rep["sgemm_before"] > 0 and rep["quiet_ceiling"] == 0.001 and rep["quotable"] is True
    assert "**quotable: every SGEMM ceiling" in r.out
    assert {"cpu_model", "physical_cores", "machine", "load_avg_1m", "versions"} <= set(rep["host"])
    assert {"apache-tvm", "onnx", "numpy"} <= set(rep["host"]["versions"])
    res = {x["name"]: x for x in rep["results"]}
    expected = {"ort", "untuned"} | ({"openvino"} if REGISTRY["openvino"].available() else set())
    assert set(res) == expected, rep["notes"]
    peers = {k: v for k, v in res.items() if v["peer"]}
    assert rep["best_peer"] == min(peers, key=lambda k: peers[k]["median_ms"])
    for x in res.values():
        assert set(x) == RESULT_KEYS and x["peer"] == (x["name"] in PEERS)
        s = np.array(x["samples_ms"])
        assert len(s) == 6
        assert x["median_ms"] == pytest.approx(float(np.median(s)))
        assert x["p90_ms"] == pytest.approx(float(np.percentile(s, 90)))
        assert x["gflops"] == pytest.approx(rep["flops"] / (x["median_ms"] / 1e3) / 1e9)
        assert x["pct_of_sgemm"] == pytest.approx(100 * x["gflops"] / rep["sgemm_gflops"])
        assert x["ratio_to_best_peer"] == pytest.approx(x["median_ms"] / res[rep["best_peer"]]["median_ms"])
        assert x["ratio_to_ort"] == pytest.approx(x["median_ms"] / res["ort"]["median_ms"])
    assert rep["headline"] == {"contender": "untuned", "best_peer": rep["best_peer"],
                               "ratio_to_best_peer": pytest.approx(res["untuned"]["ratio_to_best_peer"])}
    kernels = rep["profile"]["untuned"]
    assert kernels and all(k["calls"] >= 1 and k["total_ms"] > 0 for k in kernels)
    assert any("matmul" in k["name"] for k in kernels)
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_is_each_kernels_median_after_a_pause_and_warmup():
    """profile_vm: a pause and an uninstrumented warm-up first, then each kernel's median
    over the runs: one run whose first kernel waited for another engine's spinning workers
    (int8 MHA at seq 512 after ORT: the range kernel read 18x its own time) does not move it."""
    from blockforge.bench.harness import QUIET_S, profile_vm

    clock = [0.0]
    events = []
    # run r's cost of each kernel (a fake clock): run 0 of "range" is the slow one
    cost = {"range": [40.0, 1.0, 1.0, 1.2, 1.0], "gemm": [5.0, 5.0, 5.5, 5.0, 5.0]}

    class FakeVM:
        hook = None

        def set_instrument(self, f):
            events.append("hook" if f else "unhook")
            self.hook = f

    class Runner:
        vm = FakeVM()
        dev = type("D", (), {"sync": lambda self: None})()
        run = -1

        def __call__(self):
            if self.vm.hook is None:
                events.append("warmup")
                return
            self.run += 1
            for name in ("range", "gemm", "range", "vm.builtin.alloc"):
                self.vm.hook(None, name, True, None)
                clock[0] += cost.get(name, [9.0] * 5)[self.run] / 2 if name == "range" else \
                    cost.get(name, [9.0] * 5)[self.run]
                self.vm.hook(None, name, False, None)

    slept = []
    rows = profile_vm(Runner(), runs=5, warmup=1, clock=lambda: clock[0] / 1e3,
                      sleep=lambda s: (slept.append(s), events.append("sleep")))
    assert slept == [QUIET_S] and events[:3] == ["sleep", "warmup", "hook"] and events[-1] == "unhook"
    got = {r.name: (r.calls, round(r.total_ms, 6)) for r in rows}
    assert got == {"range": (2, 1.0), "gemm": (1, 5.0)}  # medians; the builtin is not a kernel
    assert [r.name for r in rows] == ["gemm", "range"]
    assert sum(r.pct for r in rows) == pytest.approx(100.0)


def test_kernel_classes_name_where_the_time_goes():
    """bench --profile's classes, from kernel names as the compiled models have them."""
    from blockforge.bench.report import KernelProfile, class_shares, kernel_class

    cases = {"fused_matmul2_divide_erf_add3_multiply1_multiply2": "GEMM", "matmul5": "GEMM", "bf16_gemm_0": "GEMM",
             "fused_attention_1": "attention", "softmax": "attention", "conv_im2col": "conv", "conv_gemm1": "conv",
             "layer_norm": "elementwise/norm", "fused_power_mean_add_rsqrt_multiply": "elementwise/norm",
             "fused_add1_add1": "elementwise/norm", "fused_reshape_transpose1": "other", "take": "other",
             "split": "other"}
    assert {n: kernel_class(n) for n in cases} == cases
    shares = class_shares([KernelProfile("matmul", 1, 3.0, 0), KernelProfile("layer_norm", 1, 1.0, 0)])
    assert shares == {"GEMM": 75.0, "attention": 0.0, "conv": 0.0, "elementwise/norm": 25.0, "other": 0.0}


def test_profile_says_what_its_kernels_sum_to_against_the_median():
    """bench --profile's header line: the kernels' sum against the contender's median, and a
    warning where the instrumented run overstates it (many small kernels)."""
    from blockforge.bench.report import PROFILE_OVERSTATES, KernelProfile, profile_sum_line

    ks = [KernelProfile("int8_gemm_0", 3, 4.0, 50.0), KernelProfile("fused_softmax", 12, 4.0, 50.0)]
    close = profile_sum_line(ks, 7.8)
    assert "kernels sum to 8.000 ms per run, 1.03x the median (7.800 ms), 15 calls" in close
    assert "read the shares" not in close
    far = profile_sum_line(ks, 8.0 / (PROFILE_OVERSTATES + 0.3))
    assert "read the shares, not the milliseconds" in far
    assert profile_sum_line(ks, None) == "" and profile_sum_line([], 5.0) == ""
