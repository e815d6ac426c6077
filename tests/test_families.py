"""Families a user brings (tests/fixtures/families, made by benchmarks/export_families.py; torch
is not needed here): 52 transformers families outside the main corpus (vision CNNs and hybrids,
vision transformers, encoders, decoders, speech, encoder-decoders), each exported by both of
torch's exporters (MobileViT V2 by dynamo only). Each compiles for host, matches ONNX Runtime on the inputs it was exported
with, and the compiler did with it what the file asks for, counted in the file: every Softmax an
attention the fuser took, every depthwise Conv a call of compile/conv/depthwise.py's kernels,
no convolution left to TVM's default schedule (the twenty-fifth and twenty-sixth sessions found
each of these wrong on some family: three attention forms unfused, CNN convs at ~12 GFLOP/s)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from conftest import REPO, fused_attention_counts, save_npz

# Compiles 103 exports (~4 s each): marked slow as a whole, so `make test` starts it first
# (conftest _heavy_first) and `make check` never picks it up.
pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).parent / "fixtures" / "families"
INDEX = json.loads((FIXTURES / "index.json").read_text())
MODELS = INDEX["models"]
MAX_BYTES = 640 * 1024
# Softmaxes the fuser leaves, each with the reason its log line gives (compile/attention/match.py):
# SwiftFormer's additive attention and MobileViT V2's separable self-attention take a softmax
# over one score per token and weight the tokens with it (a sum, not P V), no Q K^T at all;
# DeBERTa-v2 adds its content-to-position and position-to-content scores to Q K^T per
# (batch * head) from gathers, with Q K^T and Q pos^T one matmul between the splits.
UNFUSED = {"swiftformer": "do not feed one matmul with V", "mobilevitv2": "do not feed one matmul with V",
           "deberta_v2": "the scores come from relax.reshape"}


def _exporter_module():
    """benchmarks/export_families.py: its family table and example inputs (no torch at import)."""
    spec = importlib.util.spec_from_file_location("export_families", REPO / "benchmarks" / "export_families.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


EXPORT = _exporter_module()


def test_corpus_index():
    """Every family of the exporter's table, by both exporters, files as indexed, IR <= 10
    (ORT 1.31), each at most 640 KiB; the counts the tests below hold the compiler to are the
    file's own."""
    assert {(e["family"], e["exporter"]) for e in MODELS} == \
        {(f, x) for f in EXPORT.FAMILIES for x in EXPORT.EXPORTERS if x == "dynamo" or f not in EXPORT.ONLY_DYNAMO}
    for e in MODELS:
        data = (FIXTURES / e["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == e["sha256"] and len(data) <= MAX_BYTES, e["file"]
        m = onnx.load_from_string(data)
        assert m.ir_version <= 10 and m.opset_import[0].version == e["opset"] == EXPORT.EXPORTERS[e["exporter"]]
        assert e["softmax"] == sum(n.op_type == "Softmax" for n in m.graph.node), e["file"]
        assert e["depthwise_convs"] == EXPORT._depthwise(m) and e["convs"] == sum(n.op_type == "Conv" for n in m.graph.node)
        ins = EXPORT.example_inputs(e["kind"])
        assert [i.name for i in m.graph.input] == list(ins) and {k: list(v.shape) for k, v in ins.items()} == e["inputs"]
    # What the corpus is for: depthwise convs in the mobile CNNs, attention in every non-CNN.
    by = {e["family"]: e for e in MODELS if e["exporter"] == "dynamo"}
    assert {"convnext", "mobilevit", "segformer", "mobilenet_v2", "efficientnet", "cvt"} <= \
        {f for f, e in by.items() if e["depthwise_convs"]}
    assert all(e["softmax"] for e in by.values() if not e["kind"].startswith("image")), "every text/audio model"
    assert set(UNFUSED) <= set(by)


def test_depthwise_count_reads_the_weights():
    """_depthwise counts group == out channels with one input channel per group, not any grouped
    conv (Wav2Vec2-style positional convs are grouped, not depthwise)."""
    from onnx import helper, numpy_helper

    def conv(w_shape, group):
        w = numpy_helper.from_array(np.zeros(w_shape, np.float32), "w")
        node = helper.make_node("Conv", ["x", "w"], ["y"], group=group)
        x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, None)
        y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
        return helper.make_model(helper.make_graph([node], "g", [x], [y], [w]))

    assert EXPORT._depthwise(conv((8, 1, 3, 3), 8)) == 1
    assert EXPORT._depthwise(conv((8, 2, 3, 3), 4)) == 0  # grouped, two channels a group
    assert EXPORT._depthwise(conv((8, 8, 3, 3), 1)) == 0


def _depthwise_calls(mod) -> int:
    """call_tir sites in main whose kernel is one of the depthwise kernels."""
    from blockforge.compile.conv import depthwise

    import tvm

    names = (f'"{depthwise.CONV_BLOCK}"', f'"{depthwise.TOKENS_CONV_BLOCK}"')
    kernels = {gv.name_hint for gv, f in mod.functions_items()
               if isinstance(f, tvm.tirx.PrimFunc) and any(n in f.script() for n in names)}
    return sum(getattr(getattr(b.value, "op", None), "name", None) == "relax.call_tir"
               and b.value.args[0].name_hint in kernels
               for blk in mod["main"].body.blocks for b in blk.bindings)


@pytest.mark.parametrize("entry", MODELS, ids=[e["file"][:-5] for e in MODELS])
def test_family_compiles_fuses_and_matches_ort(entry, tmp_path, monkeypatch, caplog):
    import logging

    from blockforge.compile import VerifyOptions, open_model, verify
    from blockforge.compile.pipeline import run_phases

    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")  # in-process: the isolation child has its own tests
    path = FIXTURES / entry["file"]
    inputs = EXPORT.example_inputs(entry["kind"])
    shapes = {k: tuple(v.shape) for k, v in inputs.items()}
    session = open_model(path, "host", shapes)
    with caplog.at_level(logging.INFO, logger="blockforge.attention"):
        _, calls, left = fused_attention_counts(session)
    why = UNFUSED.get(entry["family"])
    if why is None:
        assert (calls, left) == (entry["softmax"], 0), (entry["file"], calls, left)
    else:
        lines = [r.getMessage() for r in caplog.records if "attention not fused" in r.getMessage()]
        assert (calls, left, len(lines)) == (0, entry["softmax"], entry["softmax"]) and why in lines[0], lines
    if entry["convs"]:
        # after optimize: patch convs (kernel == stride) are fast_math's, the rest conv-gemm's
        mod, _ = run_phases(session.relax(), session.target, stop_after="optimize")
        text = mod.script()
        assert text.count("R.nn.conv1d") + text.count("R.nn.conv2d") == 0, "a conv left to TVM's schedule"
        assert _depthwise_calls(mod) == entry["depthwise_convs"], entry["file"]
    npz = save_npz(tmp_path / "inputs.npz", **inputs)
    report = verify(VerifyOptions(model=path, inputs=npz, target="host", shape=shapes, use_tuning=False), session)
    assert {c.pair for c in report.comparisons} == {"tvm vs ort"}, report
    assert report.passed, [c for c in report.comparisons if not c.passed]
