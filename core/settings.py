"""Every environment variable blockforge reads, and the process-wide settings it applies.

Nothing here runs at import time. Values are read when asked for, so a test (or a
long-lived service) that changes the environment sees the change.

| variable | default | what |
|---|---|---|
| `BLOCKFORGE_CACHE_DIR` | `$XDG_CACHE_HOME/blockforge` or `~/.cache/blockforge` | per-user state: default tuning databases, logs, edge-app builds |
| `BLOCKFORGE_LOG` | `<cache>/logs/blockforge.log` | where Python logs and TVM's native output go |
| `BLOCKFORGE_ISOLATE` | `1` | `0` skips the child-process check of untrusted models |
| `BLOCKFORGE_ISOLATE_TIMEOUT` | `300` | seconds the child-process check may take |
| `BLOCKFORGE_MEMORY_LIMIT_GB` | 3/4 of the RAM (or the container's memory limit, when lower) | GiB of data memory (RLIMIT_DATA) a child process handling an untrusted model may use: the check, prepare and TVM import, and ONNX Runtime's run |
| `BLOCKFORGE_MAX_TENSOR_GB` | 2, or 1/4 of the memory limit when lower | GiB a tensor computed at compile time (a folded constant: ConstantOfShape, Expand, Tile, Range, ... of constants) may have; a model over it is refused before anything is allocated |
| `BLOCKFORGE_PREPACK` | `1` | `0` turns off CPU weight prepacking (for A/B measurements) |
| `BLOCKFORGE_FUSE_ATTENTION` | `1` | `0` turns off the fused CPU attention kernel (for A/B measurements) |
| `BLOCKFORGE_MATVEC` | `0` | `1` schedules packed matmuls of <= 4 rows with CPUMatvec (compile/schedule/matvec.py) instead of CPUMatmul |
| `BLOCKFORGE_PANEL_PREFETCH` | `few-rows` | which GEMMs have CPUMatmul's micro-tile prefetch the next weight panel (compile/passes/panel_prefetch.py): `few-rows` those of 19-64 static rows, `all` (`1`) every static-M one, `off` (`0`) none |
| `BLOCKFORGE_HUGEPAGES` | `1` | `0` loads an artifact's weights on a CPU as private copies in TVM's memory instead of one MADV_HUGEPAGE arena (compile/artifact/weights.py; for A/B measurements) |
| `BLOCKFORGE_BUILDER` | `reuse` | `fresh` builds tuning candidates with TVM's LocalBuilder (new worker processes per build call) instead of one pool per job (tune/builder.py; for A/B measurements) |
| `TVM_NUM_THREADS` | physical cores | TVM's CPU thread pool size (set by `configure()` when unset) |
| `TVM_THREAD_POOL_SPIN_COUNT` | `10000` | spins before an idle TVM worker sleeps (set by `configure()` when unset) |

`configure()` applies the process-wide parts: the CLI calls it first thing; a library
user calls `blockforge.configure()` once to get the same behaviour (thread pool sized to
the cores, TVM's native output redirected to the log file instead of the terminal).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CACHE_DIR = "BLOCKFORGE_CACHE_DIR"
LOG = "BLOCKFORGE_LOG"
ISOLATE = "BLOCKFORGE_ISOLATE"
ISOLATE_TIMEOUT = "BLOCKFORGE_ISOLATE_TIMEOUT"
MEMORY_LIMIT = "BLOCKFORGE_MEMORY_LIMIT_GB"
MAX_TENSOR = "BLOCKFORGE_MAX_TENSOR_GB"
PREPACK = "BLOCKFORGE_PREPACK"
FUSE_ATTENTION = "BLOCKFORGE_FUSE_ATTENTION"
MATVEC = "BLOCKFORGE_MATVEC"
PANEL_PREFETCH = "BLOCKFORGE_PANEL_PREFETCH"
BUILDER = "BLOCKFORGE_BUILDER"
HUGEPAGES = "BLOCKFORGE_HUGEPAGES"

# Measured: TVM's pool starts one thread on these VMs and runtime.config_threadpool does
# not change it; the variable does (a 128x768x3072 GEMM: 252 GFLOP/s with 1, 516 with 2).
TVM_THREADS = "TVM_NUM_THREADS"
# Idle TVM workers spin before sleeping; the default spin steals a core from ONNX Runtime
# (or the app) running next. 10k spins keeps back-to-back calls warm.
TVM_SPIN = "TVM_THREAD_POOL_SPIN_COUNT"
TVM_SPIN_DEFAULT = "10000"


@dataclass
class _State:
    redirect_native: bool = False  # native_output_to_log() redirects fds 1/2 only when True
    filled_in: tuple[str, ...] = ()  # variables configure() set because they were unset


STATE = _State()


def _flag(name: str, default: bool) -> bool:
    v = os.environ.get(name)
    if v is None or v.strip() == "":
        return default
    return v.strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    """Per-user state: default tuning databases, logs, edge-app builds."""
    if os.environ.get(CACHE_DIR):
        return Path(os.environ[CACHE_DIR]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "blockforge"


def log_file() -> Path:
    v = os.environ.get(LOG)
    return Path(v).expanduser() if v else cache_dir() / "logs" / "blockforge.log"


def tuning_root() -> Path:
    """Where default per-device tuning databases live: <cache>/tuning/<device-key>/."""
    return cache_dir() / "tuning"


def edge_build_root() -> Path:
    return cache_dir() / "edge"


def isolate() -> bool:
    return _flag(ISOLATE, True)


def isolate_timeout_s() -> float:
    v = os.environ.get(ISOLATE_TIMEOUT, "300")
    try:
        t = float(v)
    except ValueError:
        t = 300.0
    return t if t > 0 else 300.0


def _gib(name: str) -> float | None:
    """A positive number of GiB from the environment; None when unset or not one."""
    try:
        v = float(os.environ.get(name, ""))
    except ValueError:
        return None
    return v if v > 0 and v < float("inf") else None


def machine_memory_bytes() -> int:
    """The RAM this process may use: physical memory, or its cgroup's limit when lower (a
    container, a systemd slice)."""
    try:
        import psutil

        total = psutil.virtual_memory().total
    except ImportError:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in _cgroup_files("memory.max", "memory.limit_in_bytes"):
        try:
            v = Path(path).read_text().strip()
        except OSError:
            continue
        if v.isdigit():
            total = min(total, int(v))
    return total


def _cgroup_files(*names: str) -> list[str]:
    """This process's cgroup files of these names (v2 unified, or v1 memory controller)."""
    out = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, rel = line.split(":", 2)
            if controllers == "" or "memory" in controllers.split(","):
                base = "/sys/fs/cgroup" + ("" if controllers == "" else "/memory")
                out += [f"{base}{rel.rstrip('/')}/{n}" for n in names]
    except (OSError, ValueError):
        pass
    return out


