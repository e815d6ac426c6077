"""The benchmark harness: schema, ratios from the same run, interleaving, profile, plot.
(Timings themselves are not asserted: they belong in benchmarks/.)"""

import json

import numpy as np
import pytest

from blockforge.bench.harness import SCHEMA, measure_interleaved
from blockforge.graph import FFNSpec, export

from conftest import run_cli


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


@pytest.mark.slow
def test_bench_cli_json_plot_profile(tmp_path):
    model = export(FFNSpec(d_model=64, d_ff=128), tmp_path / "f.onnx").model_path
    r = run_cli("bench", model, "--shape", "batch=1,seq=16", "--against", "ort,untuned,tuned", "--repeat", 6,
                "--profile", "--json", tmp_path / "b.json", "--plot", tmp_path / "b.png", cwd=tmp_path)
    assert r.rc == 0, r.text
    assert "| ort |" in r.out and "| untuned |" in r.out and "profile of untuned" in r.out
    assert "tuned: no tuning records" in r.out  # no database: said, not faked
    rep = json.loads((tmp_path / "b.json").read_text())
    assert rep["schema"] == SCHEMA
    assert rep["flops"] == 2 * 2 * 16 * 64 * 128 and rep["threads"] >= 1 and rep["sgemm_gflops"] > 0
    res = {x["name"]: x for x in rep["results"]}
    assert set(res) == {"ort", "untuned"}
    for x in res.values():
        s = np.array(x["samples_ms"])
        assert len(s) == 6
        assert x["median_ms"] == pytest.approx(float(np.median(s)))
        assert x["p90_ms"] == pytest.approx(float(np.percentile(s, 90)))
        assert x["gflops"] == pytest.approx(rep["flops"] / (x["median_ms"] / 1e3) / 1e9)
        assert x["pct_of_sgemm"] == pytest.approx(100 * x["gflops"] / rep["sgemm_gflops"])
        assert x["ratio_to_ort"] == pytest.approx(x["median_ms"] / res["ort"]["median_ms"])
    kernels = rep["profile"]["untuned"]
    assert kernels and all(k["calls"] >= 1 and k["total_ms"] > 0 for k in kernels)
    assert any("matmul" in k["name"] for k in kernels)
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
