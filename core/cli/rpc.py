"""`blockforge rpc`: TVM's RPC tracker or server (binds 127.0.0.1 by default)."""

from __future__ import annotations


def add(sub) -> None:
    p = sub.add_parser("rpc", help="start a TVM RPC tracker or server (binds 127.0.0.1 by default)")
    p.add_argument("role", choices=["tracker", "server"])
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback: the server runs "
                                                       "arbitrary code for anyone who reaches it)")
    p.add_argument("--port", type=int, default=None, help="tracker default 9190, server 9090; 0 picks a free port (printed)")
    p.add_argument("--tracker", default=None, help="server: HOST:PORT of the tracker")
    p.add_argument("--key", default=None, help="server: device key")
    p.set_defaults(func=run)


def run(a) -> int:
    from blockforge.tune.rpc import serve

    return serve(a.role, host=a.host, port=a.port, tracker=a.tracker, key=a.key)
