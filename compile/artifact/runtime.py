"""Load an artifact and run it. Loading a .so runs native code, so the manifest and
the sha256 of every file are checked first (module.so and weights.bin over the very bytes
used), and the target must run here."""

from __future__ import annotations

import functools
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from blockforge.errors import BlockforgeError, error_line
from blockforge.graph.model_io import TensorSig, check_inputs
from blockforge.targets import resolve
from blockforge.targets.toolchain import cuda_load_env, host_arch

from blockforge import settings
from blockforge.compile.artifact.manifest import elf_arch, private_copy, read_manifest, verify_files, verify_package
from blockforge.compile.artifact.weights import load_weights, load_weights_arena


def _sigs(items: list[dict]) -> list[TensorSig]:
    return [TensorSig(i["name"], tuple(i["shape"]), i["dtype"]) for i in items]


@dataclass
class LoadedModule:
    artifact: Path
    manifest: dict
    vm: object
    device: object
    weights: list = field(default_factory=list)  # tvm tensors on `device`: main's parameters after the inputs
    arena: object = None  # weights.WeightArena the CPU tensors view (None: each tensor in TVM's own memory)

    @property
    def params(self) -> list:
        """What follows the inputs in every call of main (the same tensors each call: not copied)."""
        return self.weights

    @property
    def inputs(self) -> list[TensorSig]:
        return _sigs(self.manifest["inputs"])

    @functools.cached_property
    def pairing(self):
        """The signature's decode pairing (None: not a decoder), inferred once, not per call."""
        from blockforge.compile.decode.inputs import pairing_of

        return pairing_of(self.inputs, _sigs(self.manifest["outputs"]))

    def entry(self, shapes: dict[str, tuple]) -> str:
        """The function a call on arrays of these shapes runs: the decode step's own entry where
        the manifest records one and the shapes are its (seq 1: compile/decode/entries.py), else main."""
        from blockforge.compile.decode import entries

        return entries.STEP_ENTRY if entries.uses_step(self.inputs, entries.step_dim(self.manifest), shapes) else "main"

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        check_inputs(self.inputs, inputs, "inputs")
        from blockforge.compile.decode.inputs import check_mask_length

        shapes = {k: np.shape(v) for k, v in inputs.items()}
        check_mask_length(self.inputs, self.pairing, shapes)
        return run_vm(self.vm, self.device, self.inputs, _sigs(self.manifest["outputs"]), inputs, self.weights,
                      entry=self.entry(shapes))


def run_vm(vm, device, in_sigs: list[TensorSig], out_sigs: list[TensorSig], inputs: dict,
           params: list = (), entry: str = "main") -> dict[str, np.ndarray]:
    """Call the VM's `entry` (main) on `inputs` (then `params`: an artifact's weights); outputs are
    checked against the declared signature (count, dtype, rank, static and symbolic dims): a
    mismatch is an error, not a result."""
    import tvm

    args = [tvm.runtime.tensor(_contiguous(inputs[s.name]), device) for s in in_sigs]
    try:
        out = vm[entry](*args, *params)
    except Exception as e:
        raise BlockforgeError(f"compiled module failed to run: {error_line(e, last=True)}") from None
    if len(out_sigs) == 1:
        outs = [out]  # a single output may itself be a tuple (an R.Shape from ONNX Shape)
    elif _is_sequence(out) and len(out) == len(out_sigs):
        outs = list(out)
    else:
        got = len(out) if _is_sequence(out) else 1
        raise BlockforgeError(f"compiled module returned {got} outputs, the model declares {len(out_sigs)} "
                              f"({', '.join(s.name for s in out_sigs)})")
    result = {s.name: _to_numpy(o, s) for s, o in zip(out_sigs, outs)}
    check_outputs(out_sigs, result, _bindings(in_sigs, inputs))
    return result


