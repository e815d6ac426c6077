"""The bf16 GEMM (compile/bf16, `--precision bf16`): VDPBF16PS in the kernel's assembly,
its results against a numpy emulation of the kernel's rounding (exact on this CPU) and
against float32 within the bf16 row of the tolerance table, odd shapes (K odd, N not a
multiple of 16, ragged and symbolic M), the in-kernel round-to-nearest-even, the phase in a
model (attention products stay float32), and the refusal of a target without AVX512_BF16."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from blockforge.compile.bf16 import gemm  # noqa: E402
from blockforge.errors import BlockforgeError  # noqa: E402
from blockforge.graph.tolerance import compare, output_tolerance  # noqa: E402
from blockforge.targets import resolve  # noqa: E402
from blockforge.targets.precision import resolve_precision, target_has  # noqa: E402

from conftest import assert_user_error, run_cli_in_process  # noqa: E402

ZNVER4 = {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "znver4", "num-cores": 2}


def _need_bf16_host():
    if not target_has(resolve("host"), "avx512bf16"):
        pytest.skip("this CPU has no AVX512_BF16 (avx512_bf16): the bf16 kernel cannot run here")


def _fp32_rel_l2(got, a, w, bias):
    exact = a.astype(np.float64) @ w.astype(np.float64) + bias
    return float(np.linalg.norm(got - exact) / np.linalg.norm(exact))


def test_precision_is_read_from_the_target_not_the_build_machine():
    assert resolve_precision("bf16", resolve(ZNVER4)).name == "bf16"
    assert resolve_precision(None, resolve("x86-64-avx512")).name == "fp32"
    for target in ("x86-64-avx512", "aarch64-linux", "cuda-sm90"):
        with pytest.raises(BlockforgeError, match="needs a CPU target with AVX512_BF16"):
            resolve_precision("bf16", resolve(target))
    with pytest.raises(BlockforgeError, match="unknown precision"):
        resolve_precision("fp8", resolve(ZNVER4))
    from blockforge.targets import list_targets

    listed = {r["name"]: r["precisions"] for r in list_targets()}
    assert listed["x86-64-avx512"] == ["fp32"] and listed["cuda-sm90"] == ["fp32"]


def test_phase_only_at_bf16_and_its_ablation():
    from blockforge.compile.pipeline import phases

    t = resolve(ZNVER4)
    names = lambda **kw: [p.name for p in phases(t, **kw)]  # noqa: E731
    assert "bf16-gemm" not in names() and "bf16-gemm" not in names(precision="bf16", without={"bf16-gemm"})
    at_bf16 = names(precision="bf16")
    assert at_bf16.index("bf16-gemm") == at_bf16.index("optimize") - 1, at_bf16
    assert "bf16-gemm" not in names(precision="bf16", default_schedules=False)  # TVM's own lowering: fp32


def test_kernel_assembly_has_vdpbf16ps_inlined():
    """Cross-built for znver4 (no bf16 CPU needed): the instruction is in the loop and the
    imported LLVM function is inlined (no call left)."""
    f = gemm.kernel(gemm.Bf16GemmSpec(k=64, n=64, m=12, bias=True))
    assert f.script().count(f'"{gemm.KERNEL_ATTR}":') == 1
    lib = tvm.compile(tvm.IRModule({"main": f}), target=tvm.target.Target(ZNVER4))
    asm = lib.mod.inspect_source("asm")
    # 12 rows / 6 x 4 vectors, unrolled: 24 per k pair
    assert asm.count("vdpbf16ps") >= gemm.MR * gemm.NV, asm.count("vdpbf16ps")
    assert not [ln for ln in asm.splitlines() if "call" in ln and "dpbf16" in ln]


def _run(spec, a, w, bias, lib=None):
    if lib is None:
        lib = tvm.compile(tvm.IRModule({"main": gemm.kernel(spec)}), target=resolve("host").tvm_target())
    out = tvm.runtime.tensor(np.zeros((a.shape[0], spec.n), np.float32))
    args = [a, gemm.pack_weights(w)] + ([bias] if spec.bias else [])
    lib["main"](*[tvm.runtime.tensor(np.ascontiguousarray(x)) for x in args], out)
    return out.numpy(), lib


# K odd, N % 16, M % 6 ragged; M % 4 with N % 96: 4 x 6 micro-tiles (row_fit), K odd there too
@pytest.mark.parametrize("m,k,n", [(12, 64, 64), (7, 33, 20), (13, 96, 48), (8, 64, 96), (20, 33, 192)])
def test_kernel_matches_the_bf16_emulation_and_fp32_within_the_bf16_row(m, k, n):
    _need_bf16_host()
    rng = np.random.default_rng(k)
    a = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    got, _ = _run(gemm.Bf16GemmSpec(k=k, n=n, m=m, bias=True), a, w, bias)
    ref = gemm.reference(a, w, bias)
    # The emulation's sums are VDPBF16PS's order: equal here (Zen 4); another CPU may differ
    # by float32 sum noise, far below bf16's rounding (2^-9).
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6 * np.abs(ref).max())
    rel = _fp32_rel_l2(got, a, w, bias)
    assert 1e-4 < rel < output_tolerance("float32", "ffn", "bf16").rel_l2, rel  # really rounded, within the row


def test_row_fit_tiles_static_rows_in_whole_4_row_tiles():
    """M = 128 (BERT's seq): 32 tiles of 4 rows x 6 vectors, not 22 of 6 (132 rows, 4 of them
    clamped re-reads); the rounded A has M rows exactly. Off (ablation bf16-row-fit), or where
    6 rows divide M, 4 x 6 does not fit N, or M is symbolic: 6 x 4 as before."""
    sp = gemm.Bf16GemmSpec(k=768, n=3072, m=128, bias=True, activation="gelu")
    assert [gemm.Bf16GemmSpec(k=768, n=n, m=m, row_fit=fit).tile() for m, n, fit in
            [(128, 3072, True), (512, 768, True), (128, 3072, False), (120, 768, True), (128, 800, True),
             (None, 768, True)]] == [(4, 6), (4, 6), (6, 4), (6, 4), (6, 2), (6, 4)]
    f = gemm.kernel(sp)
    shapes = {b.name: [int(d) for d in b.shape] for b in f.body.block.alloc_buffers}
    assert shapes["a_bf16"] == [128, 768], shapes
    off = gemm.kernel(gemm.Bf16GemmSpec(k=768, n=3072, m=128, bias=True, activation="gelu", row_fit=False))
    assert {b.name: [int(d) for d in b.shape] for b in off.body.block.alloc_buffers}["a_bf16"] == [132, 768]
    assert json.loads(sp.to_json()) == {"k": 768, "n": 3072, "m": 128, "bias": True, "activation": "gelu"}
    asm = tvm.compile(tvm.IRModule({"main": f}), target=tvm.target.Target(ZNVER4)).mod.inspect_source("asm")
    assert asm.count("vdpbf16ps") >= 24


def test_row_fit_ablation_reaches_the_kernels(tmp_path):
    from blockforge.compile import open_model
    from blockforge.compile.pipeline import run_phases
    from blockforge.graph import FFNSpec, export

    model = export(FFNSpec(d_model=96, d_ff=192), tmp_path / "ffn.onnx").model_path
    s = open_model(model, ZNVER4, {"batch": 1, "seq": 128}, precision="bf16")
    tiles = {}
    for without in (frozenset(), frozenset({"bf16-row-fit"})):
        mod, _ = run_phases(s.relax(), s.target, stop_after="bf16-gemm", precision="bf16", without=without)
        tiles[bool(without)] = sorted({sp.tile() for sp in gemm.kernel_specs(mod)})
    assert tiles == {False: [(4, 6)], True: [(6, 2), (6, 4)]}, tiles  # N 96: 6 x 2 vectors before


def test_gelu_segments_in_the_write_back_and_their_ablation(tmp_path):
    """The bf16-gemm phase's gelu is compile/quant/gelu.py's (VPERMI2PS, no VDIVPS) where the
    write-back is 16 lanes wide; N % 16 != 0 and the ablation keep fast_erf's; on a bf16 host
    the kernel agrees with the emulation's sums through gelu.reference."""
    from blockforge.compile import open_model
    from blockforge.compile.pipeline import run_phases
    from blockforge.compile.quant import gelu
    from blockforge.graph import FFNSpec, export

    def asm(spec, segments=True):
        f = gemm.kernel(spec, segments)
        return tvm.compile(tvm.IRModule({"main": f}), target=tvm.target.Target(ZNVER4)).mod.inspect_source("asm")

    seg = asm(gemm.Bf16GemmSpec(k=64, n=96, m=12, bias=True, activation="gelu"))
    perms = len(re.findall(r"\bvperm[it]2ps\b", seg))
    assert perms >= 4 * 6 and "vdivps" not in seg, perms  # four tables x the 6-vector row
    assert "vdivps" in asm(gemm.Bf16GemmSpec(k=64, n=96, m=12, bias=True, activation="gelu"), False)
    assert "vdivps" in asm(gemm.Bf16GemmSpec(k=64, n=20, m=12, bias=True, activation="gelu"))
    model = export(FFNSpec(d_model=96, d_ff=192, activation="gelu"), tmp_path / "ffn.onnx").model_path
    s = open_model(model, ZNVER4, {"batch": 1, "seq": 16}, precision="bf16")
    for without in (frozenset(), frozenset({"bf16-gelu-segments"})):
        mod, _ = run_phases(s.relax(), s.target, stop_after="bf16-gemm", precision="bf16", without=without)
        gelu_kernels = [f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)
                        and gemm.is_kernel(f) and '"gelu"' in str(f.attrs[gemm.KERNEL_ATTR])]
        assert len(gelu_kernels) == 1
        assert ("vpermi2var" in gelu_kernels[0].script()) == (not without)
    _need_bf16_host()
    rng = np.random.default_rng(21)
    a = rng.standard_normal((12, 64)).astype(np.float32)
    w = (rng.standard_normal((64, 96)) * 0.4).astype(np.float32)
    bias = rng.standard_normal(96).astype(np.float32)
    spec = gemm.Bf16GemmSpec(k=64, n=96, m=12, bias=True, activation="gelu")
    lib = tvm.compile(tvm.IRModule({"main": gemm.kernel(spec, True)}), target=resolve("host").tvm_target())
    got, _ = _run(spec, a, w, bias, lib)
    z = gemm.reference(a, w, bias)
    assert np.abs(z).max() > 16 / 3
    np.testing.assert_allclose(got, gelu.reference(z), rtol=0, atol=2e-6 * max(1, np.abs(z).max()))


