"""Loading ONNX files safely, model signatures, and input tensors (random or .npz).

Untrusted-file policy: a model is read without its external data first; external
tensors are then loaded only from regular files inside the model's folder, never
through a symlink or a hardlink (the onnx CVE classes: ../, absolute paths, links).
"""

from __future__ import annotations

import json
import lzma
import math
import os
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, external_data_helper

from blockforge.errors import ArgumentError, BlockforgeError, printable
from blockforge.errors import error_line

from .spec import Spec, spec_from_dict

MAX_MODEL_BYTES = 4 << 30
MAX_BOUND_DIM = 1 << 16
MAX_INPUT_BYTES = 2 << 30  # random inputs beyond this are refused, not allocated
DEFAULT_DIMS = {"batch": 2, "seq": 32, "kv_seq": 48, "past": 16}  # past: --kv-cache's cached length

NP_DTYPE = {
    TensorProto.FLOAT: "float32",
    TensorProto.FLOAT16: "float16",
    TensorProto.DOUBLE: "float64",
    TensorProto.BOOL: "bool",
    TensorProto.INT64: "int64",
    TensorProto.INT32: "int32",
    TensorProto.INT8: "int8",
    TensorProto.UINT8: "uint8",
}


def numpy_dtype(name: str) -> np.dtype:
    """A dtype name as TVM and the manifest write it ("float32", "bfloat16") as a little-endian
    numpy dtype; bfloat16 is ml_dtypes' (numpy has none). One mapping for the frontend's
    constants and the artifact's weights reader."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name).newbyteorder("<")


@dataclass(frozen=True)
class TensorSig:
    name: str
    dims: tuple  # ints, symbol names (str), or None for unknown
    dtype: str

    def to_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.dims), "dtype": self.dtype}

    def at(self, values: dict[str, int]) -> "TensorSig":
        """This signature with the symbolic dims `values` names replaced by their values (what
        bind_dims does to the model's inputs/outputs, without copying the model)."""
        return TensorSig(self.name, tuple(values.get(d, d) if isinstance(d, str) else d for d in self.dims), self.dtype)

    def bind(self, dims: dict[str, int]) -> tuple[int, ...]:
        out = []
        for d in self.dims:
            if isinstance(d, int):
                out.append(d)
            elif d in dims:
                out.append(dims[d])
            else:
                shape = "x".join(str(x) if isinstance(x, int) else "N" for x in self.dims)
                raise ArgumentError(
                    f"input {self.name!r} has symbolic dim {d!r}: bind it in {{shape}}: {d}=N, "
                    f"or the whole input's shape, {printable(self.name)}={shape}", "shape"
                )
        return tuple(out)


def _external_locations(model: onnx.ModelProto) -> list[str]:
    return [
        info.get("location", "")
        for t in external_data_helper._get_all_tensors(model)
        if t.data_location == TensorProto.EXTERNAL
        for info in [{e.key: e.value for e in t.external_data}]
    ]


def _check_external(path: Path, model: onnx.ModelProto) -> None:
    base = path.parent.resolve()
    for loc in _external_locations(model):
        p = Path(loc)
        if not loc or p.is_absolute() or ".." in p.parts:
            raise BlockforgeError(f"{path}: external data location {loc!r} points outside the model's folder")
        full = base / p
        if full.is_symlink() or any(q.is_symlink() for q in full.parents if base in q.parents):
            raise BlockforgeError(f"{path}: external data {loc!r} is a symlink; refusing to follow it")
        if not full.is_file():
            raise BlockforgeError(f"{path}: external data file {loc!r} is missing")
        if base not in full.resolve().parents:
            raise BlockforgeError(f"{path}: external data {loc!r} resolves outside the model's folder")
        if os.stat(full).st_nlink > 1:
            raise BlockforgeError(f"{path}: external data {loc!r} is a hardlink; refusing it")


def load_model(path: str | os.PathLike, *, check: bool = True, external_data: bool = True) -> onnx.ModelProto:
    """Read and check an ONNX model; every failure is one BlockforgeError line.
    external_data=False: external tensors are checked (policy above) but left on disk."""
    path = Path(path)
    if not path.exists():
        raise BlockforgeError(f"{path}: no such file")
    if not path.is_file():
        raise BlockforgeError(f"{path}: not a regular file")
    size = path.stat().st_size
    if size == 0:
        raise BlockforgeError(f"{path}: empty file, not an ONNX model")
    if size > MAX_MODEL_BYTES:
        raise BlockforgeError(f"{path}: {size / 2**30:.1f} GiB exceeds the {MAX_MODEL_BYTES >> 30} GiB limit")
    try:
        model = onnx.load_model(str(path), load_external_data=False)
    except Exception as e:  # protobuf DecodeError and friends
        raise BlockforgeError(f"{path}: not an ONNX model (cannot parse: {error_line(e)})") from None
    if not model.HasField("graph") or not model.opset_import:
        raise BlockforgeError(f"{path}: parses as protobuf but is not an ONNX model (no graph or opset)")
    if _external_locations(model):
        _check_external(path, model)
        if not external_data:
            return model
        try:
            external_data_helper.load_external_data_for_model(model, str(path.parent))
        except Exception as e:
            raise BlockforgeError(f"{path}: cannot load external data: {error_line(e)}") from None
    if check:
        check_model(model, str(path))
    return model


def read_external(t: onnx.TensorProto, folder: str | os.PathLike) -> np.ndarray:
    """The array of external tensor `t` from its file in `folder`, read alone (onnx's
    to_array loads it into the proto, where it stays). The location is held to the folder
    (_check_external's policy) and the bytes to what the dims and dtype need."""
    info = {e.key: e.value for e in t.external_data}
    name = printable(t.name)
    base = Path(folder).resolve()
    loc = Path(info.get("location", ""))
    full = base / loc
    if not loc.parts or loc.is_absolute() or ".." in loc.parts or full.is_symlink() or not full.is_file() \
            or full.resolve().parent != base:
        raise BlockforgeError(f"tensor {name}: external data location {str(loc)!r} is not a file in {folder}")
    try:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type))
        offset, length = int(info.get("offset", 0)), info.get("length")
    except (KeyError, TypeError, ValueError) as e:
        raise BlockforgeError(f"tensor {name}: unreadable external data ({error_line(e)})") from None
    need = math.prod(t.dims) * dtype.itemsize
    if t.data_type in (TensorProto.STRING, TensorProto.INT4, TensorProto.UINT4) or \
            (length is not None and int(length) != need) or offset < 0 or offset + need > full.stat().st_size:
        raise BlockforgeError(f"tensor {name}: external data of {length} bytes at offset {offset}, "
                              f"its dims {list(t.dims)} ({dtype}) need {need}")
    with open(full, "rb") as f:
        f.seek(offset)
        data = f.read(need)
    return np.frombuffer(data, dtype=dtype).reshape(tuple(t.dims))


