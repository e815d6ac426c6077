"""int8 at the decode shape (issue #21's int8 target): a dynamic-quantized decoder with its
KV cache, compiled with the past length symbolic and one new token, puts every weight
MatMul on the int8 kernel as a one-row matvec (a one-row tile, on the thread pool once the
weights are big enough to be the step's cost), and matches ONNX Runtime on the same
quantized file; plus the ragged-N lm_head (GPT-2's 50257 columns) padded to whole panels."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import tvm
from conftest import run_cli_in_process

from blockforge.compile.quant import gemm
from blockforge.compile.quant.intrin import has_vnni

pytest.importorskip("onnxruntime.quantization")

FIXTURES = Path(__file__).parent / "fixtures" / "models"
LAYERS, HEADS, HEAD_DIM, VOCAB = 2, 4, 8, 128  # tests/fixtures/models/gpt2_past_legacy_op17.onnx
ZNVER4 = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "znver4", "num-cores": 2})


def _need_vnni_host():
    from blockforge.targets import resolve

    if not has_vnni(resolve("host").tvm_target()):
        pytest.skip("this CPU has no AVX-512 VNNI (avx512_vnni): the int8 kernel cannot run here")


@pytest.fixture(scope="module")
def quantized_decoder(tmp_path_factory):
    d = tmp_path_factory.mktemp("qdec")
    out = d / "gpt2_past_dyn.onnx"
    res = run_cli_in_process("quantize", str(FIXTURES / "gpt2_past_legacy_op17.onnx"), "--mode", "dynamic",
                             "-o", str(out))
    assert res.rc == 0, res.text
    # 4 per layer (qkv, attention out, fc, proj) + the lm_head
    assert f"dynamic: {4 * LAYERS + 1} int8 GEMMs" in res.out, res.out
    return out


def _feeds(past: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {"input_ids": rng.integers(0, VOCAB, (1, 1)).astype(np.int64),
             "attention_mask": np.ones((1, past + 1), np.int64)}
    for i in range(LAYERS):
        for w in ("key", "value"):
            feeds[f"past_key_values.{i}.{w}"] = rng.standard_normal((1, HEADS, past, HEAD_DIM)).astype(np.float32)
    return feeds


def test_decode_step_on_the_int8_matvec_matches_ort(quantized_decoder, tmp_path, monkeypatch):
    _need_vnni_host()
    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    import onnxruntime as ort
    from tvm import relax

    from blockforge.bench.contenders import tvm_device
    from blockforge.compile import open_model
    from blockforge.compile.artifact.runtime import run_vm

    s = open_model(quantized_decoder, "host", {"batch": 1, "seq": 1})  # past symbolic
    res = s.build(dump_ir=tmp_path / "dump")
    after = next((tmp_path / "dump").glob("*-int8-gemm.py")).read_text()
    main = after.split("def main")[-1]
    assert main.count("R.call_tir(cls.int8_gemm_") == 4 * LAYERS + 1, main
    assert 'out_dtype="int32"' not in main, "an int32 matmul is left"
    final = next((tmp_path / "dump").glob("*-finalize.py")).read_text()
    # every kernel a one-row tile (M = 1 is static: batch 1, seq 1), none the 6-row one
    tiles = re.findall(f'"{re.escape(gemm.TILES_ATTR)}": "([^"]*)"', final)
    assert tiles and all(t.startswith("1x") for t in tiles), tiles
    dev = tvm_device("cpu")
    vm = relax.VirtualMachine(res.executable, dev)
    sess = ort.InferenceSession(str(quantized_decoder), providers=["CPUExecutionProvider"])
    for past in (0, 17, 128):  # one artifact, the past symbolic
        feeds = _feeds(past, seed=past)
        got = run_vm(vm, dev, s.inputs, s.outputs, feeds)
        want = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
        # present = Concat(past, new K/V): float all the way, but after the int8 qkv GEMM
        np.testing.assert_array_equal(got["present.0.key"][:, :, :past], feeds["past_key_values.0.key"])
        for name, w in want.items():
            # one rounding step of the activations' quantization (their dynamic scale is
            # range / 255) can flip where the two engines' float sums differ in order
            step = float(np.ptp(w)) / 255
            assert np.abs(got[name] - w).max() <= step, (past, name, float(np.abs(got[name] - w).max()), step)


def test_one_row_tile_and_weight_bound_parallelism():
    """M = 1 gets a one-row tile (the 6-row tile re-reads the row into 5 dead rows), and a
    weight of >= PARALLEL_WEIGHT_BYTES runs on the pool though its MACs are few."""
    assert gemm.default_tiles(gemm.Int8GemmSpec(k=768, n=768, m=1)).mr == 1
    assert gemm.default_tiles(gemm.Int8GemmSpec(k=768, n=768, m=4)).mr == 4
    assert gemm.default_tiles(gemm.Int8GemmSpec(k=768, n=768, m=None)).mr == gemm.MR
    assert "T.parallel" in gemm.kernel(gemm.Int8GemmSpec(k=768, n=768, m=1)).script()
    assert "T.parallel" not in gemm.kernel(gemm.Int8GemmSpec(k=64, n=128, m=1)).script()


def _dynamic_matmul_module(w: np.ndarray, seq: int):
    """The importer's form of MatMulInteger -> Cast -> Mul(scale per column) -> Add(bias)."""
    from tvm import relax

    bb = relax.BlockBuilder()
    n = w.shape[1]
    x = relax.Var("x", relax.TensorType([1, seq, w.shape[0]], "uint8"))
    zp = relax.Var("zp", relax.TensorType([], "uint8"))
    scale = relax.Var("scale", relax.TensorType([n], "float32"))
    bias = relax.Var("bias", relax.TensorType([n], "float32"))
    with bb.function("main", [x, zp, scale, bias]):
        with bb.dataflow():
            a32 = bb.emit(relax.op.subtract(relax.op.astype(x, "int32"), relax.op.astype(zp, "int32")))
            y = bb.emit(relax.op.matmul(a32, relax.const(w.astype(np.int32)), out_dtype="int32"))
            f = bb.emit(relax.op.astype(y, "float32"))
            z = bb.emit(relax.op.multiply(f, scale))
            out = bb.emit_output(relax.op.add(z, bias))
        bb.emit_func_output(out)
    return bb.get()