def test_symbolic_m_on_ragged_rows():
    _need_bf16_host()
    spec = gemm.Bf16GemmSpec(k=48, n=40, m=None, bias=True)
    rng = np.random.default_rng(1)
    w = rng.standard_normal((48, 40)).astype(np.float32)
    bias = rng.standard_normal(40).astype(np.float32)
    lib = None
    for m in (1, 5, 6, 7, 20):  # below, at and past one 6-row tile
        a = rng.standard_normal((m, 48)).astype(np.float32)
        got, lib = _run(spec, a, w, bias, lib)
        np.testing.assert_allclose(got, gemm.reference(a, w, bias), rtol=0, atol=1e-5, err_msg=f"M={m}")


def test_in_kernel_rounding_is_nearest_even_and_keeps_nan_and_inf():
    """W = I: row 0 of the output is A's row 0 as the kernel rounded it, bit for bit; rows
    1-3 carry one inf, -inf or NaN each (inf * 0 makes the rest of such a row NaN, as in fp32)."""
    _need_bf16_host()
    vals = np.array([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -(1 + 2**-8), 3.0e38, 1e-3, -7.25, 0.0,
                     65504.0, 1 + 2**-7, 1 + 5 * 2**-9, 1.0, 2.5, 2**-120, 3.3895e38, 1 / 3], np.float32)
    a = np.zeros((6, 16), np.float32)
    a[0] = vals
    a[1, 0], a[2, 0], a[3, 0] = np.inf, -np.inf, np.nan
    a[4, 0], a[5, 0] = 2**-130, -(2**-127)  # denormals: the instruction reads them as 0 (DAZ)
    got, _ = _run(gemm.Bf16GemmSpec(k=16, n=16, m=6), a, np.eye(16, dtype=np.float32), None)
    expected = gemm.from_bf16_bits(gemm.to_bf16_bits(vals))
    # ties to even: 1+2^-8 -> 1, 1+3*2^-8 -> 1+2^-6; above the tie -> up; 3e38 stays finite
    assert expected[0] == 1.0 and expected[1] == 1 + 2**-6 and expected[2] == 1 + 2**-7 and np.isfinite(expected).all()
    np.testing.assert_array_equal(got[0].view(np.uint32), expected.view(np.uint32))
    assert got[1, 0] == np.inf and got[2, 0] == -np.inf and np.isnan(got[3, 0])
    assert (got[4:] == 0).all() and (gemm.reference(a[4:], np.eye(16, dtype=np.float32)) == 0).all()
    assert np.isnan(gemm.from_bf16_bits(gemm.to_bf16_bits(np.array([np.nan, -np.nan], np.float32)))).all()


