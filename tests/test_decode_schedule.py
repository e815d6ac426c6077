"""Schedules at the decode shape (one query row after P cached keys), at the IR level on a
fixed vector width, as tests/test_schedule_ir.py does."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from blockforge.compile import attention

FIXTURES = Path(__file__).parent / "fixtures" / "models"


def _spec(sq: int, skv: int = 129) -> attention.AttentionSpec:
    return attention.AttentionSpec(dtype="float32", q="bhsd", k="bhds", v="bhsd", o="bshd", heads=12, d=64, dv=64,
                                   scale=0.125, batch=1, sq=sq, skv=skv, add=("b", "1", "q", "k"))


def test_decode_step_attention_tile_is_the_query_rows():
    """At Sq = 1 the kernel's query tile is one row, not the default 64 (which computed 64
    rows, clamped, for the one stored: 64x the Q K^T and P V work per head); a chunk of 5
    gets 5; a prompt longer than a tile keeps the default."""
    for sq, want in ((1, 1), (5, 5), (128, 64)):
        func = attention.kernel(_spec(sq), lanes=16)
        assert str(func.attrs[attention.KERNEL_ATTR + ".tiles"]) == f"{want}x64", sq
    # an explicit (tuned) tile is clamped too
    assert str(attention.kernel(_spec(1), tiles=(32, 128), lanes=16).attrs[attention.KERNEL_ATTR + ".tiles"]) == "1x128"


def _fused(model: str, dims: str, without=frozenset()):
    """The fused attention specs and the ops left in main, of a fixture built to fuse-attention."""
    from blockforge.compile.pipeline import run_phases
    from blockforge.compile.session import open_model
    from blockforge.targets import resolve

    host = resolve("host")
    path = FIXTURES / model
    mod, _ = run_phases(open_model(path, host, dims).relax(), host, stop_after="fuse-attention", without=without)
    ops = [getattr(getattr(b.value, "op", None), "name", None) for blk in mod["main"].body.blocks for b in blk.bindings]
    return attention.kernel_specs(mod), ops


@pytest.mark.parametrize("model", ["gpt2_past_legacy_op17.onnx", "llama_past_legacy_op17.onnx"])
def test_decode_step_reads_the_cached_keys_untransposed(model):
    """At seq = 1 the kernel reads K (B, H, P+1, d) as the cache holds it: no per-step
    transpose copying the whole cached K to K^T (GPT-2 small at P = 512: 19 MB read and
    written per token); GQA (Llama) reads the kv heads so too. A prompt (seq 5) keeps K^T,
    where the register-tiled K^T micro-kernel is the faster one."""
    step, step_ops = _fused(model, "batch=1,seq=1,past=17,past_seq=18")
    assert step and {s.k for s in step} == {"bhsd"}, step
    prompt, prompt_ops = _fused(model, "batch=1,seq=5,past=17,past_seq=22")
    assert prompt and {s.k for s in prompt} == {"bhds"}, prompt
    # one K^T transpose per layer less (Llama's Q/K rotary keeps its own permutes)
    layers = sum(1 for o in onnx.load(str(FIXTURES / model)).graph.output if o.name.endswith(".key"))
    assert prompt_ops.count("relax.permute_dims") - step_ops.count("relax.permute_dims") == layers
    kt, _ = _fused(model, "batch=1,seq=1,past=17,past_seq=18", without={"attention-key-rows"})
    assert {s.k for s in kt} == {"bhds"}, "the ablation keeps K^T"