def check_model(model: onnx.ModelProto, label: str = "model") -> None:
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as e:
        raise BlockforgeError(f"{label}: fails the ONNX checker: {error_line(e)}") from None


def _sig(vi: onnx.ValueInfoProto) -> TensorSig:
    tt = vi.type.tensor_type
    dims = tuple(
        d.dim_value if d.HasField("dim_value") else (d.dim_param if d.HasField("dim_param") else None)
        for d in tt.shape.dim
    )
    return TensorSig(vi.name, dims, NP_DTYPE.get(tt.elem_type, TensorProto.DataType.Name(tt.elem_type).lower()))


def signature(model: onnx.ModelProto) -> tuple[list[TensorSig], list[TensorSig]]:
    inits = {t.name for t in model.graph.initializer}
    ins = [_sig(v) for v in model.graph.input if v.name not in inits]
    return ins, [_sig(v) for v in model.graph.output]


def bind_dims(model: onnx.ModelProto, dims: dict[str, int], *, strict: bool = True) -> onnx.ModelProto:
    """Copy of `model` with symbolic input/output dims replaced by static values.

    strict: a name that is not one of the model's symbolic input dims is an error."""
    if not dims:
        return model
    if strict:
        known = {d for s in signature(model)[0] for d in s.dims if isinstance(d, str)}
        unknown = sorted(set(dims) - known)
        if unknown:
            raise ArgumentError(f"{{shape}} names {', '.join(unknown)}, but the model's symbolic dims are "
                                f"{', '.join(sorted(known)) or 'none'}", "shape")
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for vi in list(m.graph.input) + list(m.graph.output):
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_param") and d.dim_param in dims:
                d.dim_value = dims[d.dim_param]
    return m