def test_bf16_row_judges_the_relative_l2_error():
    rng = np.random.default_rng(0)
    e = rng.standard_normal(1000)
    tol = output_tolerance("float32", "block", "bf16")
    assert tol.rel_l2 is not None and output_tolerance("float32", "block").rel_l2 is None
    assert compare("tvm vs ort", "y", e * (1 + 4e-3 * rng.standard_normal(1000)), e, tol).passed
    assert not compare("tvm vs ort", "y", e * (1 + 3e-2 * rng.standard_normal(1000)), e, tol).passed
    assert not compare("tvm vs ort", "y", e + np.where(np.arange(1000) == 3, np.nan, 0), e, tol).passed


def test_phase_puts_weight_matmuls_on_the_kernel_and_leaves_attention_products_fp32(tmp_path):
    from tvm import relax

    from blockforge.compile import open_model
    from blockforge.compile.pipeline import run_phases
    from blockforge.graph import MHASpec, export

    model = export(MHASpec(d_model=64, heads=2), tmp_path / "mha.onnx").model_path
    s = open_model(model, ZNVER4, {"batch": 1, "seq": 16}, precision="bf16")
    mod, names = run_phases(s.relax(), s.target, stop_after="bf16-gemm", precision="bf16",
                            fuse_attention=False)
    assert names[-1] == "bf16-gemm"
    left = []
    relax.analysis.post_order_visit(mod["main"], lambda e: left.append(e) if isinstance(e, relax.Call)
                                    and getattr(e.op, "name", None) == "relax.matmul" else None)
    assert left and all(not isinstance(c.args[1], tvm.ir.expr.GenericConst) for c in left), \
        "a constant-weight matmul was left in float32"  # the products QK^T and PV are what is left
    specs = gemm.kernel_specs(mod)
    assert specs and all(sp.bias for sp in specs)  # Q, K, V, output projections, bias fused
    fp32, _ = run_phases(s.relax(), s.target, stop_after="optimize")
    assert not gemm.kernel_specs(fp32)
    # with the fused attention kernel (the default) the projections still go to bf16
    fused, _ = run_phases(s.relax(), s.target, stop_after="bf16-gemm", precision="bf16", fuse_attention=True)
    assert len(gemm.kernel_specs(fused)) == len(specs)


