"""`blockforge run`: a compiled artifact on inputs from an .npz."""

from __future__ import annotations


def add(sub) -> None:
    p = sub.add_parser("run", help="run a compiled artifact on inputs from an .npz")
    p.add_argument("artifact")
    p.add_argument("--inputs", required=True)
    p.add_argument("--output", required=True)
    p.set_defaults(func=run)


def run(a) -> int:
    import io
    import time

    import numpy as np

    from blockforge.compile import load_artifact
    from blockforge.fsutil import atomic_write_bytes, write_error
    from blockforge.graph.model_io import load_npz
    from blockforge.logs import native_output_to_log

    from .common import check_outputs

    check_outputs(output=a.output)
    inputs = load_npz(a.inputs)
    mod = load_artifact(a.artifact)
    with native_output_to_log():
        t0 = time.perf_counter()
        outs = mod.run(inputs)
        dt = time.perf_counter() - t0
    buf = io.BytesIO()
    np.savez(buf, **outs)
    try:
        atomic_write_bytes(a.output, buf.getvalue())
    except OSError as e:
        raise write_error(a.output, e) from None
    print(f"ran {a.artifact} in {dt * 1e3:.2f} ms -> {a.output} ({', '.join(f'{k} {v.shape}' for k, v in outs.items())})")
    return 0
