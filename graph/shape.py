"""The shape a user asks for, and what it binds, as types.

    ShapeRequest.parse("batch=1,input_ids=1x128")    what was asked (the CLI's --shape, parsed
                                                     by argparse `type=`): dim names and/or
                                                     whole input shapes, not yet told apart;
                                                     "seq=..1024": a dim left symbolic, bounded
    Binding.resolve(inputs, outputs, shape, ...)     against a model's signature: symbolic dim
                                                     name -> value, and the signature at those
                                                     values, computed from the signature
                                                     alone (the model is not copied)

`shape` names a request, `binding` the resolved values, `dims` a tensor's axes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from blockforge.errors import ArgumentError

from .model_io import DimBound, TensorSig, parse_dims, resolve_bounds, resolve_dims, unbound_dims


@dataclass(frozen=True)
class ShapeRequest:
    """Entries as given: (name, int) for a dim or a rank-1 input, (name, (ints...)) for a
    whole input shape, (name, DimBound) for a dim's upper bound. Which is which is decided
    against a model (Binding.resolve)."""
    entries: tuple[tuple[str, int | tuple[int, ...] | DimBound], ...] = ()

    @classmethod
    def parse(cls, text: str | None) -> "ShapeRequest":
        """'batch=1,input_ids=1x128,past=..1024'; every malformed entry is one BlockforgeError."""
        return cls(tuple(parse_dims(text).items()))

    @classmethod
    def of(cls, value: "ShapeRequest | Mapping | str | None") -> "ShapeRequest":
        """The library's entry points take a request, a parsed mapping (parse_dims, or to_dict's
        JSON form) or text."""
        if isinstance(value, ShapeRequest):
            return value
        if value is None or isinstance(value, str):
            return cls.parse(value)

        def entry(v):
            if isinstance(v, DimBound):
                return v
            if isinstance(v, Mapping) and set(v) == {"max"}:
                return DimBound(int(v["max"]))
            return tuple(v) if isinstance(v, (list, tuple)) else int(v)
        return cls(tuple((k, entry(v)) for k, v in value.items()))

    def as_spec(self) -> dict:
        """What model_io.resolve_dims takes (parse_dims' form)."""
        return dict(self.entries)

    def to_dict(self) -> dict:
        """JSON (an isolation child's request): shapes as lists, bounds as {"max": N}."""
        return {k: list(v) if isinstance(v, tuple) else {"max": v.max} if isinstance(v, DimBound) else v
                for k, v in self.entries}

    def __bool__(self) -> bool:
        return bool(self.entries)


@dataclass(frozen=True)
class Binding:
    """Symbolic dim name -> value, resolved against a model whose signature (at its symbolic
    dims) is `inputs`/`outputs`."""
    values: tuple[tuple[str, int], ...]
    inputs: tuple[TensorSig, ...]
    outputs: tuple[TensorSig, ...]
    bounds: tuple[tuple[str, int], ...] = ()  # symbolic dims left unbound, with an upper bound (seq=..1024)

    @classmethod
    def resolve(cls, inputs, outputs, shape: ShapeRequest | None = None, *, input_shapes: Mapping | None = None,
                defaults: Mapping | None = None, static: bool = False) -> "Binding":
        """model_io.resolve_dims on the signature; static: every dim must be bound (one clear
        error naming the input, the dim and both ways to give it)."""
        spec = (shape or ShapeRequest()).as_spec()
        values = resolve_dims(list(inputs), spec, input_shapes=dict(input_shapes or {}), defaults=dict(defaults or {}))
        b = cls(tuple(values.items()), tuple(inputs), tuple(outputs), tuple(resolve_bounds(spec, values).items()))
        if static:
            if b.bounds:  # every such dim in the one message, not only the first
                names = " and ".join(n for n, _ in b.bounds)
                given = ", ".join(f"{n}=..{v}" for n, v in b.bounds)
                wanted = ",".join(f"{n}=N" for n, _ in b.bounds)
                what = (f"{names} an upper bound ({given}), which leaves it symbolic; this needs its value"
                        if len(b.bounds) == 1 else
                        f"{names} upper bounds ({given}), which leave them symbolic; this needs their values")
                raise ArgumentError(f"{{shape}} gives {what}: {wanted}", "shape")
            for s in inputs:
                s.bind(values)  # raises, naming the input
        return b

    def as_dict(self) -> dict[str, int]:
        return dict(self.values)

    def signature(self) -> tuple[list[TensorSig], list[TensorSig]]:
        """(inputs, outputs) at the bound values: what model_io.bind_dims + signature give,
        without copying the model (bind_dims copies the whole ModelProto, weights included)."""
        d = self.as_dict()
        return [s.at(d) for s in self.inputs], [s.at(d) for s in self.outputs]

    def unbound(self) -> list[str]:
        return unbound_dims(list(self.inputs), self.as_dict())

    def bounds_dict(self) -> dict[str, int]:
        """Upper bounds of dims left symbolic (what the build plans memory for)."""
        return dict(self.bounds)

    def to_dict(self) -> dict:
        return {"values": self.as_dict(), "inputs": [s.to_dict() for s in self.inputs],
                "outputs": [s.to_dict() for s in self.outputs], "bounds": self.bounds_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> "Binding":
        """What an isolation child wrote (to_dict)."""
        sig = lambda s: TensorSig(str(s["name"]), tuple(s["shape"]), str(s["dtype"]))  # noqa: E731
        return cls(tuple((str(k), int(v)) for k, v in d["values"].items()),
                   tuple(map(sig, d["inputs"])), tuple(map(sig, d["outputs"])),
                   tuple((str(k), int(v)) for k, v in d.get("bounds", {}).items()))
