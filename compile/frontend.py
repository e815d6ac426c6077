"""ONNX -> Relax. The ONNX checker must pass first (TVM's importer only warns)."""

from __future__ import annotations

import onnx

from blockforge.errors import BlockforgeError, error_line
from blockforge.graph.model_io import bind_dims, check_model, signature


def bound_signature(model: onnx.ModelProto, dims: dict[str, int]):
    """(inputs, outputs) of `model` with `dims` bound: what a build for those dims takes."""
    return signature(bind_dims(model, dims))


def import_onnx(model: onnx.ModelProto, dims: dict[str, int] | None = None):
    """Checked import: returns a Relax IRModule with weights embedded as constants."""
    from tvm.relax.frontend.onnx import from_onnx

    check_model(model)
    model = bind_dims(model, dims or {})
    ins, _ = signature(model)
    try:
        mod = from_onnx(model, dtype_dict={s.name: s.dtype for s in ins}, keep_params_in_input=True)
    except Exception as e:
        text = str(e)
        if "not supported for frontend ONNX" in text:
            ops = text.split("frontend ONNX:", 1)[1].strip().splitlines()[0]
            raise BlockforgeError(f"TVM cannot import this model: unsupported ONNX op(s): {ops}") from None
        raise BlockforgeError(f"TVM cannot import this model: {error_line(e)}") from None
    return embed_weights(mod)


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