def test_bench_holds_bf16_builds_to_the_bf16_row(workdir):
    """At fp32's row (rtol 1e-4) the bf16 build would be refused as `a different computation`."""
    from blockforge.bench import BenchOptions, bench
    from blockforge.graph import FFNSpec, export

    _need_bf16_host()
    model = export(FFNSpec(d_model=64, d_ff=128), workdir / "ffn.onnx").model_path
    rep = bench(BenchOptions(model=model, against=("ort", "untuned"), repeat=3, shape={"batch": 1, "seq": 16},
                             precision="bf16"))
    assert "untuned" in {r.name for r in rep.results}, rep.notes


def test_cli_compile_and_verify_bf16(workdir):
    from blockforge.graph import FFNSpec, export

    _need_bf16_host()
    model = export(FFNSpec(d_model=64, d_ff=128), workdir / "ffn.onnx").model_path
    r = run_cli_in_process("compile", model, "--target", "host", "--shape", "batch=1,seq=16", "--precision", "bf16",
                           "-o", workdir / "art", cwd=workdir)
    assert r.rc == 0, r.text
    m = json.loads((workdir / "art" / "manifest.json").read_text())
    assert m["precision"] == "bf16" and "bf16-gemm" in m["phases"], m["phases"]
    r = run_cli_in_process("verify", model, "--target", "host", "--shape", "batch=1,seq=16", "--precision", "bf16",
                           "--json", workdir / "v.json", cwd=workdir)
    assert r.rc == 0, r.text
    rows = [c for c in json.loads((workdir / "v.json").read_text())["comparisons"] if c["pair"] == "tvm vs ort"]
    assert rows and "rel L2" in rows[0]["note"] and rows[0]["max_abs"] > 1e-5  # bf16, not the fp32 build


def test_cli_refuses_bf16_on_a_target_without_it(workdir):
    from blockforge.graph import FFNSpec, export

    model = export(FFNSpec(d_model=64, d_ff=128), workdir / "ffn.onnx").model_path
    r = run_cli_in_process("compile", model, "--target", "x86-64-avx512", "--precision", "bf16", "-o", workdir / "art",
                           cwd=workdir)
    assert_user_error(r, "precision bf16 needs a CPU target with AVX512_BF16", "x86-64-avx512")
    assert not (workdir / "art").exists()
