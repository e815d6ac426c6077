"""Upper bounds on symbolic dims (`--shape seq=..1024`, compile/passes/dim_bounds.py): parsed and
refused like every --shape entry, carried through the isolation child, planned by
StaticPlanBlockMemory at a static size, and enforced by module.so itself (the Python loader and
the C++ edge app refuse a larger dim with the module's one line)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I, relax as R, tirx as T

from blockforge.errors import ArgumentError, BlockforgeError
from blockforge.graph.model_io import DimBound, TensorSig, parse_dims, resolve_bounds, resolve_dims
from blockforge.graph.shape import Binding, ShapeRequest
from blockforge.compile.passes.dim_bounds import UPPER_BOUND_ATTR, bound_dims, check_message
from conftest import run_cli_in_process as cli, save_npz

GPT2 = Path(__file__).parent / "fixtures" / "models" / "gpt2_past_legacy_op17.onnx"  # 2 layers, 4 heads of 8
BOUNDS = "batch=1,seq=..64,past=..64"  # past_seq, the mask's length = past + seq: bounded by 128 from them


def test_parse_bounds():
    assert parse_dims("batch=1,seq=..1024") == {"batch": 1, "seq": DimBound(1024)}
    assert ShapeRequest.parse(" seq = ..7 ").entries == (("seq", DimBound(7)),)
    for bad, frag in (("seq=..", "not an integer"), ("seq=..0", "[1,"), ("seq=..70000", "[1,"),
                      ("seq=..2x3", "one integer"), ("seq=...5", "not an integer"), ("seq=..-4", "[1,"),
                      ("seq=5..", "not an integer")):
        with pytest.raises(ArgumentError, match=re.escape(frag)) as e:
            parse_dims(bad)
        assert "\n" not in str(e.value) and "{shape}" not in e.value.render(lambda a: "--" + a)


SIGS = [TensorSig("input_ids", ("batch", "seq"), "int64"), TensorSig("past", ("batch", 2, "past", 4), "float32")]


def test_resolve_bounds():
    spec = parse_dims("batch=1,seq=..64,past=..32")
    values = resolve_dims(SIGS, spec)
    assert values == {"batch": 1} and resolve_bounds(spec, values) == {"seq": 64, "past": 32}
    # a dim the inputs bind anyway: within its bound it is just bound; beyond, one error naming both
    values = resolve_dims(SIGS, spec, input_shapes={"input_ids": (1, 64)})
    assert values == {"batch": 1, "seq": 64} and resolve_bounds(spec, values) == {"past": 32}
    with pytest.raises(ArgumentError, match=re.escape("shape bounds seq at 64 (seq=..64), but inputs give seq=65")):
        resolve_bounds(spec, resolve_dims(SIGS, spec, input_shapes={"input_ids": (1, 65)}))
    # a default (bench's seq=128) binds no bounded dim: it stays symbolic
    assert resolve_dims(SIGS, spec, defaults={"batch": 2, "seq": 128}) == {"batch": 1}
    with pytest.raises(ArgumentError, match="names kv, which the model does not have"):
        resolve_dims(SIGS, parse_dims("kv=..8"))
    # through the isolation child's JSON and back
    req = ShapeRequest.parse("batch=1,seq=..64,past=..32")
    assert ShapeRequest.of(json.loads(json.dumps(req.to_dict()))) == req
    b = Binding.resolve(SIGS, [], req)
    assert b.bounds_dict() == {"seq": 64, "past": 32} and b.unbound() == ["seq", "past"]
    assert Binding.from_dict(json.loads(json.dumps(b.to_dict()))) == b
    # a verb that needs every dim's value (bench) says a bound is not one
    with pytest.raises(ArgumentError, match=re.escape("shape gives seq an upper bound (seq=..64), which leaves it "
                                                      "symbolic; this needs its value: seq=N")):
        Binding.resolve(SIGS, [], ShapeRequest.parse("batch=1,seq=..64,past=3"), static=True)
    with pytest.raises(ArgumentError, match=re.escape("shape gives seq and past upper bounds (seq=..64, past=..32), "
                                                      "which leave them symbolic; this needs their values: seq=N,past=N")):
        Binding.resolve(SIGS, [], req, static=True)  # both named at once


@I.ir_module
class Chain:
    @R.function
    def main(x: R.Tensor(("n", 16), "float32"), w: R.Tensor((16, 16), "float32")):
        with R.dataflow():
            y = R.matmul(x, w)
            z = R.nn.relu(y)
            q = R.matmul(z, w)
            R.output(q)
        return q


def _storages(mod) -> list:
    """The sizes of main's storages after StaticPlanBlockMemory (ints where static)."""
    out = []

    def visit(e):
        if isinstance(e, relax.Call) and getattr(e.op, "name", "") == "relax.memory.alloc_storage":
            out.append([int(d) if isinstance(d, tvm.tirx.IntImm) else d for d in e.args[0].values])
    relax.analysis.post_order_visit(mod["main"], visit)
    return out


def _lowered(mod):
    return tvm.transform.Sequential([relax.transform.LegalizeOps(), relax.transform.ToNonDataflow(),
                                     relax.transform.CallTIRRewrite(), relax.transform.StaticPlanBlockMemory()])(mod)


