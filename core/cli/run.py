"""`blockforge run`: a compiled artifact on inputs from an .npz."""

from __future__ import annotations

from .common import add_force, check_outputs, write_json

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
    p.add_argument("--inputs", required=True, help=".npz of named inputs (with --decode: the prompt)")
    p.add_argument("--output", default=None, help=".npz of the outputs (with --decode: of the last call; optional)")
    p.add_argument("--decode", type=int, default=None, metavar="N",
                   help="run N calls, feeding each call's present outputs back as the next call's past inputs "
                        "(the pairing recorded in the manifest); for a model with logits and input_ids the argmax "
                        "token is appended (greedy). Past inputs left out of --inputs start empty")
    p.add_argument("--json", default=None, help="with --decode: per-token latency and the tokens as JSON here")
    p.add_argument("--copy-cache", action="store_true",
                   help="with --decode on an artifact compiled with --kv-capacity: the copying loop (each step's "
                        "presents fed back), not the in-place cache")
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
    from blockforge.compile.decode import DecodeOptions
    from blockforge.errors import BlockforgeError
    from blockforge.fsutil import atomic_write_bytes, write_error
    from blockforge.graph.model_io import load_npz
    from blockforge.logs import native_output_to_log

    if a.decode is None:
        if a.output is None:
            raise BlockforgeError("--output is required (unless --decode)")
        if a.json is not None:
            raise BlockforgeError("--json is for --decode")
    else:
        DecodeOptions(a.decode, inplace=not a.copy_cache)  # the range check before anything is loaded
    check_outputs(a, [a.artifact, a.inputs], output=a.output, json=a.json)
    inputs = load_npz(a.inputs)
    mod = load_artifact(a.artifact)
    if a.decode is not None:
        outs = run_decode(a, mod, inputs)
        if a.output is None:
            return 0
    else:
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
    if a.decode is None:
        print(f"ran {a.artifact} in {dt * 1e3:.2f} ms -> {a.output} "
              f"({', '.join(f'{k} {v.shape}' for k, v in stored.items())})")
    else:
        print(f"wrote the last call's outputs to {a.output}")
    return 0


def run_decode(a, mod, inputs: dict) -> dict:
    """The loop, one line per call as it runs; a summary, and --json."""
    from blockforge.compile.decode import DecodeOptions, decode

    def line(r) -> None:
        tok = "" if r.token is None else f"  token {' '.join(map(str, r.token))}"
        what = "prompt" if r.step == 0 else f"step {r.step}"
        print(f"{what:>9}: past {r.past:>5} + {r.seq}  {r.ms:8.3f} ms (call {r.call_ms:.3f} ms){tok}", flush=True)

    # not under native_output_to_log: that redirects stdout, where each step's line goes as it runs
    res = decode(mod, inputs, DecodeOptions(a.decode, inplace=not a.copy_cache), on_step=line)
    d = res.to_dict()
    if d["step_ms_mean"] is not None:
        print(f"{len(res.steps) - 1} steps after the prompt: {d['step_ms_mean']:.3f} ms/token "
              f"(module call {d['call_ms_mean']:.3f} ms; prompt {d['prompt_ms']:.3f} ms)")
    if res.tokens is not None:
        for b, row in enumerate(res.tokens):
            print(f"tokens[{b}]: {' '.join(map(str, row))}")
    write_json(a.json, d)
    return res.outputs
