"""Benchmarking: contenders (ONNX Runtime, ORT's fused kernels, OpenVINO, blockforge untuned
and tuned) measured side by side in one process, interleaved, at equal threads; reports give
each one's ratio to the best peer, as markdown, JSON and PNG."""

from .contenders import CONTENDERS, PEERS, REGISTRY
from .harness import BenchOptions, bench, measure_interleaved
from .report import SCHEMA, BenchReport, plot, summarize

__all__ = ["CONTENDERS", "PEERS", "REGISTRY", "SCHEMA", "BenchOptions", "BenchReport", "bench",
           "measure_interleaved", "plot", "summarize"]
