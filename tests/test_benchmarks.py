"""Every benchmark script runs: toy sizes, one or two samples, in make test.

README quotes numbers from these scripts; one that no test runs rots unseen (issue #18:
benchmarks/dynamic_seq.py failed at once on a private name a refactor had renamed).
These runs measure nothing; they prove each script still imports only what exists and
goes end to end. A new script under benchmarks/ must get a case here (the last test).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import re
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_cli_in_process

# Among the longest files: marked slow as a whole, so `make test` starts it first (conftest
# _heavy_first) and `make check` never picks it up.
pytestmark = pytest.mark.slow

BENCH = REPO / "benchmarks"
# In TMPDIR but not ours: ORT's telemetry SDK's session id (`.ses`), torch's inductor cache.
THIRD_PARTY_TMP = r"\.ses|torchinductor_.+"


def _run(script: str, *args, cwd: Path, env: dict | None = None, timeout: float = 600) -> str:
    """The script's stdout; it exited 0, without a traceback, and left nothing in its TMPDIR
    (three scripts' mkdtemp()s had left ~6 exported-model directories in /tmp per CI run)."""
    e = dict(os.environ)
    e.setdefault("BLOCKFORGE_LOG", str(cwd / "blockforge.log"))
    tmpdir = cwd / "tmpdir"
    tmpdir.mkdir(exist_ok=True)
    e["TMPDIR"] = str(tmpdir)
    e.update(env or {})
    p = subprocess.run([sys.executable, str(BENCH / script), *map(str, args)], cwd=cwd, env=e,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{script} {' '.join(map(str, args))}: rc={p.returncode}\n{p.stdout}\n{p.stderr}"
    assert "Traceback" not in p.stderr, p.stderr
    if e["TMPDIR"] == str(tmpdir):  # other libraries' caches, each one entry reused by every run, aside
        left = sorted(x.name for x in tmpdir.iterdir() if not re.fullmatch(THIRD_PARTY_TMP, x.name))
        assert left == [], f"{script} left in TMPDIR: {left[:5]}"
    return p.stdout


@pytest.fixture(scope="module")
def tiny_mha(tmp_path_factory):
    """A toy MHA export with seq left symbolic (dynamic_seq binds only batch)."""
    from blockforge.graph import MHASpec, export

    return export(MHASpec(d_model=32, heads=2), tmp_path_factory.mktemp("bench") / "mha.onnx").model_path


def test_attention_ab(tiny_mha, tmp_path):
    out = _run("attention.py", tiny_mha, "--seq", 8, "--repeat", 1, "--profile", "--json", tmp_path / "a.json",
               cwd=tmp_path)
    assert "| 8 | fused |" in out and "top kernels" in out, out
    assert (tmp_path / "a.json").is_file()


def test_attention_tiles(tiny_mha, tmp_path):
    out = _run("attention.py", tiny_mha, "--seq", 8, "--repeat", 1, "--tiles", cwd=tmp_path)
    assert "seq 8 " in out and " *" in out, out


def test_dynamic_seq(tiny_mha, tmp_path):
    out = _run("dynamic_seq.py", tiny_mha, "--seq", 8, 16, "--repeat", 1, "--unfused", cwd=tmp_path)
    for build in ("static", "dynamic", "dynamic-unfused"):
        assert f"| 16 | {build} |" in out, out


def test_attention_layouts(tmp_path):
    out = _run("attention_layouts.py", "--d-model", 32, "--heads", 2, "--seq", 8, "--repeat", 1, cwd=tmp_path)
    assert out.count("max |packed - attention-op|") == 2, out


def test_fp16_cpu(tmp_path):
    out = _run("fp16_cpu.py", "--smoke", "--repeat", 1, cwd=tmp_path)
    assert "tiny_ffn_fp16 seq 8" in out and "same positions" in out, out


def test_conv(tmp_path):
    out = _run("conv.py", "--smoke", "--json", tmp_path / "c.json", cwd=tmp_path)
    for case in ("whisper_front", "wav2vec2_fe", "wav2vec2_pos"):
        assert f"| {case} | untuned |" in out, out
    assert (tmp_path / "c.json").is_file()


def test_conv_ablation_ab(tmp_path):
    out = _run("conv.py", "--smoke", "--ab", "conv-panels,conv-implicit", "--case", "wav2vec2_pos", cwd=tmp_path)
    assert "wav2vec2_pos: ort" in out and "without conv-panels,conv-implicit" in out and "new / without " in out, out


def test_patch_conv(tmp_path):
    assert "ms per call" in _run("patch_conv.py", cwd=tmp_path)


def test_ragged_matmul(tmp_path):
    assert "ms per call" in _run("ragged_matmul.py", cwd=tmp_path)


def test_peers(tmp_path):
    out = _run("peers.py", "--smoke", "--repeat", 3, "--against", "ort,untuned", "--out", tmp_path / "res",
               cwd=tmp_path)
    assert "tiny_block_s8" in out, out
    assert sorted(p.suffix for p in (tmp_path / "res").iterdir()) == [".json", ".md", ".png"]


def test_run_suite(tmp_path):
    out = _run("run.py", "--smoke", "--repeat", 3, "--out", tmp_path / "res", cwd=tmp_path)
    assert "wrote" in out, out
    assert sorted(p.suffix for p in (tmp_path / "res").iterdir()) == [".json", ".md", ".png"]


def test_ship_records(tmp_path):
    from blockforge.targets import resolve

    if (problem := resolve("x86-64-avx512").run_problem()) is not None:
        pytest.skip(f"x86-64-avx512 records cannot be tuned on this CPU: {problem}")
    out = _run("ship_records.py", "--smoke", "--trials-per-task", 1, "--dest", tmp_path / "shipped", cwd=tmp_path,
               env={"BLOCKFORGE_CACHE_DIR": str(tmp_path / "cache")})
    assert "records to" in out, out
    assert (tmp_path / "shipped" / "database_tuning_record.json").is_file()


def test_ship_records_refuses_toy_records_over_the_shipped_ones(tmp_path):
    p = subprocess.run([sys.executable, str(BENCH / "ship_records.py"), "--smoke"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "give --dest" in p.stderr, p.stderr


def test_export_models(tmp_path):
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        pytest.skip("torch/transformers not installed (pip install '.[export]'): benchmarks/export_models.py")
    out = _run("export_models.py", "tiny", "--models", "bert", "--exporters", "legacy", "--opsets", "17",
               "--out", tmp_path, cwd=tmp_path)
    assert "wrote" in out, out


def test_export_families(tmp_path):
    """One family exported into a fresh folder: its file and an index entry with the counts
    tests/test_families.py holds the compiler to."""
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        pytest.skip("torch/transformers not installed (pip install '.[export]'): benchmarks/export_families.py")
    out = _run("export_families.py", "--families", "mobilenet_v1", "--exporters", "legacy", "--out", tmp_path / "f",
               cwd=tmp_path)
    assert "wrote" in out, out
    (entry,) = json.loads((tmp_path / "f" / "index.json").read_text())["models"]
    assert entry["file"] == "mobilenet_v1_legacy.onnx" and entry["depthwise_convs"] == 13 and entry["softmax"] == 0


def test_export_families_refuses_unknown_names(tmp_path):
    """Checked before torch is imported: one line and exit 2 on a machine without it too."""
    p = subprocess.run([sys.executable, str(BENCH / "export_families.py"), "--families", "resnet,nosuch",
                        "--out", tmp_path], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "unknown: nosuch" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "index.json").exists()


def test_int8_gemm(tmp_path):
    out = _run("int8_gemm.py", "--smoke", "--repeat", 1, "--no-avx512", "--no-vnni", cwd=tmp_path)
    from blockforge.targets import resolve

    if resolve("x86-64-avxvnni").run_problem() is None:  # --no-avx512: both FFNs' builds for the AVX2-class presets
        # (--no-vnni's fp32 build for x86-64-avx2 is the same contender)
        assert out.count("blockforge int8, x86-64-avxvnni") == 2 and out.count("blockforge fp32, x86-64-avx2") == 2, out
    if resolve("x86-64-avx512").run_problem() is None:  # --no-vnni: 7-bit int8 on VPMADDUBSW, equal to ORT on its file
        assert re.findall(r"blockforge int8 7-bit, x86-64-avx(?:2|512): max \|blockforge - ORT on the 7-bit file\| "
                          r"(\S+)", out) and "rel L2 against the fp32 FFN" in out, out
        assert out.count("blockforge int8 full-range, x86-64-avx512:") == 2, out
    # the kernels the dynamic and the QDQ FFN run (two specs each, QDQ's with its requantize chain
    # in the epilogue) beside the bare one, none interleaved with numpy
    # (+ the dynamic FFN's two at the 6 x 4 tile, the int8-stack-tiles ablation)
    assert "no AVX-512 VNNI" in out or (out.count("x the SGEMM ceiling") == 9 and "VNNI probe" in out
                                        and out.count("(int8-stack-tiles off)") == 4
                                        and "int8 FFN 8x64x128 scale=scalar +bias +gelu" in out
                                        and "int8 QDQ FFN 8x64x128 scale=column +bias >qdq(int8) >bias >qdq(int8) "
                                            ">gelu >q(uint8)" in out
                                        and out.count("blockforge int8 (after)") == 2
                                        and out.count("blockforge int8 (int8-qdq-epilogue off)") == 1), out


def test_int8_gemm_one_thread_tiles(tmp_path):
    out = _run("int8_gemm.py", "--smoke", "--repeat", 1, "--threads", 1, "--gemm-only", "--tiles", "--seq", 12,
               cwd=tmp_path)
    assert "no AVX-512 VNNI" in out or ("1 thread(s), CPU time" in out and len(re.findall(r"time / default \d+x\d+ tiles", out)) == 4
                                        and "int8 FFN 12x64x128" in out and "blockforge int8 (after)" not in out), out


def test_compile_memory(tmp_path):
    out = _run("compile_memory.py", "--smoke", "--shape", "batch=1,seq=8", cwd=tmp_path)
    assert "compile peak RSS (parent + children)" in out and "x the weights" in out, out


def test_bf16_gemm(tmp_path):
    out = _run("bf16_gemm.py", "--smoke", "--repeat", 1, "--blocks", "ffn,mha,block", "--ab", "bf16-attention",
               cwd=tmp_path)
    assert "no AVX512_BF16" in out or ("x the SGEMM ceiling" in out and out.count("blockforge bf16:") == 3
                                       and out.count("blockforge bf16 (bf16-attention off):") == 3
                                       and all(f"{b} d_model 64" in out for b in ("FFN", "MHA", "BLOCK"))), out


def _whole_models_module():
    spec = importlib.util.spec_from_file_location("whole_models", BENCH / "whole_models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _whole_models_fails(*args, cwd: Path) -> str:
    p = subprocess.run([sys.executable, str(BENCH / "whole_models.py"), *map(str, args)], cwd=cwd,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, (p.returncode, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("whole_models.py: error: "), p.stderr
    return lines[0]


def test_whole_models(tmp_path):
    """--smoke on the committed tiny Wav2Vec2 (convolutions, attention and GEMMs in one model):
    every field the table promises is in the JSON, the markdown has its rows, the PNG is written."""
    out = _run("whole_models.py", "--smoke", "--only", "wav2vec2_base", "--out", tmp_path / "res", cwd=tmp_path)
    assert "wav2vec2_base: blockforge (untuned) at" in out, out
    res = tmp_path / "res"
    assert sorted(p.name for p in res.iterdir()) == [f"whole-models-smoke.{x}" for x in ("json", "md", "png")]
    doc = json.loads((res / "whole-models-smoke.json").read_text())
    assert doc["schema"] == "blockforge.whole_models/1" and doc["quotable"] is False
    assert doc["host"]["cpu_model"] and {"apache-tvm", "numpy"} <= set(doc["host"]["versions"])
    assert {"torch", "transformers"} <= set(doc["export_versions"])
    assert set(doc["sgemm"]["per_measurement"]) == {"before", "wav2vec2_base (before)", "wav2vec2_base", "after"}
    (m,) = doc["models"]
    assert m["model"] == "wav2vec2_base" and m["inputs"] == {"input_values": [1, 400]} and m["gflop"] > 0
    assert set(m["load_avg_1m"]) == {"before", "after"} and m["threads"] >= 1
    u = m["contenders"]["untuned"]
    assert u["ms"]["p10"] <= u["ms"]["median"] <= u["ms"]["p90"] and u["gflops"] > 0 and u["pct_of_sgemm"] > 0
    assert m["contenders"]["ort"]["ratio_to_best_peer"] is not None and m["best_peer"] in m["contenders"]
    assert m["headline"]["contender"] == "untuned"
    classes = m["profile"]["classes_pct"]
    assert list(classes) == ["GEMM", "attention", "conv", "elementwise/norm", "other"]
    assert abs(sum(classes.values()) - 100) < 1e-6 and classes["conv"] > 0 and classes["GEMM"] > 0
    assert m["profile"]["top_kernels"] and doc["reports"]["wav2vec2_base"]["schema"] == "blockforge.bench/4"
    md = (res / "whole-models-smoke.md").read_text()
    assert "**NOT QUOTABLE**: --smoke" in md and "| wav2vec2_base | " in md and "| GEMM | attention | conv |" in md


def test_whole_models_quotable_gate_and_export_cache(tmp_path):
    """Without --smoke: the models come from the export cache (tiny exports placed under their
    recipe keys: reused, no exporter needed); a ceiling below 90% of --quiet-ceiling makes the
    run not quotable, written beside (never over) a quotable table; a model that cannot run is
    a failed row (exit 1), the others are measured; a cached file that no longer matches its
    entry is not benchmarked."""
    wm = _whole_models_module()
    fixture = REPO / "tests" / "fixtures" / "whole_models"
    exporter = wm.load_exporter()
    for name in ("bert_base", "gpt2_small"):
        d = tmp_path / "cache" / f"{name}-{wm.recipe_key(exporter, name)}"
        d.mkdir(parents=True)
        for suffix in (".onnx", ".json"):
            (d / f"{name}{suffix}").write_bytes((fixture / f"{name}{suffix}").read_bytes())
    cached = tmp_path / "cache" / f"bert_base-{wm.recipe_key(exporter, 'bert_base')}"
    entry = json.loads((fixture / "gpt2_small.json").read_text())
    (tmp_path / "cache" / f"gpt2_small-{wm.recipe_key(exporter, 'gpt2_small')}" / "gpt2_small.json").write_text(
        json.dumps({**entry, "run_inputs": {"pixel_values": [1, 3, 8, 8]}}))  # not an input of GPT-2
    args = ("--repeat", 3, "--cache-dir", tmp_path / "cache", "--out", tmp_path / "res")
    p = subprocess.run([sys.executable, str(BENCH / "whole_models.py"), "--only", "bert_base,gpt2_small",
                        *map(str, args), "--quiet-ceiling", "1e9"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 1 and "Traceback" not in p.stderr, (p.returncode, p.stdout, p.stderr)
    assert "**NOT QUOTABLE**: SGEMM ceiling" in p.stdout and "below 90% of the quiet" in p.stdout, p.stdout
    assert "gpt2_small: FAILED: " in p.stdout and "Failed (not in the table):" in p.stdout, p.stdout
    doc = json.loads(next((tmp_path / "res").glob("whole-models-*-not-quotable.json")).read_text())
    assert doc["quotable"] is False and [m["model"] for m in doc["models"]] == ["bert_base"]
    assert doc["models"][0]["reused_export"] is True and "pixel_values" in doc["failed"][0]["error"]
    assert doc["quiet_ceiling"] == {"gflops": 1e9, "source": "--quiet-ceiling"}
    args = ("--only", "bert_base", *args)
    data = bytearray((cached / "bert_base.onnx").read_bytes())
    data[-1] ^= 1
    (cached / "bert_base.onnx").write_bytes(bytes(data))
    line = _whole_models_fails(*args, "--quiet-ceiling", 1, cwd=tmp_path)
    assert "bert_base is not in the cache" in line and "--export-python" in line, line


def test_whole_models_quiet_ceiling(tmp_path):
    """The default --quiet-ceiling is the newest quiet value under --out; none: exit 2, one line."""
    wm = _whole_models_module()
    res = tmp_path / "res"
    res.mkdir()
    line = _whole_models_fails("--only", "bert_base", "--out", res, cwd=tmp_path)
    assert "no quiet SGEMM ceiling" in line and "--quiet-ceiling" in line, line
    assert "unknown model(s) nope" in _whole_models_fails("--only", "nope", "--quiet-ceiling", 1, cwd=tmp_path)
    assert "--repeat must be at least 3" in _whole_models_fails("--repeat", 2, "--quiet-ceiling", 1, cwd=tmp_path)
    line = _whole_models_fails("--only", "bert_base", "--quiet-ceiling", 1, "--cache-dir", tmp_path / "empty",
                               "--export-python", tmp_path / "no-such-python", cwd=tmp_path)
    assert "--export-python" in line and "cannot run it" in line, line
    (res / "quiet-2026-11-30").mkdir()
    (res / "quiet-2026-11-30" / "conv.json").write_text(json.dumps({"reports": {"a": {"sgemm_gflops": 170.0},
                                                                                "b": {"sgemm_gflops": 190.0}}}))
    assert wm.last_quiet_ceiling(res) == (180.0, f"{res / 'quiet-2026-11-30'} (median of 2 ceilings)")
    table = {"schema": wm.SCHEMA, "date": "2026-12-01T10:00:00Z", "quotable": True, "sgemm": {"median": 200.0}}
    (res / "whole-models-vm.json").write_text(json.dumps(table))
    (res / "whole-models-vm-not-quotable.json").write_text(json.dumps({**table, "date": "2026-12-02", "quotable": False}))
    assert wm.last_quiet_ceiling(res) == (200.0, str(res / "whole-models-vm.json"))


def test_matvec(tmp_path):
    out = _run("matvec.py", "--smoke", cwd=tmp_path)
    for case in ("read, 1 thread", "96x273 read", "96x273 CPUMatmul", "96x273 CPUMatvec 1 thread"):
        assert f"| {case} |" in out, out
    out = _run("matvec.py", "--model", REPO / "tests/fixtures/models/gpt2_past_legacy_op17.onnx", "--past", 4,
               "--repeat", 3, cwd=tmp_path)
    assert "| blockforge |" in out and "| with matvec |" in out and "| ort |" in out, out


def test_norms(tmp_path):
    out = _run("norms.py", "--micro", "--repeat", 1,
               f"{REPO / 'tests/fixtures/models/llama_sdpa_dynamo_op18.onnx'}:s33=1,s50=8,s6=1", cwd=tmp_path)
    for what in ("RMSNorm (1, 128, 768): with rms-norm", "SwiGLU (1, 128, 2 x 2048): with fast-sigmoid",
                 "llama_sdpa_dynamo_op18.onnx: with rms-norm", "RoPE, Llama GQA 12/4 (1, 128, 20 x 64): with qkv-heads",
                 "QKV heads, GPT-2 (1, 128, 36 x 64): with qkv-heads"):
        assert what in out, out


def test_decode_key_rows(tmp_path):
    out = _run("decode_key_rows.py", "--model", REPO / "tests/fixtures/models/gpt2_past_legacy_op17.onnx", "--past", 3,
               "--repeat", 3, cwd=tmp_path)
    assert "P=3: K rows" in out and "the K^T build" in out and "ORT" in out, out


def test_int8_decode(tmp_path):
    fp32 = REPO / "tests/fixtures/models/gpt2_past_legacy_op17.onnx"
    res = run_cli_in_process("quantize", str(fp32), "--mode", "dynamic", "-o", str(tmp_path / "q.onnx"))
    assert res.rc == 0, res.text
    out = _run("int8_decode.py", "--fp32", fp32, "--int8", tmp_path / "q.onnx", "--past", "0,4", "--repeat", 3,
               "--vocab", 128, cwd=tmp_path)
    assert "P = 4: logits max |blockforge - ORT|" in out and "| 4 |" in out, out


def test_int8_whole(tmp_path):
    res = run_cli_in_process("quantize", str(REPO / "tests/fixtures/models/bert_legacy_op17.onnx"), "--mode", "dynamic",
                             "-o", str(tmp_path / "q.onnx"))
    assert res.rc == 0, res.text
    out = _run("int8_whole.py", tmp_path / "q.onnx", "--seq", 8, "--repeat", 2, "--threads", 1, cwd=tmp_path)
    assert "blockforge: max |out - ORT|" in out and "| ort |" in out and "blockforge / best peer:" in out, out


def test_decode_entries(tmp_path):
    out = _run("decode_entries.py", "--model", REPO / "tests/fixtures/models/gpt2_past_legacy_op17.onnx", "--past", 3,
               "--prompt", 4, "--repeat", 3, cwd=tmp_path)
    assert "P=3" in out and "loop step / loop main" in out and "run --decode loop from P=3" in out, out
    assert "prefill seq=4" in out, out


def test_decode_entries_cache_copy(tmp_path):
    """--cache-copy: the tiny GPT-2's 4 cache copies per step (2 layers x K, V), bytes as counted:
    each reads P + 1 rows of 4 heads x 8 floats and writes P + 1: 4 x 2 x 4 x 128 B."""
    out = _run("decode_entries.py", "--model", REPO / "tests/fixtures/models/gpt2_past_legacy_op17.onnx", "--past", 3,
               "--cache-copy", cwd=tmp_path)
    assert "P=3" in out and "4 cache copies per step move 0.0 MB (4096 B)" in out and "prefill" not in out, out


def test_decode_inplace(tmp_path):
    """The copying loop, the in-place loop and both bare entries at P = 3 of the tiny GPT-2
    compiled with --kv-capacity (the loops' tokens checked equal by the script)."""
    model = REPO / "tests/fixtures/models/gpt2_past_legacy_op17.onnx"
    res = run_cli_in_process("compile", model, "--target", "host", "--shape", "batch=1", "--kv-capacity", 16,
                             "-o", tmp_path / "a", cwd=tmp_path)
    assert res.rc == 0, res.text
    out = _run("decode_inplace.py", "--artifact", tmp_path / "a", "--model", model, "--past", 3, "--rounds", 1,
               "--steps", 4, cwd=tmp_path)
    assert "P=3" in out and "inplace loop / copy loop" in out and "bare inplace / bare step" in out, out


SMOKED = {"decode_key_rows.py", "norms.py", "int8_whole.py", "int8_decode.py", "compile_memory.py", "bf16_gemm.py", "conv.py", "int8_gemm.py", "attention.py", "dynamic_seq.py", "attention_layouts.py", "fp16_cpu.py", "patch_conv.py",
          "ragged_matmul.py", "matvec.py", "peers.py", "run.py", "ship_records.py", "export_models.py", "whole_models.py",
          "export_families.py"}
SMOKED |= {"vit_gemm.py", "attention_qtile.py", "whole_ab.py"}  # vit (issue #20): tests/test_bench_vit.py
SMOKED |= {"decode_entries.py", "decode_inplace.py"}  # decode (issue #21): test_decode_entries, test_decode_inplace above


def test_every_benchmark_script_has_a_smoke_run():
    scripts = {p.name for p in BENCH.glob("*.py")}
    assert scripts == SMOKED, f"give the new script a smoke test here: {sorted(scripts ^ SMOKED)}"



def test_whole_ab_on_a_decoder_with_presents(tmp_path):
    """A decoder returns a tuple (logits, presents): whole_ab compares the first output (it
    called .numpy() on the tuple before)."""
    model = REPO / "tests" / "fixtures" / "models" / "gpt2_past_legacy_op17.onnx"
    out = _run("whole_ab.py", model, "--dims", "batch=1,seq=1,past=16,past_seq=17", "--ab", "attention-key-rows",
               "--repeat", 2, "--no-peers", cwd=tmp_path)
    assert "new / without attention-key-rows:" in out, out


def test_whole_ab_at_bf16(tmp_path):
    """--precision bf16: both builds through bf16-gemm (the A/B of a bf16 ablation), outputs held
    to the bf16 row; OpenVINO, when it runs, with its bf16 hint."""
    from blockforge.graph import FFNSpec, export
    from blockforge.targets import resolve
    from blockforge.targets.precision import target_has

    if not target_has(resolve("host"), "avx512bf16"):
        pytest.skip("the bf16 kernel needs AVX512_BF16")
    model = export(FFNSpec(d_model=64, d_ff=128), tmp_path / "ffn.onnx").model_path
    out = _run("whole_ab.py", model, "--dims", "batch=1,seq=16", "--ab", "bf16-row-fit", "--precision", "bf16",
               "--repeat", 2, "--no-peers", cwd=tmp_path)
    assert "new / without bf16-row-fit:" in out, out


def test_whole_ab_abba_on_a_quantized_model(tmp_path):
    """--abba: four builds, both pairs and their geometric mean; a quantized model's outputs are
    held to the int8 parity row (the script asserted rtol 2e-3 before, which int8 fails by design)."""
    pytest.importorskip("onnxruntime.quantization")
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from blockforge.graph import MHASpec, export

    fp32 = export(MHASpec(d_model=64, heads=4), tmp_path / "mha.onnx").model_path
    quantize_dynamic(str(fp32), str(tmp_path / "mha_q.onnx"), weight_type=QuantType.QInt8)
    out = _run("whole_ab.py", tmp_path / "mha_q.onnx", "--dims", "batch=1,seq=16", "--ab", "int8-combine",
               "--repeat", 2, "--no-peers", "--abba", cwd=tmp_path)
    assert "'new (2)'" in out and "'without int8-combine (2)'" in out, out
    assert "(new built first)" in out and "(new built last)" in out and "geometric mean" in out, out
