"""The greedy decode loop over a loaded artifact.

Each call's present outputs become the next call's past inputs as the runtime's own tensors
(no copy through numpy between steps: the cache stays where the module wrote it); for a
language model (logits and input_ids) the argmax of the last row becomes the next input_ids,
attention_mask grows by a column of ones and position_ids moves on by one. Other inputs stay
as the prompt gave them. Call 1 runs the prompt (its past inputs may be left out: an empty
cache, P = 0); calls 2..N run one step each. An artifact with `decode_inplace` (compile
--kv-capacity) runs calls 2..N there: the prompt's presents are copied once into buffers of the
capacity's rows, which each step then extends in place (compile/decode/inplace.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from blockforge.errors import ArgumentError, BlockforgeError, error_line
from blockforge.graph.model_io import MAX_BOUND_DIM, TensorSig, check_inputs

from blockforge.compile.decode import entries
from blockforge.compile.decode import inplace as inplace_entry
from blockforge.compile.decode.inputs import check_mask_length
from blockforge.compile.decode.pairing import DecodePairing, pairing_for_run

MAX_STEPS = 1 << 16


@dataclass(frozen=True)
class DecodeOptions:
    steps: int  # calls in all, the first on the prompt
    # an artifact with `decode_inplace` (compile --kv-capacity): the steps after the prompt write
    # one preallocated cache in place (compile/decode/inplace.py); False: the copying loop (A/B)
    inplace: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or not 1 <= self.steps <= MAX_STEPS:
            raise ArgumentError(f"{{steps}} must be an integer in [1, {MAX_STEPS}], got {self.steps!r}", "steps")
        if not isinstance(self.inplace, bool):
            raise ArgumentError(f"{{inplace}} must be a bool, got {self.inplace!r}", "inplace")


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
    ip = _inplace_plan(mod, opts, pairing, step_at, args, host)
    ip_fn = mod.vm[inplace_entry.INPLACE_ENTRY] if ip is not None else None
    caps: dict | None = None  # past input -> its capacity buffer, from step 1 on
    presents = {p.present for p in pairing.pairs}
    for step in range(opts.steps):
        past_len = int(args[first.past].shape[first.axis]) if caps is None else filled
        seq = int(np.shape(host[feed.input_ids])[1]) if feed else None
        fn = step_fn if step_at is not None and int(args[step_at[0]].shape[step_at[1]]) == 1 else main
        if caps is not None:
            fn = ip_fn
        t0 = time.perf_counter()
        try:
            if caps is None:
                out = fn(*(args[s.name] for s in in_sigs), *mod.params)
            else:
                out = fn(*(caps.get(s.name, args[s.name]) for s in in_sigs), tvm.runtime.ShapeTuple([past_len]),
                         *mod.params)
            if not on_cpu:  # the call may return before the kernels end
                dev.sync()
        except Exception as e:
            raise BlockforgeError(f"compiled module failed to run (step {step}): {error_line(e, last=True)}") from None
        t1 = time.perf_counter()
        vals = out if len(out_sigs) > 1 else [out]
        if len(vals) != len(out_sigs):
            raise BlockforgeError(f"compiled module returned {len(vals)} outputs, the model declares {len(out_sigs)}")
        # An in-place step's presents are its capacity buffers: taken out of the returned tuple
        # only at the last step. This bookkeeping runs right after the step has streamed every
        # weight through the caches: GPT-2 small, 24 present objects 0.12 ms, a copy of the
        # logits 0.11 ms of the loop's 0.59 ms per token (a 16.5 ms step).
        last = step == opts.steps - 1
        outs = {s.name: vals[i] for i, s in enumerate(out_sigs) if caps is None or last or s.name not in presents}
        if caps is None:
            bound = {d: n for s in in_sigs for d, n in zip(s.dims, args[s.name].shape) if isinstance(d, str)}
            check_outputs(out_sigs, {k: _Meta(v) for k, v in outs.items()}, bound)
        else:  # the caches are the capacity buffers (checked by the entry); the rest as declared
            bound = {d: n for s in in_sigs if s.name not in caps
                     for d, n in zip(s.dims, args[s.name].shape) if isinstance(d, str)}
            bound[ip] = past_len
            check_outputs([s for s in out_sigs if s.name not in presents],
                          {k: _Meta(v) for k, v in outs.items() if k not in presents}, bound)
        tok = None
        if feed:
            logits = outs[feed.logits]
            tok = _next_tokens(feed, host, np.from_dlpack(logits) if on_cpu else logits.numpy())  # (a view: read here only)
            for n in fed:
                args[n] = tvm.runtime.tensor(np.ascontiguousarray(host[n]), dev)
        if caps is None:
            for p in pairing.pairs:  # the module's own present tensors become the next pasts
                args[p.past] = outs[p.present]
            grown = int(outs[first.present].shape[first.axis])
        else:  # written in place: the same buffers, one row longer
            grown = past_len + seq
        if ip is not None and caps is None and step < opts.steps - 1:
            # the prompt's cache into the capacity buffers, once (rows [0, grown)); every later
            # step writes its row there (timed in this step's ms, not its call_ms)
            caps = {p.past: _capacity_buffer(tvm, outs[p.present], p.axis, mod.manifest[inplace_entry.KEY]["capacity"],
                                             dev) for p in pairing.pairs}
        filled = grown
        t2 = time.perf_counter()
        if seq is None:
            seq = grown - past_len
        if step == 0:  # later calls add 1 position (a token) or the prompt's length again
            final = grown + (opts.steps - 1) * (1 if feed else seq)
            if final > MAX_BOUND_DIM:
                raise ArgumentError(f"{{steps}} {opts.steps} would grow the cache to {final} positions, past the "
                                    f"limit of {MAX_BOUND_DIM} for a symbolic dim", "steps")
        rec = StepRecord(step, past_len, seq, (t2 - t0) * 1e3, (t1 - t0) * 1e3,
                         tuple(int(t) for t in tok) if tok is not None else None,
                         inplace_entry.INPLACE_ENTRY if fn is ip_fn and ip_fn is not None
                         else entries.STEP_ENTRY if fn is step_fn else "main")
        result.steps.append(rec)
        if on_step:
            on_step(rec)
        if last:
            result.outputs = {k: v.numpy() for k, v in outs.items()}
            if fn is ip_fn and ip_fn is not None:  # the presents: the buffers' filled rows
                for p in pairing.pairs:
                    result.outputs[p.present] = inplace_entry.filled_rows(result.outputs[p.present], p.axis, grown)
    return result


def _inplace_plan(mod, opts: DecodeOptions, pairing: DecodePairing, step_at, args: dict, host: dict) -> str | None:
    """The past dim when the steps after the prompt run `decode_inplace` (the artifact has it,
    opts.inplace, a language model: one token per step), else None. A loop that would outgrow
    the capacity is refused before it runs."""
    rec = mod.manifest.get(inplace_entry.KEY)
    if rec is None or not opts.inplace or step_at is None or pairing.tokens is None or opts.steps < 2:
        return None
    first = pairing.pairs[0]
    final = int(args[first.past].shape[first.axis]) + int(np.shape(host[pairing.tokens.input_ids])[1]) + opts.steps - 1
    if final > rec["capacity"]:
        raise ArgumentError(f"{{steps}} {opts.steps} would fill {final} positions of the cache, past the artifact's "
                            f"in-place capacity of {rec['capacity']} (compile --kv-capacity): fewer steps, a larger "
                            "capacity, or the copying loop (run --copy-cache)", "steps")
    return rec["dim"]


def _capacity_buffer(tvm, present, axis: int, capacity: int, dev):
    """A capacity buffer holding `present` in its first rows along `axis` (the rest zero)."""
    return tvm.runtime.tensor(inplace_entry.capacity_array(present.numpy(), axis, capacity), dev)
