"""weights.bin: the weights lifted out of module.so (compile/passes/lift_weights.py), beside it.

The file is the tensors' raw bytes (little-endian, C order), each at an offset that is a
multiple of 64, zero bytes between; nothing else. Its table is manifest.json's `weights`
(one hardened JSON reader in each loader, one hash chain: the manifest lists the file's
sha256 in `files`):

    "weights": {"file": "weights.bin", "bytes": 436207616,
                "tensors": [{"name": "w0", "dtype": "float32", "shape": [30522, 768],
                             "offset": 0, "nbytes": 93763584}, ...]}

`tensors` is the parameter order: main(inputs..., w0, w1, ...). manifest.py checks the table
(dtypes, static shapes, nbytes = shape x dtype size, aligned, ordered, no overlap, inside
`bytes`); load_weights checks the file against it. The C++ edge app reads the same file with
the same checks (deploy/edge_app/manifest.h, main.cc).

Written tensor by tensor from the constants' own buffers (no copy of the whole set), so a
compile holds its weights once while it writes them.

On a CPU the runtime reads the file into one arena (`WeightArena`, load_weights_arena): an
anonymous private mapping, 2 MiB aligned and advised MADV_HUGEPAGE, that TVM's tensors then
view without a copy (DLPack). A decode step streams every weight once per token, and the 4 KiB
pages of TVM's own allocations cost it (a page walk every 4 KiB of each GEMV's stream, and the
hardware prefetchers stop at page boundaries). Measured below (the arena's docstring); where THP
is off the advice is a no-op and the arena is plain memory. BLOCKFORGE_HUGEPAGES=0 loads as
before (a private copy per tensor into TVM's memory).
"""

from __future__ import annotations

import hashlib
import mmap
import os
from pathlib import Path

import numpy as np

from blockforge.errors import BlockforgeError
from blockforge.graph.model_io import numpy_dtype

from blockforge.compile.artifact.manifest import MAX_FILE_BYTES, WEIGHTS_ALIGN, open_regular, refuse_tampered

FILE = "weights.bin"


