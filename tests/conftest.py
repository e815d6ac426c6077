"""Shared helpers: run the CLI as a user would, small specs, GPU skipping."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

BLOCKFORGE = [sys.executable, "-m", "blockforge"]
REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    """Tests keep per-user state out of the user's cache: a cache under build/ (git-ignored),
    whose edge-app builds are reused between runs (the aarch64 runtime takes minutes) and
    whose default tuning databases start empty every run. In-process library calls get the
    CLI's thread settings (blockforge.configure), but keep native output on the terminal
    (pytest captures it)."""
    import shutil

    import blockforge

    if "BLOCKFORGE_CACHE_DIR" not in os.environ:
        cache = REPO / "build" / "test-cache"
        shutil.rmtree(cache / "tuning", ignore_errors=True)
        cache.mkdir(parents=True, exist_ok=True)
        os.environ["BLOCKFORGE_CACHE_DIR"] = str(cache)
    blockforge.configure(redirect_native_output=False)


@dataclass
class CliResult:
    rc: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err


def run_cli(*args, cwd: Path | None = None, timeout: float = 600, env: dict | None = None) -> CliResult:
    e = dict(os.environ)
    e.update(env or {})
    if cwd is not None:
        e.setdefault("BLOCKFORGE_LOG", str(Path(cwd) / "blockforge.log"))
    p = subprocess.run([*BLOCKFORGE, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                       timeout=timeout, env=e)
    return CliResult(p.returncode, p.stdout, p.stderr)


def assert_user_error(res: CliResult, *fragments: str, rc: int = 2) -> None:
    """One clear error line, the expected exit code, no traceback."""
    assert res.rc == rc, f"rc={res.rc}\n{res.text}"
    assert "Traceback" not in res.text, res.text
    errs = [ln for ln in res.err.splitlines() if ln.startswith("blockforge: error:")]
    assert len(errs) == 1, res.err
    for f in fragments:
        assert f.lower() in errs[0].lower(), errs[0]


def gpu_present() -> bool:
    from blockforge.targets.resolve import cuda_device_present

    return cuda_device_present()


def pytest_collection_modifyitems(config, items):
    if gpu_present():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine (gpu tests run where one is present)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BLOCKFORGE_LOG", str(tmp_path / "blockforge.log"))
    return tmp_path


def save_npz(path: Path, **arrays: np.ndarray) -> Path:
    np.savez(path, **arrays)
    return path