def model_spec(model: onnx.ModelProto) -> Spec | None:
    """The spec a blockforge export stored in metadata_props, or None for foreign models."""
    from .builders import SPEC_KEY

    props = {p.key: p.value for p in model.metadata_props}
    if SPEC_KEY not in props:
        return None
    try:
        return spec_from_dict(json.loads(props[SPEC_KEY]))
    except (ValueError, TypeError) as e:
        raise BlockforgeError(f"model metadata holds an invalid blockforge spec: {error_line(e)}") from None


@dataclass(frozen=True)
class DimBound:
    """`--shape seq=..1024`: the dim stays symbolic, at most `max` (the build plans its memory for
    that and the module refuses more: compile/passes/dim_bounds.py)."""
    max: int


def parse_dims(text: str | None) -> dict[str, int | tuple[int, ...] | DimBound]:
    """'batch=1,seq=128' -> {'batch': 1, 'seq': 128}; whole input shapes too:
    'input_ids=1x128,pixel_values=1x3x224x224' -> {'input_ids': (1, 128), ...}; an upper bound
    on a dim left symbolic: 'seq=..1024' -> {'seq': DimBound(1024)}.
    Which names are dims and which are inputs is decided against a model: resolve_dims()."""
    out: dict[str, int | tuple[int, ...] | DimBound] = {}
    if not text:
        return out
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep or not name.strip():
            raise ArgumentError(f"bad {{shape}} entry {part!r}: expected NAME=INT (a dim), NAME=..INT (a dim's "
                                "upper bound) or INPUT=AxB (an input's shape), e.g. seq=128, seq=..1024 or "
                                "input_ids=1x128", "shape")
        upto = value.strip().startswith("..")
        try:
            vals = tuple(int(v) for v in value.strip().removeprefix("..").lower().split("x"))
        except ValueError:
            raise ArgumentError(f"bad {{shape}} entry {part!r}: {value!r} is not an integer, "
                                "an upper bound like ..1024 or a shape like 1x128", "shape") from None
        if not all(0 < v <= MAX_BOUND_DIM for v in vals):
            raise ArgumentError(f"bad {{shape}} entry {part!r}: every value must be in [1, {MAX_BOUND_DIM}]", "shape")
        if upto and len(vals) != 1:
            raise ArgumentError(f"bad {{shape}} entry {part!r}: an upper bound is one integer (NAME=..INT)", "shape")
        out[name.strip()] = DimBound(vals[0]) if upto else vals[0] if len(vals) == 1 and "x" not in value.lower() else vals
    return out


def symbolic_dims(sigs: list[TensorSig]) -> list[str]:
    """The model's symbolic input dim names, in order of first appearance."""
    return list(dict.fromkeys(d for s in sigs for d in s.dims if isinstance(d, str)))


def describe_inputs(sigs: list[TensorSig]) -> str:
    """'input_ids [s33, s50], attention_mask [s6, s50]': for error messages."""
    return ", ".join(f"{printable(s.name)} [{', '.join(printable(d) for d in s.dims)}]" for s in sigs) or "none"


