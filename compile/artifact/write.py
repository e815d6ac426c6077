"""Compile an ONNX model into a deployable artifact directory.

    ARTIFACT/
      module.so        the VM executable (code and small constants)
      weights.bin      the weights, lifted out of the executable (compile/artifact/weights.py)
      kernels.<ext>    device source, for GPU / build-only targets
      device.fatbin    CUDA only: the kernels compiled by nvcc for the target arch
      manifest.json    hashes, target, versions, signature, tuning database hash

The directory appears atomically (built in a temp dir, then renamed).
"""

from __future__ import annotations

import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import onnx

import blockforge
from blockforge.errors import ArgumentError, BlockforgeError, error_line, raise_if_stopped
from blockforge.fsutil import (INTO, TREE, Output, atomic_directory, atomic_write_bytes, check_outputs, json_bytes,
                               sha256_file)
from blockforge.graph.shape import ShapeRequest
from blockforge.logs import native_output_to_log
from blockforge.targets import ResolvedTarget, resolve
from blockforge.targets.toolchain import nvcc

from blockforge.compile.artifact import manifest as manifest_io
from blockforge.compile.artifact import weights as weights_io
from blockforge.compile.decode import entries as decode_entries
from blockforge.compile.decode import inplace as decode_inplace
from blockforge.compile.decode import pairing as decode_pairing
from blockforge.compile.records.reader import open_for_apply
from blockforge.compile.session import open_model


@dataclass
class CompileOptions:
    model: Path
    target: str | dict = "host"
    shape: ShapeRequest | dict | None = None  # dim names and/or whole input shapes (graph/shape.py)
    output: Path | None = None
    dump_ir: Path | None = None
    tuning_db: Path | None = None  # None: the device's default database, if any
    use_tuning: bool = True
    precision: str = "fp32"  # targets.precision: what the GEMMs compute in
    step_entry: bool = True  # a decoder with symbolic seq: also `decode`, main at seq 1 (compile/decode/entries.py)
    # rows of the preallocated cache: also `decode_inplace` (compile/decode/inplace.py); None: none
    kv_capacity: int | None = None
    force: bool = False  # replace an existing output that is not a blockforge artifact (fsutil.check_outputs)


@dataclass
class CompileResult:
    artifact: Path
    manifest: dict
    target: ResolvedTarget


def device_sources(executable, target: ResolvedTarget) -> str | None:
    """Concatenated device kernel source of a GPU build (CUDA C, OpenCL C, MSL, WGSL)."""
    if not target.is_gpu:
        return None
    texts = []
    for host in executable.mod.imports:
        for dev in host.imports:
            fmt = "wgsl" if target.kind == "webgpu" else ""
            texts.append(dev.inspect_source(fmt))
    return "\n".join(t for t in texts if t) or None


