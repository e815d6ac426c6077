"""Memory bombs: a model of a few hundred bytes whose constant folding (or run) would
allocate gigabytes. Each verb must refuse it with one line, exit 2, in seconds, and the
process tree's peak memory must stay far below the tensor it asks for; a model that needs
more than the memory limit (BLOCKFORGE_MEMORY_LIMIT_GB) is told so in one line."""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from conftest import BLOCKFORGE, CliResult, assert_user_error

# The isolation child is under test here (tests/conftest.py turns it off elsewhere).
pytestmark = pytest.mark.isolation

N = 65536
PEAK_MAX = 600 << 20  # bytes: the largest process of a refused bomb's tree (measured ~210 MB)


@dataclass
class Run:
    res: CliResult
    peak_rss: int  # bytes: the largest process in the CLI's tree (wait4 folds in reaped children)
    seconds: float


def run_measured(*args, cwd: Path, env: dict | None = None, timeout: float = 120) -> Run:
    """run_cli, plus the tree's peak RSS: wait4's rusage covers the CLI and its reaped children
    (the isolation child); an address-space cap keeps a regression from filling the machine."""
    import resource

    def cap():  # 8 GiB of address space: a bomb that gets through fails instead of swapping others out
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

    e = {**os.environ, "BLOCKFORGE_LOG": str(cwd / "blockforge.log"), **(env or {})}
    t0 = time.monotonic()
    with open(cwd / "out.txt", "w+") as out, open(cwd / "err.txt", "w+") as err:
        p = subprocess.Popen([*BLOCKFORGE, *map(str, args)], stdout=out, stderr=err, cwd=cwd, env=e,
                             preexec_fn=cap)
        while True:  # wait4, not Popen.wait: its rusage is the tree's peak
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - t0 > timeout:
                p.kill()
                os.wait4(p.pid, 0)
                p.returncode = -9
                pytest.fail(f"{args[0]} did not finish within {timeout} s")
            time.sleep(0.02)
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        res = CliResult(p.returncode, out.read(), err.read())
    return Run(res, ru.ru_maxrss * 1024, time.monotonic() - t0)


