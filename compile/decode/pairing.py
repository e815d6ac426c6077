"""The cache pairing: each present output and the past input it becomes at the next step.

Inferred from names at compile time and stored as manifest["decode"]:

    {"pairs": [{"present": "present_key", "past": "past_key", "axis": 2}, ...],
     "tokens": {"logits": "logits", "input_ids": "input_ids",
                "attention_mask": "attention_mask" | null, "position_ids": ... | null} | null}

Names paired: blockforge's own `present_X` -> `past_X`, and the exporters'
`present.{i}.key` / `.value` -> `past_key_values.{i}.key` / `.value`. An output that names
two existing inputs, a past input nothing feeds, or a pair without exactly one axis where
past and present differ is refused (no pairing recorded, the reason said by `run --decode`).

The manifest is untrusted: before a loop runs, the recorded pairing is type-checked and must
be the one the manifest's own signature implies (a pairing that swapped key and value, or fed
a present into an input of another shape, is refused), with the same rules as inference.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from blockforge.errors import ArgumentError, BlockforgeError, printable, with_prefix

_EXPORTER = re.compile(r"present\.(\d{1,4})\.(key|value)", re.ASCII)
TOKEN_INPUTS = ("input_ids", "attention_mask", "position_ids")


@dataclass(frozen=True)
class CachePair:
    present: str  # output
    past: str  # input of the next step
    axis: int  # the sequence axis: present = past grown along it

    def to_dict(self) -> dict:
        return {"present": self.present, "past": self.past, "axis": self.axis}


@dataclass(frozen=True)
class TokenFeed:
    """A language model: the argmax of logits[:, -1] becomes the next input_ids (B, 1);
    attention_mask grows by a column of ones, position_ids by the next position."""

    logits: str
    input_ids: str
    attention_mask: str | None = None
    position_ids: str | None = None

    def to_dict(self) -> dict:
        return {"logits": self.logits, "input_ids": self.input_ids, "attention_mask": self.attention_mask,
                "position_ids": self.position_ids}


@dataclass(frozen=True)
class DecodePairing:
    pairs: tuple[CachePair, ...]
    tokens: TokenFeed | None

    def to_dict(self) -> dict:
        return {"pairs": [p.to_dict() for p in self.pairs], "tokens": self.tokens.to_dict() if self.tokens else None}


def _past_candidates(present: str) -> list[str]:
    out = []
    if present.startswith("present"):
        out.append("past" + present[len("present"):])  # present_key -> past_key, present.0.key -> past.0.key
    m = _EXPORTER.fullmatch(present)
    if m:
        out.append(f"past_key_values.{m.group(1)}.{m.group(2)}")
    return out


def _grow_axis(past: dict, present: dict) -> int:
    """The one axis where present's dim differs from past's; refuses anything else."""
    pn, qn = printable(past["name"]), printable(present["name"])
    if past["dtype"] != present["dtype"]:
        raise BlockforgeError(f"{qn} ({present['dtype']}) cannot feed {pn} ({past['dtype']})")
    ps, qs = past["shape"], present["shape"]
    if len(ps) != len(qs):
        raise BlockforgeError(f"{qn} has rank {len(qs)}, {pn} rank {len(ps)}")
    differ = [i for i, (a, b) in enumerate(zip(ps, qs)) if a != b or a is None]
    if len(differ) != 1:
        raise BlockforgeError(f"cannot tell which axis of {pn} {ps} grows into {qn} {qs} "
                              f"({'no axis differs' if not differ else f'axes {differ} differ'})")
    axis = differ[0]
    if not isinstance(ps[axis], str):
        raise ArgumentError(f"{pn}'s past length is fixed at {ps[axis]} (the artifact was compiled with it "
                            "bound): a decode loop needs it symbolic; compile without binding it in {shape}", "shape")
    return axis


def infer_pairing(inputs: list[dict], outputs: list[dict]) -> DecodePairing | None:
    """The pairing for a signature ({name, shape, dtype} lists): None when no output is a
    cache; BlockforgeError (the reason) when the names or shapes are ambiguous."""
    ins = {s["name"]: s for s in inputs}
    pairs, fed = [], set()
    for out in outputs:
        found = [c for c in _past_candidates(out["name"]) if c in ins]
        if len(found) > 1:
            raise BlockforgeError(f"output {printable(out['name'])} could feed {' or '.join(map(printable, found))}: "
                                  "ambiguous")
        if found:
            pairs.append(CachePair(out["name"], found[0], _grow_axis(ins[found[0]], out)))
            fed.add(found[0])
    if not pairs:
        return None
    unfed = [n for n in ins if n.startswith("past") and n not in fed]
    if unfed:
        raise BlockforgeError(f"input {printable(unfed[0])} looks like a cache but no present output feeds it")
    outs = {s["name"] for s in outputs}
    tokens = None
    if "logits" in outs and "input_ids" in ins:
        tokens = TokenFeed("logits", "input_ids", *(n if n in ins else None for n in TOKEN_INPUTS[1:]))
    return DecodePairing(tuple(pairs), tokens)


def record(inputs: list[dict], outputs: list[dict]) -> dict | None:
    """manifest["decode"] at compile time: the pairing, or None (no cache, or ambiguous:
    `run --decode` says why)."""
    try:
        p = infer_pairing(inputs, outputs)
    except BlockforgeError:
        return None
    return p.to_dict() if p else None


def _check_recorded(d, where: str) -> None:
    """Types only (the values are compared with the inferred pairing after)."""
    def bad(what: str):
        return BlockforgeError(f"{where}: 'decode' {what}")

    if not isinstance(d, dict) or set(d) != {"pairs", "tokens"}:
        raise bad("must be an object with 'pairs' and 'tokens'")
    if not isinstance(d["pairs"], list) or not d["pairs"]:
        raise bad("'pairs' must be a non-empty list of {present, past, axis}")
    for k, p in enumerate(d["pairs"]):
        if not (isinstance(p, dict) and set(p) == {"present", "past", "axis"} and isinstance(p["present"], str)
                and isinstance(p["past"], str) and type(p["axis"]) is int):
            raise bad(f"'pairs' entry {k} must be {{present: string, past: string, axis: integer}}")
    t = d["tokens"]
    if t is not None and not (isinstance(t, dict) and set(t) == {"logits", *TOKEN_INPUTS}
                              and all(isinstance(t[k], str) for k in ("logits", "input_ids"))
                              and all(t[k] is None or isinstance(t[k], str) for k in TOKEN_INPUTS[1:])):
        raise bad("'tokens' must be null or {logits, input_ids, attention_mask, position_ids}")


def pairing_for_run(manifest: dict, where: str) -> DecodePairing:
    """The pairing a decode loop may use: the recorded one, checked (see the module doc)."""
    rec = manifest.get("decode")
    try:
        inferred = infer_pairing(manifest["inputs"], manifest["outputs"])
    except BlockforgeError as e:
        raise with_prefix(f"{where}: cannot decode: ", e) from None
    if inferred is None:
        raise BlockforgeError(f"{where}: cannot decode: no output is a key/value cache (present_* or "
                              "present.N.key/value feeding past_* or past_key_values.N.*)")
    if rec is None:
        raise BlockforgeError(f"{where}: cannot decode: manifest.json records no cache pairing (compiled by an "
                              "older blockforge? recompile it)")
    _check_recorded(rec, where)
    if rec != inferred.to_dict():
        raise BlockforgeError(f"{where}: 'decode' does not match the pairing the artifact's signature implies; "
                              "refusing to feed outputs into inputs it does not name")
    return inferred
