"""The test run ends by naming each group of skipped tests, why, and the command that enables
it (tests/conftest.py pytest_terminal_summary), on the terminal or in the file `make test`
prints last."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import EDGE_DEBS, EDGE_DEPS_STATUS, skipped_groups_lines

SUITE = '''
import pytest

def test_runs():
    pass

@pytest.mark.skipif(True, reason="aarch64-linux-gnu-g++ not installed (Debian package g++-aarch64-linux-gnu)")
def test_cross():
    pass

@pytest.mark.parametrize("n", [1, 2])
def test_qemu(n):
    pytest.skip("qemu-aarch64 or the aarch64 sysroot /usr/aarch64-linux-gnu missing")

def test_gpu():
    pytest.skip("no CUDA GPU on this machine (gpu tests run where one is present)")

def test_other():
    pytest.skip("the host is aarch64: nothing to cross-build")
'''


def _run_suite(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    shutil.copy2(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_fake.py").write_text(SUITE)
    env = {**os.environ, EDGE_DEPS_STATUS: "not root (uid 1000): run `sudo apt-get install x`"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
                           str(tmp_path), str(tmp_path), *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)


def test_groups_with_reason_and_enabling_command():
    lines = skipped_groups_lines([
        "aarch64-linux-gnu-g++ not installed (Debian package g++-aarch64-linux-gnu)",
        "qemu-aarch64 or the aarch64 sysroot /usr/aarch64-linux-gnu missing",
        "qemu-aarch64 or the aarch64 sysroot /usr/aarch64-linux-gnu missing",
        "no CUDA GPU on this machine (gpu tests run where one is present)",
        "CUDA builds need nvcc: nvcc not found",
        "the host is aarch64: nothing to cross-build",
    ])
    text = "\n".join(lines)
    assert lines[0] == "aarch64 edge tests (cross-build + qemu): 3 tests skipped", text
    assert f"enable:  apt-get install {EDGE_DEBS}" in text
    assert "qemu-aarch64 or the aarch64 sysroot /usr/aarch64-linux-gnu missing (2)" in text
    assert "gpu tests (CUDA device): 1 test skipped" in text and "NVIDIA GPU" in text
    assert "CUDA build tests (nvcc): 1 test skipped" in text and "nvcc on PATH" in text
    assert "other skips: 1 test skipped" in text and "the host is aarch64" in text
    # every group that was skipped says how to enable it, and the edge group why make test did not
    assert text.count("enable:") == 3 and text.count("not installed:") == 1
    assert skipped_groups_lines([]) == ["no test was skipped: every group ran"]


def test_summary_on_the_terminal_and_in_the_file(tmp_path):
    r = _run_suite(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "SKIPPED TEST GROUPS: 5 tests did not run" in out, out
    assert "aarch64 edge tests (cross-build + qemu): 3 tests skipped" in out
    assert "not installed: not root (uid 1000)" in out
    assert "gpu tests (CUDA device): 1 test skipped" in out and "other skips: 1 test skipped" in out

    dest = tmp_path / "out" / "skipped.txt"
    r = _run_suite(tmp_path, "--skip-summary", str(dest))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SKIPPED TEST GROUPS" not in r.stdout  # `make test` prints the file last instead
    text = dest.read_text()
    assert text.startswith("==== SKIPPED TEST GROUPS: 5 tests did not run ====")
    assert f"enable:  apt-get install {EDGE_DEBS}" in text and "gpu tests (CUDA device)" in text