def _nvcc_fatbin(source: str, arch: str, out: Path) -> None:
    """Compile the CUDA kernels ahead of time for `arch` (sm_XX): proves they build for it."""
    compute = arch.replace("sm_", "compute_")
    with tempfile.TemporaryDirectory() as tmp:
        cu = Path(tmp) / "kernels.cu"
        cu.write_text(source)
        cmd = [nvcc(), "-fatbin", "-O3", f"-gencode=arch={compute},code=[{arch},{compute}]", "-o", str(out), str(cu)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise BlockforgeError(f"nvcc failed for {arch}: {(r.stderr.strip().splitlines() or ['?'])[-1][:300]}")


def release_freed_memory() -> None:
    """Hand freed heap pages back to the system (glibc's malloc_trim): the Relax module's
    weights, freed, stay in the process's heap otherwise (allocations of a few MB are not
    mmapped once one has been freed), and the export's serialized copy is allocated anew."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def pack_imports_incbin(mod, is_system_lib: bool, prefix: str, workspace_dir: str) -> str:
    """export_library's fpack_imports: the imports blob (the VM executable, weights included)
    written to a file once and assembled with `.incbin`. TVM's LLVM packer holds it three
    times over (the serialized string, an LLVM constant, the object being emitted): 2.7 GB
    of a BERT-base compile's peak came from there. The bytes and the symbol are the ones
    TVM's C packer writes (ModulePackImportsToC), so the runtime finds the same blob."""
    import numpy as np
    import tvm_ffi
    from tvm.runtime import _ffi_api

    if is_system_lib:  # the blob is registered by a constructor there: TVM's own C form
        path = Path(workspace_dir) / f"{prefix}devc.c"
        path.write_text(_ffi_api.ModulePackImportsToC(mod, is_system_lib, prefix))
        return str(path)
    blob = _ffi_api.ModulePackImportsToTensor(mod)
    data = Path(workspace_dir) / f"{prefix}devc.bin"
    np.from_dlpack(blob).tofile(data)  # a view: not a second copy
    size = int(blob.shape[0])
    del blob
    symbol = prefix + tvm_ffi.get_global_func("runtime.ModuleImportsBlobName")()
    asm = Path(workspace_dir) / f"{prefix}devc.S"
    asm.write_text(f'''.section .rodata
.globl {symbol}
.type {symbol}, %object
.balign 16
{symbol}:
.incbin "{data.resolve()}"
.size {symbol}, {size}
.section .note.GNU-stack,"",%progbits
''')
    return str(asm)


def export_module(executable, target: ResolvedTarget, path: Path) -> None:
    from tvm.support import cc

    kwargs = {}
    if target.cross_compiler:
        kwargs["fcompile"] = cc.cross_compiler(target.cross_compiler)
    else:  # the native compiler assembles the blob (a cross toolchain keeps TVM's LLVM packer)
        kwargs["fpack_imports"] = pack_imports_incbin
    # TVM's intermediates (lib0.o, devc.o) go beside the output, not to a tmp* directory of
    # TVM's in TMPDIR that an interrupted export leaves behind.
    try:
        with tempfile.TemporaryDirectory(prefix=".export-", dir=path.parent) as workspace:
            executable.export_library(str(path), workspace_dir=workspace, **kwargs)
    except Exception as e:
        raise_if_stopped()  # the compiler was stopped by the same signal: not an export failure
        raise BlockforgeError(f"export of module.so for {target.name} failed: {error_line(e, last=True)}") from None


def _versions() -> dict:
    import tvm

    return {"blockforge": blockforge.__version__, "tvm": tvm.__version__, "onnx": onnx.__version__}


def default_output(model: Path, target: ResolvedTarget) -> Path:
    """Beside the model: MODEL.onnx -> MODEL.<target>/."""
    return model.with_name(f"{model.stem}.{target.name}")


def _check_outputs(opts: CompileOptions, out) -> Path:
    check_outputs([Output("output", out, TREE, "artifact", manifest_io.is_artifact),
                   Output("dump_ir", opts.dump_ir, INTO, "IR dump directory") if opts.dump_ir is not None else None],
                  [opts.model, opts.tuning_db], force=opts.force)
    return Path(out)


def _inplace_plan(opts: CompileOptions, target: ResolvedTarget, step: str | None, ins, outs, bounds: dict):
    """(the past dim, the cache pairs as indices) for `kv_capacity` (checked by compile_model
    first), or the reason it cannot be."""
    if target.kind != "llvm":
        raise ArgumentError(f"{{kv_capacity}}: the in-place cache is built for CPU targets only, not {target.name}",
                            "kv_capacity")
    in_d, out_d = [s.to_dict() for s in ins], [s.to_dict() for s in outs]
    pairing = decode_pairing.record(in_d, out_d)
    if step is None or pairing is None:
        raise ArgumentError("{kv_capacity} needs a decoder with a KV cache compiled with seq symbolic and its step "
                            "entry (not --no-step-entry)", "kv_capacity")
    pairs = decode_inplace.cache_indices(in_d, out_d, pairing)
    first = pairing["pairs"][0]
    dim = next(s for s in ins if s.name == first["past"]).dims[first["axis"]]
    bound = bounds.get(dim) if isinstance(dim, str) else None
    if bound is not None and opts.kv_capacity > bound + 1:
        # the module refuses a past over its bound: a step at past = bound writes row bound, and
        # rows after it could never be used
        raise ArgumentError(f"{{kv_capacity}} {opts.kv_capacity} exceeds {dim}'s upper bound {bound} "
                            f"({{shape}} {dim}=..{bound}) + 1: give at most {bound + 1} rows, or a larger bound",
                            "kv_capacity", "shape")
    return dim, pairs


def compile_model(opts: CompileOptions) -> CompileResult:
    if opts.kv_capacity is not None:
        decode_inplace.check_capacity(opts.kv_capacity)
    # The output policy first: a refused or unwritable output costs nothing, not even the
    # target's resolution (TVM's import); only the default output's name waits for it. A
    # given output leaves the resolution to open_model, which does it while its child reads
    # the model (a toy MHA compile 10.7-12.0 -> 8.8-8.9 s wall on a 2-core Zen 4).
    if opts.output is not None:
        dest = _check_outputs(opts, opts.output)
        target = opts.target
    else:
        target = resolve(opts.target)
        dest = _check_outputs(opts, default_output(Path(opts.model), target))
    session = open_model(opts.model, target, opts.shape, precision=opts.precision)
    target, ins, outs = session.target, session.inputs, session.outputs
    manifest_io.check_signature([s.to_dict() for s in ins], [s.to_dict() for s in outs], str(opts.model))
    db, db_info = open_for_apply(target, opts.tuning_db) if opts.use_tuning else (None, None)
    step = decode_entries.token_dim([s.to_dict() for s in ins], [s.to_dict() for s in outs]) \
        if opts.step_entry else None
    transform = None if step is None else lambda m: decode_entries.add_step_entry(m, step)
    inplace = None
    if opts.kv_capacity is not None:
        inplace = _inplace_plan(opts, target, step, ins, outs, session.binding.bounds_dict())
        transform = lambda m: decode_inplace.add_inplace_entry(decode_entries.add_step_entry(m, step), step,  # noqa: E731
                                                               opts.kv_capacity, inplace[1])
    res = session.build(database=db, dump_ir=Path(opts.dump_ir) if opts.dump_ir is not None else None,
                        lift_weights=True, transform=transform)
    session.forget_imports()  # res.weights holds what the executable needs; the rest of the Relax module goes
    with atomic_directory(dest, is_ours=manifest_io.is_artifact, what="artifact", force=opts.force) as tmp:
        files = {}
        # The weights first, tensor by tensor from their buffers, then dropped: the executable
        # serialized into module.so is then code and small constants (issue #18).
        weights = weights_io.write_weights(tmp / weights_io.FILE, res.weights)
        res.weights.clear()
        release_freed_memory()
        files[weights_io.FILE] = sha256_file(tmp / weights_io.FILE)
        with native_output_to_log():
            export_module(res.executable, target, tmp / "module.so")
        files["module.so"] = sha256_file(tmp / "module.so")
        src = device_sources(res.executable, target)
        if src:
            name = f"kernels.{target.source_ext or target.kind}"
            (tmp / name).write_text(src)
            files[name] = sha256_file(tmp / name)
        if target.kind == "cuda":
            _nvcc_fatbin(src, target.target_json["arch"], tmp / "device.fatbin")
            files["device.fatbin"] = sha256_file(tmp / "device.fatbin")
        manifest = {
            "format": manifest_io.FORMAT,
            "module": "module.so",
            "files": files,
            "source_onnx": {"name": Path(opts.model).name, "sha256": sha256_file(opts.model)},
            "target": {"name": target.name, "json": target.target_json, "device": target.device,
                       "arch": target.arch, "key": target.key()},
            "dims": session.dims,  # resolved: symbolic dim name -> value
            # symbolic dims' upper bounds (--shape seq=..1024): informational, no loader reads them;
            # module.so itself refuses a larger value (compile/passes/dim_bounds.py)
            **({"dim_bounds": session.binding.bounds_dict()} if session.binding.bounds else {}),
            "inputs": [s.to_dict() for s in ins],
            "outputs": [s.to_dict() for s in outs],
            "params_embedded": False,  # they are in 'weights' (the parameters after the inputs)
            "weights": weights,
            "tuning": None if db_info is None else {
                **db_info, "tasks": res.tasks, "applied": res.tasks - len(res.untuned_tasks),
                "missing": [t for t in res.untuned_tasks
                            if t not in db_info["kept_default"] and t not in db_info["unvalidated"]
                            and t not in db_info["refused_tasks"]],  # warned about as refused
                # records judged only on another CPU: left out until `tune --check-only` here
                "unvalidated": [t for t in res.untuned_tasks if t in db_info["unvalidated"]]},
            "precision": session.precision.name,  # what the GEMMs compute in (inputs/outputs keep their dtypes)
            # what the build could not do as asked (compile prints each as a warning)
            **({"notes": list(res.notes)} if res.notes else {}),
            "phases": res.phases,  # "prepare" first: the ONNX-level phase (compile/frontend/prepare.py)
            "prepare": session.prepare_report.to_dict(),
            "versions": _versions(),
        }
        decode = decode_pairing.record(manifest["inputs"], manifest["outputs"])
        if decode:  # present output -> past input of the next step (compile/decode/pairing.py)
            manifest["decode"] = decode
        if step is not None:  # the decode step's own entry function (compile/decode/entries.py)
            manifest[decode_entries.KEY] = decode_entries.step_record(step)
        if inplace is not None:  # the preallocated cache's entry (compile/decode/inplace.py)
            manifest[decode_inplace.KEY] = decode_inplace.inplace_record(opts.kv_capacity, inplace[0])
        data = json_bytes(manifest)
        manifest_io.parse_manifest(data, f"{dest}/{manifest_io.NAME}")  # what the loaders will check, whole
        atomic_write_bytes(tmp / manifest_io.NAME, data)
    return CompileResult(dest, manifest, target)