def _contiguous(a) -> np.ndarray:
    # np.ascontiguousarray returns at least 1-d: a 0-d input (Trilu's k, a scalar Gemm C)
    # would reach the VM as shape (1,) and fail its ndim check.
    a = np.asarray(a)
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def _is_sequence(o) -> bool:
    return isinstance(o, (list, tuple)) or type(o).__name__ == "Array"


def _to_numpy(o, sig: TensorSig) -> np.ndarray:
    """A VM result as numpy: tensors, R.Shape values (ONNX Shape -> int64) and scalars."""
    if hasattr(o, "numpy"):
        return o.numpy()
    if isinstance(o, tuple) and all(isinstance(d, int) for d in o):  # tvm_ffi.Shape
        return np.asarray(list(o), dtype=np.int64).reshape(len(o))
    if isinstance(o, (bool, int, float, np.generic)):
        return np.asarray(o, dtype=sig.dtype if sig.dtype in np.sctypeDict else None)
    raise BlockforgeError(f"output {sig.name!r}: the compiled module returned a {type(o).__name__}, "
                          "not a tensor (sequence outputs are not supported)")


def _bindings(sigs: list[TensorSig], arrays: dict) -> dict:
    bound: dict = {}
    for s in sigs:
        shape = np.shape(arrays[s.name])
        for d, got in zip(s.dims, shape):
            if isinstance(d, str):
                bound.setdefault(d, got)
    return bound


def _same_dtype(got: np.dtype, declared: str) -> bool:
    """`declared` is numpy's name, or ONNX's (lower case) for the ml_dtypes types: float8e4m3fn
    is numpy's float8_e4m3fn, float8e8m0 float8_e8m0fnu."""
    if str(got) == declared:
        return True
    import onnx

    try:
        code = onnx.TensorProto.DataType.Value(declared.upper())
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(code)) == got
    except (ValueError, KeyError, TypeError):
        return False


def check_outputs(sigs: list[TensorSig], outputs: dict[str, np.ndarray], bound: dict | None = None) -> None:
    """Outputs against the declared signature. Symbolic dims must agree with the value the
    inputs gave them (`bound`); unknown dims (None) match anything, and so does a name no input
    binds: that is the exporter's guess, not a contract (torch's legacy exporter declares
    MobileNet's (1, C, 2, 2) output as [d0, C, d0, d3], d0 named for the batch; ORT only warns).
    A declared shape of () is also what an unknown rank looks like, so it is not checked."""
    bound = bound or {}
    for s in sigs:
        a = outputs[s.name]
        if not _same_dtype(a.dtype, s.dtype):
            raise BlockforgeError(f"output {s.name!r} of the compiled module has dtype {a.dtype}, "
                                  f"the model declares {s.dtype}")
        if not s.dims:
            continue
        if a.ndim != len(s.dims):
            raise BlockforgeError(f"output {s.name!r} of the compiled module has shape {a.shape}, "
                                  f"the model declares rank {len(s.dims)} {list(s.dims)}")
        for axis, (got, d) in enumerate(zip(a.shape, s.dims)):
            if isinstance(d, str):
                want = bound.get(d, got)
            else:
                want = got if d is None else d
            if got != want:
                raise BlockforgeError(f"output {s.name!r} of the compiled module has shape {a.shape}, "
                                      f"the model declares {list(s.dims)} (axis {axis}: {got} != {want})")


def tvm_device(kind: str | None):
    import tvm

    return tvm.cuda(0) if kind == "cuda" else tvm.cpu(0)


