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

# The isolation child is under test here (tests/conftest.py turns it off elsewhere).
pytestmark = pytest.mark.isolation


def _relu(path: Path, x: str = "x") -> Path:
    """A model whose symbolic dim is named `n`: bench's default batch/seq binds nothing."""
    g = helper.make_graph([helper.make_node("Relu", [x], ["y"])], "relu",
                          [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["n", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from blockforge.graph import FFNSpec, export

    d = tmp_path_factory.mktemp("models")
    ffn = export(FFNSpec(d_model=16, d_ff=32), d / "ffn.onnx").model_path
    np.savez(d / "seq8.npz", x=np.ones((1, 8, 16), np.float32))
    np.savez(d / "f64.npz", x=np.ones((1, 8, 16), np.float64))
    (d / "empty-db").mkdir()
    (d / "a-dir.onnx").mkdir()
    (d / "a-file").write_text("a user's file\n")
    (d / "a-link.onnx").symlink_to(d / "a-file")
    return {"ffn": ffn, "relu": _relu(d / "relu.onnx"), "relu_z": _relu(d / "relu_z.onnx", "z"), "seq8": d / "seq8.npz",
            "f64": d / "f64.npz", "empty_db": d / "empty-db", "dir": d}


def _open(m, shape):
    from blockforge.compile import open_model

    open_model(m["ffn"], "host", shape)


def _verify(m, shape, inputs=None, **kw):
    from blockforge.compile import VerifyOptions, verify

    verify(VerifyOptions(model=m["ffn"], shape=shape, inputs=inputs, **kw))


def _bench_relu(m, repeat=3):
    from blockforge.bench import BenchOptions, bench

    bench(BenchOptions(model=m["relu"], against=("ort",), repeat=repeat, default_dims={"batch": 1, "seq": 128}))


def _parse(text):
    from blockforge.graph.shape import ShapeRequest

    ShapeRequest.parse(text)


def _tune(m, **opts):
    from blockforge.tune import TuneOptions, tune

    tune(TuneOptions(**{"model": m["ffn"], "target": "host", "tuning_db": m["dir"] / "db", "progress": False, **opts}))


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


def _quantize_static(m, calibration):
    from blockforge.graph.quantize import QuantizeOptions, quantize

    quantize(QuantizeOptions(model=m["ffn"], output=m["dir"] / "q.onnx", mode="static", calibration=calibration))


def _bench_decode(m, **kw):
    from blockforge.bench.decode import DecodeOptions, bench_decode

    bench_decode(DecodeOptions(model=m["relu"], **kw))


def _decode_steps(n):
    from blockforge.compile.decode import DecodeOptions

    DecodeOptions(n)


def _export_to(m, name):
    from blockforge.graph import FFNSpec, export

    export(FFNSpec(d_model=16, d_ff=32), m["dir"] / name)


def _compile_dump_ir(m, name):
    from blockforge.compile import CompileOptions, compile_model

    compile_model(CompileOptions(model=m["ffn"], target="host", output=m["dir"] / "dumped", dump_ir=m["dir"] / name))


def _rpc_port(port):
    from blockforge.tune.rpc import check_port

    check_port(port)


def _rpc_server():
    from blockforge.tune.rpc import serve

    serve("server", host="127.0.0.1", port=None, tracker=None, key=None)


@dataclass(frozen=True)
class Case:
    id: str
    api: Callable  # models -> raises
    cli: Callable  # models -> argv
    says: str | Callable  # in both messages; {name}: the API's argument name there, its flag in the CLI's
    arguments: tuple[str, ...] = ("shape",)  # .arguments; the first is .argument

    def message(self, name_of, m) -> str:
        s = self.says(m) if callable(self.says) else self.says  # callable: a fragment naming a fixture's path
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
    # issue #18 item 2, the rest: records, decode, bench --decode, verify --reference, rpc, quantize
    Case("empty-tuning-db", lambda m: _verify(m, None, target="host", tuning_db=m["empty_db"]),
         lambda m: ["verify", m["ffn"], "--target", "host", "--tuning-db", m["empty_db"]],
         "tuning database holds no records (run `blockforge tune` first, or drop {tuning_db})", ("tuning_db",)),
    Case("reference-inputs", lambda m: _verify(m, None, reference=m["relu_z"]),
         lambda m: ["verify", m["ffn"], "--reference", m["relu_z"]],
         lambda m: f"{{reference}} {m['relu_z']} (it must take the quantized model's inputs): missing z",
         ("reference",)),
    Case("calibration-inputs", lambda m: _quantize_static(m, m["f64"]),
         lambda m: ["quantize", m["ffn"], "--mode", "static", "--calibration", m["f64"], "-o", m["dir"] / "q.onnx"],
         lambda m: f"{{calibration}} {m['f64']} batch 0: input 'x' has dtype float64", ("calibration",)),
    Case("decode-steps", lambda m: _decode_steps(0), lambda m: ["run", m["dir"], "--inputs", m["seq8"], "--decode", 0],
         "{steps} must be an integer in [1, 65536], got 0", ("steps",)),
    Case("bench-decode-model", _bench_decode, lambda m: ["bench", m["relu"], "--decode"],
         "{bench_decode} needs a decoder exported with its KV cache", ("bench_decode",)),
    Case("bench-decode-past", lambda m: _bench_decode(m, pasts=(0,)),
         lambda m: ["bench", m["relu"], "--decode", "--past", 0],
         "{pasts} needs lengths >= 1 and {prompt} >= 0", ("pasts", "prompt")),
    # the output policy (fsutil.check_outputs) in the terms of the argument that holds the path
    Case("output-is-a-directory", lambda m: _export_to(m, "a-dir.onnx"),
         lambda m: ["export", "ffn", "--d-model", 16, "--d-ff", 32, "-o", m["dir"] / "a-dir.onnx"],
         lambda m: f"{{output}} {m['dir'] / 'a-dir.onnx'} is a directory; the model must be a file path", ("output",)),
    Case("output-is-a-link", lambda m: _export_to(m, "a-link.onnx"),
         lambda m: ["export", "ffn", "--d-model", 16, "--d-ff", 32, "-o", m["dir"] / "a-link.onnx"],
         "is a symbolic link; refusing to replace it (pass {force} to replace the link itself", ("output", "force")),
    Case("dump-ir-is-a-file", lambda m: _compile_dump_ir(m, "a-file"),
         lambda m: ["compile", m["ffn"], "--target", "host", "-o", m["dir"] / "dumped", "--dump-ir", m["dir"] / "a-file"],
         lambda m: f"{{dump_ir}} {m['dir'] / 'a-file'}: the IR dump directory must be a directory", ("dump_ir",)),
    Case("tuning-db-is-a-file", lambda m: _tune(m, tuning_db=m["dir"] / "a-file"),
         lambda m: ["tune", m["ffn"], "--target", "host", "--tuning-db", m["dir"] / "a-file", "--no-progress"],
         "the tuning database must be a directory", ("tuning_db",)),
    Case("rpc-port", lambda m: _rpc_port(70000), lambda m: ["rpc", "tracker", "--port", 70000],
         "{port} 70000 is out of range (0..65535; 0 picks a free port)", ("port",)),
    Case("rpc-server", lambda m: _rpc_server(), lambda m: ["rpc", "server"],
         "a server needs {tracker} HOST:PORT and {key} KEY", ("tracker", "key")),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_api_names_the_argument_cli_the_flag(models, case, tmp_path):
    from blockforge.cli.common import flag_of

    with pytest.raises(ArgumentError) as info:
        case.api(models)
    e = info.value
    assert e.arguments == case.arguments and e.argument == case.arguments[0], e.arguments
    assert "--" not in str(e), str(e)
    assert case.message(str, models) in str(e), str(e)

    res = run_cli_in_process(*case.cli(models), cwd=tmp_path)
    assert_user_error(res, case.message(flag_of, models))


def test_decode_pairing_names_the_shape_argument():
    """A past length bound at compile time (the pairing is refused before a loop: no build needed)."""
    from blockforge.compile.decode import pairing_for_run

    sig = lambda n, shape: {"name": n, "shape": shape, "dtype": "float32"}  # noqa: E731
    man = {"inputs": [sig("past_key", [1, 2, 17, 4])], "outputs": [sig("present_key", [1, 2, "total", 4])],
           "decode": None}
    with pytest.raises(ArgumentError) as info:
        pairing_for_run(man, "a.host")
    assert info.value.argument == "shape" and "--" not in str(info.value)
    assert str(info.value).startswith("a.host: cannot decode: past_key's past length is fixed at 17")
    assert str(info.value).endswith("compile without binding it in shape")


def test_notes_name_the_argument_cli_the_flag(models, tmp_path):
    """A note (verify's, for a float model given a float reference) reads in the API's terms to a
    library caller and in JSON, with the flag in the CLI's output."""
    import json

    from blockforge.compile import VerifyOptions, verify
    from blockforge.errors import Phrase

    report = verify(VerifyOptions(model=models["ffn"], reference=models["ffn"]))
    note = next(n for n in report.notes if "not quantized" in n)
    assert isinstance(note, Phrase) and note.startswith(f"reference {models['ffn']}:") and "--" not in note
    assert json.loads(json.dumps({"notes": report.notes}))["notes"] == [str(n) for n in report.notes]

    res = run_cli_in_process("verify", models["ffn"], "--reference", models["ffn"], cwd=tmp_path)
    assert res.rc == 0, res.err
    assert f"note: --reference {models['ffn']}: the model is not quantized" in res.out, res.out
