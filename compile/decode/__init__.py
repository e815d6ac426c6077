"""Decoding: which present output feeds which past input (the pairing, recorded in the
manifest at compile time and checked before a loop runs), and the greedy decode loop."""

from blockforge.compile.decode.loop import DecodeOptions, DecodeResult, StepRecord, decode
from blockforge.compile.decode.pairing import CachePair, DecodePairing, TokenFeed, infer_pairing, pairing_for_run

__all__ = ["CachePair", "DecodeOptions", "DecodePairing", "DecodeResult", "StepRecord", "TokenFeed", "decode",
           "infer_pairing", "pairing_for_run"]
