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


def _bench_relu(m, repeat=3):
    from blockforge.bench import BenchOptions, bench

    bench(BenchOptions(model=m["relu"], against=("ort",), repeat=repeat, default_dims={"batch": 1, "seq": 128}))


def _parse(text):
    from blockforge.graph.shape import ShapeRequest

    ShapeRequest.parse(text)


def _tune(m, **opts):
    from blockforge.tune import TuneOptions, tune

    tune(TuneOptions(model=m["ffn"], target="host", tuning_db=m["dir"] / "db", progress=False, **opts))


def _tune_cli(m, *args):
    return ["tune", m["ffn"], "--target", "host", "--db", m["dir"] / "db", "--no-progress", *args]


def _mha(**kw):
    from blockforge.graph import MHASpec

    MHASpec(d_model=16, heads=2, **kw)


def _compile_bf16(m):
    from blockforge.compile import CompileOptions, compile_model

    compile_model(CompileOptions(model=m["ffn"], target="aarch64-linux", precision="bf16", output=m["dir"] / "a"))


def _quantize_dynamic(m):
    from blockforge.graph.quantize import QuantizeOptions, quantize

    quantize(QuantizeOptions(model=m["ffn"], output=m["dir"] / "q.onnx", mode="dynamic", calibration=m["seq8"]))


@dataclass(frozen=True)
class Case:
    id: str
    api: Callable  # models -> raises
    cli: Callable  # models -> argv
    says: str  # in both messages; {name}: the API's argument name there, its flag in the CLI's
    arguments: tuple[str, ...] = ("shape",)  # .arguments; the first is .argument

    def message(self, name_of) -> str:
        s = self.says
        for a in self.arguments:
            s = s.replace("{" + a + "}", name_of(a))
        return s


CASES = [
    Case("unknown-dim", lambda m: _open(m, "sq=3"), lambda m: ["inspect", m["ffn"], "--shape", "sq=3"],
         "{shape} names sq, which the model does not have"),
    Case("fixed-axis", lambda m: _open(m, "x=1x2x3"), lambda m: ["inspect", m["ffn"], "--shape", "x=1x2x3"],
         "{shape} gives input 'x' shape [1, 2, 3], but axis 2"),
    Case("bad-entry", lambda m: _parse("batch=0"), lambda m: ["inspect", m["ffn"], "--shape", "batch=0"],
         "bad {shape} entry 'batch=0'"),
    Case("inputs-disagree", lambda m: _verify(m, "seq=4", m["seq8"]),
         lambda m: ["verify", m["ffn"], "--shape", "seq=4", "--inputs", m["seq8"]],
         "{inputs} gives seq=8 through input 'x', but {shape} gave seq=4", ("inputs", "shape")),
    Case("unbound-dim", _bench_relu, lambda m: ["bench", m["relu"], "--against", "ort", "--repeat", "3"],
         "has symbolic dim 'n': bind it in {shape}: n=N, or the whole input's shape, x=Nx4"),
    Case("too-large", lambda m: _verify(m, "batch=65536,seq=65536"),
         lambda m: ["verify", m["ffn"], "--shape", "batch=65536,seq=65536"], "bind smaller dims with {shape}"),
    Case("tune-trials", lambda m: _tune(m, trials=0), lambda m: _tune_cli(m, "--trials", 0),
         "{trials} must be a positive integer, got 0", ("trials",)),
    Case("tune-per-task", lambda m: _tune(m, trials_per_task=-3), lambda m: _tune_cli(m, "--trials-per-task", -3),
         "{trials_per_task} must be a positive integer", ("trials_per_task",)),
    Case("tune-round", lambda m: _tune(m, round_trials=0), lambda m: _tune_cli(m, "--round-trials", 0),
         "{round_trials} must be a positive integer", ("round_trials",)),
    Case("tune-population", lambda m: _tune(m, population=8), lambda m: _tune_cli(m, "--population", 8),
         "{population} must be an integer >= 16, got 8", ("population",)),
    Case("tune-rpc-pair", lambda m: _tune(m, rpc_key="k"), lambda m: _tune_cli(m, "--rpc-key", "k"),
         "{rpc_tracker} and {rpc_key} go together", ("rpc_tracker", "rpc_key")),
    Case("tune-rpc-tracker", lambda m: _tune(m, rpc_tracker="nohost", rpc_key="k"),
         lambda m: _tune_cli(m, "--rpc-tracker", "nohost", "--rpc-key", "k"),
         "bad {rpc_tracker} 'nohost': expected HOST:PORT", ("rpc_tracker",)),
    Case("tune-check-only-rpc", lambda m: _tune(m, check_only=True, rpc_tracker="h:1", rpc_key="k"),
         lambda m: _tune_cli(m, "--check-only", "--rpc-tracker", "h:1", "--rpc-key", "k"),
         "{check_only} measures on this machine; drop {rpc_tracker}/{rpc_key}", ("check_only", "rpc_tracker", "rpc_key")),
    Case("kv-cache-cross", lambda m: _mha(kv_cache=True, cross=True),
         lambda m: ["export", "mha", "--d-model", 16, "--heads", 2, "--kv-cache", "--cross", "-o", m["dir"] / "k.onnx"],
         "drop {kv_cache} or {kv_seq}/{cross}", ("kv_cache", "kv_seq", "cross")),
    Case("causal-cross", lambda m: _mha(causal=True, cross=True),
         lambda m: ["export", "mha", "--d-model", 16, "--heads", 2, "--causal", "--cross", "-o", m["dir"] / "c.onnx"],
         "drop {causal} or {kv_seq}/{cross}", ("causal", "kv_seq", "cross")),
    Case("bf16-target", _compile_bf16,
         lambda m: ["compile", m["ffn"], "--target", "aarch64-linux", "--precision", "bf16", "-o", m["dir"] / "a"],
         "or {precision} fp32)", ("precision",)),
    Case("bench-repeat", lambda m: _bench_relu(m, repeat=2), lambda m: ["bench", m["relu"], "--repeat", 2],
         "{repeat} must be at least 3", ("repeat",)),
    Case("quantize-dynamic-calibration", _quantize_dynamic,
         lambda m: ["quantize", m["ffn"], "--mode", "dynamic", "--calibration", m["seq8"], "-o", m["dir"] / "q.onnx"],
         "{calibration} is for {mode} static", ("calibration", "mode")),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_api_names_the_argument_cli_the_flag(models, case, tmp_path):
    from blockforge.cli.common import flag_of

    with pytest.raises(ArgumentError) as info:
        case.api(models)
    e = info.value
    assert e.arguments == case.arguments and e.argument == case.arguments[0], e.arguments
    assert "--" not in str(e), str(e)
    assert case.message(str) in str(e), str(e)

    res = run_cli_in_process(*case.cli(models), cwd=tmp_path)
    assert_user_error(res, case.message(flag_of))
