"""Benchmarking: contenders (ONNX Runtime, blockforge untuned and tuned) measured side by
side in one process, interleaved, at equal threads; reports as markdown, JSON and PNG."""

from .harness import CONTENDERS, SCHEMA, BenchOptions, BenchReport, bench, measure_interleaved, plot

__all__ = ["CONTENDERS", "SCHEMA", "BenchOptions", "BenchReport", "bench", "measure_interleaved", "plot"]