def _aligned(n: int) -> int:
    return -(-n // WEIGHTS_ALIGN) * WEIGHTS_ALIGN


def write_weights(path: Path, weights: list) -> dict:
    """weights: LiftedWeight (tvm.runtime.Tensor data) in parameter order -> the manifest's
    `weights` entry, the file written at `path`."""
    tensors, offset = [], 0
    with open(path, "wb") as f:
        for w in weights:
            try:
                a = np.from_dlpack(w.data)  # a view of the constant: not a copy
            except (RuntimeError, BufferError, TypeError):  # bfloat16: numpy takes no such DLPack dtype
                a = w.data.numpy()  # one tensor's copy, dropped after writing it
            if not a.flags.c_contiguous:
                raise BlockforgeError(f"weight {w.name}: not contiguous")
            f.write(b"\0" * (offset - f.tell()))
            f.write(memoryview(a.reshape(-1).view(np.uint8)) if a.size else b"")
            dtype = str(w.data.dtype)
            tensors.append({"name": w.name, "dtype": dtype, "shape": [int(d) for d in a.shape], "offset": offset,
                            "nbytes": a.nbytes})
            offset = _aligned(offset + a.nbytes)
        total = f.tell()
        f.flush()
        os.fsync(f.fileno())
    return {"file": path.name, "bytes": total, "tensors": tensors}


def load_weights(artifact: Path, manifest: dict, convert=None) -> list:
    """The weights of a checked manifest (read_manifest), in parameter order, each a private
    copy of its bytes (`convert(array)` of it when given: the runtime passes each straight into
    TVM's memory, so no more than one tensor is held twice). The file's sha256 is taken over
    the bytes copied (and the padding between them), not in an earlier pass: a file replaced
    after a check could otherwise pass it. [] for an artifact without weights (built before
    weights.bin existed)."""
    if manifest.get("weights") is None:
        return []

    def copies(fd: int, size: int, h, w: dict) -> list:
        pos, out = 0, []
        for t in w["tensors"]:  # offsets, sizes and order were checked against `bytes` (manifest.py)
            h.update(os.pread(fd, t["offset"] - pos, pos))  # the padding (< 64 bytes)
            data = bytearray(t["nbytes"])  # the private copy, read into directly
            if _read_into(fd, data, t["offset"]) != t["nbytes"]:
                raise BlockforgeError(f"{artifact}: {w['file']} changed while being read")
            h.update(data)
            pos = t["offset"] + t["nbytes"]
            a = np.frombuffer(data, dtype=numpy_dtype(t["dtype"])).reshape(t["shape"])
            out.append(convert(a) if convert else a)
            del data, a
        h.update(os.pread(fd, size - pos, pos))
        return out

    return _read_checked(Path(artifact), manifest, copies)


def _read_checked(artifact: Path, manifest: dict, read):
    """read(fd, size, sha256, table) under the checks both loaders make: the file is hashed in
    'files', a regular file of the size the table says, not grown while read, and its digest (of
    what `read` fed the hash) the manifest's."""
    w = manifest["weights"]
    digest = manifest["files"].get(w["file"])
    if digest is None:  # check_manifest lists it; a hand-made dict may not
        raise BlockforgeError(f"{artifact}: {w['file']} is not among the hashed 'files' of manifest.json")
    fd, size = open_regular(artifact / w["file"], w["file"], MAX_FILE_BYTES, where=str(artifact))
    h = hashlib.sha256()
    try:
        if size != w["bytes"]:
            raise BlockforgeError(f"{artifact}: {w['file']} is {size} bytes, manifest.json's 'weights' says "
                                  f"{w['bytes']} (truncated or replaced)")
        result = read(fd, size, h, w)
        if os.pread(fd, 1, size):
            raise BlockforgeError(f"{artifact}: {w['file']} changed while being read")
    finally:
        os.close(fd)
    if h.hexdigest() != digest:
        refuse_tampered(artifact, w["file"])
    return result


HUGE_PAGE = 2 << 20


class WeightArena:
    """One anonymous private mapping for all the weights of an artifact, its first byte 2 MiB
    aligned and the whole of it advised MADV_HUGEPAGE (THP 'madvise' mode, this VM's default,
    gives such ranges huge pages; 'never' leaves them 4 KiB pages). `view` is the usable
    `nbytes`. The mapping is freed when the last array viewing it goes: the TVM tensors made
    from it hold their arrays through DLPack."""

    def __init__(self, nbytes: int):
        import ctypes

        self._map = mmap.mmap(-1, nbytes + 2 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        probe = ctypes.c_char.from_buffer(self._map)
        base = ctypes.addressof(probe)
        del probe  # (an export of the buffer while it lives)
        start = -base % HUGE_PAGE  # a multiple of the 4 KiB page: the mapping starts on one
        self.huge = False
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE, start, -(-nbytes // HUGE_PAGE) * HUGE_PAGE or HUGE_PAGE)
                self.huge = True
            except OSError:  # a kernel without THP
                pass
        self.nbytes = nbytes
        self.view = memoryview(self._map)[start:start + nbytes]

    def array(self, t: dict) -> np.ndarray:
        """The tensor `t` of the manifest's table, viewed in place."""
        return np.frombuffer(self.view, dtype=numpy_dtype(t["dtype"]), count=int(np.prod(t["shape"], dtype=np.int64)),
                             offset=t["offset"]).reshape(t["shape"])


def load_weights_arena(artifact: Path, manifest: dict) -> tuple[WeightArena | None, list]:
    """The weights of a checked manifest as arrays viewing one WeightArena holding weights.bin
    byte for byte (its tensors at their offsets: the file's layout is the arena's), hashed over the
    arena's bytes, as load_weights hashes its copies. (None, []) without weights."""
    if manifest.get("weights") is None:
        return None, []

    def whole(fd: int, size: int, h, w: dict) -> WeightArena:
        arena = WeightArena(size)
        if _read_into(fd, arena.view, 0) != size:
            raise BlockforgeError(f"{artifact}: {w['file']} changed while being read")
        h.update(arena.view)
        return arena

    arena = _read_checked(Path(artifact), manifest, whole)
    return arena, [arena.array(t) for t in manifest["weights"]["tensors"]]


def _read_into(fd: int, data, offset: int) -> int:
    view, done = memoryview(data), 0
    while done < len(data):
        n = os.preadv(fd, [view[done:done + (1 << 26)]], offset + done)
        if n <= 0:
            break
        done += n
    return done
