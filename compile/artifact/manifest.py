"""The artifact manifest: its format, and the checks that come before loading native code.

Written by compile (artifact.py), read by the loader (runtime.py), packaging (deploy) and,
with the same rules and limits, by the C++ edge app (deploy/edge_app/manifest.h, main.cc):

- manifest.json: a regular file (no symlink, FIFO, device), at most 1 MiB, UTF-8 JSON
  without duplicate keys, NaN/Infinity, numbers over 100 characters or lone surrogates,
  nested at most 32 deep; then type-checked: `files` an object of plain file name ->
  64 lowercase hex, `module` a string naming one of those files, `inputs`/`outputs`
  lists of {name, shape, dtype}, `target` an object.
- every listed file: a plain name inside the artifact (no separators, `..`, absolute
  paths), a regular file reached without following a symlink, at most 4 GiB, hashed
  through the descriptor that was checked.
- a package (deploy/package.py) also lists what it ships in bin/ and lib/:
  `package_files`, an object of "bin/NAME" or "lib/NAME" -> 64 lowercase hex. When bin/ or
  lib/ is there, it must be a real directory (not a symlink), `package_files` must be
  present and list every entry of both, and each listed file must be a regular file whose
  sha256 matches and whose ELF machine is the module's (verify_package).

- `weights` (optional; compile writes it): the lifted weights (compile/passes/lift_weights.py),
  {file, bytes, tensors}: `file` one of the hashed `files` (not `module`), `bytes` its size,
  `tensors` in parameter order (they follow the inputs), each {name, dtype, shape, offset,
  nbytes}: dtype one of WEIGHT_DTYPES, static dims, nbytes = the shape's elements (multiplied
  left to right, at most 4 GiB) x the dtype's size, offset a multiple of 64, each tensor after
  the one before it (no overlap) and inside `bytes`. The loaders then check that the file has
  exactly `bytes` (compile/artifact/weights.py; the edge app's main.cc).

- `step` (optional; compile writes it for a decoder with symbolic seq): {function, dim},
  `function` "decode" (nothing else), `dim` a symbolic dim of the inputs
  (compile/decode/entries.py): a call binding `dim` to 1 runs `decode`, every other `main`.

tests/robustness/manifest_cases.json holds one table of hostile manifests that both
loaders must refuse with the same words; a fuzz test compares the two readers' verdicts
on mutated manifests.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
from pathlib import Path

from blockforge.errors import BlockforgeError
from blockforge.targets.toolchain import arch_name

FORMAT = "blockforge.artifact/1"
NAME = "manifest.json"
REQUIRED = ("files", "target", "inputs", "outputs", "module")

# Limits shared with deploy/edge_app/manifest.h and json.h (keep them equal).
MAX_MANIFEST_BYTES = 1 << 20  # real manifests are ~2 KiB
MAX_FILE_BYTES = 4 << 30  # = graph.model_io.MAX_MODEL_BYTES
MAX_DEPTH = 32  # containers; real manifests nest 4 deep
MAX_NUMBER_CHARS = 100
MAX_FILES = 64
MAX_TENSORS = 64
MAX_RANK = 32
MAX_STATIC_DIM = 2**31 - 1
MAX_NAME_BYTES = 256
MAX_PACKAGE_FILES = 16  # a package ships 3: bin/edge_app, lib/libtvm_runtime.so, lib/libtvm_ffi.so
PACKAGE_DIRS = ("bin", "lib")
MAX_WEIGHTS = 4096  # BERT-base lifts ~200 tensors; each is a manifest entry of ~120 bytes
WEIGHTS_ALIGN = 64  # bytes; TVM's own allocation alignment (a mapped tensor may be used in place)
# The dtypes weights.bin may hold -> bytes per element (the edge app's manifest.h has the same table).
WEIGHT_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1, "uint8": 1, "int16": 2,
                 "uint16": 2, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8, "bool": 1}

# A file name inside the artifact: no separators, no "." / "..", no leading dot; what
# compile writes (module.so, kernels.cu, device.fatbin) fits.
PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,127}", re.ASCII)
DTYPE_NAME = re.compile(r"[a-z][a-z0-9]{0,15}", re.ASCII)
PACKAGE_NAME = re.compile(r"(?:bin|lib)/[A-Za-z0-9_][A-Za-z0-9._+-]{0,127}", re.ASCII)
SHA256_HEX = re.compile(r"[0-9a-f]{64}", re.ASCII)
_OUTSIDE = "(a path could reach outside the artifact)"

ELF_MACHINES = {3: "i386", 40: "arm", 62: "x86_64", 183: "aarch64", 243: "riscv64"}


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _byte_size(n: int) -> str:
    return f"{n >> 30} GiB" if n >= 1 << 30 else f"{n >> 20} MiB"


def open_regular(path: Path, label: str, max_bytes: int, *, where: str) -> tuple[int, int]:
    """(fd, size) of `path`, a regular file of at most max_bytes reached without following
    a symlink; every refusal is "{where}: {label} ...". The type is checked before opening
    (opening a FIFO blocks, a device can have effects) and again on the descriptor (the
    path may be swapped in between; O_NONBLOCK keeps a FIFO swapped in from blocking)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise BlockforgeError(f"{where}: {label} is missing") from None
    except OSError as e:
        raise BlockforgeError(f"{where}: {label}: cannot open ({e.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise BlockforgeError(f"{where}: {label} is a symlink; refusing to follow it")
    if not stat.S_ISREG(st.st_mode):
        raise BlockforgeError(f"{where}: {label} is not a regular file ({_file_kind(st.st_mode)})")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise BlockforgeError(f"{where}: {label} is a symlink; refusing to follow it") from None
        raise BlockforgeError(f"{where}: {label}: cannot open ({e.strerror})") from None
    st = os.fstat(fd)
    problem = (f"is not a regular file ({_file_kind(st.st_mode)})" if not stat.S_ISREG(st.st_mode) else
               f"is larger than {_byte_size(max_bytes)} ({st.st_size} bytes)" if st.st_size > max_bytes else None)
    if problem:
        os.close(fd)
        raise BlockforgeError(f"{where}: {label} {problem}")
    return fd, st.st_size


def _read_fd(fd: int, size: int, *, hasher=None, sink=None) -> bytes | None:
    """Exactly `size` bytes (fed to `hasher` and `sink` when given, else returned); None when
    the file no longer has that size."""
    chunks, off = [], 0
    while off < size:
        chunk = os.pread(fd, min(1 << 20, size - off), off)
        if not chunk:
            return None
        if hasher is not None:
            hasher.update(chunk)
        if sink is not None:
            sink(chunk)
        if hasher is None and sink is None:
            chunks.append(chunk)
        off += len(chunk)
    if os.pread(fd, 1, size):  # it grew
        return None
    return b"".join(chunks)


# ------------------------------------------------------------------ parsing


class _Refused(ValueError):
    pass


def _no_duplicates(pairs: list) -> dict:
    # json.loads would keep the last of two equal keys; another reader might keep the first.
    out = {}
    for k, v in pairs:
        if k in out:
            raise _Refused(f"duplicate key '{_printable(k)}'")
        out[k] = v
    return out


def _refuse_constant(name: str):
    raise _Refused(f"{name} is not JSON")


def _number(conv):
    def parse(tok: str):
        if len(tok) > MAX_NUMBER_CHARS:
            raise _Refused(f"number longer than {MAX_NUMBER_CHARS} characters")
        return conv(tok)
    return parse


def _check_tree(value) -> None:
    """Nesting depth (containers) and strings (no lone surrogates), without recursion."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise _Refused("lone surrogate in \\u escape") from None
        elif isinstance(v, (dict, list)):
            if depth + 1 > MAX_DEPTH:
                raise _Refused(f"nested more than {MAX_DEPTH} deep")
            items = [x for kv in v.items() for x in kv] if isinstance(v, dict) else v
            stack.extend((x, depth + 1) for x in items)


def _printable(s: str) -> str:
    """Text from the file as it may appear in a message: control characters as \\xNN (the C++
    reader's json::Printable), so that a refusal is one line."""
    return "".join(f"\\x{ord(c):02x}" if ord(c) < 0x20 or ord(c) == 0x7F else c for c in s)


def _is_label(s) -> bool:
    """Tensor and symbol names: any UTF-8, but bounded and one line."""
    return (isinstance(s, str) and 0 < len(s.encode("utf-8")) <= MAX_NAME_BYTES
            and not any(ord(c) < 0x20 or ord(c) == 0x7F for c in s))


def _sigs(m: dict, key: str) -> None:
    items, where = m[key], f"'{key}'"
    if not isinstance(items, list):
        raise _Refused(f"{where} must be a list of {{name, shape, dtype}}")
    if len(items) > MAX_TENSORS:
        raise _Refused(f"{where} lists more than {MAX_TENSORS} tensors")
    seen = set()
    for k, item in enumerate(items):
        entry = f"{where} entry {k}"
        if not isinstance(item, dict):
            raise _Refused(f"{entry} is not an object")
        name, dtype, shape = item.get("name"), item.get("dtype"), item.get("shape")
        if not _is_label(name):
            raise _Refused(f"{entry}: 'name' must be a one-line string of 1 to {MAX_NAME_BYTES} bytes")
        if name in seen:
            raise _Refused(f"{entry}: name '{_printable(name)}' appears twice")
        seen.add(name)
        if not (isinstance(dtype, str) and DTYPE_NAME.fullmatch(dtype)):
            raise _Refused(f"{entry}: 'dtype' must be a dtype name such as float32")
        if not (isinstance(shape, list) and len(shape) <= MAX_RANK):
            raise _Refused(f"{entry}: 'shape' must be a list of at most {MAX_RANK} dims")
        for d in shape:
            if not ((type(d) is int and 0 <= d <= MAX_STATIC_DIM) or _is_label(d) or d is None):
                raise _Refused(f"{entry}: bad dim in 'shape' (dims are integers in [0, {MAX_STATIC_DIM}], "
                               "symbol names or null)")


def _digest_listing(listing, key: str, limit: int, pattern: re.Pattern, shape: str, kind: str) -> None:
    """'files' and 'package_files': an object of at most `limit` names matching `pattern`
    -> 64 lowercase hex."""
    if not isinstance(listing, dict):
        raise _Refused(f"'{key}' must be an object of {shape} -> sha256")
    if len(listing) > limit:
        raise _Refused(f"'{key}' lists more than {limit} files")
    for name in sorted(listing):  # the C++ reader's std::map order (UTF-8 byte order = code point order)
        if not pattern.fullmatch(name):
            raise _Refused(f"'{key}' names '{_printable(name)}': not a {kind} {_OUTSIDE}")
        if not (isinstance(listing[name], str) and SHA256_HEX.fullmatch(listing[name])):
            raise _Refused(f"'{key}': the sha256 of {name} is not 64 lowercase hex digits")


def check_manifest(m) -> None:
    """The type checks, in the C++ reader's order (so both name the same first problem)."""
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise _Refused(f"unknown manifest format (expected {FORMAT})")
    for key in REQUIRED:
        if key not in m:
            raise _Refused(f"manifest lacks '{key}'")
    files = m["files"]
    _digest_listing(files, "files", MAX_FILES, PLAIN_NAME, "file name", "plain file name")
    module = m["module"]
    if not isinstance(module, str):
        raise _Refused("'module' must be a string naming one of the hashed 'files'")
    if not PLAIN_NAME.fullmatch(module):
        raise _Refused(f"'module' '{_printable(module)}' is not a plain file name {_OUTSIDE}")
    if module not in files:
        raise _Refused(f"'module' {module} is not one of the hashed 'files'")
    t = m["target"]
    if not (isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("json"), dict)
            and all(t.get(k) is None or isinstance(t[k], str) for k in ("arch", "device"))):
        raise _Refused("'target' must be an object with 'name' (a string), 'json' (an object), 'arch' and "
                       "'device' (strings or null)")
    _sigs(m, "inputs")
    _sigs(m, "outputs")
    if "package_files" in m:
        _digest_listing(m["package_files"], "package_files", MAX_PACKAGE_FILES, PACKAGE_NAME,
                        "bin/NAME or lib/NAME", "bin/ or lib/ file name")
    if "weights" in m:
        _weights(m)
    if "step" in m:
        _step(m)
    if "inplace" in m:
        _inplace(m)


def _step(m: dict) -> None:
    """'step' (compile/decode/entries.py): {function, dim}, in the C++ reader's order
    (manifest.h, Step). The only function a loader may be sent to is STEP_ENTRY."""
    from blockforge.compile.decode.entries import STEP_ENTRY

    st = m["step"]
    if not (isinstance(st, dict) and set(st) == {"function", "dim"} and isinstance(st["function"], str)
            and isinstance(st["dim"], str)):
        raise _Refused("'step' must be an object with exactly 'function' and 'dim' (strings)")
    if st["function"] != STEP_ENTRY:
        raise _Refused(f"'step' function '{_printable(st['function'])}' is not {STEP_ENTRY} (the only step entry "
                       "a loader calls)")
    if not any(st["dim"] in s["shape"] for s in m["inputs"]):
        raise _Refused(f"'step' dim '{_printable(st['dim'])}' is not a symbolic dim of the inputs")


def _inplace(m: dict) -> None:
    """'inplace' (compile/decode/inplace.py): {function, capacity, dim}. Only with 'step' and
    'decode' (the loop that calls it pairs the caches); the function must be INPLACE_ENTRY, the
    capacity a row count in [1, MAX_CAPACITY], dim the symbolic past dim of the pairing's
    first cache (the dim the entry's last input, past_len, carries)."""
    from blockforge.compile.decode.inplace import INPLACE_ENTRY, MAX_CAPACITY

    ip = m["inplace"]
    if not (isinstance(ip, dict) and set(ip) == {"function", "capacity", "dim"} and isinstance(ip["function"], str)
            and isinstance(ip["dim"], str) and type(ip["capacity"]) is int):
        raise _Refused("'inplace' must be an object with exactly 'function', 'dim' (strings) and 'capacity' (an integer)")
    if ip["function"] != INPLACE_ENTRY:
        raise _Refused(f"'inplace' function '{_printable(ip['function'])}' is not {INPLACE_ENTRY} (the only in-place "
                       "entry a loader calls)")
    if not 1 <= ip["capacity"] <= MAX_CAPACITY:
        # (no value in the words: a double-parsing reader, the edge app's, cannot print 2**53 + 1 as written)
        raise _Refused(f"'inplace' capacity is not in [1, {MAX_CAPACITY}]")
    if "step" not in m or not isinstance(m.get("decode"), dict):
        raise _Refused("'inplace' needs 'step' and 'decode' (the step entry and the cache pairing)")
    pairs = m["decode"].get("pairs")
    first = pairs[0] if isinstance(pairs, list) and pairs and isinstance(pairs[0], dict) else {}
    past = next((s for s in m["inputs"] if s["name"] == first.get("past")), None)
    axis = first.get("axis")
    if past is None or type(axis) is not int or not 0 <= axis < len(past["shape"]) or past["shape"][axis] != ip["dim"]:
        raise _Refused(f"'inplace' dim '{_printable(ip['dim'])}' is not the past dim of the first cache input")


def _is_count(v, limit: int) -> bool:
    return type(v) is int and 0 <= v <= limit


def _weights(m: dict) -> None:
    """The 'weights' table, in the C++ reader's order (manifest.h, Weights)."""
    w = m["weights"]
    if not (isinstance(w, dict) and isinstance(w.get("file"), str) and type(w.get("bytes")) is int
            and isinstance(w.get("tensors"), list)):
        raise _Refused("'weights' must be an object with 'file' (a string), 'bytes' (an integer) and 'tensors' "
                       "(a list)")
    name, total, tensors = w["file"], w["bytes"], w["tensors"]
    if not PLAIN_NAME.fullmatch(name):
        raise _Refused(f"'weights' file '{_printable(name)}' is not a plain file name {_OUTSIDE}")
    if name not in m["files"] or name == m["module"]:
        raise _Refused(f"'weights' file {name} is not one of the hashed 'files' (besides 'module')")
    if not _is_count(total, MAX_FILE_BYTES):
        raise _Refused(f"'weights' bytes must be an integer in [0, {MAX_FILE_BYTES}]")
    if len(tensors) > MAX_WEIGHTS:
        raise _Refused(f"'weights' lists more than {MAX_WEIGHTS} tensors")
    seen, end = set(), 0
    for k, t in enumerate(tensors):
        entry = f"'weights' entry {k}"
        if not isinstance(t, dict):
            raise _Refused(f"{entry} is not an object")
        tname, dtype, shape, offset, nbytes = (t.get(x) for x in ("name", "dtype", "shape", "offset", "nbytes"))
        if not _is_label(tname):
            raise _Refused(f"{entry}: 'name' must be a one-line string of 1 to {MAX_NAME_BYTES} bytes")
        if tname in seen:
            raise _Refused(f"{entry}: name '{_printable(tname)}' appears twice")
        seen.add(tname)
        if not (isinstance(dtype, str) and dtype in WEIGHT_DTYPES):
            raise _Refused(f"{entry}: 'dtype' must be one of {', '.join(WEIGHT_DTYPES)}")
        if not (isinstance(shape, list) and len(shape) <= MAX_RANK and all(_is_count(d, MAX_STATIC_DIM) for d in shape)):
            raise _Refused(f"{entry}: 'shape' must be a list of at most {MAX_RANK} integers in [0, {MAX_STATIC_DIM}]")
        size = WEIGHT_DTYPES[dtype]
        for d in shape:  # left to right, bounded at each step (the C++ reader multiplies in uint64)
            size *= d
            if size > MAX_FILE_BYTES:
                raise _Refused(f"{entry}: its shape holds more than {_byte_size(MAX_FILE_BYTES)}")
        if not (_is_count(offset, MAX_FILE_BYTES) and offset % WEIGHTS_ALIGN == 0):
            raise _Refused(f"{entry}: 'offset' must be a multiple of {WEIGHTS_ALIGN} in [0, {MAX_FILE_BYTES}]")
        if nbytes != size or type(nbytes) is not int:
            raise _Refused(f"{entry}: 'nbytes' must be {size} (its shape's elements times its dtype's size)")
        if offset < end:
            raise _Refused(f"{entry}: 'offset' {offset} overlaps the tensor before it (which ends at {end})")
        if offset + nbytes > total:
            raise _Refused(f"{entry}: reaches past the end of the weights file ({offset} + {nbytes} > {total} bytes)")
        end = offset + nbytes


def check_signature(inputs: list[dict], outputs: list[dict], label: str) -> None:
    """The loaders' checks of a signature ({name, shape, dtype} lists), for compile to apply
    before it builds: a model whose names or dims no loader would take (a negative dim, a
    newline in a name, a 100k-character name) is refused now, not after the build."""
    try:
        for key, items in (("inputs", inputs), ("outputs", outputs)):
            _sigs({key: items}, key)
    except _Refused as e:
        raise BlockforgeError(f"{label}: cannot compile: the artifact loaders (Python and the edge app) would "
                              f"refuse its signature: {e}") from None


def parse_manifest(data: bytes, label: str = NAME) -> dict:
    """manifest.json's bytes -> the checked manifest; every refusal is "{label}: ..."."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise BlockforgeError(f"{label}: manifest.json is larger than 1 MiB")
    try:
        manifest = json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates,
                              parse_constant=_refuse_constant, parse_int=_number(int), parse_float=_number(float))
        _check_tree(manifest)
    except UnicodeDecodeError:
        raise BlockforgeError(f"{label}: corrupt manifest (not UTF-8)") from None
    except RecursionError:
        raise BlockforgeError(f"{label}: corrupt manifest (nested more than {MAX_DEPTH} deep)") from None
    except _Refused as e:
        raise BlockforgeError(f"{label}: corrupt manifest ({e})") from None
    except ValueError as e:  # json.JSONDecodeError
        raise BlockforgeError(f"{label}: corrupt manifest (invalid JSON: {e})") from None
    try:
        check_manifest(manifest)
    except _Refused as e:
        raise BlockforgeError(f"{label}: {e}") from None
    return manifest


def read_manifest(artifact: Path) -> dict:
    artifact = Path(artifact)
    if not artifact.is_dir():
        raise BlockforgeError(f"{artifact}: not an artifact directory")
    mpath = artifact / NAME
    if not os.path.lexists(mpath):
        raise BlockforgeError(f"{artifact}: no manifest.json (not a blockforge artifact)")
    return parse_manifest(read_regular(mpath, NAME, MAX_MANIFEST_BYTES, where=str(artifact)), str(mpath))


def is_artifact(path: Path) -> bool:
    """Whether `path` is a blockforge artifact directory (a manifest that passes the checks)."""
    try:
        read_manifest(Path(path))
    except BlockforgeError:
        return False
    return True


def read_regular(path: Path, label: str, max_bytes: int, *, where: str) -> bytes:
    """The bytes of a bounded regular file reached without following a symlink (open_regular)."""
    fd, size = open_regular(path, label, max_bytes, where=where)
    try:
        data = _read_fd(fd, size)
    finally:
        os.close(fd)
    if data is None:
        raise BlockforgeError(f"{where}: {label} changed while being read")
    return data


def hash_regular(path: Path, label: str, *, where: str) -> tuple[str, bytes]:
    """(sha256, first 64 bytes) of a regular file of at most MAX_FILE_BYTES reached without
    following a symlink, hashed through the descriptor that was checked."""
    fd, size = open_regular(path, label, MAX_FILE_BYTES, where=where)
    try:
        h = hashlib.sha256()
        complete = _read_fd(fd, size, hasher=h) is not None
        head = os.pread(fd, 64, 0)
    finally:
        os.close(fd)
    if not complete:
        raise BlockforgeError(f"{where}: {label} changed while being read")
    return h.hexdigest(), head


def refuse_tampered(artifact: Path, name: str):
    raise BlockforgeError(f"{artifact}: {name} does not match its sha256 in manifest.json "
                          "(tampered or corrupted); refusing to load it")


def _check_listed(artifact: Path, name: str, digest: str) -> bytes:
    """The first 64 bytes of artifact/name, a bounded regular file (no symlink) whose
    sha256 is `digest`."""
    sha, head = hash_regular(Path(artifact) / name, name, where=str(artifact))
    if sha != digest:
        refuse_tampered(artifact, name)
    return head


def verify_files(artifact: Path, manifest: dict, *, at_use: frozenset = frozenset()) -> None:
    """Every listed file is a bounded regular file (no symlink) whose sha256 matches. The
    names in `at_use` are hashed by their reader over the very bytes it uses (private_copy,
    weights.load_weights): a file replaced between a check here and a later open would
    otherwise pass."""
    for name in sorted(manifest["files"]):
        if not PLAIN_NAME.fullmatch(name):
            raise BlockforgeError(f"{artifact}: 'files' names '{_printable(name)}': not a plain file name {_OUTSIDE}")
        if name not in at_use:
            _check_listed(artifact, name, manifest["files"][name])


def copy_regular(path: Path, label: str, dest: Path, *, where: str, exclusive: bool = False) -> str | None:
    """Copies a bounded regular file (reached without following a symlink) to `dest`, hashing
    the bytes as they are written: the sha256 of exactly what `dest` holds, or None when the
    file changed size while being read."""
    fd, size = open_regular(path, label, MAX_FILE_BYTES, where=where)
    h = hashlib.sha256()
    try:
        with open(dest, "xb" if exclusive else "wb") as out:
            complete = _read_fd(fd, size, hasher=h, sink=out.write) is not None
    finally:
        os.close(fd)
    return h.hexdigest() if complete else None


def private_copy(artifact: Path, name: str, digest: str, dest: Path) -> None:
    """artifact/name copied to `dest` and checked against `digest` as it is copied: a library
    loaded from `dest` is the one that was checked, whatever happens to the artifact meanwhile."""
    got = copy_regular(Path(artifact) / name, name, dest, where=str(artifact))
    if got is None:
        raise BlockforgeError(f"{artifact}: {name} changed while being read")
    if got != digest:
        refuse_tampered(artifact, name)


def verify_package(artifact: Path, manifest: dict, arch: str) -> None:
    """A package's bin/ and lib/ (the edge app and the runtime libraries it loads), in the
    C++ app's order: both real directories (a symlinked lib/ would reach outside), every
    entry listed in 'package_files' (the app's rpath searches lib/ before the system, so an
    unlisted libstdc++.so.6 there would be loaded), every listed file a regular file with its
    sha256 and an ELF for `arch`. An artifact with neither directory and no
    'package_files' passes."""
    artifact = Path(artifact)
    listed = manifest.get("package_files")
    present = []
    for d in PACKAGE_DIRS:
        p = artifact / d
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise BlockforgeError(f"{artifact}: {d}: cannot open ({e.strerror})") from None
        if stat.S_ISLNK(st.st_mode):
            raise BlockforgeError(f"{artifact}: {d}/ is a symlink; refusing to follow it")
        if not stat.S_ISDIR(st.st_mode):
            raise BlockforgeError(f"{artifact}: {d} is not a directory")
        present.append(d)
    if listed is None:
        if present:
            raise BlockforgeError(f"{artifact}: {present[0]}/ is there but manifest.json lacks 'package_files' "
                                  "(a package lists what it ships in bin/ and lib/)")
        return
    try:
        entries = sorted(f"{d}/{e}" for d in present for e in os.listdir(artifact / d))
    except OSError as e:
        raise BlockforgeError(f"{artifact}: cannot list {e.filename} ({e.strerror})") from None
    for rel in entries:
        if rel not in listed:
            raise BlockforgeError(f"{artifact}: {_printable(rel)} is not listed in manifest.json's 'package_files'; "
                                  "refusing a package with unlisted files in bin/ or lib/")
    for rel in sorted(listed):
        if not PACKAGE_NAME.fullmatch(rel):
            raise BlockforgeError(f"{artifact}: 'package_files' names '{_printable(rel)}': not a bin/ or lib/ "
                                  f"file name {_OUTSIDE}")
        found = elf_arch_of(_check_listed(artifact, rel, listed[rel]))
        if found is None:
            raise BlockforgeError(f"{artifact}: {rel} is not an ELF file; refusing to load it")
        if found != arch:
            raise BlockforgeError(f"{artifact}: {rel} is for {found}, this package is for {arch}")


def elf_arch(path: Path) -> str | None:
    """Architecture an ELF shared object was built for (e_machine), or None if not ELF."""
    with open(path, "rb") as f:
        return elf_arch_of(f.read(20))


def elf_arch_of(head: bytes) -> str | None:
    """elf_arch from a file's first (at least 20) bytes."""
    if len(head) < 20 or head[:4] != b"\x7fELF":
        return None
    order = "little" if head[5] == 1 else "big"
    machine = int.from_bytes(head[18:20], order)
    return arch_name(ELF_MACHINES.get(machine, f"e_machine {machine}"))
