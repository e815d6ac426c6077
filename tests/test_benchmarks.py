"""Every benchmark script runs: toy sizes, one or two samples, in make test.

README quotes numbers from these scripts; one that no test runs rots unseen (issue #18:
benchmarks/dynamic_seq.py failed at once on a private name a refactor had renamed).
These runs measure nothing; they prove each script still imports only what exists and
goes end to end. A new script under benchmarks/ must get a case here (the last test).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

# Among the longest files: marked slow as a whole, so `make test` starts it first (conftest
# _heavy_first) and `make check` never picks it up.
pytestmark = pytest.mark.slow

BENCH = REPO / "benchmarks"


def _run(script: str, *args, cwd: Path, env: dict | None = None, timeout: float = 600) -> str:
    e = dict(os.environ)
    e.setdefault("BLOCKFORGE_LOG", str(cwd / "blockforge.log"))
    e.update(env or {})
    p = subprocess.run([sys.executable, str(BENCH / script), *map(str, args)], cwd=cwd, env=e,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{script} {' '.join(map(str, args))}: rc={p.returncode}\n{p.stdout}\n{p.stderr}"
    assert "Traceback" not in p.stderr, p.stderr
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


def test_int8_gemm(tmp_path):
    out = _run("int8_gemm.py", "--smoke", "--repeat", 1, cwd=tmp_path)
    # the kernels the FFN runs (its two specs) beside the bare one, none interleaved with numpy
    assert "no AVX-512 VNNI" in out or (out.count("x the SGEMM ceiling") == 4 and "VNNI probe" in out
                                        and "int8 FFN 8x64x128 scale=scalar +bias +gelu" in out
                                        and out.count("blockforge int8 (after)") == 2), out


def test_int8_gemm_one_thread_tiles(tmp_path):
    out = _run("int8_gemm.py", "--smoke", "--repeat", 1, "--threads", 1, "--gemm-only", "--tiles", cwd=tmp_path)
    assert "no AVX-512 VNNI" in out or ("1 thread(s), CPU time" in out and out.count("time / default 6x64 tiles") == 2
                                        and "blockforge int8 (after)" not in out), out


def test_compile_memory(tmp_path):
    out = _run("compile_memory.py", "--smoke", "--shape", "batch=1,seq=8", cwd=tmp_path)
    assert "compile peak RSS (parent + children)" in out and "x the weights" in out, out


def test_bf16_gemm(tmp_path):
    out = _run("bf16_gemm.py", "--smoke", "--repeat", 1, cwd=tmp_path)
    assert "no AVX512_BF16" in out or ("x the SGEMM ceiling" in out and "blockforge bf16:" in out), out


SMOKED = {"compile_memory.py", "bf16_gemm.py", "conv.py", "int8_gemm.py", "attention.py", "dynamic_seq.py", "attention_layouts.py", "fp16_cpu.py", "patch_conv.py",
          "ragged_matmul.py", "peers.py", "run.py", "ship_records.py", "export_models.py"}


def test_every_benchmark_script_has_a_smoke_run():
    scripts = {p.name for p in BENCH.glob("*.py")}
    assert scripts == SMOKED, f"give the new script a smoke test here: {sorted(scripts ^ SMOKED)}"