def load_artifact(artifact: str | Path) -> LoadedModule:
    """Checks everything a hostile artifact could use before any native code runs:
    read_manifest type-checks manifest.json ('module' must be one of the hashed 'files',
    all plain names), verify_files hashes every listed regular file (no symlinks), a
    package's bin/ and lib/ must be what its 'package_files' lists (verify_package: this
    loader uses the wheel's runtime, not lib/, but a tampered package is refused here too),
    the target must run here and the module must be an ELF for this CPU; only then dlopen."""
    import tvm
    from tvm import relax

    artifact = Path(artifact)
    manifest = read_manifest(artifact)
    module = manifest["module"]
    weights_file = (manifest.get("weights") or {}).get("file")
    # module.so and weights.bin are hashed over the bytes that are used (a private copy of the
    # library, the weights as they are copied into TVM's memory), not in a pass before.
    verify_files(artifact, manifest, at_use=frozenset({module, weights_file} - {None}))
    with tempfile.TemporaryDirectory(prefix="module-", dir=_private_dir()) as tmp:
        so = Path(tmp) / "module.so"
        private_copy(artifact, module, manifest["files"][module], so)
        arch = elf_arch(so)
        verify_package(artifact, manifest, arch or host_arch())
        t = manifest["target"]
        target = resolve(t["json"]) if t["name"] == "custom" else resolve(t["name"])
        problem = target.run_problem()
        if problem:
            raise BlockforgeError(f"{artifact}: built for {t['name']} ({t['json'].get('kind')}), cannot run here: {problem}")
        if arch is None:
            raise BlockforgeError(f"{artifact}: {module} is not an ELF shared object; refusing to load it")
        if arch != host_arch():
            raise BlockforgeError(f"{artifact}: {module} is for {arch}, this machine is {host_arch()}")
        dev = tvm_device(target.device)
        arena, weights = _weights(artifact, manifest, target.device, dev)  # before any native code
        try:
            if target.kind == "cuda":
                with cuda_load_env():
                    lib = tvm.runtime.load_module(str(so))
            else:
                lib = tvm.runtime.load_module(str(so))
        except Exception as e:
            raise BlockforgeError(f"{artifact}: cannot load {module}: {error_line(e, last=True)}") from None
    # (the copy is unlinked once loaded: the mapping stays)
    if target.kind == "llvm":
        _warn_thread_pool()
    vm = relax.VirtualMachine(lib, dev)
    step = (manifest.get("step") or {}).get("function")
    if step is not None and not vm.module.implements_function(step):  # a manifest naming what is not there
        raise BlockforgeError(f"{artifact}: manifest.json's 'step' names function {step!r}, which {module} does "
                              "not have; refusing to run it")
    inplace = (manifest.get("inplace") or {}).get("function")
    if inplace is not None and not vm.module.implements_function(inplace):
        raise BlockforgeError(f"{artifact}: manifest.json's 'inplace' names function {inplace!r}, which {module} "
                              "does not have; refusing to run it")
    return LoadedModule(artifact, manifest, vm, dev, weights, arena)


@functools.cache
def _warn_thread_pool() -> None:
    """Once per process: a library caller who skipped blockforge.configure() may be running on
    half the cores (settings.thread_pool_note)."""
    import logging

    note = settings.thread_pool_note()
    if note:
        logging.getLogger("blockforge").warning(note)


def _weights(artifact: Path, manifest: dict, device_kind: str | None, dev) -> tuple[object, list]:
    """On a CPU: weights.bin read into one huge-page arena that the tensors view (no copy);
    elsewhere (or BLOCKFORGE_HUGEPAGES=0): one copy into TVM's memory, tensor by tensor."""
    import tvm

    if device_kind != "cuda" and settings.hugepages():
        arena, arrays = load_weights_arena(artifact, manifest)
        return arena, [_view(a, dev) for a in arrays]
    return None, load_weights(artifact, manifest, convert=lambda a: tvm.runtime.tensor(np.ascontiguousarray(a), dev))


def _view(a: np.ndarray, dev):
    """A TVM tensor on the arena's bytes; a dtype DLPack cannot carry (ml_dtypes' bfloat16) is copied."""
    import tvm

    try:
        return tvm.runtime.from_dlpack(a)
    except (BufferError, TypeError, RuntimeError, ValueError):
        return tvm.runtime.tensor(np.ascontiguousarray(a), dev)


def _private_dir() -> str | None:
    """Where the checked copy of module.so is loaded from: the user's blockforge cache (a
    /tmp mounted noexec would refuse to map it), else the system's temporary directory."""
    d = settings.cache_dir() / "run"
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        return str(d)
    except OSError:
        return None