def _bomb(kind: str, n: int = N, dtype: int = T.FLOAT) -> onnx.ModelProto:
    """`kind` makes an n x n (Range: n*n) constant from a few bytes; Cast and ReduceSum fold it
    to one number, added to the input."""
    np_dtype = onnx.helper.tensor_dtype_to_np_dtype(dtype)
    x = helper.make_tensor_value_info("x", T.FLOAT, ["batch", 1])
    y = helper.make_tensor_value_info("y", T.FLOAT, ["batch", 1])
    inits = [numpy_helper.from_array(np.array([n, n], np.int64), "shape"),
             numpy_helper.from_array(np.ones([1, 1], np_dtype), "one")]
    node = {
        "ConstantOfShape": lambda: helper.make_node("ConstantOfShape", ["shape"], ["big"], name="bomb",
                                                    value=numpy_helper.from_array(np.ones([1], np_dtype))),
        "Expand": lambda: helper.make_node("Expand", ["one", "shape"], ["big"], name="bomb"),
        "Tile": lambda: helper.make_node("Tile", ["one", "shape"], ["big"], name="bomb"),
        "Range": lambda: helper.make_node("Range", ["start", "limit", "delta"], ["big"], name="bomb"),
    }[kind]()
    if kind == "Range":
        inits = [numpy_helper.from_array(np.array(v, np_dtype), name)
                 for name, v in (("start", 0), ("limit", n * n), ("delta", 1))]
    nodes = [node, helper.make_node("Cast", ["big"], ["bigf"], to=T.FLOAT, name="cast"),
             helper.make_node("ReduceSum", ["bigf"], ["r"], keepdims=0, name="sum"),
             helper.make_node("Add", ["x", "r"], ["y"], name="add")]
    m = helper.make_model(helper.make_graph(nodes, "bomb", [x], [y], inits),
                          opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(m, full_check=True)
    return m


def _shape_bomb() -> onnx.ModelProto:
    """The size comes from shape arithmetic (Shape(x) * k), so only the bound, inferred model
    shows it: ConstantOfShape(Shape(x) * [256, 256]), uint8: 4 GiB at batch=256, seq=256,
    64 KiB at batch=1, seq=1."""
    x = helper.make_tensor_value_info("x", T.FLOAT, ["batch", "seq"])
    y = helper.make_tensor_value_info("y", T.FLOAT, [])
    nodes = [helper.make_node("Shape", ["x"], ["s"], name="shape"),
             helper.make_node("Mul", ["s", "k"], ["s2"], name="mul"),
             helper.make_node("ConstantOfShape", ["s2"], ["big"], name="bomb",
                              value=numpy_helper.from_array(np.array([1], np.uint8))),
             helper.make_node("Cast", ["big"], ["bigf"], to=T.FLOAT, name="cast"),
             helper.make_node("ReduceSum", ["bigf"], ["y"], keepdims=0, name="sum")]
    m = helper.make_model(helper.make_graph(nodes, "shape_bomb", [x], [y],
                                            [numpy_helper.from_array(np.array([256, 256], np.int64), "k")]),
                          opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(m, full_check=True)
    return m


@pytest.fixture(scope="module")
def bombs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bombs")
    models = {k: _bomb(k) for k in ("ConstantOfShape", "Expand", "Tile", "Range")}
    models["uint8"] = _bomb("ConstantOfShape", dtype=T.UINT8)  # 4 GiB: the one that peaked at 4.4 GB
    models["shape"] = _shape_bomb()
    out = {}
    for k, m in models.items():
        out[k] = d / f"{k}.onnx"
        onnx.save(m, out[k])
        assert out[k].stat().st_size < 400, k
    return out


def _refused(r: Run, gib: str) -> None:
    assert_user_error(r.res, "node 'bomb'", f"would materialise a {gib} GiB tensor", "BLOCKFORGE_MAX_TENSOR_GB")
    assert r.peak_rss < PEAK_MAX, f"peak {r.peak_rss / 2**20:.0f} MiB"
    assert r.seconds < 30, r.seconds


@pytest.mark.parametrize("kind", ["ConstantOfShape", "Expand", "Tile", "Range"])
def test_bomb_compile(bombs, kind, tmp_path):
    """The whole compile verb (isolation child, then the parent's prepare and TVM build)."""
    r = run_measured("compile", bombs[kind], "--target", "host", "-o", tmp_path / "art", cwd=tmp_path)
    _refused(r, "16.0")
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize("verb", [("inspect",), ("verify",), ("verify", "--target", "host"),
                                  ("compile", "--target", "host")], ids=" ".join)
def test_bomb_every_verb(bombs, verb, tmp_path):
    """The 4 GiB uint8 ConstantOfShape through each verb (verify without --target used to
    run ONNX Runtime on it in the parent)."""
    _refused(run_measured(*verb[:1], bombs["uint8"], *verb[1:], cwd=tmp_path), "4.0")


def test_bomb_from_shape_arithmetic(bombs, tmp_path):
    """inspect prepares (folds) a model with Shape ops in its child: the size is seen at the
    bound dims, and named with them."""
    r = run_measured("inspect", bombs["shape"], "--shape", "batch=256,seq=256", cwd=tmp_path)
    _refused(r, "4.0")
    assert "'seq': 256" in r.res.err
    ok = run_measured("inspect", bombs["shape"], "--shape", "batch=1,seq=1", cwd=tmp_path)
    assert ok.res.rc == 0, ok.res.text


def test_tensor_cap_is_a_setting(bombs, tmp_path):
    r = run_measured("inspect", bombs["shape"], "--shape", "batch=64,seq=128", cwd=tmp_path,
                     env={"BLOCKFORGE_MAX_TENSOR_GB": "0.1"})
    assert_user_error(r.res, "would materialise a 0.5 GiB tensor", "limit is 0.1 GiB")


def test_many_folded_tensors_in_all(tmp_path):
    """300 Casts of a 1M-element Range: each 8 MiB, under the cap, 2.4 GiB in all from a 12 KB
    model (ONNX's data propagation alone took 1.5 GB for 20 of them; onnxslim keeps every
    folded value)."""
    n, k = 1 << 20, 300
    x = helper.make_tensor_value_info("x", T.INT64, [1])
    y = helper.make_tensor_value_info("y", T.INT64, [1])
    inits = [numpy_helper.from_array(np.array(v, np.int64), name) for name, v in (("s", 0), ("l", n), ("d", 1))]
    nodes = [helper.make_node("Range", ["s", "l", "d"], ["c0"], name="range")]
    nodes += [helper.make_node("Cast", [f"c{i}"], [f"c{i + 1}"], to=T.INT64, name=f"cast{i}") for i in range(k)]
    nodes += [helper.make_node("ReduceSum", [f"c{k}"], ["r"], keepdims=0, name="sum"),
              helper.make_node("Add", ["x", "r"], ["y"], name="add")]
    onnx.save(helper.make_model(helper.make_graph(nodes, "g", [x], [y], inits), ir_version=8,
                                opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "casts.onnx")
    r = run_measured("compile", tmp_path / "casts.onnx", "--target", "host", "-o", tmp_path / "art", cwd=tmp_path)
    assert_user_error(r.res, "folding its constants would materialise 2.4 GiB", "node 'range' (Range)",
                      "BLOCKFORGE_MAX_TENSOR_GB plus 4x the model's weights")
    assert r.peak_rss < PEAK_MAX and r.seconds < 30, (r.peak_rss, r.seconds)


def test_dense_constant_is_weights_sparse_is_folded(monkeypatch):
    """A dense Constant node holds weights the file already has (some exporters write weights
    so): never refused; a sparse one is expanded to its dense shape: sized like a fold."""
    from blockforge.compile.frontend.prepare import check_sizes
    from blockforge.errors import BlockforgeError

    monkeypatch.setenv("BLOCKFORGE_MAX_TENSOR_GB", "0.001")  # 1 MiB
    x = helper.make_tensor_value_info("x", T.FLOAT, [1, 1024])
    y = helper.make_tensor_value_info("y", T.FLOAT, [1, 1024])

    def model(**value):
        nodes = [helper.make_node("Constant", [], ["w"], name="w", **value), helper.make_node("MatMul", ["x", "w"], ["y"])]
        return helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)])

    check_sizes(model(value=numpy_helper.from_array(np.ones((1024, 1024), np.float32))), {}, "dense")  # 4 MiB
    sparse = helper.make_sparse_tensor(numpy_helper.from_array(np.array([1.0], np.float32), "v"),
                                       numpy_helper.from_array(np.array([0], np.int64), "i"), [1024, 1024])
    with pytest.raises(BlockforgeError, match=r"node 'w' \(Constant\) would materialise a 4.0 MiB tensor"):
        check_sizes(model(sparse_value=sparse), {}, "sparse")


