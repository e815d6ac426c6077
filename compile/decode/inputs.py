"""Decoder inputs refused before TVM sees them (issue #21).

- A dim bound to 0: only a decoder's past length may be 0 (an empty cache, P = 0: the prompt
  step), and only where that dim sizes nothing but the past inputs' past axes. Anything else
  (seq=0, batch=0, a past length that is also another input's dim) was a crash inside TVM's
  importer or its kernels.
- The attention mask of a decoder spans the cache and the new positions: its length must be
  past + seq. The exporters name it by a dim of its own (legacy: past_seq; dynamo: a fresh
  symbol), so nothing in the model ties them, and a wrong length ran and returned garbage or
  crashed inside TVM.

Both take the signature as TensorSigs and the sizes as {dim: value} (a binding) or the
arrays' shapes; the errors name the argument that gave the sizes ({inputs}, {shape}).
"""

from __future__ import annotations

from blockforge.errors import ArgumentError, BlockforgeError, printable
from blockforge.graph.model_io import TensorSig

from blockforge.compile.decode.pairing import DecodePairing, infer_pairing


def pairing_of(inputs: list[TensorSig], outputs: list[TensorSig]) -> DecodePairing | None:
    """The signature's cache pairing, or None (no cache, or an ambiguous one: nothing to check)."""
    try:
        return infer_pairing([s.to_dict() for s in inputs], [s.to_dict() for s in outputs])
    except BlockforgeError:
        return None


def empty_dims(inputs: list[TensorSig], pairing: DecodePairing | None) -> frozenset:
    """The symbolic dims that may be 0: a past length that only the past inputs' past axes carry."""
    if pairing is None:
        return frozenset()
    by_name = {s.name: s for s in inputs}
    past_axes = {(p.past, p.axis) for p in pairing.pairs}
    dims = {by_name[p.past].dims[p.axis] for p in pairing.pairs}
    carried_elsewhere = {d for s in inputs for axis, d in enumerate(s.dims) if (s.name, axis) not in past_axes}
    return frozenset(d for d in dims if isinstance(d, str) and d not in carried_elsewhere)


def check_zero_dims(inputs: list[TensorSig], pairing: DecodePairing | None, values: dict[str, int],
                    argument: str = "inputs") -> None:
    """Refuse a symbolic dim bound to 0 unless it is a decoder's past length (see module doc)."""
    zero = [d for d, v in values.items() if v == 0]
    if not zero:
        return
    allowed = empty_dims(inputs, pairing)
    for d in zero:
        if d not in allowed:
            where = next(f"{printable(s.name)} axis {s.dims.index(d)}" for s in inputs if d in s.dims)
            raise ArgumentError(f"{{{argument}}} binds dim {printable(d)!r} ({where}) to 0: only a decoder's past "
                                "length may be 0 (an empty cache); give it at least 1", argument)


def _mask_dims(pairing: DecodePairing | None, shapes: dict[str, tuple]) -> tuple | None:
    """(the mask's length, seq, past) as `shapes` (input name -> its dims) give them, for a decoder
    whose feed has an attention mask; None where there is none or a rank is not the decoder's
    (rank errors are the signature check's)."""
    feed = pairing.tokens if pairing else None
    if feed is None or feed.attention_mask is None:
        return None
    first = pairing.pairs[0]
    mask, ids, past = (shapes.get(n) for n in (feed.attention_mask, feed.input_ids, first.past))
    if not (mask and ids and past) or len(mask) != 2 or len(ids) != 2 or len(past) <= first.axis:
        return None
    return mask[1], ids[1], past[first.axis]


def check_mask_length(inputs: list[TensorSig], pairing: DecodePairing | None, shapes: dict[str, tuple],
                      argument: str = "inputs") -> None:
    """A decoder's attention_mask must be (batch, past + seq). shapes: input name -> its shape
    (None or a str for a dim not known yet: nothing checked)."""
    dims = _mask_dims(pairing, shapes)
    if dims is None:
        return
    m, s, p = dims
    if not all(isinstance(v, int) for v in (m, s, p)) or m == p + s:
        return
    feed, first = pairing.tokens, pairing.pairs[0]
    raise ArgumentError(f"{{{argument}}}: {printable(feed.attention_mask)} has length {m}, but a decoder's mask spans "
                        f"the cache and the new positions: past + seq = {p} + {s} = {p + s} ({printable(first.past)} "
                        f"axis {first.axis}, {printable(feed.input_ids)} axis 1)", argument)


def mask_bound(inputs: list[TensorSig], pairing: DecodePairing | None, bounds: dict[str, int]) -> dict[str, int]:
    """A decoder's attention-mask length dim (past_seq; dynamo's sN) left without an upper bound
    while past's and seq's have one: bounded by their sum (it equals past + seq when it runs:
    check_mask_length), so `--shape seq=..S,past=..P` plans the mask's tensors too."""
    dims = _mask_dims(pairing, {s.name: s.dims for s in inputs})
    if dims is None:
        return {}
    m, s, p = dims
    if not all(isinstance(d, str) for d in (m, s, p)) or m in bounds or len({m, s, p}) < 3 \
            or s not in bounds or p not in bounds:
        return {}
    return {m: bounds[s] + bounds[p]}


def check_decoder_binding(inputs: list[TensorSig], outputs: list[TensorSig], values: dict[str, int],
                          argument: str = "inputs") -> DecodePairing | None:
    """Both checks on a binding (the prelude's, before the model reaches TVM); returns the
    signature's pairing (mask_bound reads it too)."""
    pairing = pairing_of(inputs, outputs)
    check_zero_dims(inputs, pairing, values, argument)
    check_mask_length(inputs, pairing, {s.name: s.at(values).dims for s in inputs}, argument)
    return pairing
