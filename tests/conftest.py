"""Shared helpers: run the CLI as a user would, small specs, GPU skipping."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

BLOCKFORGE = [sys.executable, "-m", "blockforge"]
REPO = Path(__file__).resolve().parents[1]


def pytest_addoption(parser):
    parser.addoption("--skip-summary", default=None, metavar="FILE",
                     help="write the skipped-groups summary to FILE instead of the terminal "
                          "(`make test` prints it last, after pytest's own summary)")


def pytest_configure(config):
    """Tests keep per-user state out of the user's cache: a cache under build/ (git-ignored),
    whose edge-app builds are reused between runs (the aarch64 runtime takes minutes) and
    whose default tuning databases start empty every run. In-process library calls get the
    CLI's thread settings (blockforge.configure), but keep native output on the terminal
    (pytest captures it)."""
    import shutil

    import blockforge

    if hasattr(config, "workerinput"):
        # A pytest-xdist worker (`make test` runs two): the controller made the cache (the
        # workers inherit its environment) and must be the only one to empty it. Two workers
        # on two cores: one TVM thread each, not two pools spinning against each other.
        os.environ.setdefault("TVM_NUM_THREADS", "1")
    elif "BLOCKFORGE_CACHE_DIR" not in os.environ:
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


def run_cli_in_process(*args, cwd: Path | None = None, env: dict | None = None) -> CliResult:
    """`blockforge ARGS` through blockforge.cli.main in this process: what run_cli returns,
    without an interpreter start and a TVM import per call (~2-3 s of CPU each). For error
    tables and verbs whose output is under test; keep run_cli (a real process) where the exit
    status of the process, signals, isolation or the entry point are. The verb still starts
    its own children (the isolation check). The process-wide state the CLI sets up (cwd,
    environment, the log handler, settings.STATE, signal handlers) is restored afterwards."""
    from blockforge import settings
    from blockforge.cli import main

    env = dict(env or {})
    if cwd is not None:
        env.setdefault("BLOCKFORGE_LOG", str(Path(cwd) / "blockforge.log"))
    saved_env = {k: os.environ.get(k) for k in env}
    saved_state = dict(vars(settings.STATE))
    saved_cwd = os.getcwd()
    root = logging.getLogger()
    saved_level = root.level

    def drop_log_handlers():  # each call logs to its own BLOCKFORGE_LOG, as a process would
        for h in [h for h in root.handlers if getattr(h, "_blockforge", False)]:
            root.removeHandler(h)
            h.close()

    out, err = io.StringIO(), io.StringIO()
    try:
        os.environ.update({k: str(v) for k, v in env.items()})
        if cwd is not None:
            os.chdir(cwd)
        drop_log_handlers()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main([str(a) for a in args])
            except SystemExit as e:  # argparse's --help and usage errors
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        drop_log_handlers()
        root.setLevel(saved_level)
        os.chdir(saved_cwd)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        vars(settings.STATE).update(saved_state)
    return CliResult(rc, out.getvalue(), err.getvalue())


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


def pytest_report_header(config):
    import blockforge

    where = Path(blockforge.__file__).parent
    kind = "source tree (tests/devtree.py)" if "dev-src" in where.parts else "installed package"
    return f"blockforge under test: {where} ({kind})"


def _heavy_first(items) -> None:
    """Files marked slow as a whole (module pytestmark) run first, in their order: with
    `make test`'s two workers (one file each at a time, pytest-xdist --dist loadfile) the long
    files start at once and the short ones fill the gaps, instead of a long file at the end
    running alone. Same order on every worker (xdist checks that)."""
    def module_slow(item) -> bool:
        marks = getattr(getattr(item, "module", None), "pytestmark", [])
        marks = marks if isinstance(marks, list) else [marks]
        return any(m.name == "slow" for m in marks)

    items.sort(key=lambda item: not module_slow(item))  # stable: order within each part kept


# The isolation child (compile/isolate.py: a second interpreter that loads, checks and imports
# an untrusted model under resource limits) costs ~2 s of CPU per verb: in the profile of the
# whole suite (2026-12-03) 384 children, 716 s, 30% of the suite's CPU (121 children, 190 s
# after this). It is under test only where a file says so (`pytestmark =
# pytest.mark.isolation`: hostile models, interrupts, errors crossing from the child, the
# prelude, the wheel); every other test runs with BLOCKFORGE_ISOLATE=0, the same checks done
# in-process. A BLOCKFORGE_ISOLATE given from outside (`BLOCKFORGE_ISOLATE=1 make test`) wins.
_ISOLATE_FROM_OUTSIDE = "BLOCKFORGE_ISOLATE" in os.environ


def pytest_runtest_setup(item):
    """Before the item's fixtures (module-scoped ones included, built during the first item's
    setup), so a module fixture's compiles follow its file's choice; a test's own
    monkeypatch.setenv still overrides it."""
    if not _ISOLATE_FROM_OUTSIDE:
        os.environ["BLOCKFORGE_ISOLATE"] = "1" if item.get_closest_marker("isolation") else "0"


def pytest_collection_modifyitems(config, items):
    _heavy_first(items)
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


def compiled_ffn(d: Path, d_model: int, seq: int) -> dict:
    """A small FFN exported and compiled for host at batch=1,seq=`seq`, with ones as inputs:
    {"model", "art", "inputs"} (the robustness suites' common starting point)."""
    from blockforge.graph import FFNSpec, export

    model = export(FFNSpec(d_model=d_model, d_ff=2 * d_model), d / "ffn.onnx").model_path
    art = d / "ffn.host"
    r = run_cli("compile", model, "--target", "host", "--shape", f"batch=1,seq={seq}", "-o", art, cwd=d)
    assert r.rc == 0, r.text
    np.savez(d / "in.npz", x=np.ones((1, seq, d_model), np.float32))
    return {"model": model, "art": art, "inputs": d / "in.npz"}


def save_npz(path: Path, **arrays: np.ndarray) -> Path:
    np.savez(path, **arrays)
    return path


# ------------------------------------------------------------------ skipped groups

EDGE_DEBS = "g++-aarch64-linux-gnu qemu-user"
# Set by `make test` (.ci/edge-deps): what it did about the edge tests' Debian packages.
EDGE_DEPS_STATUS = "EDGE_DEPS_STATUS"


@dataclass(frozen=True)
class SkipGroup:
    name: str
    patterns: tuple[str, ...]  # lower-case fragments of the skip reasons that belong here
    enable: str  # what makes the group run


SKIP_GROUPS = (
    SkipGroup("aarch64 edge tests (cross-build + qemu)", ("aarch64-linux-gnu", "qemu"),
              f"apt-get install {EDGE_DEBS}   (`make test` does this itself as root)"),
    SkipGroup("gpu tests (CUDA device)", ("cuda gpu",),
              "a machine with an NVIDIA GPU and its driver (nvidia-smi lists it); then `make test`"),
    SkipGroup("CUDA build tests (nvcc)", ("nvcc",),
              "the CUDA toolkit with nvcc on PATH (e.g. apt-get install nvidia-cuda-toolkit)"),
    SkipGroup("Hugging Face export tests (torch, transformers)", ("torch/transformers not installed",),
              "pip install '.[export]' into the venv (~3 min: a CPU torch wheel)"),
)


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def _edge_deps_why_not() -> str:
    """Why the aarch64 edge tests' packages are not here (the status `make test` passed on,
    or what it would have found)."""
    status = os.environ.get(EDGE_DEPS_STATUS)
    if status in ("present", "installed by this run"):
        return f"`make test` reports the packages {status}; the reasons above say what is still missing"
    if status:
        return status
    if shutil.which("apt-get") is None:
        return "no apt-get on this system: install an aarch64 cross g++ and qemu-user with its package manager"
    if os.geteuid() != 0:
        return f"not root (uid {os.geteuid()}): run `sudo apt-get install {EDGE_DEBS}`"
    return "pytest ran directly: `make test` installs them (root and apt-get are both here)"


def skipped_groups_lines(reasons: list[str]) -> list[str]:
    """The summary: each skipped group, how many tests, why, and what enables it."""
    if not reasons:
        return ["no test was skipped: every group ran"]
    grouped: dict[SkipGroup | None, Counter] = {}
    for r in reasons:
        group = next((g for g in SKIP_GROUPS if any(p in r.lower() for p in g.patterns)), None)
        grouped.setdefault(group, Counter())[r] += 1
    lines = []
    for group in [g for g in SKIP_GROUPS if g in grouped] + ([None] if None in grouped else []):
        counts = grouped[group]
        n = sum(counts.values())
        lines.append(f"{group.name if group else 'other skips'}: {n} test{'s' if n != 1 else ''} skipped")
        for reason, k in counts.most_common():
            lines.append(f"    because: {reason}" + (f" ({k})" if len(counts) > 1 else ""))
        if group is None:
            lines.append("    (no package enables these here)")
            continue
        lines.append(f"    enable:  {group.enable}")
        if group is SKIP_GROUPS[0]:
            lines.append(f"    not installed: {_edge_deps_why_not()}")
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Say loudly which groups of tests did not run and the command that enables each,
    instead of one line per test lost among the -ra skips."""
    reasons = [_skip_reason(r) for r in terminalreporter.stats.get("skipped", [])
               if getattr(r, "when", "call") in ("setup", "call")]
    lines = skipped_groups_lines(reasons)
    title = f"SKIPPED TEST GROUPS: {len(reasons)} test{'s' if len(reasons) != 1 else ''} did not run"
    dest = config.getoption("--skip-summary")
    if dest:
        Path(dest).parent.mkdir(parents=True, exist_ok=True)
        Path(dest).write_text("\n".join([f"==== {title} ====", *lines]) + "\n")
        return
    terminalreporter.write_sep("=", title, yellow=bool(reasons), green=not reasons, bold=True)
    for line in lines:
        terminalreporter.write_line(line, yellow=bool(reasons) and not line.startswith(" "))


def relax_op_names(mod, func: str = "main") -> list[str]:
    """The Relax ops a module's function calls, in post order (rewrite passes' IR tests)."""
    import tvm
    from tvm import relax

    names = []
    relax.analysis.post_order_visit(mod[func].body, lambda e: names.append(e.op.name) if isinstance(e, relax.Call)
                                    and isinstance(e.op, tvm.ir.Op) else None)
    return names


def fused_attention_counts(session):
    """After the fuse-attention phase of an opened model: (the module, calls of a fused kernel
    fused_attention_<n>, softmaxes left in main). A count, not only matching outputs: the SDPA
    exports matched ORT with 0 of their attentions fused."""
    from blockforge.compile.pipeline import run_phases

    fused, _ = run_phases(session.relax(), session.target, stop_after="fuse-attention")
    bindings = [b.value for blk in fused["main"].body.blocks for b in blk.bindings]
    op = lambda v: getattr(getattr(v, "op", None), "name", None)  # noqa: E731
    calls = sum(op(v) == "relax.call_tir" and v.args[0].name_hint.startswith("fused_attention_") for v in bindings)
    return fused, calls, sum(op(v) == "relax.nn.softmax" for v in bindings)
