"""TVM's own RPC tracker and server as blockforge's device farm.

They bind 127.0.0.1 unless told otherwise: a TVM RPC server loads and runs any module
sent to it (arbitrary native code) for anyone who can reach its port, and the tracker
hands its servers out to anyone who asks. Reach remote boards through an SSH tunnel.
"""

from __future__ import annotations

import signal
import sys
import time

from blockforge.errors import BlockforgeError, error_line

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def start_tracker(host: str = "127.0.0.1", port: int = 9190):
    from tvm.rpc.tracker import Tracker

    try:
        return Tracker(host, port=port, port_end=port + 1, silent=True)
    except Exception as e:
        raise BlockforgeError(f"cannot start an RPC tracker on {host}:{port}: {error_line(e, last=True)}") from None


def start_server(tracker: str, key: str, host: str = "127.0.0.1", port: int = 9090):
    from tvm import rpc

    from .tune import parse_tracker

    thost, tport = parse_tracker(tracker)
    try:
        return rpc.Server(host, port=port, port_end=port + 1, key=key, tracker_addr=(thost, tport), silent=True)
    except Exception as e:
        raise BlockforgeError(f"cannot start an RPC server on {host}:{port}: {error_line(e, last=True)}") from None


def serve(role: str, *, host: str, port: int | None, tracker: str | None, key: str | None) -> int:
    if host not in LOOPBACK:
        print(f"warning: binding {host}: a TVM RPC server runs any code sent to it; keep it on a trusted "
              "network or reach it through an SSH tunnel", file=sys.stderr)
    if role == "tracker":
        proc = start_tracker(host, port or 9190)
        print(f"RPC tracker on {host}:{proc.port} (Ctrl-C to stop)", flush=True)
    else:
        if not tracker or not key:
            raise BlockforgeError("rpc server needs --tracker HOST:PORT and --key KEY")
        proc = start_server(tracker, key, host, port or 9090)
        print(f"RPC server on {host}:{proc.port}, key {key!r}, registered at {tracker} (Ctrl-C to stop)", flush=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        while not stop:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        proc.terminate()
    return 0
