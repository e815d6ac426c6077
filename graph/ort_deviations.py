"""Where ONNX Runtime is known to depart from the ONNX reference (onnx.reference).

verify compares TVM with ORT. Where a model uses one of the cases below and TVM fails
against ORT, verify also runs onnx.reference.ReferenceEvaluator: when TVM matches the
reference, the row says so (TVM follows the ONNX specification; ORT is the one that differs).

Each entry is measured by tests/robustness/test_messages.py, which builds the smallest model
for it and checks that ORT really departs: when ORT is fixed, that test fails and the entry
goes. Measured with onnxruntime 1.31.1 and onnx 1.23.2 (float32, Q/K/V 1x2x3x4 and 1x2x5x4, opset 23):

- attention-qk-softcap-mode0: qk_matmul_output (mode 0) differs by up to 16.2 (ORT: the
  scaled scores before the softcap; the reference: after it). Modes 1-3 agree (<= 2.4e-7).
- attention-qk-bool-mask-mode2: where a boolean attn_mask blocks a key, ORT's
  qk_matmul_output (mode 2) is -3.4e38 (the lowest float32), the reference's -inf; with or
  without softcap. A float mask agrees (<= 9.5e-7).
- attention-scale-nan: with scale=NaN ORT's outputs are finite (it takes 1/sqrt(head size));
  the reference's are all NaN.

ORT's own graph rewrites that change a model's numbers are switched off instead, in every ORT
session blockforge opens (verify's reference and bench's peer; `wrong_rewrites`), only for a model
that has the pattern, so no other model's timing moves:

- Pad_Fusion (ORT PR #18136, a level-1 rewrite) folds a constant Pad into a following MaxPool's
  pads; MaxPool pads with -inf, so where a window holds only padding zeros and negative values
  ORT returns the negative maximum, the reference 0. Found on BiT's stem (Conv -> Pad of 0 ->
  MaxPool 3x3/2: 9 of 4096 outputs off by up to 5.9, rel L2 5.8e-3 after the first GroupNorm);
  the session with the rewrite off agrees with numpy and the reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx
from onnx import numpy_helper


@dataclass(frozen=True)
class Deviation:
    key: str
    what: str  # what ORT does, against what the reference does
    applies: Callable[[onnx.NodeProto, dict[str, int]], bool]  # (node, value name -> elem type)


def _attr(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _attention(node: onnx.NodeProto) -> bool:
    return node.op_type == "Attention" and node.domain in ("", "ai.onnx")


def _qk_output(node: onnx.NodeProto) -> bool:
    return len(node.output) > 3 and bool(node.output[3])


KNOWN: tuple[Deviation, ...] = (
    Deviation("attention-qk-softcap-mode0",
              "Attention's qk_matmul_output in mode 0 with softcap: ORT gives the scores before the softcap, "
              "the reference after it",
              lambda n, types: _attention(n) and _qk_output(n) and _attr(n, "softcap", 0.0) > 0
              and _attr(n, "qk_matmul_output_mode", 0) == 0),
    Deviation("attention-qk-bool-mask-mode2",
              "Attention's qk_matmul_output in mode 2 with a boolean attn_mask: ORT gives the lowest float "
              "where a key is masked, the reference -inf",
              lambda n, types: _attention(n) and _qk_output(n) and _attr(n, "qk_matmul_output_mode", 0) == 2
              and len(n.input) > 3 and types.get(n.input[3]) == onnx.TensorProto.BOOL),
    Deviation("attention-scale-nan",
              "Attention with scale=NaN: ORT ignores it (1/sqrt(head size)), the reference's outputs are NaN",
              lambda n, types: _attention(n) and math.isnan(_attr(n, "scale", 0.0))),
)


def wrong_rewrites(model: onnx.ModelProto) -> list[str]:
    """ORT rewrites (disabled_optimizers names) that would change this model's numbers: Pad_Fusion
    where a MaxPool reads a constant-mode Pad (any pad value but -inf: the pool pads with -inf)."""
    pads = {n.output[0]: n for n in model.graph.node if n.op_type == "Pad" and n.domain in ("", "ai.onnx")}
    consts = {t.name: t for t in model.graph.initializer}
    consts.update({n.output[0]: n.attribute[0].t for n in model.graph.node
                   if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"})

    def minus_inf(pad: onnx.NodeProto) -> bool:
        if len(pad.input) < 3 or pad.input[2] not in consts:
            return False  # absent: 0
        v = numpy_helper.to_array(consts[pad.input[2]])
        return v.size == 1 and np.isneginf(v.reshape(-1)[0])

    hit = any(n.op_type == "MaxPool" and n.input and n.input[0] in pads
              and _attr(pads[n.input[0]], "mode", b"constant") in (b"constant", "constant")
              and not minus_inf(pads[n.input[0]]) for n in model.graph.node)
    return ["Pad_Fusion"] if hit else []


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    g = model.graph
    types = {t.name: t.data_type for t in g.initializer}
    for vi in (*g.input, *g.value_info, *g.output):
        if vi.type.HasField("tensor_type"):
            types[vi.name] = vi.type.tensor_type.elem_type
    return types


def deviations_in(model: onnx.ModelProto) -> list[Deviation]:
    """The known deviations the model's (top-level) nodes hit."""
    types = _elem_types(model)
    return [d for d in KNOWN if any(d.applies(n, types) for n in model.graph.node)]


def reference_outputs(model: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The ONNX reference implementation's outputs (slow: only for the models above)."""
    from onnx.reference import ReferenceEvaluator

    with np.errstate(all="ignore"):  # NaN and -inf are the point here
        outs = ReferenceEvaluator(model).run(None, inputs)
    return {o.name: np.asarray(v) for o, v in zip(model.graph.output, outs)}
