"""`--precision bf16`'s fused attention (compile/attention/flash.py, bf16=True): Q K^T and
P V on VDPBF16PS, softmax and sums float32. The instruction in the kernel's assembly; the
kernel unchanged where bf16_pairs refuses (key rows, odd d, d_v not whole vectors, AVX2);
numbers against float64 within the bf16 row (and really rounded), full tiles and the float32
partial tiles of symbolic, ragged and causal key lengths side by side; the phase picks it
only at bf16 (ablation bf16-attention); an MHA verified against ONNX Runtime."""

from __future__ import annotations

import json

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from blockforge.compile import attention  # noqa: E402
from blockforge.compile.attention.flash import bf16_pairs  # noqa: E402
from blockforge.graph.tolerance import output_tolerance  # noqa: E402
from blockforge.targets import resolve  # noqa: E402
from blockforge.targets.precision import target_has  # noqa: E402

from conftest import run_cli_in_process  # noqa: E402
from test_attention_fusion import _reference, _spec  # noqa: E402

ZNVER4 = {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "znver4", "num-cores": 2}
BF16 = attention.KERNEL_ATTR + ".bf16"


def _need_bf16_host():
    if not target_has(resolve("host"), "avx512bf16"):
        pytest.skip("this CPU has no AVX512_BF16 (avx512_bf16): the bf16 kernel cannot run here")


def _bert(**kw):
    return _spec(**{**dict(heads=2, d=64, dv=64, scale=0.125, batch=1, sq=128, skv=128), **kw})


def test_products_are_vdpbf16ps_in_the_assembly():
    """Cross-built for znver4: Q K^T and P V on the instruction, the pairs packed on
    VCVTNEPS2BF16, the imported functions inlined (no call left); bf16=False has none."""
    spec = _bert()
    f = attention.kernel(spec, (64, 64), 16, bf16=True)
    assert f.attrs[BF16]
    asm = tvm.compile(tvm.IRModule({"main": f}), target=tvm.target.Target(ZNVER4)).mod.inspect_source("asm")
    # per d pair: 4 rows x 4 key vectors; per key pair: 4 rows x 4 d vectors (both unrolled)
    assert asm.count("vdpbf16ps") >= 32, asm.count("vdpbf16ps")
    assert not [ln for ln in asm.splitlines() if "call" in ln and ("dpbf16" in ln or "pack_bf16" in ln)]
    assert asm.count("vcvtneps2bf16") >= 4  # the pair packs: Q, K^T, V, P (two halves each)
    fp32 = attention.kernel(spec, (64, 64), 16)
    assert BF16 not in fp32.attrs
    asm32 = tvm.compile(tvm.IRModule({"main": fp32}), target=tvm.target.Target(ZNVER4)).mod.inspect_source("asm")
    assert "vdpbf16ps" not in asm32


@pytest.mark.parametrize("kw, lanes, tiles", [
    (dict(k="bhsd", sq=1), 16, (64, 64)),  # key rows (a decode step)
    (dict(d=63, dv=64), 16, (64, 64)),  # odd d: no (d, d + d/2) pairs
    (dict(d=48, dv=64), 16, (64, 64)),  # d/2 not whole vectors
    (dict(dv=40), 16, (64, 64)),  # d_v not whole vectors
    (dict(), 16, (64, 48)),  # key tiles not whole 32-key blocks
    (dict(), 8, (64, 32)),  # AVX2: no VDPBF16PS
])
def test_refused_forms_keep_the_float32_kernel(kw, lanes, tiles):
    spec = _bert(**kw)
    assert not bf16_pairs(spec, tiles[1], lanes)
    tvm.ir.assert_structural_equal(attention.kernel(spec, tiles, lanes, bf16=True), attention.kernel(spec, tiles, lanes))


