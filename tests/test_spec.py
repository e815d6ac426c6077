"""Specs validate on construction with clear messages."""

import pytest

from blockforge.errors import BlockforgeError
from blockforge.graph import BlockSpec, FFNSpec, MHASpec, spec_from_dict


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(d_model=100, heads=8), "divisible by heads"),
    (dict(d_model=0), "positive"),
    (dict(d_model=-8, heads=2), "positive"),
    (dict(heads=0), "positive"),
    (dict(d_model=2.5), "integer"),
    (dict(dtype="bfloat16"), "unknown dtype"),
    (dict(layout="fused"), "unknown layout"),
    (dict(mask="float"), "unknown mask"),
    (dict(opset=9), "opset"),
    (dict(opset=99), "opset"),
    (dict(seq=0), "seq"),
    (dict(batch=-1), "batch"),
    (dict(kv_seq=0), "kv_seq"),
    (dict(causal=True, cross=True), "causal"),
    (dict(causal=True, kv_seq=12), "causal"),
    (dict(d_model=65536, heads=8), "GiB"),
    (dict(d_model=1 << 20, heads=8), "exceeds"),
    (dict(seed=-1), "seed"),
    (dict(bias="yes"), "bias"),
])
def test_bad_mha_spec(kwargs, fragment):
    with pytest.raises(BlockforgeError, match="(?i)" + fragment):
        MHASpec(**kwargs)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(activation="swish"), "unknown activation"),
    (dict(d_ff=0), "d_ff"),
    (dict(d_model=16384, d_ff=65536), "GiB"),
])
def test_bad_ffn_spec(kwargs, fragment):
    with pytest.raises(BlockforgeError, match="(?i)" + fragment):
        FFNSpec(**kwargs)


def test_bad_block_spec():
    with pytest.raises(BlockforgeError, match="unknown norm"):
        BlockSpec(norm="mid")
    with pytest.raises(BlockforgeError, match="divisible"):
        BlockSpec(d_model=30, heads=4)


def test_defaults_and_roundtrip():
    f = FFNSpec(d_model=96)
    assert f.d_ff == 384
    m = MHASpec(d_model=96, heads=4, kv_seq=7)
    assert m.cross and m.d_k == 24
    for s in (f, m, BlockSpec(d_model=32, heads=2, norm="post")):
        assert spec_from_dict(s.to_dict()) == s


def test_spec_from_dict_rejects_unknown():
    with pytest.raises(BlockforgeError, match="unknown block kind"):
        spec_from_dict({"kind": "conv"})
    with pytest.raises(BlockforgeError, match="unknown mha spec field"):
        spec_from_dict({"kind": "mha", "dmodel": 4})
