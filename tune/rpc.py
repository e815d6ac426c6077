"""TVM's own RPC tracker and server as blockforge's device farm.

They bind 127.0.0.1 unless told otherwise: a TVM RPC server loads and runs any module
sent to it (arbitrary native code) for anyone who can reach its port, and the tracker
hands its servers out to anyone who asks. Reach remote boards through an SSH tunnel.
"""

from __future__ import annotations

import logging
import socket
import sys
import time

from blockforge.errors import ArgumentError, BlockforgeError, error_line, raise_if_stopped, stop_deferred

LOOPBACK = ("127.0.0.1", "localhost", "::1")
TRACKER_PORT = 9190  # TVM's conventional ports
SERVER_PORT = 9090


def parse_tracker(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ArgumentError(f"bad {{rpc_tracker}} {text!r}: expected HOST:PORT", "rpc_tracker")
    try:
        p = int(port)
    except ValueError:
        raise ArgumentError(f"bad {{rpc_tracker}} {text!r}: port {port!r} is not an integer", "rpc_tracker") from None
    if not 0 < p < 65536:
        raise ArgumentError(f"bad {{rpc_tracker}} {text!r}: port out of range", "rpc_tracker")
    return host, p


def wait_for_devices(host: str, port: int, key: str, wait_s: float) -> int:
    """Number of servers behind `key`; a clear error after at most `wait_s` seconds."""
    from tvm import rpc

    deadline = time.monotonic() + wait_s
    try:
        with socket.create_connection((host, port), timeout=min(3.0, max(wait_s, 0.1))):
            pass
    except OSError as e:
        raise BlockforgeError(f"no RPC tracker at {host}:{port} ({e.strerror or e}); start one with "
                              f"`blockforge rpc tracker --port {port}`") from None
    while True:
        try:
            summary = rpc.connect_tracker(host, port).summary()
        except Exception as e:
            raise BlockforgeError(f"RPC tracker at {host}:{port} does not answer: {error_line(e, limit=200)}") from None
        servers = [s for s in summary.get("server_info", []) if s.get("key", "").split(":", 1)[-1] == key]
        if servers:
            return len(servers)
        if time.monotonic() >= deadline:
            keys = sorted({s.get("key", "").split(":", 1)[-1] for s in summary.get("server_info", [])})
            raise BlockforgeError(f"RPC tracker {host}:{port} has no device for key {key!r} after "
                                  f"{wait_s:.0f}s (keys present: {', '.join(keys) or 'none'})")
        time.sleep(0.5)


def free_port(host: str) -> int:
    """A port the OS picks as free on `host` (for --port 0). TVM binds the port it is given,
    with SO_REUSEADDR, so handing it the number right after this socket closes works; a
    process taking it in between makes the start fail with a clear error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            return sock.getsockname()[1]
    except OSError as e:
        raise BlockforgeError(f"cannot bind {host}: {e.strerror or e}") from None


def check_port(port: int) -> None:
    if not 0 <= port < 65536:
        raise ArgumentError(f"{{port}} {port} is out of range (0..65535; 0 picks a free port)", "port")


def start_tracker(host: str = "127.0.0.1", port: int = TRACKER_PORT):
    from tvm.rpc.tracker import Tracker

    check_port(port)
    port = port or free_port(host)
    try:
        return Tracker(host, port=port, port_end=port + 1, silent=True)
    except Exception as e:
        raise_if_stopped()
        raise BlockforgeError(f"cannot start an RPC tracker on {host}:{port}: {error_line(e, last=True)}") from None


def start_server(tracker: str, key: str, host: str = "127.0.0.1", port: int = SERVER_PORT):
    from tvm import rpc

    thost, tport = parse_tracker(tracker)
    check_port(port)
    port = port or free_port(host)
    try:
        return rpc.Server(host, port=port, port_end=port + 1, key=key, tracker_addr=(thost, tport), silent=True)
    except Exception as e:
        raise_if_stopped()
        raise BlockforgeError(f"cannot start an RPC server on {host}:{port}: {error_line(e, last=True)}") from None


def stop(proc) -> None:
    """End a tracker or server and everything it started, without a word.

    TVM's Server.terminate kills its worker; Tracker.terminate first asks the tracker to stop
    over a connection to 127.0.0.1, which fails (a traceback) for a tracker bound to any
    other address. Both run in a TVM PopenWorker whose process tree (the server forks one
    process per session) is killed here directly."""
    worker = getattr(proc, "proc", None)
    if worker is None:
        return
    proc.proc = None  # TVM's own terminate/__del__ then do nothing
    try:
        worker.kill()  # SIGKILL to the worker's descendants, then to the worker; reaped
    except Exception as e:  # already gone
        logging.getLogger("blockforge").info("stopping the RPC %s: %s", type(proc).__name__, e)


def serve(role: str, *, host: str, port: int | None, tracker: str | None, key: str | None) -> int:
    """Run a tracker or a server until SIGINT/SIGTERM (which end it as they end every verb:
    KeyboardInterrupt / Terminated from the CLI's handler); the worker process is ended on
    every way out, a signal during startup included."""
    if role == "server" and (not tracker or not key):
        raise ArgumentError("a server needs {tracker} HOST:PORT and {key} KEY", "tracker", "key")
    if host not in LOOPBACK:
        print(f"warning: binding {host}: a TVM RPC server runs any code sent to it; keep it on a trusted "
              "network or reach it through an SSH tunnel", file=sys.stderr)
    proc = None
    try:
        # A stop signal while TVM starts the worker would leave it running with nobody holding
        # it (a listener that runs any code sent to it): the signal waits until it is owned.
        with stop_deferred():
            if role == "tracker":
                proc = start_tracker(host, TRACKER_PORT if port is None else port)
            else:
                proc = start_server(tracker, key, host, SERVER_PORT if port is None else port)
        if role == "tracker":
            print(f"RPC tracker on {host}:{proc.port} (Ctrl-C to stop)", flush=True)
        else:
            print(f"RPC server on {host}:{proc.port}, key {key!r}, registered at {tracker} (Ctrl-C to stop)",
                  flush=True)
        while True:
            time.sleep(0.5)
            if not proc.proc.is_alive():
                raise BlockforgeError(f"the RPC {role} process ended unexpectedly (see the log)")
    finally:
        if proc is not None:
            stop(proc)