def test_ragged_n_padded_to_whole_panels_and_cropped():
    """N = 50 (GPT-2's lm_head: 50257): the weights get zero columns to 64, the per-column
    scale and the bias are padded alike, and the output is cropped back to 50 columns."""
    _need_vnni_host()
    from tvm import relax

    from blockforge.compile.quant.rewrite import int8_gemm
    from blockforge.targets import resolve

    rng = np.random.default_rng(3)
    w = rng.integers(-128, 128, (32, 50), dtype=np.int8)
    mod = _dynamic_matmul_module(w, 1)
    with ZNVER4:
        new = int8_gemm()(mod)
    (spec,) = gemm.kernel_specs(new)
    assert (spec.n, spec.scale, spec.bias, spec.m) == (64, "column", True, 1)
    vm = relax.VirtualMachine(tvm.compile(new, target=resolve("host").tvm_target()), tvm.cpu())
    x = rng.integers(0, 256, (1, 1, 32)).astype(np.uint8)
    zp = np.array(131, np.uint8)
    scale = rng.random(50).astype(np.float32)
    bias = rng.standard_normal(50).astype(np.float32)
    got = vm["main"](*(tvm.runtime.tensor(a) for a in (x, zp, scale, bias))).numpy()
    ref = ((x.astype(np.int64) - 131) @ w.astype(np.int64)).astype(np.float32) * scale + bias
    assert got.shape == (1, 1, 50)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-4)
