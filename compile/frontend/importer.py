"""ONNX -> Relax. The ONNX checker must pass first (TVM's importer only warns)."""

from __future__ import annotations

import numpy as np
import onnx

from blockforge.errors import BlockforgeError, error_line
from blockforge.graph.model_io import bind_dims, check_model, signature


def import_onnx(model: onnx.ModelProto, dims: dict[str, int] | None = None, *, check: bool = True,
                weights_dir=None):
    """Checked import: returns a Relax IRModule with weights embedded as constants.

    TVM's importer plus blockforge's converters (compile/frontend/converters.py: the standard ONNX
    Attention op). An op it cannot import is one line naming the op, its node and the opset.
    check=False: the caller has checked this very model (prepare ends with the checker).
    weights_dir: where the model's external tensors are (the prelude's child wrote them)."""
    from blockforge.compile.frontend.converters import OnnxImportError, from_onnx

    if check:
        check_model(model)
    model = _shape_constants(bind_dims(model, dims or {}))
    ins, _ = signature(model)
    try:
        mod = from_onnx(model, dtype_dict={s.name: _tvm_dtype(s.dtype) for s in ins}, keep_params_in_input=True,
                        weights_dir=weights_dir)
    except OnnxImportError as e:
        raise BlockforgeError(f"TVM cannot import this model: {e}{data_dependent_hint(model)}") from None
    except Exception as e:
        raise BlockforgeError(f"TVM cannot import this model: {error_line(e)}{data_dependent_hint(model)}") from None
    try:
        return embed_weights(legalize_shape_functions(mod))
    except Exception as e:  # a TVM pass failing on an imported model: one line, not a traceback
        raise BlockforgeError(f"TVM cannot import this model: folding its constants failed: "
                              f"{error_line(e, last=True)}") from None


# Ops whose output shape is computed from the data, not from the input shapes
DATA_DEPENDENT_OPS = ("NonZero", "Unique", "Compress")


def data_dependent_hint(model: onnx.ModelProto) -> str:
    """Why an import failure may be the model's, not TVM's: a shape computed from data. The
    exporters trace a mixture-of-experts router (transformers' eager experts: Mixtral, Qwen2-MoE)
    into NonZero + a Split with one output per expert the example input reached, so the graph
    only runs where every traced expert gets a token (ONNX Runtime too fails on one token:
    "Split size 1 exceeds the remaining size"); torch's dynamo exporter refuses such routing."""
    hits = [n for n in model.graph.node if n.op_type in DATA_DEPENDENT_OPS]
    if not hits:
        return ""
    first = hits[0]
    return (f" (the model computes shapes from its data: {len(hits)} {'/'.join(sorted({n.op_type for n in hits}))} "
            f"node(s), the first '{first.name or first.output[0]}'; blockforge compiles static and symbolic "
            f"input shapes only: a mixture-of-experts router traced by the exporter is such a model)")


SHAPE_CONST_MAX = 64  # elements: shapes, axes, starts/ends; weights are far larger


def _shape_constants(model: onnx.ModelProto) -> onnx.ModelProto:
    """Small integer initializers (shapes, axes, indices) as Constant nodes.

    keep_params_in_input=True (needed so CombineParallelMatmul sees the weights) turns every
    initializer into a runtime parameter, and an Expand/Reshape whose shape is a parameter
    has an unknown output shape. Exports fold their shape arithmetic into such initializers
    (prepare), so they must stay constants: e.g. an Attention op fed by Expand(mask, rows)
    was refused with "needs an input of known shape"."""
    # bool too: a folded Equal of a shape against -1 (Llama/Qwen2's Expand of the causal mask)
    # must stay a constant for the shape arithmetic on symbolic dims (frontend/symbolic.py)
    ints = {onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.BOOL}
    small = [t for t in model.graph.initializer if t.data_type in ints and
             int(np.prod(t.dims, dtype=np.int64)) <= SHAPE_CONST_MAX]
    if not small:
        return model
    m = onnx.ModelProto()
    m.CopyFrom(model)
    names = {t.name for t in small}
    keep = [t for t in m.graph.initializer if t.name not in names]
    consts = [onnx.helper.make_node("Constant", [], [t.name], value=t, name=f"const/{t.name}") for t in small]
    del m.graph.initializer[:]
    m.graph.initializer.extend(keep)
    # graph inputs that merely declared those initializers go too (IR < 4 style)
    inputs = [i for i in m.graph.input if i.name not in names]
    del m.graph.input[:]
    m.graph.input.extend(inputs)
    nodes = consts + list(m.graph.node)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    return m


def _tvm_dtype(name: str) -> str:
    """Signatures name the ml_dtypes types as ONNX does (float8e4m3fn); TVM as numpy
    (float8_e4m3fn)."""
    try:
        return str(onnx.helper.tensor_dtype_to_np_dtype(onnx.TensorProto.DataType.Value(name.upper())))
    except (ValueError, KeyError, TypeError):
        return name


def legalize_shape_functions(mod):
    """Lower the ops whose legalization adds a shape function before any FoldConstant runs.

    Relax's FoldConstant tries to legalize every op in a dataflow block; for
    dynamic_strided_slice (ONNX Slice with runtime starts/ends) that emits a call to a new
    `shape_func` PrimFunc into the function but drops the PrimFunc itself, and the build then
    fails with `There is no definition of I.GlobalVar("shape_func")`. Legalizing those calls
    here, in a builder whose module keeps the PrimFuncs, leaves FoldConstant nothing to break."""
    from tvm.ir import Op
    from tvm.relax.expr_functor import PyExprMutator, mutator

    op = "relax.dynamic_strided_slice"
    legalize = Op.get(op).get_attr("FLegalize")

    @mutator
    class _Lower(PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if getattr(call.op, "name", None) == op:
                return legalize(self.builder_, call)
            return call

    from blockforge.compile.passes.exprs import rewrite_functions

    return rewrite_functions(mod, _Lower(mod))


def embed_weights(mod):
    """Combine parallel matmuls, then bind the weights as constants.

    CombineParallelMatmul only matches weights that are still parameters; it turns the
    seed's h per-head d_model x d_k projections sharing one input into a single
    d_model x (h d_k) GEMM followed by slices. Binding + FoldConstant then concatenates
    the weights once, at compile time.
    """
    from tvm import relax

    mod, params = relax.frontend.detach_params(mod)
    mod = relax.transform.CombineParallelMatmul()(mod)
    weights = params.get("main", [])
    if weights:
        names = list(mod["main"].params)[-len(weights):]
        mod = relax.transform.BindParams("main", dict(zip(names, weights)))(mod)
    mod = relax.transform.FoldConstant()(mod)
    if "num_input" in (mod["main"].attrs or {}):
        mod["main"] = mod["main"].without_attr("num_input")
    return mod
