"""The other quantized matmul forms exporters write, as standard ONNX ops TVM imports.

TVM's ONNX importer has no converter for QLinearMatMul (ONNX; what ORT's QOperator format
writes), nor for com.microsoft's MatMulIntegerToFloat and QGemm: a model with one did not
import. Here (in prepare, on the graph TVM imports; ONNX Runtime still runs the file as
written) each becomes the same sum in the forms blockforge already puts on the int8 kernel:

    QLinearMatMul(a, sa, za, b, sb, zb, sy, zy)
        -> QuantizeLinear(MatMul(DQ(a, sa, za), DQ(b, sb, zb)), sy, zy)        (QDQ: compile/quant/qdq.py)
    MatMulIntegerToFloat(a, b, sa, sb, za, zb, bias)
        -> Cast(MatMulInteger(a, b, za, zb), float) * (sa * sb) [+ bias]       (dynamic: quant/rewrite.py)
    QGemm(a, sa, za, b, sb, zb, c, sy, zy; alpha, transA, transB)
        -> [QuantizeLinear](alpha * MatMul(DQ(a'), DQ(b')) + DQ(c, alpha*sa*sb))  (c: int32, zero point 0)

A weight given transposed (QGemm transB=1, as an initializer) is transposed here, so the
QDQ rewrite still sees a (K, N) int8 weight with per-column scales. A form this does not
cover (a non-2-D per-channel weight, a transposed activation-side b) is left as written, and
the import names the op it could not convert.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

MS = "com.microsoft"


def _attr(node, name, default):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _arg(node, i) -> str:
    return node.input[i] if len(node.input) > i else ""


class _Rewriter:
    def __init__(self, model: onnx.ModelProto):
        self.inits = {t.name: t for t in model.graph.initializer}
        self.new_inits: list[onnx.TensorProto] = []
        self.count = 0

    def const(self, name, array) -> str:
        t = numpy_helper.from_array(np.asarray(array), name)
        self.new_inits.append(t)
        self.inits[name] = t
        return name

    def array(self, name):
        return numpy_helper.to_array(self.inits[name]) if name in self.inits else None

    def dq(self, x, s, z, tag, axis=None) -> list:
        kw = {"axis": axis} if axis is not None else {}
        return [helper.make_node("DequantizeLinear", [x, s] + ([z] if z else []), [f"{tag}_dq"], name=f"{tag}_dq", **kw)]

    def weight_axis(self, b, sb) -> int | None:
        """DequantizeLinear's axis for b's scale: None per tensor, 1 per column of a 2-D b;
        raises ValueError for what QDQ cannot say in one DequantizeLinear."""
        s = self.array(sb)
        if s is not None and s.size == 1:
            return None
        w = self.array(b)
        rank = w.ndim if w is not None else None
        if rank == 2:
            return 1
        raise ValueError("per-channel scale on a b that is not a 2-D initializer")

    def qlinear_matmul(self, n, tag) -> list:
        a, sa, za, b, sb, zb, sy, zy = (_arg(n, i) for i in range(8))
        axis = self.weight_axis(b, sb)
        nodes = self.dq(a, sa, za, f"{tag}_a") + self.dq(b, sb, zb, f"{tag}_b", axis)
        nodes.append(helper.make_node("MatMul", [f"{tag}_a_dq", f"{tag}_b_dq"], [f"{tag}_y"], name=f"{tag}_matmul"))
        nodes.append(helper.make_node("QuantizeLinear", [f"{tag}_y", sy] + ([zy] if zy else []), list(n.output),
                                      name=f"{tag}_q"))
        return nodes

    def matmul_integer_to_float(self, n, tag) -> list:
        a, b, sa, sb, za, zb, bias = (_arg(n, i) for i in range(7))
        mi = [a, b, za, zb]
        while mi and not mi[-1]:
            mi.pop()
        out = n.output[0]
        nodes = [helper.make_node("Mul", [sa, sb], [f"{tag}_scale"], name=f"{tag}_scale"),
                 helper.make_node("MatMulInteger", mi, [f"{tag}_acc"], name=f"{tag}_matmul_integer"),
                 helper.make_node("Cast", [f"{tag}_acc"], [f"{tag}_accf"], to=onnx.TensorProto.FLOAT, name=f"{tag}_cast"),
                 helper.make_node("Mul", [f"{tag}_accf", f"{tag}_scale"], [f"{tag}_y" if bias else out],
                                  name=f"{tag}_mul")]
        if bias:
            nodes.append(helper.make_node("Add", [f"{tag}_y", bias], [out], name=f"{tag}_bias"))
        return nodes

    def qgemm(self, n, tag) -> list:
        a, sa, za, b, sb, zb, c, sy, zy = (_arg(n, i) for i in range(9))
        alpha = float(_attr(n, "alpha", 1.0))
        nodes = []
        if _attr(n, "transA", 0):
            nodes.append(helper.make_node("Transpose", [a], [f"{tag}_at"], name=f"{tag}_at"))
            a = f"{tag}_at"
        if _attr(n, "transB", 0):
            w = self.array(b)
            if w is None or w.ndim != 2:
                raise ValueError("transB on a b that is not a 2-D initializer")
            b = self.const(f"{tag}_bt", np.ascontiguousarray(w.T))
        axis = self.weight_axis(b, sb)
        nodes += self.dq(a, sa, za, f"{tag}_a") + self.dq(b, sb, zb, f"{tag}_b", axis)
        y = f"{tag}_mm"
        nodes.append(helper.make_node("MatMul", [f"{tag}_a_dq", f"{tag}_b_dq"], [y], name=f"{tag}_matmul"))
        if alpha != 1.0:
            nodes.append(helper.make_node("Mul", [y, self.const(f"{tag}_alpha", np.float32(alpha))], [f"{tag}_ya"],
                                          name=f"{tag}_alpha"))
            y = f"{tag}_ya"
        if c:  # int32, zero point 0, scale alpha * sa * sb (per column when sb is)
            nodes.append(helper.make_node("Mul", [sa, sb], [f"{tag}_sab"], name=f"{tag}_sab"))
            if alpha != 1.0:
                nodes.append(helper.make_node("Mul", [f"{tag}_sab", f"{tag}_alpha"], [f"{tag}_sc"], name=f"{tag}_sc"))
            sc = f"{tag}_sc" if alpha != 1.0 else f"{tag}_sab"
            cs = self.array(c)
            c_axis = 0 if axis is not None and cs is not None and cs.ndim == 1 else None
            if axis is not None and c_axis is None:
                raise ValueError("per-channel QGemm with a bias that is not 1-D")
            nodes += self.dq(c, sc, "", f"{tag}_c", c_axis)
            nodes.append(helper.make_node("Add", [y, f"{tag}_c_dq"], [f"{tag}_yc"], name=f"{tag}_bias"))
            y = f"{tag}_yc"
        if sy:
            nodes.append(helper.make_node("QuantizeLinear", [y, sy] + ([zy] if zy else []), list(n.output),
                                          name=f"{tag}_q"))
        else:
            nodes.append(helper.make_node("Identity", [y], list(n.output), name=f"{tag}_out"))
        return nodes


_FORMS = {("", "QLinearMatMul"): "qlinear_matmul", ("ai.onnx", "QLinearMatMul"): "qlinear_matmul",
          (MS, "MatMulIntegerToFloat"): "matmul_integer_to_float", (MS, "QGemm"): "qgemm"}


def standard_forms(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """(model with QLinearMatMul / MatMulIntegerToFloat / QGemm as standard ops, how many);
    the input is not modified."""
    if not any((n.domain, n.op_type) in _FORMS for n in model.graph.node):
        return model, 0
    r = _Rewriter(model)
    nodes = []
    for n in model.graph.node:
        form = _FORMS.get((n.domain, n.op_type))
        if form is None:
            nodes.append(n)
            continue
        try:
            nodes += getattr(r, form)(n, f"bf_qform{r.count}")
            r.count += 1
        except (ValueError, TypeError):  # a variant not covered: left as written
            nodes.append(n)
    if not r.count:
        return model, 0
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    out.graph.initializer.extend(r.new_inits)
    return out, r.count