# The arguments binding errors name ({shape}, {inputs}: the API's names; the CLI says its flags).
_BINDING_ARGS = ("shape", "inputs")


def _bind_shape(sig: TensorSig, shape: tuple[int, ...], bound: dict[str, int], source: dict[str, str],
                what: str) -> None:
    """Bind sig's symbolic dims from a whole shape; static dims must match. `what`: the
    argument that gave it ("shape", "inputs")."""
    if len(shape) != len(sig.dims):
        raise ArgumentError(f"{{{what}}} gives input {sig.name!r} rank {len(shape)} {list(shape)}, "
                            f"the model's is rank {len(sig.dims)} {list(sig.dims)}", what)
    for axis, (v, d) in enumerate(zip(shape, sig.dims)):
        if isinstance(d, int):
            if v != d:
                raise ArgumentError(f"{{{what}}} gives input {sig.name!r} shape {list(shape)}, but axis {axis} "
                                    f"of the model's {list(sig.dims)} is fixed at {d}", what)
        elif isinstance(d, str):
            if d in bound and bound[d] != v:
                raise ArgumentError(f"{{{what}}} gives {d}={v} through input {sig.name!r}, "
                                    f"but {source[d]} gave {d}={bound[d]}",
                                    what, *(a for a in _BINDING_ARGS if a != what))
            bound.setdefault(d, v)
            source.setdefault(d, f"{{{what}}} ({printable(sig.name)})")
        else:
            raise BlockforgeError(f"input {sig.name!r} axis {axis} is dynamic without a name; "
                                  "it cannot be bound (re-export the model with named dynamic axes)")


def resolve_dims(sigs: list[TensorSig], spec: dict | None, *, input_shapes: dict | None = None,
                 defaults: dict[str, int] | None = None) -> dict[str, int]:
    """Symbolic dim name -> value for a model with inputs `sigs`, from what the user gave.

    spec: parse_dims() output: DIM=INT entries, and INPUT=shape entries (a rank-1 input may
    be given as INPUT=INT). input_shapes: shapes of arrays the user supplied (verify --inputs,
    run); they bind what the spec leaves open, and must agree with it. defaults: applied only
    to dims the model has and nothing else bound (bench's batch=1,seq=128 on any model)."""
    spec = dict(spec or {})
    by_input = {s.name: s for s in sigs}
    names = symbolic_dims(sigs)
    bound: dict[str, int] = {}
    source: dict[str, str] = {}
    unknown = []
    for name, v in spec.items():
        if isinstance(v, DimBound):
            if name not in names:
                unknown.append(name)
            continue  # resolve_bounds
        if isinstance(v, (list, tuple)) or (name in by_input and name not in names):
            if name not in by_input:
                unknown.append(name)
                continue
            _bind_shape(by_input[name], tuple(int(x) for x in (v if isinstance(v, (list, tuple)) else (v,))),
                        bound, source, "shape")
        elif name in names:
            if name in bound and bound[name] != int(v):
                raise ArgumentError(f"{{shape}} gives {name}={v}, but {source[name]} gave {name}={bound[name]}",
                                    "shape")
            bound[name] = int(v)
            source[name] = "{shape}"
        else:
            unknown.append(name)
    if unknown:
        raise ArgumentError(
            f"{{shape}} names {', '.join(sorted(unknown))}, which the model does not have: its inputs are "
            f"{describe_inputs(sigs)}; its symbolic dims are {', '.join(names) or 'none (fully static)'}", "shape")
    for name, shape in (input_shapes or {}).items():
        if name in by_input:  # names the model lacks: check_inputs reports them
            _bind_shape(by_input[name], tuple(shape), bound, source, "inputs")
    for name, v in (defaults or {}).items():
        if name in names and name not in bound and not isinstance(spec.get(name), DimBound):  # bounded: symbolic
            bound[name] = int(v)
    return {d: bound[d] for d in names if d in bound}


