"""Ops compile/frontend/converters.py imports where TVM 0.27 does not, or not usefully: Col2Im
(no converter: MobileViT V2's dynamo export did not import), against onnx.reference and ONNX
Runtime over the geometries the op allows, the tiling case's reshape + transpose form, and the
inputs it refuses in one line; Einsum as a batched matmul (TVM's is one opaque kernel: CvT's
attention went unfused), against ORT, and the equations left to TVM."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

tvm = pytest.importorskip("tvm")
ort = pytest.importorskip("onnxruntime")

from blockforge.compile.frontend.importer import import_onnx  # noqa: E402
from blockforge.compile.onnx_backend import BlockforgeBackend  # noqa: E402
from blockforge.errors import BlockforgeError  # noqa: E402


def _model(x_shape, image, block, *, runtime_image: bool = False, **attrs) -> onnx.ModelProto:
    inits = [helper.make_tensor("block", TensorProto.INT64, [len(block)], block)]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)]
    if runtime_image:
        inputs.append(helper.make_tensor_value_info("image", TensorProto.INT64, [len(image)]))
    else:
        inits.append(helper.make_tensor("image", TensorProto.INT64, [len(image)], image))
    node = helper.make_node("Col2Im", ["x", "image", "block"], ["y"], name="fold", **attrs)
    g = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    if runtime_image:  # the checker wants the output's shape: what a constant image_shape would give
        c = x_shape[1] // int(np.prod(block))
        m.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, [x_shape[0], c, *image]))
    else:
        m.graph.output[0].CopyFrom(onnx.shape_inference.infer_shapes(m).graph.output[0])
    return m


def _blocks(image, block, dil, pads, strides):
    d = len(image)
    return [(image[i] + pads[i] + pads[d + i] - dil[i] * (block[i] - 1) - 1) // strides[i] + 1 for i in range(d)]


CASES = {
    # MobileViT V2's fold: 2x2 patches tiling the feature map
    "tiling-2x2": ((2, 3 * 4, 16), [8, 8], [2, 2], dict(strides=[2, 2])),
    "tiling-3x2-non-square": ((1, 2 * 6, 6), [9, 4], [3, 2], dict(strides=[3, 2])),
    # overlapping: every pixel the sum of several taps
    "overlap-3x3-stride-1": ((1, 2 * 9, 36), [8, 8], [3, 3], dict(strides=[1, 1])),
    "stride-2-pads": ((1, 3 * 9, 16), [7, 7], [3, 3], dict(strides=[2, 2], pads=[1, 1, 1, 1])),
    "dilation-2-asymmetric-pads": ((2, 1 * 4, 30), [6, 7], [2, 2], dict(dilations=[2, 2], pads=[0, 1, 1, 0])),
    # gaps: stride beyond the block, pixels no tap reaches are 0
    "stride-3-gaps": ((1, 2 * 4, 9), [8, 8], [2, 2], dict(strides=[3, 3])),
    "1-d": ((1, 2 * 3, 6), [8], [3], dict(strides=[1])),
    "3-d": ((1, 2 * 8, 8), [4, 4, 4], [2, 2, 2], dict(strides=[2, 2, 2])),
}


@pytest.mark.parametrize("name", list(CASES))
def test_col2im_matches_reference_and_ort(name):
    from onnx.reference import ReferenceEvaluator

    x_shape, image, block, attrs = CASES[name]
    d = len(image)
    blocks = _blocks(image, block, attrs.get("dilations", [1] * d), attrs.get("pads", [0] * 2 * d),
                     attrs.get("strides", [1] * d))
    assert x_shape[2] == int(np.prod(blocks)), (name, blocks)
    m = _model(x_shape, image, block, **attrs)
    x = np.random.default_rng(0).standard_normal(x_shape).astype(np.float32)
    want = ReferenceEvaluator(m).run(None, {"x": x})[0]
    np.testing.assert_allclose(ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
                               .run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-5)
    got = BlockforgeBackend.prepare(m).run({"x": x})[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_tiling_fold_is_a_reshape_and_a_transpose():
    """Stride = block, no pads or dilation: no reduction kernel, the layout ops only."""
    text = import_onnx(_model((2, 12, 16), [8, 8], [2, 2], strides=[2, 2])).script()
    assert "R.permute_dims" in text and "col2im" not in text
    text = import_onnx(_model((1, 18, 36), [8, 8], [3, 3], strides=[1, 1])).script()
    assert "col2im" in text and "R.permute_dims" not in text


@pytest.mark.parametrize("x_shape, image, block, attrs, runtime, fragment", [
    ((1, 12, 16), [8, 8], [2, 2], dict(strides=[2, 2]), True, "image_shape must be a constant"),
    ((1, 10, 16), [8, 8], [2, 2], dict(strides=[2, 2]), False, "does not hold 4-tap columns"),  # 10 % 4
    ((1, 12, 15), [8, 8], [2, 2], dict(strides=[2, 2]), False, "does not hold 4-tap columns"),  # L != 16
    ((1, 12, 16), [8, 8], [2, 2], dict(strides=[0, 2]), False, "inconsistent"),
])
def test_col2im_refusals_are_one_line(x_shape, image, block, attrs, runtime, fragment):
    m = _model(x_shape, image, block, runtime_image=runtime, **attrs)
    with pytest.raises(BlockforgeError, match=fragment) as e:
        import_onnx(m)
    assert "Col2Im (node 'fold', opset 18)" in str(e.value) and "\n" not in str(e.value)


def _einsum_model(eq: str, a_shape, b_shape) -> onnx.ModelProto:
    node = helper.make_node("Einsum", ["a", "b"], ["y"], equation=eq)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, a_shape),
                                        helper.make_tensor_value_info("b", TensorProto.FLOAT, b_shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    m.graph.output[0].CopyFrom(onnx.shape_inference.infer_shapes(m).graph.output[0])
    return m


EINSUMS = {
    # CvT's attention products
    "bhlk,bhtk->bhlt": ((2, 3, 5, 4), (2, 3, 7, 4)),
    "bhlt,bhtv->bhlv": ((2, 3, 5, 7), (2, 3, 7, 4)),
    # permuted operands and output, grouped rows / columns / contraction (reshapes)
    "bkhl,htbk->tblh": ((2, 4, 3, 5), (3, 7, 2, 4)),
    "abcd,cde->abe": ((2, 3, 4, 5), (4, 5, 6)),
    "ik,kj->ij": ((5, 4), (4, 6)),
    "bi,bj->bij": ((3, 4), (3, 5)),  # an outer product: nothing contracted
}


@pytest.mark.parametrize("eq", list(EINSUMS))
def test_einsum_is_a_matmul_and_matches_ort(eq):
    a_shape, b_shape = EINSUMS[eq]
    m = _einsum_model(eq, a_shape, b_shape)
    text = import_onnx(m).script()
    assert "R.matmul" in text and "einsum" not in text, text
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal(a_shape).astype(np.float32), "b": rng.standard_normal(b_shape).astype(np.float32)}
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(BlockforgeBackend.prepare(m).run(feeds)[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("eq, a_shape, b_shape", [
    ("ii,ij->j", (4, 4), (4, 5)),  # a diagonal
    ("ij,jk->i", (3, 4), (4, 5)),  # k summed on one side only
    ("...ij,...jk->...ik", (2, 3, 4), (2, 4, 5)),  # ellipsis
])
def test_einsum_outside_the_matmul_form_stays_tvms(eq, a_shape, b_shape):
    m = _einsum_model(eq, a_shape, b_shape)
    assert "einsum" in import_onnx(m).script()
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal(a_shape).astype(np.float32), "b": rng.standard_normal(b_shape).astype(np.float32)}
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(BlockforgeBackend.prepare(m).run(feeds)[0], want, rtol=1e-5, atol=1e-5)
