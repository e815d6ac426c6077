"""The `blockforge` command: parses arguments and calls the typed Python API, nothing more.

One module per verb (add(subparsers) + run(args)); this module owns the entry: process-wide
settings, logging, and how every way of ending becomes one line and an exit code.

Exit codes: 0 success, 1 parity failure (verify), 2 user error (bad input),
130 interrupted (SIGINT), 143 terminated (SIGTERM), 70 internal error (a bug).

A signal ends every verb the same way: the first SIGINT/SIGTERM raises in the main thread
(KeyboardInterrupt / errors.Terminated), cleanup runs (temporary files, locks, the
database's scratch rounds), child processes started during the run are ended, and the
run's private temporary directory (TMPDIR for TVM and every child) is removed.
"""

from __future__ import annotations

import argparse
import errno
import signal
import sys
import time
import traceback

from blockforge.errors import BlockforgeError, Terminated, printable

VERB_NAMES = ("export", "quantize", "inspect", "verify", "targets", "compile", "run", "tune", "rpc", "bench", "package", "env")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
CHILD_GRACE_S = 2.0  # children get SIGTERM, then SIGKILL after this long
_ENVIRONMENT_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EISDIR,
                       errno.ENOTDIR, errno.ENAMETOOLONG, errno.ELOOP, errno.EEXIST, errno.ENOTEMPTY}


def _verbs(names=VERB_NAMES):
    import importlib

    return [importlib.import_module(f"{__name__}.{name}") for name in names]


class _Parser(argparse.ArgumentParser):
    """A usage mistake is one line, as every other user error: `blockforge: error: ...`
    naming where the usage is, instead of argparse's usage block and `prog verb: error:`."""

    def error(self, message: str):
        from blockforge.errors import printable

        self.exit(2, f"blockforge: error: {printable(message, None)} (see `{self.prog} --help`)\n")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole parser, or (argv naming a verb first) only that verb's: a verb's add()
    imports what its choices and defaults come from (tune's budget table imports TVM, export's
    spec table ONNX), 4.7 s for all twelve against 0.1 s for `inspect`'s, paid by every
    `blockforge` process before it did anything (measured on a 2-core Zen 4)."""
    import blockforge

    parser = _Parser(prog="blockforge", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"blockforge {blockforge.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    named = argv[:1] if argv and argv[0] in VERB_NAMES else VERB_NAMES
    for verb in _verbs(named):
        verb.add(sub)
    return parser


def _on_signal(signum, frame):
    from blockforge import errors

    if errors.request_stop(signum):
        raise errors.stop_exception(signum)


def _stopped() -> int:
    from blockforge.errors import stop_signal

    if stop_signal() == signal.SIGTERM:
        print("blockforge: terminated", file=sys.stderr)
        return 143
    print("blockforge: interrupted", file=sys.stderr)
    return 130


def end_children(since: float, grace_s: float = CHILD_GRACE_S) -> list[int]:
    """End the descendants of this process started at or after `since` (time.time()):
    builder/runner worker pools, RPC workers, compilers, the isolated-import child. A
    library caller's own older children are left alone. Returns the pids ended."""
    try:
        import psutil
    except ImportError:  # a dependency; without it only the owners' own cleanup runs
        return []
    try:
        kids = [p for p in psutil.Process().children(recursive=True) if p.create_time() >= since - 1.0]
    except psutil.Error:
        return []
    for p in kids:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(kids, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    return [p.pid for p in kids]


def _dispatch(args, log) -> int:
    from blockforge.errors import stop_deferred
    from blockforge.fsutil import private_temp_root, remove_leftovers

    started = time.time()
    try:
        with private_temp_root():
            try:
                return int(args.func(args) or 0)
            finally:
                with stop_deferred():
                    end_children(started)  # before the temporary root goes: they may write in it
                    remove_leftovers()  # outputs' temporaries a child was still writing in
    except BlockforgeError as e:
        if _stop_requested():
            return _stopped()
        # one line whatever the message quotes (a model's names, TVM's text): no raw control characters
        from blockforge.cli.common import error_message

        print(f"blockforge: error: {printable(error_message(e), limit=None)}", file=sys.stderr)
        return e.exit_code
    except (KeyboardInterrupt, Terminated):
        return _stopped()
    except OSError as e:
        if _stop_requested():
            return _stopped()
        if e.errno not in _ENVIRONMENT_ERRNOS:
            return _internal_error(e, log)
        # the file system said no (permissions, a full disk, a directory where a file was
        # expected): the user's to fix, not a bug; the traceback still goes to the log
        log.error("file system error\n%s", traceback.format_exc())
        where = f"{e.filename}: " if e.filename else ""
        print(f"blockforge: error: {printable(where, limit=None)}{e.strerror or e}", file=sys.stderr)
        return 2
    except Exception as e:
        if _stop_requested():
            return _stopped()  # TVM wrapped our KeyboardInterrupt/Terminated in a RuntimeError
        return _internal_error(e, log)


def _internal_error(e: BaseException, log) -> int:
    """A bug: one line on the terminal, the traceback in the log."""
    from blockforge.logs import log_path

    log.error("internal error\n%s", traceback.format_exc())
    print(f"blockforge: internal error: {type(e).__name__}: {printable(str(e).splitlines()[0] if str(e) else '')} "
          f"(traceback in {log_path()})", file=sys.stderr)
    return 70


def _stop_requested() -> bool:
    from blockforge.errors import stop_signal

    return stop_signal() is not None


def _main(argv: list[str] | None) -> int:
    from blockforge import settings
    from blockforge.logs import log_path, setup_logging

    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    settings.configure()
    try:
        log = setup_logging()
    except OSError as e:
        print(f"blockforge: error: cannot write the log file {log_path()}: {e.strerror or e} "
              f"(set {settings.LOG} or {settings.CACHE_DIR})", file=sys.stderr)
        return 2
    rc = _dispatch(args, log)
    if rc not in (130, 143) and _stop_requested():
        return _stopped()  # a signal some library code swallowed: still a stopped run
    return rc


def main(argv: list[str] | None = None, *, _program: bool = False) -> int:
    import threading

    from blockforge.errors import reset_stop

    reset_stop()
    previous = {}
    if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
        previous = {s: signal.signal(s, _on_signal) for s in STOP_SIGNALS}
    try:
        return _main(argv)
    except (KeyboardInterrupt, Terminated):  # while parsing arguments or printing the last line
        return _stopped()
    finally:
        for s, h in previous.items():
            # The program: the exit code is decided and the cleanup done, so a signal in the
            # last milliseconds (a second Ctrl-C) must not turn into a traceback or a death by
            # signal. A library caller gets its own handlers back.
            signal.signal(s, signal.SIG_IGN if _program else h)


def entry() -> None:
    """The `blockforge` program (console script and `python -m blockforge`)."""
    rc = main(_program=True)
    # CPython 3.11-3.13 marks a KeyboardInterrupt raised inside exec() of a string (dataclasses
    # build their methods so, at import) as unhandled even when it was caught, and `python -m`
    # then ends by re-sending itself SIGINT: rc -2 instead of 130 in 2 of 15 Ctrl-C at start.
    # An exec of a string clears the mark (every eval of one resets it first).
    exec("None")
    sys.exit(rc)


if __name__ == "__main__":
    entry()
