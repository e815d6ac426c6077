#!/usr/bin/env bash
# Runs the benchmark suite. OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE are unset for this
# command alone: this machine image sets them to force old (Haswell) OpenBLAS kernels,
# which would understate the numpy SGEMM ceiling the report compares against.
set -euo pipefail
cd "$(dirname "$0")/.."
make -s install >/dev/null
exec env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/run.py "$@"
