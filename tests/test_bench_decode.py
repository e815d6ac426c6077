"""`bench --decode`: per-token latency of a decoder with its KV cache at each past length,
prefill from an empty cache, bytes read per token over a triad bandwidth measured in the run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# The verbs in-process: their outputs and errors are under test, not the process (~2 s of
# CPU less per call than an interpreter start and a TVM import; verbs still run their children).
from conftest import assert_user_error, run_cli_in_process as cli

FIXTURES = Path(__file__).parent / "fixtures" / "models"


def test_weight_bytes_skip_gathered_tables():
    """An embedding table only gathered from is read one row per token, so not counted; a
    table a MatMul also reads (a tied LM head) is."""
    from blockforge.bench.decode import weight_bytes

    def model(tied: bool) -> onnx.ModelProto:
        emb = numpy_helper.from_array(np.zeros((100, 8), np.float32), "emb")
        w = numpy_helper.from_array(np.zeros((8, 8), np.float32), "w")
        nodes = [helper.make_node("Gather", ["emb", "ids"], ["x"]), helper.make_node("MatMul", ["x", "w"], ["y"])]
        if tied:
            nodes.append(helper.make_node("MatMul", ["y", "emb"], ["z"], name="not_shape_checked"))
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [emb, w])
        return helper.make_model(g)

    assert weight_bytes(model(False)) == 8 * 8 * 4
    assert weight_bytes(model(True)) == (8 * 8 + 100 * 8) * 4


def test_bench_decode_cli(tmp_path):
    """Decode rows at each past length and a prefill row from an empty cache (P = 0: random
    inputs refused a zero dim before), every contender checked against ORT, the roofline
    from bytes read and the measured bandwidth."""
    model = FIXTURES / "gpt2_past_dynamo_op18.onnx"
    r = cli("bench", "--decode", model, "--past", "16,40", "--prompt", "4", "--repeat", "3",
            "--against", "ort,untuned", "--json", tmp_path / "d.json", cwd=tmp_path)
    assert r.rc == 0, r.text
    assert "| decode | 40 | 1 | " in r.out and "| prefill | 0 | 4 |" in r.out and "memory bandwidth (triad)" in r.out, r.out
    d = json.loads((tmp_path / "d.json").read_text())
    assert d["schema"] == "blockforge.bench-decode/2" and d["bandwidth_gbs"] > 0
    assert [(p["phase"], p["past"], p["seq"]) for p in d["points"]] == [("decode", 16, 1), ("decode", 40, 1),
                                                                      ("prefill", 0, 4)]
    # bytes read: the weights (no embedding tables) plus the whole cache, 2 layers x K, V
    cache40 = 2 * 2 * 4 * 40 * 8 * 4
    assert d["points"][1]["bytes_read"] - d["weight_bytes"] == cache40
    for p in d["points"]:
        # beside the build bound at each point: the artifact `run --decode` runs (seq 1: its step entry)
        # and, at the decode points, that artifact's in-place step (--kv-capacity 41), its outputs
        # (the buffers' P + 1 rows) checked against ORT's like every row's
        extra = {"in-place step"} if p["phase"] == "decode" else set()
        assert {x["name"] for x in p["results"]} == {"ort", "untuned", "loop artifact"} | extra, r.out
        # each point's roofline: its bytes over the triad timed in the point's own rounds; the read beside it
        assert p["triad_gbs"] > 0 and p["read_gbs"] > 0
        assert abs(p["roofline_ms"] - p["bytes_read"] / (p["triad_gbs"] * 1e9) * 1e3) < 1e-9
        for x in p["results"]:
            want = 100 * p["roofline_ms"] / x["median_ms"]
            read = 100 * p["bytes_read"] / (p["read_gbs"] * 1e9) * 1e3 / x["median_ms"]
            if p["phase"] == "prefill":
                assert x["pct_of_roofline"] is None and x["pct_of_read"] is None
            else:
                assert abs(x["pct_of_roofline"] - want) < 1e-6 and abs(x["pct_of_read"] - read) < 1e-6
    assert len({p["triad_gbs"] for p in d["points"]}) == 3, "one bandwidth per point, not one per run"
    # the probes are timed, not ranked: no row of theirs, in the table or the results
    assert "bandwidth:" not in r.out and all(not x["name"].startswith("bandwidth") for p in d["points"]
                                             for x in p["results"]), r.out


def test_bench_decode_refusals(tmp_path):
    assert_user_error(cli("bench", "--decode", FIXTURES / "bert_legacy_op17.onnx", cwd=tmp_path),
                      "--decode needs a decoder exported with its KV cache", "input_ids")
    model = FIXTURES / "gpt2_past_legacy_op17.onnx"
    assert_user_error(cli("bench", "--decode", model, "--shape", "batch=1", cwd=tmp_path), "drop --shape")
    assert_user_error(cli("bench", "--decode", model, "--quiet-ceiling", "400", cwd=tmp_path), "drop --quiet-ceiling")
    assert_user_error(cli("bench", "--decode", model, "--past", "16,x", cwd=tmp_path), "--past '16,x'")
    assert_user_error(cli("bench", "--decode", model, "--past", "0", cwd=tmp_path), "--past needs lengths >= 1")
    assert_user_error(cli("bench", model, "--copy-cache", cwd=tmp_path), "--copy-cache is a --decode option")
