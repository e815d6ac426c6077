"""The greedy decode loop over a loaded artifact.

Each call's present outputs become the next call's past inputs as the runtime's own tensors
(no copy through numpy between steps: the cache stays where the module wrote it); for a
language model (logits and input_ids) the argmax of the last row becomes the next input_ids,
attention_mask grows by a column of ones and position_ids moves on by one. Other inputs stay
as the prompt gave them. Call 1 runs the prompt (its past inputs may be left out: an empty
cache, P = 0); calls 2..N run one step each.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from blockforge.errors import ArgumentError, BlockforgeError, error_line
from blockforge.graph.model_io import MAX_BOUND_DIM, TensorSig, check_inputs

from blockforge.compile.decode import entries
from blockforge.compile.decode.inputs import check_mask_length
from blockforge.compile.decode.pairing import DecodePairing, pairing_for_run

MAX_STEPS = 1 << 16


@dataclass(frozen=True)
class DecodeOptions:
    steps: int  # calls in all, the first on the prompt

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or not 1 <= self.steps <= MAX_STEPS:
            raise ArgumentError(f"{{steps}} must be an integer in [1, {MAX_STEPS}], got {self.steps!r}", "steps")


@dataclass(frozen=True)
class StepRecord:
    step: int  # 0: the prompt
    past: int  # cached positions going in
    seq: int  # new positions
    ms: float  # the whole step: the call and the loop's bookkeeping
    call_ms: float  # the compiled module's call alone
    token: tuple[int, ...] | None  # the argmax per batch row (language models)
    entry: str = "main"  # the function called: main, or the decode step's entry (compile/decode/entries.py)

    def to_dict(self) -> dict:
        return {"step": self.step, "past": self.past, "seq": self.seq, "ms": self.ms, "call_ms": self.call_ms,
                "token": list(self.token) if self.token is not None else None, "entry": self.entry}


@dataclass
class DecodeResult:
    pairing: DecodePairing
    steps: list[StepRecord] = field(default_factory=list)
    outputs: dict[str, np.ndarray] = field(default_factory=dict)  # the last call's

    @property
    def tokens(self) -> list[list[int]] | None:
        """Generated tokens per batch row, or None (no logits)."""
        if self.pairing.tokens is None or not self.steps:
            return None
        return [list(t) for t in zip(*(s.token for s in self.steps))]

    def to_dict(self) -> dict:
        steps = self.steps[1:]
        return {"pairing": self.pairing.to_dict(), "tokens": self.tokens,
                "prompt_ms": self.steps[0].ms if self.steps else None,
                "step_ms_mean": float(np.mean([s.ms for s in steps])) if steps else None,
                "call_ms_mean": float(np.mean([s.call_ms for s in steps])) if steps else None,
                "steps": [s.to_dict() for s in self.steps]}


def _sigs(items: list[dict]) -> list[TensorSig]:
    return [TensorSig(i["name"], tuple(i["shape"]), i["dtype"]) for i in items]


def _with_empty_cache(sigs: list[TensorSig], pairing: DecodePairing, given: dict) -> dict:
    """The prompt's inputs, an empty (P = 0) cache for every past input left out; the other
    symbolic dims of a past come from the inputs given."""
    bound: dict = {}
    for s in sigs:
        if s.name in given:
            for d, n in zip(s.dims, np.shape(given[s.name])):
                if isinstance(d, str):
                    bound.setdefault(d, n)
    out = dict(given)
    by_name = {s.name: s for s in sigs}
    for p in pairing.pairs:
        if p.past in given:
            continue
        s = by_name[p.past]
        dims = list(s.dims)
        dims[p.axis] = 0
        try:
            shape = TensorSig(s.name, tuple(dims), s.dtype).bind(bound)
        except BlockforgeError:
            raise ArgumentError(f"{{inputs}} has no {s.name!r} and its shape {list(s.dims)} does not follow from "
                                "the other inputs: give it (an empty cache has length 0 on the past axis)", "inputs") from None
        out[p.past] = np.zeros(shape, dtype=s.dtype)
    return out


class _Meta:
    """What runtime.check_outputs reads of an output, without copying the tensor to numpy."""

    def __init__(self, t) -> None:
        self.shape = tuple(int(d) for d in t.shape)
        self.ndim = len(self.shape)
        self.dtype = np.dtype(str(t.dtype)) if str(t.dtype) in np.sctypeDict else str(t.dtype)


def _next_tokens(feed, host: dict, logits: np.ndarray) -> np.ndarray:
    """Greedy: argmax over the vocabulary of the last position, (B,)."""
    if logits.ndim != 3:
        raise BlockforgeError(f"logits has shape {logits.shape}; a greedy step needs (batch, seq, vocab)")
    tok = logits[:, -1, :].argmax(axis=-1)
    host[feed.input_ids] = tok.astype(host[feed.input_ids].dtype).reshape(-1, 1)
    if feed.attention_mask:
        m = host[feed.attention_mask]
        host[feed.attention_mask] = np.concatenate([m, np.ones((m.shape[0], 1), m.dtype)], axis=1)
    if feed.position_ids:
        pos = host[feed.position_ids]
        host[feed.position_ids] = pos[:, -1:] + 1
    return tok


def decode(mod, inputs: dict[str, np.ndarray], opts: DecodeOptions, on_step=None) -> DecodeResult:
    """Run `opts.steps` calls of a loaded artifact (compile.LoadedModule), feeding the cache
    back; on_step(StepRecord) after each (for printing as it goes)."""
    import tvm

    from blockforge.compile.artifact.runtime import check_outputs

    where = str(mod.artifact)
    pairing = pairing_for_run(mod.manifest, where)
    in_sigs, out_sigs = _sigs(mod.manifest["inputs"]), _sigs(mod.manifest["outputs"])
    host = _with_empty_cache(in_sigs, pairing, inputs)
    by_name = {s.name: s for s in in_sigs}
    past_dims = frozenset(by_name[p.past].dims[p.axis] for p in pairing.pairs)
    check_inputs(in_sigs, host, "inputs", may_be_empty=past_dims)
    check_mask_length(in_sigs, pairing, {k: np.shape(v) for k, v in host.items()})
    dev = mod.device
    args = {s.name: tvm.runtime.tensor(np.ascontiguousarray(host[s.name]), dev) for s in in_sigs}
    feed = pairing.tokens
    fed = {feed.input_ids, feed.attention_mask, feed.position_ids} - {None} if feed else set()
    first = pairing.pairs[0]
    result = DecodeResult(pairing)
    main = mod.vm["main"]
    step_at = entries.step_axis(in_sigs, entries.step_dim(mod.manifest))  # seq 1: the decode step's own entry
    step_fn = mod.vm[entries.STEP_ENTRY] if step_at is not None else None
    on_cpu = dev.dlpack_device_type() == 1  # kDLCPU
    for step in range(opts.steps):
        past_len = int(args[first.past].shape[first.axis])
        seq = int(np.shape(host[feed.input_ids])[1]) if feed else None
        fn = step_fn if step_at is not None and int(args[step_at[0]].shape[step_at[1]]) == 1 else main
        t0 = time.perf_counter()
        try:
            out = fn(*(args[s.name] for s in in_sigs), *mod.params)
            if not on_cpu:  # the call may return before the kernels end
                dev.sync()
        except Exception as e:
            raise BlockforgeError(f"compiled module failed to run (step {step}): {error_line(e, last=True)}") from None
        t1 = time.perf_counter()
        outs = dict(zip((s.name for s in out_sigs), out if len(out_sigs) > 1 else [out]))
        if len(outs) != len(out_sigs):
            raise BlockforgeError(f"compiled module returned {len(outs)} outputs, the model declares {len(out_sigs)}")
        bound = {d: n for s in in_sigs for d, n in zip(s.dims, args[s.name].shape) if isinstance(d, str)}
        check_outputs(out_sigs, {k: _Meta(v) for k, v in outs.items()}, bound)
        tok = None
        if feed:
            tok = _next_tokens(feed, host, outs[feed.logits].numpy())
            for n in fed:
                args[n] = tvm.runtime.tensor(np.ascontiguousarray(host[n]), dev)
        for p in pairing.pairs:  # the module's own present tensors become the next pasts
            args[p.past] = outs[p.present]
        t2 = time.perf_counter()
        grown = int(outs[first.present].shape[first.axis])
        if seq is None:
            seq = grown - past_len
        if step == 0:  # later calls add 1 position (a token) or the prompt's length again
            final = grown + (opts.steps - 1) * (1 if feed else seq)
            if final > MAX_BOUND_DIM:
                raise ArgumentError(f"{{steps}} {opts.steps} would grow the cache to {final} positions, past the "
                                    f"limit of {MAX_BOUND_DIM} for a symbolic dim", "steps")
        rec = StepRecord(step, past_len, seq, (t2 - t0) * 1e3, (t1 - t0) * 1e3,
                         tuple(int(t) for t in tok) if tok is not None else None,
                         entries.STEP_ENTRY if fn is step_fn else "main")
        result.steps.append(rec)
        if on_step:
            on_step(rec)
        if step == opts.steps - 1:
            result.outputs = {k: v.numpy() for k, v in outs.items()}
    return result