def test_pass_plans_static_storage_and_adds_the_check():
    bounded = bound_dims({"n": 32, "other": 5})(Chain)
    f = bounded["main"]
    assert not f.is_pure and dict(f.attrs[UPPER_BOUND_ATTR]) == {"n": 32}  # only the function's own dims
    check = bounded.get_global_var("main_dim_bounds")
    first = f.body.blocks[0].bindings[0].value
    assert first.op.same_as(check) and [str(a) for a in first.args] == ["n"]
    assert "n <= T.int64(32)" in bounded[check].script() and check_message("n", 32) in bounded[check].script()
    # the intermediates y and z (n x 16 floats) get storage of the bound's size; without: sized by n
    assert _storages(_lowered(bounded)) == [[32 * 16 * 4]] * 2
    unbounded = _storages(_lowered(Chain))
    assert len(unbounded) == 2 and all(str(s[0]) == "T.int64(64) * n" for s in unbounded), unbounded
    assert bound_dims({})(Chain).same_as(Chain) and bound_dims({"m": 3})(Chain)["main"].is_pure


def test_module_refuses_past_its_bound():
    ex = tvm.compile(bound_dims({"n": 32})(Chain), target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    w = np.random.default_rng(0).standard_normal((16, 16)).astype("float32")
    for n in (1, 7, 32):
        x = np.random.default_rng(n).standard_normal((n, 16)).astype("float32")
        got = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy()
        np.testing.assert_allclose(got, np.maximum(x @ w, 0) @ w, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match=re.escape(check_message("n", 32))):
        vm["main"](tvm.runtime.tensor(np.zeros((33, 16), "float32")), tvm.runtime.tensor(w))


def _feeds(seq: int, past: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    f = {"input_ids": rng.integers(0, 128, (1, seq)).astype(np.int64),
         "attention_mask": np.ones((1, past + seq), np.int64)}
    for i in range(2):
        for k in ("key", "value"):
            f[f"past_key_values.{i}.{k}"] = rng.standard_normal((1, 4, past, 8)).astype(np.float32)
    return f


@pytest.fixture(scope="module")
def bounded_gpt2(tmp_path_factory):
    art = tmp_path_factory.mktemp("bounds") / "g"
    res = cli("compile", str(GPT2), "--target", "host", "--shape", BOUNDS, "-o", str(art))
    assert res.rc == 0, res.text
    return art


def test_bounded_decoder_matches_ort_and_refuses_more(bounded_gpt2, tmp_path):
    from blockforge.compile.artifact.runtime import load_artifact

    man = json.loads((bounded_gpt2 / "manifest.json").read_text())
    assert man["dim_bounds"] == {"seq": 64, "past": 64, "past_seq": 128} and "dim-bounds" in man["phases"]
    m = load_artifact(bounded_gpt2)
    sess = ort.InferenceSession(str(GPT2), providers=["CPUExecutionProvider"])
    for seq, past in ((5, 17), (64, 64), (1, 64), (1, 1)):  # the prompt entry, and the step entry (seq 1)
        f = _feeds(seq, past)
        got = m.run(f)
        for o, want in zip(sess.get_outputs(), sess.run(None, f)):
            np.testing.assert_allclose(got[o.name], want, rtol=1e-4, atol=1e-4, err_msg=f"{o.name} at {seq}, {past}")
    for (seq, past), dim, bound in (((65, 1), "seq", 64), ((1, 65), "past", 64), ((64, 65), "past_seq", 128)):
        with pytest.raises(BlockforgeError) as e:
            m.run(_feeds(seq, past))
        assert check_message(dim, bound) in str(e.value) and "\n" not in str(e.value)
    # the CLI: one line, a failure exit, no outputs written
    res = cli("run", str(bounded_gpt2), "--inputs", str(save_npz(tmp_path / "in.npz", **_feeds(1, 65))),
              "--output", str(tmp_path / "out.npz"))
    assert res.rc != 0 and check_message("past", 64) in res.err and len(res.err.strip().splitlines()) == 1, res.text
    assert not (tmp_path / "out.npz").exists()
    # a decode loop that outgrows the bound: its prompt and first steps run, then the same line
    res = cli("run", str(bounded_gpt2), "--inputs", str(save_npz(tmp_path / "p.npz", **_feeds(4, 58))),
              "--decode", "8", "--output", str(tmp_path / "out.npz"))
    assert res.rc != 0 and check_message("past", 64) in res.err and len(res.err.strip().splitlines()) == 1, res.text


@pytest.mark.skipif(shutil.which("g++") is None or shutil.which("make") is None,
                    reason="edge_app needs make and g++ (Debian packages make, g++)")
def test_edge_app_refuses_more(bounded_gpt2, tmp_path):
    from blockforge.deploy.package import PackageOptions, package_artifact

    pkg = package_artifact(PackageOptions(bounded_gpt2, output=tmp_path / "pkg", app=True)).path
    cmd = [str(pkg / "run.sh")]
    for name, a in _feeds(4, 58).items():  # its decode loop outgrows past's bound at the fourth step
        np.save(tmp_path / f"{name}.npy", a)
        cmd += ["--input", f"{name}={tmp_path / f'{name}.npy'}"]
    res = subprocess.run(cmd + ["--decode", "8", "--output", str(tmp_path / "out.npy")], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode != 0 and check_message("past", 64) in res.stderr, res.stdout + res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "out.npy").exists(), res.stderr


def test_kv_capacity_over_the_past_bound_is_refused(tmp_path):
    """Cache rows after the bound's + 1 could never be used (the module refuses a larger past; the
    step at past = 64 writes row 64): one line, exit 2, nothing written."""
    res = cli("compile", str(GPT2), "--target", "host", "--shape", BOUNDS, "--kv-capacity", "80",
              "-o", str(tmp_path / "a"))
    assert res.rc == 2 and "--kv-capacity 80 exceeds past's upper bound 64 (--shape past=..64) + 1" in res.err, res.text
    assert len(res.err.strip().splitlines()) == 1 and not (tmp_path / "a").exists()