def resolve_bounds(spec: dict | None, values: dict[str, int]) -> dict[str, int]:
    """The upper bounds (DimBound entries of a resolve_dims spec) of the dims `values` leave
    symbolic; a dim the inputs bound anyway must be within its bound (resolve_dims has checked
    the names)."""
    out = {}
    for name, v in (spec or {}).items():
        if not isinstance(v, DimBound):
            continue
        if name in values:
            if values[name] > v.max:
                raise ArgumentError(f"{{shape}} bounds {name} at {v.max} ({name}=..{v.max}), but {{inputs}} give "
                                    f"{name}={values[name]}", "shape", "inputs")
            continue
        out[name] = v.max
    return out


def unbound_dims(sigs: list[TensorSig], dims: dict[str, int]) -> list[str]:
    return [d for d in symbolic_dims(sigs) if d not in dims]


def random_inputs(sigs: list[TensorSig], dims: dict[str, int] | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs of the model's shapes: N(0, 1) activations; masks that keep >= 1 key per row."""
    bound = {**DEFAULT_DIMS, **(dims or {})}
    rng = np.random.default_rng(seed)
    out = {}
    for s in sigs:
        shape = s.bind(bound)
        nbytes = int(np.prod(shape, dtype=np.float64)) * (np.dtype(s.dtype).itemsize if s.dtype in NP_DTYPE.values() else 8)
        if nbytes > MAX_INPUT_BYTES:
            raise ArgumentError(f"input {s.name!r} of shape {list(shape)} would need {nbytes / 2**30:.1f} GiB "
                                f"(limit {MAX_INPUT_BYTES >> 30} GiB); bind smaller dims with {{shape}}", "shape")
        # Zero is a length (an empty KV cache: a decoder's first step); masks below keep a
        # row's first key, so their last axis must have one.
        masked = s.dtype == "bool" or s.name == "key_padding_mask"
        if any(d < 0 for d in shape) or (masked and shape and shape[-1] == 0):
            raise BlockforgeError(f"input {s.name!r} has a non-positive dim in {list(shape)}")
        if s.dtype == "bool":
            m = rng.random(shape) < 0.75
            m[..., 0] = True  # never mask a whole row
            out[s.name] = m
        elif s.name == "key_padding_mask":
            keep = rng.random(shape) < 0.75
            keep[..., 0] = True
            out[s.name] = np.where(keep, 0.0, -1e4).astype(s.dtype)
        elif s.dtype.startswith("float"):
            out[s.name] = rng.standard_normal(shape).astype(s.dtype)
        else:
            out[s.name] = rng.integers(0, 2, shape).astype(s.dtype)
    return out


def check_inputs(sigs: list[TensorSig], inputs: dict[str, np.ndarray], label: str = "inputs",
                 may_be_empty: frozenset = frozenset(), argument: str | None = None) -> dict[str, int]:
    """Names, dtypes and shapes against the signature; returns the symbol bindings found.
    may_be_empty: symbolic dims that may be 0 (a decode loop's empty cache, P = 0).
    argument: the library argument the label names as {argument} (an ArgumentError: the CLI
    says its flag)."""
    def err(msg: str) -> BlockforgeError:
        return ArgumentError(msg, argument) if argument else BlockforgeError(msg)

    want = {s.name for s in sigs}
    missing, extra = sorted(want - set(inputs)), sorted(set(inputs) - want)
    if missing or extra:
        parts = ([f"missing {', '.join(map(printable, missing))}"] if missing else []) + (
            [f"unexpected {', '.join(map(printable, extra))}"] if extra else [])
        raise err(f"{label}: {'; '.join(parts)} (model inputs: {', '.join(printable(s.name) for s in sigs)})")
    bound: dict[str, int] = {}
    for s in sigs:
        a = inputs[s.name]
        if str(a.dtype) != s.dtype:
            raise err(f"{label}: input {s.name!r} has dtype {a.dtype}, model expects {s.dtype}")
        if a.ndim != len(s.dims):
            raise err(f"{label}: input {s.name!r} has shape {a.shape}, model expects rank {len(s.dims)} {list(s.dims)}")
        for axis, (got, d) in enumerate(zip(a.shape, s.dims)):
            if isinstance(d, int) and got != d:
                raise err(f"{label}: input {s.name!r} has shape {a.shape}, model expects {list(s.dims)} (axis {axis})")
            if not isinstance(d, int) and not (0 if d in may_be_empty else 1) <= got <= MAX_BOUND_DIM:
                # the --shape bound, and the C++ edge app's: a symbolic dim sizes what the
                # model allocates inside (attention is quadratic in seq)
                raise err(f"{label}: input {s.name!r} has shape {a.shape}: dim {d or axis!r} is {got}, "
                          f"outside [1, {MAX_BOUND_DIM}]")
            if isinstance(d, str):
                if bound.setdefault(d, got) != got:
                    raise err(f"{label}: input {s.name!r} gives {d}={got}, another input gave {d}={bound[d]}")
    return bound


MAX_NPZ_ARRAYS = 1024


def _check_npz_members(path: Path, z: zipfile.ZipFile) -> None:
    """Every member is a .npy whose header promises no more than MAX_INPUT_BYTES and exactly
    the bytes the member holds. Checked before np.load: numpy allocates what a member's
    header claims before reading its data (a 60-byte member claiming 256 TiB was a
    MemoryError traceback), and returns non-.npy members as raw bytes."""
    infos = z.infolist()
    if len(infos) > MAX_NPZ_ARRAYS:
        raise BlockforgeError(f"{path}: holds {len(infos)} members, more than {MAX_NPZ_ARRAYS}")
    fmt = np.lib.format
    for info in infos:
        if not info.filename.endswith(".npy"):
            raise BlockforgeError(f"{path}: member {info.filename!r} is not a .npy array")
        with z.open(info) as f:
            version = fmt.read_magic(f)
            read_header = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
            shape, _, dtype = read_header(f)
            header_bytes = f.tell()
        if dtype.hasobject:  # np.load would compute its size first: OverflowError on a huge shape
            raise BlockforgeError(f"{path}: array {info.filename[:-4]!r} holds Python objects (dtype {dtype}); "
                                  "only numeric and bool arrays are read (no unpickling)")
        need = math.prod(shape) * dtype.itemsize
        if need > MAX_INPUT_BYTES:
            raise BlockforgeError(f"{path}: array {info.filename[:-4]!r} of shape {shape} would need "
                                  f"{need / 2**30:.1f} GiB (limit {MAX_INPUT_BYTES >> 30} GiB)")
        if info.file_size - header_bytes != need:
            raise BlockforgeError(f"{path}: array {info.filename[:-4]!r} holds {info.file_size - header_bytes} "
                                  f"bytes of data, its shape {shape} needs {need}")


def load_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
    path = Path(path)
    if not path.exists():
        raise BlockforgeError(f"{path}: no such file")
    if not path.is_file():  # a FIFO would block the read
        raise BlockforgeError(f"{path}: not a regular file")
    try:
        with zipfile.ZipFile(path) as z:
            _check_npz_members(path, z)
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    # zlib.error / LZMAError: a damaged compressed stream (found by tests/robustness/npz_fuzz_worker.py);
    # RuntimeError: an encrypted member; NotImplementedError: an unknown compression method.
    except (OSError, ValueError, zipfile.BadZipFile, EOFError, NotImplementedError, RuntimeError, zlib.error,
            lzma.LZMAError) as e:
        raise BlockforgeError(f"{path}: not a readable .npz file ({error_line(e)})") from None
