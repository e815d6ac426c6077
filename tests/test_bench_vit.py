"""Smoke runs of the vit scripts (benchmarks/vit_gemm.py, attention_qtile.py, whole_ab.py): tiny
shapes, few samples; they prove the scripts run and check their outputs, they measure nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tvm")
REPO = Path(__file__).resolve().parents[1]


def _run(*args, tmp_path: Path, env: dict | None = None) -> str:
    e = {**os.environ, "BLOCKFORGE_LOG": str(tmp_path / "blockforge.log"), **(env or {})}
    p = subprocess.run([sys.executable, *map(str, args)], cwd=tmp_path, env=e, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "Traceback" not in p.stderr, f"{args}: rc={p.returncode}\n{p.stdout}\n{p.stderr}"
    return p.stdout


def test_vit_gemm(tmp_path):
    out = _run(REPO / "benchmarks/vit_gemm.py", "--ms", "197", "--shapes", "32x128", "--ab", "row-tiles",
               "--repeat", "2", tmp_path=tmp_path)
    assert "M=197:" in out and "M=197-row-tiles:" in out, out


def test_attention_qtile(tmp_path):
    out = _run(REPO / "benchmarks/attention_qtile.py", "--sq", "37", "--tiles", "64x64", "--repeat", "2",
               "--cpu-time", tmp_path=tmp_path, env={"TVM_NUM_THREADS": "1"})
    assert "'64x64'" in out and "balanced" in out, out


def test_whole_ab(tmp_path):
    out = _run(REPO / "benchmarks/whole_ab.py", REPO / "tests/fixtures/models/vit_sdpa_dynamo_op18.onnx",
               "--dims", "s33=1", "--ab", "row-tiles", "--repeat", "2", tmp_path=tmp_path)
    assert "new / without row-tiles:" in out and "best peer" in out, out


def test_attention_qtile_exp2(tmp_path):
    """--ab-exp2 (ablation attention-exp2) at Whisper's model layout, (b, s, h, d), scale 1."""
    out = _run(REPO / "benchmarks/attention_qtile.py", "--sq", "45", "--heads", "2", "--layout", "bshd", "--scale", "1",
               "--tiles", "64x64", "--ab-exp2", "--repeat", "2", "--cpu-time", tmp_path=tmp_path,
               env={"TVM_NUM_THREADS": "1"})
    assert "fast_exp'" in out and "balanced" in out, out
