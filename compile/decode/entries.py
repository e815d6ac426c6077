"""Prefill and decode from one artifact: a second entry function for the decode step.

A decoder compiled with its sequence length symbolic serves the prompt (seq = its length) and
each step (seq = 1) from `main`. A step built with seq unknown misses what a bound seq = 1
gets: the fused attention reads the cached keys as stored (`attention-key-rows`, only at a
query length of 1: otherwise the kernel copies the whole cache to K^T every step) and the
static M = 1 matmul schedules. So compile adds `decode` = main with the token dim bound to 1,
built in the same module (passes run over every function), its weights shared with main's
(compile/passes/lift_weights.py lifts both entries' constants into one parameter list: the
same weights.bin), and records it in the manifest:

    "step": {"function": "decode", "dim": "seq"}

A call whose inputs bind `dim` to 1 goes to `function`; every other call to `main`. Older
artifacts (no "step") run every call through main. The manifest is untrusted: `function` must
be STEP_ENTRY (a manifest cannot direct a loader to another function of the module) and `dim`
a symbolic dim of the inputs (manifest.py, and deploy/edge_app/manifest.h with the same words).
"""

from __future__ import annotations

from blockforge.graph.model_io import TensorSig

from blockforge.compile.decode.pairing import record

STEP_ENTRY = "decode"
KEY = "step"


def token_dim(inputs: list[dict], outputs: list[dict]) -> str | None:
    """The symbolic dim a decode step binds to 1: axis 1 of input_ids in a language model with a
    cache (the loop feeds one token per step), or None (not a decoder, or that axis is fixed)."""
    pairing = record(inputs, outputs)  # None also where the pairing is ambiguous (no loop runs it)
    if pairing is None or pairing["tokens"] is None:
        return None
    ids = next(s for s in inputs if s["name"] == pairing["tokens"]["input_ids"])
    d = ids["shape"][1] if len(ids["shape"]) == 2 else None
    return d if isinstance(d, str) else None


def add_step_entry(mod, dim: str):
    """`mod` with `decode`: main's copy with `dim` bound to 1 (and named so in the library)."""
    import tvm
    from tvm.relax.utils import copy_with_new_vars

    # fresh vars: an input whose shape has no `dim` would be the same Var in both (FuseOps
    # refuses a var defined twice in one module)
    step = copy_with_new_vars(mod["main"]).bind_symbolic_vars({dim: 1}).with_attr("global_symbol", STEP_ENTRY)
    out = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
    out[STEP_ENTRY] = step
    return out


def step_record(dim: str) -> dict:
    return {"function": STEP_ENTRY, "dim": dim}


def step_dim(manifest: dict) -> str | None:
    """The dim whose value 1 selects the step entry (the manifest was checked: manifest.py)."""
    step = manifest.get(KEY)
    return step["dim"] if step else None


def step_axis(inputs: list[TensorSig], dim: str | None) -> tuple[str, int] | None:
    """(input, axis) whose length is `dim`, the first input declaring it; None: no step entry."""
    if dim is None:
        return None
    return next(((s.name, list(s.dims).index(dim)) for s in inputs if dim in s.dims), None)


def uses_step(inputs: list[TensorSig], dim: str | None, shapes: dict[str, tuple]) -> bool:
    """Whether a call on arrays of these shapes binds `dim` to 1 (the step entry's shape)."""
    at = step_axis(inputs, dim)
    return at is not None and at[0] in shapes and shapes[at[0]][at[1]] == 1