def _runtime_bomb(d: Path) -> Path:
    """Expand of the *input* to 32768 x 32768 float32 (4 GiB): nothing to fold, so no cap
    applies; ONNX Runtime allocates it when it runs."""
    x = helper.make_tensor_value_info("x", T.FLOAT, [1, 1])
    y = helper.make_tensor_value_info("y", T.FLOAT, [])
    nodes = [helper.make_node("Expand", ["x", "shape"], ["big"], name="expand"),
             helper.make_node("ReduceSum", ["big"], ["y"], keepdims=0, name="sum")]
    m = helper.make_model(helper.make_graph(nodes, "g", [x], [y],
                                            [numpy_helper.from_array(np.array([32768, 32768], np.int64), "shape")]),
                          opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(m, d / "runtime_bomb.onnx")
    return d / "runtime_bomb.onnx"


@pytest.mark.parametrize("target", [(), ("--target", "host")], ids=["ort", "ort+tvm"])
def test_ort_runs_in_the_bounded_child(target, tmp_path):
    """verify: ONNX Runtime's run is bounded by the memory limit too (it used to run in the
    parent), and it runs before TVM runs the same graph in the parent."""
    r = run_measured("verify", _runtime_bomb(tmp_path), *target, cwd=tmp_path, env={"BLOCKFORGE_MEMORY_LIMIT_GB": "1"})
    assert_user_error(r.res, "the model needs more than 1.0 GiB to run in ONNX Runtime", "BLOCKFORGE_MEMORY_LIMIT_GB")
    assert r.peak_rss < PEAK_MAX, f"peak {r.peak_rss / 2**20:.0f} MiB"


@pytest.fixture(scope="module")
def ffn(tmp_path_factory) -> Path:
    from blockforge.graph import FFNSpec, export

    return export(FFNSpec(d_model=16, d_ff=32), tmp_path_factory.mktemp("ffn") / "ffn.onnx").model_path


@pytest.mark.parametrize("verb, what", [(("verify",), ("load", "run in ONNX Runtime")),
                                       (("compile", "--target", "host"), ("load", "import"))],
                         ids=["verify", "compile"])
def test_limit_too_small_for_a_normal_model(ffn, verb, what, tmp_path):
    """A limit far below what ONNX Runtime or TVM's import needs (~0.2 GiB of data): the
    child's allocations fail (or its libraries cannot be mapped), and the error says the
    model needs more than the limit. 0.1 GiB is near what the loading child itself needs, so
    which child stops first (the load, or ORT's run / TVM's import) varies from run to run
    (CI saw "to load" for verify)."""
    r = run_measured(verb[0], ffn, *verb[1:], cwd=tmp_path, env={"BLOCKFORGE_MEMORY_LIMIT_GB": "0.1"})
    assert_user_error(r.res, "the model needs more than 0.1 GiB to ", "BLOCKFORGE_MEMORY_LIMIT_GB")
    assert any(f"0.1 GiB to {w} " in r.res.err for w in what), r.res.err


def test_normal_model_under_the_default_limit(ffn, tmp_path):
    """The default limit does not trip on a legitimate model: compile and verify (ONNX
    Runtime now in the child) pass as before."""
    c = run_measured("compile", ffn, "--target", "host", "--shape", "batch=1,seq=4", "-o", tmp_path / "art",
                     cwd=tmp_path)
    assert c.res.rc == 0, c.res.text
    v = run_measured("verify", ffn, "--shape", "batch=1,seq=4", cwd=tmp_path)
    assert v.res.rc == 0 and "PASS" in v.res.out, v.res.text