def _run(spec, tiles, sq, skv, seed=0, b=1):
    from blockforge.compile.bf16 import gemm

    rng = np.random.default_rng(seed)
    h, d = spec.heads, spec.d
    q = rng.standard_normal((b, h, sq, d)).astype(np.float32)
    kt = rng.standard_normal((b, h, d, skv)).astype(np.float32)
    v = rng.standard_normal((b, h, skv, spec.dv)).astype(np.float32)
    args = [np.ascontiguousarray(q.transpose(0, 2, 1, 3)), kt, np.ascontiguousarray(v.transpose(0, 2, 1, 3))]
    outs = {}
    for bf16 in (False, True):
        f = attention.kernel(spec, tiles, 16, bf16=bf16)
        lib = tvm.compile(tvm.IRModule({"main": f}), target=resolve("host").tvm_target())
        out = tvm.runtime.tensor(np.zeros((b, sq, h, spec.dv), np.float32))
        lib["main"](*[tvm.runtime.tensor(a) for a in args], out)
        outs[bf16] = out.numpy().transpose(0, 2, 1, 3)
    exact = _reference(q, kt, v, spec)
    r = lambda x: gemm.from_bf16_bits(gemm.to_bf16_bits(x))  # noqa: E731
    rounded = _reference(r(q), r(kt), r(v), spec)  # Q, K, V as the kernel rounds them (P not)
    return outs, exact, rounded


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("sq, skv, kw, tiles", [
    (128, 128, {}, (64, 64)),  # BERT's seq 128: every tile on VDPBF16PS
    (96, 160, {}, (32, 64)),  # static ragged keys: the last tile (whole, overlapping) float32
    (100, 150, dict(sq=None, skv=None, causal=True, fill=-1e4), (64, 64)),  # symbolic + causal: partial tail fp32
    (70, 70, dict(sq=None, skv=None, same_len=True), (64, 128)),  # symbolic, one tile wider than Skv: all fp32
])
def test_kernel_within_the_bf16_row_and_really_rounded(sq, skv, kw, tiles):
    _need_bf16_host()
    spec = _bert(**{**dict(sq=sq, skv=skv), **kw})
    outs, exact, rounded = _run(spec, tiles, sq, skv)
    assert _rel(outs[False], exact) < 1e-5
    rel = _rel(outs[True], exact)
    limit = output_tolerance("float32", "block", "bf16").rel_l2
    if skv < tiles[1]:
        assert rel < 1e-5  # no full key tile: the float32 loops only
        return
    assert 1e-4 < rel < limit / 2, rel
    # Q, K and V rounded as the kernel rounds them account for most of the error (P's
    # rounding is the rest): the pairs are the right elements, not merely close ones
    assert _rel(outs[True], rounded) < 0.6 * rel, (_rel(outs[True], rounded), rel)


def test_bf16_tiles_fit_the_key_length():
    from blockforge.compile.attention.flash import bf16_tiles

    assert [bf16_tiles(16, skv) for skv in (None, 512, 128, 100, 64, 40, 31)] == \
        [(128, 128), (128, 128), (128, 128), (128, 64), (128, 64), (128, 32), None]


def test_phase_uses_it_only_at_bf16_and_its_ablation(tmp_path):
    from tvm import tirx

    from blockforge.compile import open_model
    from blockforge.compile.pipeline import run_phases
    from blockforge.graph import MHASpec, export

    model = export(MHASpec(d_model=128, heads=2), tmp_path / "mha.onnx").model_path

    def flags(precision, without=frozenset(), seq=64):
        s = open_model(model, ZNVER4, {"batch": 1, "seq": seq}, precision=precision)
        mod, _ = run_phases(s.relax(), s.target, stop_after="fuse-attention", precision=precision, without=without)
        return [(bool(f.attrs.get(BF16, False)), str(f.attrs[attention.KERNEL_ATTR + ".tiles"]))
                for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc) and attention.is_kernel(f)]

    # bf16: key tiles of 8 vectors where Skv holds one (flash.bf16_tiles), else of 4 (a key
    # tile wider than Skv would be one partial, float32 tile); the query tile Sq's when shorter
    assert flags("bf16") == [(True, "64x64")]
    assert flags("bf16", seq=256) == [(True, "128x128")]
    assert flags("bf16", frozenset({"bf16-attention"})) == [(False, "64x64")]
    assert flags("fp32") == [(False, "64x64")]


def test_cli_verify_bf16_mha_against_ort(workdir):
    """d 64 heads at seq 128: the fused kernel on VDPBF16PS, checked against ORT's float32
    within the bf16 row, as the build runs it (projections on the bf16 GEMM too)."""
    from blockforge.graph import MHASpec, export

    _need_bf16_host()
    model = export(MHASpec(d_model=128, heads=2), workdir / "mha.onnx").model_path
    r = run_cli_in_process("verify", model, "--target", "host", "--shape", "batch=1,seq=128", "--precision", "bf16",
                           "--json", workdir / "v.json", cwd=workdir)
    assert r.rc == 0, r.text
    rows = [c for c in json.loads((workdir / "v.json").read_text())["comparisons"] if c["pair"] == "tvm vs ort"]
    assert rows and all(c["passed"] for c in rows), rows
    assert "rel L2" in rows[0]["note"] and rows[0]["max_abs"] > 1e-5
