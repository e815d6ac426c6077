"""The `blockforge` command: parses arguments and calls the typed Python API, nothing more.

One module per verb (add(subparsers) + run(args)); this module owns the entry: process-wide
settings, logging, and how every way of ending becomes one line and an exit code.

Exit codes: 0 success, 1 parity failure (verify), 2 user error (bad input),
130 interrupted (SIGINT), 143 terminated (SIGTERM), 70 internal error (a bug).
"""

from __future__ import annotations

import argparse
import signal
import sys
import traceback

from blockforge.errors import BlockforgeError

from . import bench, compile, env, export, inspect, package, rpc, run, targets, tune, verify

VERBS = (export, inspect, verify, targets, compile, run, tune, rpc, bench, package, env)


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so cleanup (finally blocks, context managers) runs."""


def _on_sigterm(signum, frame):
    raise Terminated()


def build_parser() -> argparse.ArgumentParser:
    import blockforge

    parser = argparse.ArgumentParser(prog="blockforge", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"blockforge {blockforge.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for verb in VERBS:
        verb.add(sub)
    return parser


def _interrupted(e: BaseException) -> bool:
    """TVM wraps a KeyboardInterrupt raised inside its callbacks in a RuntimeError."""
    return isinstance(e, KeyboardInterrupt) or "KeyboardInterrupt" in str(e)


def main(argv: list[str] | None = None) -> int:
    from blockforge import settings
    from blockforge.logs import log_path, setup_logging

    parser = build_parser()
    args = parser.parse_args(argv)
    settings.configure()
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        log = setup_logging()
    except OSError as e:
        print(f"blockforge: error: cannot write the log file {log_path()}: {e.strerror or e} "
              f"(set {settings.LOG} or {settings.CACHE_DIR})", file=sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except BlockforgeError as e:
        print(f"blockforge: error: {e}", file=sys.stderr)
        return e.exit_code
    except Terminated:
        print("blockforge: terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("blockforge: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if _interrupted(e):
            print("blockforge: interrupted", file=sys.stderr)
            return 130
        # a bug: one line on the terminal, the traceback in the log
        log.error("internal error\n%s", traceback.format_exc())
        print(f"blockforge: internal error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
              f"(traceback in {log_path()})", file=sys.stderr)
        return 70
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
