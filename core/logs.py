"""Where noise goes: TVM's native logging and warnings land in a log file, not the terminal.

The file is `settings.log_file()`. Native output (TVM's C++ logging writes to file
descriptors 1 and 2) is redirected only in a process that asked for it through
`settings.configure()` (the CLI does); a library user's terminal is left alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Iterator

from blockforge import settings


def log_path() -> Path:
    return settings.log_file()


def setup_logging() -> logging.Logger:
    """Python-side logs (blockforge, tvm, onnx) go to the log file."""
    path = log_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    if not any(getattr(h, "_blockforge", False) for h in root.handlers):
        h = logging.FileHandler(path)
        h.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        h._blockforge = True  # type: ignore[attr-defined]
        root.addHandler(h)
        root.setLevel(logging.INFO)
        for name in ("tvm", "tvm.s_tir.meta_schedule", "autotvm"):
            logging.getLogger(name).propagate = True
    return logging.getLogger("blockforge")


@contextlib.contextmanager
def native_output_to_log(enabled: bool = True, path: Path | None = None) -> Iterator[Path]:
    """Redirect file descriptors 1 and 2 (where TVM's C++ logging writes) to the log file."""
    path = Path(path) if path else log_path()
    if not (enabled and settings.STATE.redirect_native):
        yield path
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield path
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
