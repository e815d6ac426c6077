"""blockforge as an ONNX backend (onnx.backend.base): ONNX's conformance runner, or any
code written against that API, drives the same import and build `blockforge compile` does.

    rep = BlockforgeBackend.prepare(model)    # checked import (frontend.import_onnx, with the
                                              # onnx_ops converters) + pipeline.build for the host
    y, = rep.run([x])                         # the Relax VM; inputs in graph-input order (or by name)
    BlockforgeBackend.run_node(node, [x])     # one node, wrapped in a model

Everything happens in memory: no artifact directory, no child-process probe (the model is
the caller's object, not an untrusted file). CPU only: the build is for `host`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep, Device, DeviceType, namedtupledict

from blockforge.errors import BlockforgeError
from blockforge.graph.model_io import TensorSig, signature
from blockforge.logs import native_output_to_log
from blockforge.targets import resolve

from blockforge.compile.frontend.importer import import_onnx
from blockforge.compile.pipeline import build
from blockforge.compile.artifact.runtime import run_vm, tvm_device


@dataclass
class BlockforgeRep(BackendRep):
    """A model built for the host: call run() as often as needed."""

    vm: Any
    device: Any
    inputs: list[TensorSig]
    outputs: list[TensorSig]

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        if isinstance(inputs, dict):
            named = dict(inputs)
        else:
            arrays = [inputs] if isinstance(inputs, np.ndarray) else list(inputs)
            if len(arrays) != len(self.inputs):
                raise BlockforgeError(f"got {len(arrays)} inputs, the model takes {len(self.inputs)} "
                                      f"({', '.join(s.name for s in self.inputs)})")
            named = {s.name: a for s, a in zip(self.inputs, arrays)}
        missing = [s.name for s in self.inputs if s.name not in named]
        if missing:
            raise BlockforgeError(f"missing input(s): {', '.join(missing)}")
        with native_output_to_log():
            out = run_vm(self.vm, self.device, self.inputs, self.outputs,
                         {s.name: np.asarray(named[s.name]) for s in self.inputs})
        names = [s.name for s in self.outputs]
        return namedtupledict("Outputs", names)(*[out[n] for n in names])


class BlockforgeBackend(Backend):
    @classmethod
    def supports_device(cls, device: str) -> bool:
        return Device(device).type == DeviceType.CPU

    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        return cls.supports_device(device)

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> BlockforgeRep:
        """Import (the ONNX checker first) and build for the host. Runtime inputs stay
        runtime inputs: the API gives no input values here, so none are folded."""
        if not cls.supports_device(device):
            raise BlockforgeError(f"the blockforge ONNX backend runs on CPU only, not {device}")
        target = resolve("host")
        with native_output_to_log():
            executable = build(import_onnx(model), target).executable
        from tvm import relax

        dev = tvm_device("cpu")
        ins, outs = signature(model)
        return BlockforgeRep(relax.VirtualMachine(executable, dev), dev, ins, outs)

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Any, device: str = "CPU",
                 outputs_info=None, **kwargs: Any) -> tuple[Any, ...]:
        """One node as a model: input types from the arrays, output types from `outputs_info`
        ((dtype, shape) per output) or ONNX shape inference."""
        arrays = [np.asarray(a) for a in (inputs.values() if isinstance(inputs, dict) else inputs)]
        names = [n for n in node.input if n]
        if len(names) != len(arrays):
            raise BlockforgeError(f"node {node.op_type} names {len(names)} inputs, got {len(arrays)} arrays")
        opset = kwargs.get("opset_version") or onnx.defs.onnx_opset_version()
        value = onnx.helper.make_tensor_value_info
        graph_in = [value(n, onnx.helper.np_dtype_to_tensor_dtype(a.dtype), a.shape) for n, a in zip(names, arrays)]
        outs = [n for n in node.output if n]
        if outputs_info:
            graph_out = [value(n, onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dt)), shape)
                         for n, (dt, shape) in zip(outs, outputs_info)]
        else:
            graph_out = [onnx.ValueInfoProto(name=n) for n in outs]
        model = onnx.helper.make_model(
            onnx.helper.make_graph([node], f"{node.op_type}_node", graph_in, graph_out),
            opset_imports=[onnx.helper.make_opsetid(node.domain or "", opset)])
        if not outputs_info:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
            known = {v.name: v for v in inferred.graph.value_info}
            del model.graph.output[:]
            model.graph.output.extend(known.get(n, onnx.ValueInfoProto(name=n)) for n in outs)
        return cls.prepare(model, device).run(arrays)


prepare = BlockforgeBackend.prepare
run_model = BlockforgeBackend.run_model
run_node = BlockforgeBackend.run_node
supports_device = BlockforgeBackend.supports_device
