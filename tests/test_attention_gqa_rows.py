"""A grouped-query decode step's fused attention, one job per key/value head: the `group`
query heads sharing a K/V head are one job's rows (compile/attention/flash.py group_rows), so
each cached key and value row is loaded once for all of them, not once per query head, and
P V keeps group x (dv / lanes) accumulator chains in flight. Measured on the Llama-style GQA
decoder's kernel (12 heads, 4 kv heads, d 64, P = 512), one thread CPU time, interleaved:
29.2 -> 18.3 us a call (0.63x, load 7.2); the ablation `attention-gqa-rows` builds the one
job per query head kernel."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from blockforge.compile import attention  # noqa: E402
from blockforge.compile.attention.flash import group_rows  # noqa: E402
from test_attention_fusion import LANES, TARGET  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "models"


def _spec(**kw):
    base = dict(dtype="float32", q="bhsd", k="bhsd", v="bhsd", o="bshd", heads=12, kv_heads=4, d=64, dv=64,
                scale=0.125, batch=1, sq=1, skv=None, add=("1", "1", "1", "k"))
    return attention.AttentionSpec(**{**base, **kw})


def test_group_rows():
    assert group_rows(_spec(), LANES) == 3
    assert group_rows(_spec(sq=2), LANES) == 6
    assert group_rows(_spec(kv_heads=None), LANES) == 0  # not grouped
    assert group_rows(_spec(kv_heads=12), LANES) == 0  # a group of one
    assert group_rows(_spec(k="bhds"), LANES) == 0  # K^T (a prompt): the query tile's form
    assert group_rows(_spec(sq=None), LANES) == 0  # symbolic query length
    assert group_rows(_spec(causal=True), LANES) == 0
    assert group_rows(_spec(sq=64), LANES) == 0  # 192 rows: more than the registers hold


def _parallel_extent(func) -> int:
    (ext,) = re.findall(r"T\.parallel\(T\.int64\((\d+)\)\)", func.script())
    return int(ext)


def test_jobs_are_kv_heads():
    """4 jobs of 3 rows (tiles 3x64), not 12 of 1; the ablation keeps the per-query-head jobs."""
    spec = _spec(skv=513)
    grouped, per_head = attention.kernel(spec, lanes=LANES), attention.kernel(spec, lanes=LANES, gqa_rows=False)
    assert _parallel_extent(grouped) == 4 and str(grouped.attrs[attention.KERNEL_ATTR + ".tiles"]) == "3x64"
    assert _parallel_extent(per_head) == 12 and str(per_head.attrs[attention.KERNEL_ATTR + ".tiles"]) == "1x64"


def _reference(q, k, v, spec, add, keep):
    g = spec.heads // spec.kv_heads
    k, v = np.repeat(k, g, axis=1).astype(np.float64), np.repeat(v, g, axis=1).astype(np.float64)
    s = q.astype(np.float64) @ k.transpose(0, 1, 3, 2) * spec.scale
    if add is not None:
        s = s + add
    if keep is not None:
        s = np.where(keep, s, spec.fill)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v  # (b, h, sq, dv)


@pytest.mark.parametrize("kw, b, skv", [
    (dict(skv=129), 1, 129),  # a decode step at P = 128, the ragged 16-key tail
    (dict(), 1, 70),  # past symbolic (the loop artifact)
    (dict(sq=2, batch=2, add=("b", "h", "q", "k")), 2, 37),  # a 2-token chunk, a per-head mask
    (dict(heads=8, kv_heads=2, d=32, dv=32, add=None, keep=("1", "1", "1", "k"), fill=-1e4, skv=200), 1, 200),
    (dict(o="bhsd", skv=64), 1, 64),  # whole key tiles only
])
def test_grouped_kernel_matches_numpy(kw, b, skv):
    spec = _spec(**kw)
    assert group_rows(spec, LANES)
    rng = np.random.default_rng(0)
    sq, h, hk = spec.sq, spec.heads, spec.kv_heads
    q = rng.standard_normal((b, h, sq, spec.d)).astype(np.float32)
    k = rng.standard_normal((b, hk, skv, spec.d)).astype(np.float32)
    v = rng.standard_normal((b, hk, skv, spec.dv)).astype(np.float32)
    args, add, keep = [q, k, v], None, None
    if spec.add:
        shape = [{"1": 1, "b": b, "h": h, "q": sq, "k": skv}[c] for c in spec.add]
        add = rng.standard_normal(shape).astype(np.float32)
        args.append(add)
    if spec.keep:
        keep = rng.random([{"1": 1, "b": b, "h": h, "q": sq, "k": skv}[c] for c in spec.keep]) < 0.7
        args.append(keep)
    want = _reference(q, k, v, spec, add, keep)
    for grouped in (True, False):
        lib = tvm.compile(tvm.IRModule({"main": attention.kernel(spec, lanes=LANES, gqa_rows=grouped)}), target=TARGET)
        out = tvm.runtime.tensor(np.zeros((b, sq, h, spec.dv) if spec.o == "bshd" else (b, h, sq, spec.dv), np.float32))
        lib["main"](*[tvm.runtime.tensor(a) for a in args], out)
        got = out.numpy().transpose(0, 2, 1, 3) if spec.o == "bshd" else out.numpy()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"gqa_rows={grouped}")


def test_llama_step_runs_a_job_per_kv_head():
    """The Llama-style fixture's decode step (seq 1) gets the grouped kernel; the ablation
    `attention-gqa-rows` one job per query head; a prompt (seq 5, K^T) neither."""
    from tvm import tirx

    from blockforge.compile.pipeline import run_phases
    from blockforge.compile.session import open_model
    from blockforge.targets import resolve

    host = resolve("host")

    def tiles(dims, without=frozenset()):
        mod, _ = run_phases(open_model(FIXTURES / "llama_past_legacy_op17.onnx", host, dims).relax(), host,
                            stop_after="fuse-attention", without=without)
        return {(str(f.attrs[attention.KERNEL_ATTR + ".tiles"]), _parallel_extent(f)) for _, f in mod.functions_items()
                if isinstance(f, tirx.PrimFunc) and attention.is_kernel(f)}

    spec = next(iter(attention.kernel_specs(run_phases(open_model(
        FIXTURES / "llama_past_legacy_op17.onnx", host, "batch=1,seq=1,past=17,past_seq=18").relax(), host,
        stop_after="fuse-attention")[0])))
    g = spec.heads // spec.kv_heads
    assert g > 1, spec
    step = "batch=1,seq=1,past=17,past_seq=18"
    assert tiles(step) == {(f"{g}x{4 * LANES}", spec.kv_heads)}
    assert tiles(step, {"attention-gqa-rows"}) == {(f"1x{4 * LANES}", spec.heads)}
    prompt = tiles("batch=1,seq=5,past=17,past_seq=22")
    assert prompt and all(not t.startswith(f"{g * 5}x") for t, _ in prompt), prompt
