"""What the verbs share: tables, option parsing into the API's types, and option groups
whose names and defaults are the same on every verb."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from blockforge.errors import ArgumentError, BlockforgeError


def print_table(headers: list[str], rows: list[list], out=None) -> None:
    out = out or sys.stdout
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    print(line(headers), file=out)
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|", file=out)
    for r in cells:
        print(line(r), file=out)


# The API's argument names whose flag is not `--` + the name with dashes.
_FLAG_OF = {"use_tuning": "--no-tuning", "steps": "--decode", "bench_decode": "--decode", "pasts": "--past"}


def flag_of(argument: str) -> str:
    """The CLI flag for a library argument: shape -> --shape, tuning_db -> --tuning-db."""
    return _FLAG_OF.get(argument, "--" + argument.replace("_", "-"))


def error_message(e: BlockforgeError) -> str:
    """A library error as the CLI says it: the arguments it names (ArgumentError) as flags."""
    return e.render(flag_of) if isinstance(e, ArgumentError) else str(e)


def note_text(note: str) -> str:
    """A library note as the CLI prints it: the arguments a Phrase names as flags, made printable."""
    from blockforge.errors import Phrase, printable

    return printable(note.render(flag_of) if isinstance(note, Phrase) else note, limit=None)


def path_or_none(v: str | None, flag: str) -> Path | None:
    """An optional path flag: absent is None; given but empty is the user's mistake (an empty
    --tuning-db once meant the default database, an empty --inputs random inputs)."""
    if v == "":
        raise BlockforgeError(f"{flag}: the path is empty")
    return None if v is None else Path(v)


def shape(a: argparse.Namespace):
    """--shape as parsed (a ShapeRequest: dim names, batch=1, and/or whole input shapes,
    input_ids=1x128); resolved against the model by the prelude (graph/shape.py Binding)."""
    from blockforge.graph.shape import ShapeRequest

    return getattr(a, "shape", None) or ShapeRequest()


def _shape_type(text: str):
    """argparse `type=` for --shape: the request parsed once, its error one line naming the flag."""
    from blockforge.graph.shape import ShapeRequest

    try:
        return ShapeRequest.parse(text)
    except BlockforgeError as e:
        raise argparse.ArgumentTypeError(error_message(e)) from None


def add_shape(p: argparse.ArgumentParser, default_note: str | None = None) -> None:
    p.add_argument("--shape", default=None, type=_shape_type,
                   help="bind symbolic dims by name (batch=1,seq=128) or by whole input shapes "
                        "(input_ids=1x128,attention_mask=1x128; pixel_values=1x3x224x224); a dim left "
                        "symbolic may get an upper bound (seq=..1024): its memory is then planned for "
                        "that size and the compiled module refuses a larger one"
                        + (f" (default {default_note})" if default_note else ""))


# What bench and tune time a model at when --shape is absent (they need every dim bound).
DEFAULT_SHAPE = "batch=1,seq=128"


def default_dims(a) -> dict:
    """The default applies when --shape is absent, and then only to the dims the model has
    (a static model, or an export's s33/s50, is not broken by it); a --shape given by the
    user is the whole binding."""
    from blockforge.graph.model_io import parse_dims

    return parse_dims(DEFAULT_SHAPE) if a.shape is None else {}


def add_tuning(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tuning-db", default=None,
                   help="tuning database dir (default: the device's, in the blockforge cache; see `blockforge env`)")
    p.add_argument("--no-tuning", action="store_true", help="ignore tuning records")


def add_precision(p: argparse.ArgumentParser) -> None:
    from blockforge.targets.precision import DEFAULT, PRECISIONS

    p.add_argument("--precision", default=DEFAULT, choices=list(PRECISIONS),
                   help="what the GEMMs compute in: " + "; ".join(f"{k}: {v.description}" for k, v in PRECISIONS.items()))


def add_force(p: argparse.ArgumentParser, extra: str = "") -> None:
    p.add_argument("--force", action="store_true",
                   help=f"replace {extra}an output that is an input of this run or a symbolic link (the link, not "
                        "its target); never a device, FIFO or socket, and never two outputs on one path")


def check_outputs(a: argparse.Namespace, inputs: list, *others, **paths: str | None) -> None:
    """The verb's file outputs (--json, --output, --plot; `others`: fsutil.Output objects
    of other kinds) through the one output policy (fsutil.check_outputs) together, before
    the work, not after it; an empty path is an error."""
    from blockforge.fsutil import Output, check_outputs as policy

    files = [Output(argument, path, what=f"{flag_of(argument)} output")
             for argument, path in paths.items() if path is not None]
    policy([*files, *others], inputs, force=getattr(a, "force", False))


def write_json(path: str | None, obj) -> None:
    if path is not None:
        from blockforge.fsutil import atomic_write_json, write_error

        try:
            atomic_write_json(path, obj)
        except OSError as e:
            raise write_error(path, e) from None
