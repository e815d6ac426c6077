"""Library errors in library terms (issue #18): a binding error from the Python API names the
API's argument (`shape`, `inputs`) and carries it as `ArgumentError.argument`; the same error
through the CLI names the flag (`--shape`, `--inputs`). Each case is run both ways, the model
checked in the isolation child as a user's would be (the error crosses from it as data)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from blockforge.errors import ArgumentError
from conftest import assert_user_error, run_cli_in_process


def _relu(path: Path) -> Path:
    """A model whose symbolic dim is named `n`: bench's default batch/seq binds nothing."""
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from blockforge.graph import FFNSpec, export

    d = tmp_path_factory.mktemp("models")
    ffn = export(FFNSpec(d_model=16, d_ff=32), d / "ffn.onnx").model_path
    np.savez(d / "seq8.npz", x=np.ones((1, 8, 16), np.float32))
    return {"ffn": ffn, "relu": _relu(d / "relu.onnx"), "seq8": d / "seq8.npz", "dir": d}


def _open(m, shape):
    from blockforge.compile import open_model

    open_model(m["ffn"], "host", shape)


def _verify(m, shape, inputs=None):
    from blockforge.compile import VerifyOptions, verify

    verify(VerifyOptions(model=m["ffn"], shape=shape, inputs=inputs))


def _bench_relu(m):
    from blockforge.bench import BenchOptions, bench

    bench(BenchOptions(model=m["relu"], against=("ort",), repeat=3, default_dims={"batch": 1, "seq": 128}))


def _parse(text):
    from blockforge.graph.shape import ShapeRequest

    ShapeRequest.parse(text)


@dataclass(frozen=True)
class Case:
    id: str
    api: Callable  # models -> raises
    cli: Callable  # models -> argv
    says: str  # in both messages, with {} for the argument: "shape" / "--shape"
    argument: str = "shape"


CASES = [
    Case("unknown-dim", lambda m: _open(m, "sq=3"), lambda m: ["inspect", m["ffn"], "--shape", "sq=3"],
         "{} names sq, which the model does not have"),
    Case("fixed-axis", lambda m: _open(m, "x=1x2x3"), lambda m: ["inspect", m["ffn"], "--shape", "x=1x2x3"],
         "{} gives input 'x' shape [1, 2, 3], but axis 2"),
    Case("bad-entry", lambda m: _parse("batch=0"), lambda m: ["inspect", m["ffn"], "--shape", "batch=0"],
         "bad {} entry 'batch=0'"),
    Case("inputs-disagree", lambda m: _verify(m, "seq=4", m["seq8"]),
         lambda m: ["verify", m["ffn"], "--shape", "seq=4", "--inputs", m["seq8"]],
         "{} gives seq=8 through input 'x', but ", argument="inputs"),
    Case("unbound-dim", _bench_relu, lambda m: ["bench", m["relu"], "--against", "ort", "--repeat", "3"],
         "has symbolic dim 'n': bind it in {}: n=N, or the whole input's shape, x=Nx4"),
    Case("too-large", lambda m: _verify(m, "batch=65536,seq=65536"),
         lambda m: ["verify", m["ffn"], "--shape", "batch=65536,seq=65536"], "bind smaller dims with {}"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_api_names_the_argument_cli_the_flag(models, case, tmp_path):
    with pytest.raises(ArgumentError) as info:
        case.api(models)
    e = info.value
    assert e.argument == case.argument, e.arguments
    assert "--" not in str(e), str(e)
    assert case.says.format(case.argument) in str(e), str(e)

    res = run_cli_in_process(*case.cli(models), cwd=tmp_path)
    flag = "--" + case.argument
    assert_user_error(res, case.says.format(flag))
