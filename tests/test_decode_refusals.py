"""Decoder inputs refused before TVM (issue #21, compile/decode/inputs.py): a dim of 0 anywhere
but a decoder's past length, and an attention mask whose length is not past + seq. Before, the
prelude handed both to TVM (its importer failed on ConstantOfShape) and an artifact ran them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from blockforge.errors import ArgumentError
from conftest import assert_user_error, run_cli_in_process, save_npz
from decode_models import tiny_lm

GPT2 = Path(__file__).parent / "fixtures" / "models" / "gpt2_past_legacy_op17.onnx"


def _feeds(seq: int, past: int, mask: int | None = None, batch: int = 1) -> dict[str, np.ndarray]:
    d = {"input_ids": np.ones((batch, seq), np.int64),
         "attention_mask": np.ones((batch, past + seq if mask is None else mask), np.int64)}
    for i in range(2):
        for w in ("key", "value"):
            d[f"past_key_values.{i}.{w}"] = np.zeros((batch, 4, past, 8), np.float32)
    return d


def _bind(feeds):
    from blockforge.compile import open_model

    return open_model(GPT2, None, None, input_shapes={k: v.shape for k, v in feeds.items()}, prepare=False)


@pytest.mark.parametrize("feeds, says", [
    (_feeds(0, 3), "binds dim 'seq' (input_ids axis 1) to 0"),
    (_feeds(2, 0, batch=0), "binds dim 'batch' (input_ids axis 0) to 0"),
    (_feeds(2, 3, mask=9), "attention_mask has length 9, but a decoder's mask spans the cache and the new "
                           "positions: past + seq = 3 + 2 = 5"),
], ids=["seq0", "batch0", "mask-length"])
def test_prelude_refuses(feeds, says, tmp_path):
    with pytest.raises(ArgumentError) as info:
        _bind(feeds)
    assert info.value.argument == "inputs" and says in str(info.value) and "--" not in str(info.value)
    z = save_npz(tmp_path / "in.npz", **feeds)
    assert_user_error(run_cli_in_process("verify", GPT2, "--target", "host", "--inputs", z, cwd=tmp_path),
                      "--inputs", says)


def test_mask_length_from_shape():
    from blockforge.compile import open_model

    with pytest.raises(ArgumentError, match=r"past \+ seq = 3 \+ 2 = 5") as info:
        open_model(GPT2, None, "batch=1,seq=2,past=3,past_seq=9", prepare=False)
    assert info.value.argument == "shape"


def test_empty_cache_still_binds():
    """P = 0 (the prompt step) is a legal decode start; its mask spans seq alone."""
    assert _bind(_feeds(2, 0)).binding.as_dict() == {"batch": 1, "seq": 2, "past_seq": 2, "past": 0}
    assert _bind(_feeds(2, 3)).binding.as_dict()["past_seq"] == 5


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm")
    tiny_lm(d / "lm.onnx")
    res = run_cli_in_process("compile", "lm.onnx", "--target", "host", "--shape", "batch=1", "-o", "lm.host", cwd=d)
    assert res.rc == 0, res.err
    return d


def _lm_inputs(d: Path, seq: int, mask: int, past: int) -> Path:
    from decode_models import D

    arrays = {"input_ids": np.ones((1, seq), np.int64), "attention_mask": np.ones((1, mask), np.int64),
              "position_ids": np.arange(seq, dtype=np.int64)[None]}
    if past:
        arrays |= {f"past_key_values.0.{w}": np.zeros((1, 1, past, D), np.float32) for w in ("key", "value")}
    return save_npz(d / f"in-{seq}-{mask}-{past}.npz", **arrays)


def test_artifact_run_refuses_mask_length(lm):
    z = _lm_inputs(lm, 2, 7, 3)
    assert_user_error(run_cli_in_process("run", "lm.host", "--inputs", z, "--output", "o.npz", cwd=lm),
                                 "--inputs: attention_mask has length 7", "past + seq = 3 + 2 = 5")
    assert not (lm / "o.npz").exists()
    assert run_cli_in_process("run", "lm.host", "--inputs", _lm_inputs(lm, 2, 5, 3), "--output", "o.npz",
                              cwd=lm).rc == 0


def test_decode_loop_refuses_mask_length(lm):
    """The prompt's cache left out (P = 0): its mask must span the prompt alone."""
    assert_user_error(run_cli_in_process("run", "lm.host", "--inputs", _lm_inputs(lm, 4, 6, 0), "--decode", "3",
                                         cwd=lm),
                                 "attention_mask has length 6", "past + seq = 0 + 4 = 4")
    assert run_cli_in_process("run", "lm.host", "--inputs", _lm_inputs(lm, 4, 4, 0), "--decode", "3", cwd=lm).rc == 0