def cgroup_oom_kills() -> int:
    """OOM kills counted so far in this process's cgroup (v2 memory.events, v1 oom_control) plus system-wide
    (/proc/vmstat): a child killed by SIGKILL while one of them rose was killed for memory."""
    n = 0
    for path in [*_cgroup_files("memory.events", "memory.oom_control"), "/proc/vmstat"]:
        try:
            for line in Path(path).read_text().splitlines():
                k, _, v = line.partition(" ")
                if k == "oom_kill" and v.strip().isdigit():
                    n += int(v)
        except OSError:
            continue
    return n


def memory_limit_bytes() -> int:
    """Data memory (RLIMIT_DATA) a child process handling an untrusted model may use."""
    v = _gib(MEMORY_LIMIT)
    return int(v * 2**30) if v else machine_memory_bytes() * 3 // 4


def max_tensor_bytes() -> int:
    """The largest tensor compile-time folding may materialise: a quarter of the memory
    limit leaves room for the copies folding makes (input, output, TVM's constant)."""
    v = _gib(MAX_TENSOR)
    return int(v * 2**30) if v else min(2 << 30, memory_limit_bytes() // 4)


def prepack() -> bool:
    return _flag(PREPACK, True)


def fuse_attention() -> bool:
    return _flag(FUSE_ATTENTION, True)


def matvec() -> bool:
    # Off: quiet, a GPT-2-small decode step took 21.98 ms with it vs 21.14 without (P = 128)
    # and 26.79 vs 25.23 (P = 512), its kernels within 5% of CPUMatmul's (both at the read
    # bandwidth); kept for the A/B (benchmarks/matvec.py) on machines where it may win.
    return _flag(MATVEC, False)


def panel_prefetch() -> str:
    """"few-rows" by default: only GEMMs whose static rows are within schedule.matmul.PREFETCH_ROWS
    (19-64) prefetch the next weight panel. Quiet Zen 5, whole models, the build with it over the build
    without, both build orders (geometric mean): CLIP ViT-B/32 (50 rows) 0.983 / 0.911 (0.946) and
    1.012 / 0.914 (0.962), Wav2Vec2-base (49) 0.903 / 1.006 (0.953); at more rows it bought nothing
    (ViT-B/16's 197: 1.029). "all" (1): every static-M packed GEMM; "off" (0): none."""
    value = os.environ.get(PANEL_PREFETCH, "").strip().lower()
    modes = {"": "few-rows", "few-rows": "few-rows", "0": "off", "off": "off", "1": "all", "all": "all"}
    if value not in modes:  # a user's setting: one line from the CLI
        from blockforge.errors import BlockforgeError

        raise BlockforgeError(f"{PANEL_PREFETCH}={value!r}: expected 'few-rows' (the default), 'all' (1) or 'off' (0)")
    return modes[value]


def hugepages() -> bool:
    return _flag(HUGEPAGES, True)


def reuse_build_workers() -> bool:
    """False under BLOCKFORGE_BUILDER=fresh (TVM's LocalBuilder: new workers per build call)."""
    value = os.environ.get(BUILDER, "").strip().lower()
    if value not in ("", "reuse", "fresh"):
        raise ValueError(f"{BUILDER}={value!r}: expected 'reuse' (the default) or 'fresh'")
    return value != "fresh"


def physical_cores() -> int:
    """Physical cores of this machine (TVM's pool and ORT's intra-op threads use as many)."""
    try:
        import psutil

        return psutil.cpu_count(logical=False) or os.cpu_count() or 1
    except ImportError:
        return os.cpu_count() or 1


def thread_pool_note() -> str | None:
    """A library user's process that never called configure() (nor set TVM_NUM_THREADS): TVM's
    pool then sizes itself, and on x86 it halves the hardware threads to skip hyper-threads, so
    a 2-vCPU VM without SMT runs one thread (measured here: a bf16 GEMM 1.22 ms against 0.61 ms
    with 2). The line to warn with where the pool has fewer threads than the cores, else None.
    Asking TVM starts its pool (at this size), as the first model call would."""
    if TVM_THREADS in os.environ:
        return None
    import tvm

    n, cores = int(tvm.get_global_func("runtime.NumThreads")()), physical_cores()
    if n >= cores:
        return None
    return (f"TVM's thread pool runs {n} thread{'s' if n != 1 else ''} on this machine's {cores} cores: call "
            f"blockforge.configure() before the first model call (or set {TVM_THREADS})")


def source(name: str) -> str:
    """Where a documented variable's value comes from: "environment", "default", or
    "default, exported" (unset, so configure() set it for TVM)."""
    if name in STATE.filled_in:
        return "default, exported"
    return "environment" if os.environ.get(name) else "default"


def documented() -> dict[str, str]:
    """Every variable this module owns, with its current effective value (for `blockforge env`)."""
    return {CACHE_DIR: str(cache_dir()), LOG: str(log_file()), ISOLATE: "1" if isolate() else "0",
            ISOLATE_TIMEOUT: f"{isolate_timeout_s():g}",
            MEMORY_LIMIT: f"{memory_limit_bytes() / 2**30:.1f}", MAX_TENSOR: f"{max_tensor_bytes() / 2**30:.1f}",
            PREPACK: "1" if prepack() else "0",
            FUSE_ATTENTION: "1" if fuse_attention() else "0",
            MATVEC: "1" if matvec() else "0",
            PANEL_PREFETCH: panel_prefetch(),
            BUILDER: "reuse" if reuse_build_workers() else "fresh",
            HUGEPAGES: "1" if hugepages() else "0",
            TVM_THREADS: os.environ.get(TVM_THREADS, "(unset)"),
            TVM_SPIN: os.environ.get(TVM_SPIN, "(unset)")}


def configure(*, threads: int | None = None, redirect_native_output: bool = True) -> None:
    """Apply the process-wide settings (before TVM's runtime starts its thread pool).

    threads: TVM's pool size; default the physical cores (an explicit TVM_NUM_THREADS wins).
    redirect_native_output: send TVM's C++ logging (fds 1/2) to log_file() while blockforge
    compiles, tunes and runs, instead of the terminal.
    """
    filled = []
    if TVM_THREADS not in os.environ:
        os.environ[TVM_THREADS] = str(threads or physical_cores())
        filled.append(TVM_THREADS)
    if TVM_SPIN not in os.environ:
        os.environ[TVM_SPIN] = TVM_SPIN_DEFAULT
        filled.append(TVM_SPIN)
    STATE.filled_in = (*STATE.filled_in, *filled)
    STATE.redirect_native = redirect_native_output
