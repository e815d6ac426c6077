"""Convolutions at GEMM speed on CPU: rewrite.py (conv -> im2col + packed GEMM), schedule.py
(the im2col's schedule; the GEMM is cpu_schedule.CPUMatmul's)."""
