"""`blockforge run`: a compiled artifact on inputs from an .npz."""

from __future__ import annotations

from .common import add_force, check_outputs

# numpy cannot read back what np.savez writes for ml_dtypes arrays (bfloat16, float8_*,
# int4, ...: they load as raw void bytes), so such an output is stored as its bits:
# `<name>.<dtype>_bits`, a uint8/uint16 array; ml_dtypes gets the values back with
# `z["y.bfloat16_bits"].view(ml_dtypes.bfloat16)`.
BITS_SUFFIX = "_bits"


def add(sub) -> None:
    p = sub.add_parser("run", help="run a compiled artifact on inputs from an .npz",
                       description="Outputs whose dtype numpy cannot store (bfloat16, float8, int4) are "
                                   "written as their raw bits under '<name>.<dtype>_bits' (uint8/uint16); "
                                   "view them with ml_dtypes: z['y.bfloat16_bits'].view(ml_dtypes.bfloat16).")
    p.add_argument("artifact")
    p.add_argument("--inputs", required=True)
    p.add_argument("--output", required=True)
    add_force(p)
    p.set_defaults(func=run)


def npz_entries(outs: dict) -> dict:
    """Output name -> array as stored in the .npz (numpy-native dtypes unchanged)."""
    import numpy as np

    from blockforge.errors import BlockforgeError

    stored = {}
    for name, a in outs.items():
        if a.dtype.kind == "V":  # an ml_dtypes type: np.load would give raw void records
            name = f"{name}.{a.dtype.name}{BITS_SUFFIX}"
            a = a.view(np.dtype(f"uint{8 * a.dtype.itemsize}"))
        if name in stored:
            raise BlockforgeError(f"two outputs would be stored as {name!r} in the .npz")
        stored[name] = a
    return stored


def run(a) -> int:
    import io
    import time

    import numpy as np

    from blockforge.compile import load_artifact
    from blockforge.fsutil import atomic_write_bytes, write_error
    from blockforge.graph.model_io import load_npz
    from blockforge.logs import native_output_to_log

    check_outputs(a, [a.artifact, a.inputs], output=a.output)
    inputs = load_npz(a.inputs)
    mod = load_artifact(a.artifact)
    with native_output_to_log():
        t0 = time.perf_counter()
        outs = mod.run(inputs)
        dt = time.perf_counter() - t0
    stored = npz_entries(outs)
    buf = io.BytesIO()
    np.savez(buf, **stored)
    try:
        atomic_write_bytes(a.output, buf.getvalue())
    except OSError as e:
        raise write_error(a.output, e) from None
    print(f"ran {a.artifact} in {dt * 1e3:.2f} ms -> {a.output} ({', '.join(f'{k} {v.shape}' for k, v in stored.items())})")
    return 0
