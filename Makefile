# Two commands on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
BF := $(BIN)/blockforge
DEPS_STAMP := $(VENV)/.deps-installed
DEMO := artifacts/demo
SHIPPED := artifacts/shipped/tuning/x86-64-avx512
# Benchmarks only: this machine image forces old OpenBLAS kernels (OPENBLAS_CORETYPE),
# which would understate the SGEMM ceiling the bench table compares against.
NOBLAS := env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE
PYTEST_ARGS ?=

# The fast tier: unit and in-process tests (no tuning, no cross builds, no wheel, few TVM
# builds), for the loop after an edit. `make check` runs them against the source tree, not the
# installed copy: tests/devtree.py lays the package-dir mapping out as links under
# build/dev-src and PYTHONPATH puts it first (the CLI and isolation children see it too), so an
# edit is tested at once, nothing reinstalled. Tests marked slow are left to `make test`.
# Picked by measured time per file (`pytest --durations=0` of the whole suite).
DEV_SRC := build/dev-src
# `make test` and `make check` run two pytest-xdist workers (TEST_WORKERS=1: one process), each
# taking a whole file at a time (its module fixtures built once; files marked slow as a whole
# first: tests/conftest.py).
TEST_WORKERS ?= 2
XDIST := $(if $(filter-out 0 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
CHECK_TESTS := tests/test_architecture.py tests/test_spec.py tests/test_targets.py \
	tests/test_graph_structure.py tests/test_graph_parity.py tests/test_tolerance_report.py \
	tests/test_skip_summary.py tests/test_devtree.py tests/test_schedules.py tests/test_schedule_ir.py tests/test_ablations.py \
	tests/test_artifacts.py tests/test_bench.py tests/test_records_cpu.py tests/test_cli_graph.py \
	tests/test_attention_fusion.py tests/robustness/test_outputs.py tests/robustness/test_fuzz.py \
	tests/robustness/test_fp16_overflow.py tests/test_library_errors.py tests/test_tune_intrinsics.py \
	tests/test_window_allocs.py tests/test_rewrite_functions.py tests/test_i8mm_gemm.py tests/test_nan_guard.py \
	tests/test_dim_bounds.py tests/robustness/test_stale_roots.py tests/test_maddubs_gemm.py tests/test_depthwise.py \
	tests/test_frontend_ops.py

.PHONY: demo test check test-long fuzz-edge install clean robustness bench onnx-backend bench-peers

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Dependencies change rarely: installed once per pyproject.toml change.
$(DEPS_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --upgrade pip "setuptools>=77" wheel
	$(BIN)/pip install -q ".[test,bench]"
	touch $@

# The package itself is reinstalled (not editable) every time: tests import the
# installed blockforge.* namespace, proving the package-dir mapping.
install: $(DEPS_STAMP)
	$(BIN)/pip install -q --no-deps --no-build-isolation --force-reinstall .

demo: install
	@mkdir -p $(DEMO)
	$(BF) export mha --d-model 768 --heads 12 -o $(DEMO)/mha_bert.onnx
	$(BF) export ffn --d-model 768 --d-ff 3072 --activation gelu -o $(DEMO)/ffn_bert.onnx
	$(BF) verify $(DEMO)/mha_bert.onnx --shape batch=1,seq=128
	$(BF) verify $(DEMO)/ffn_bert.onnx --shape batch=1,seq=128
	$(BF) compile $(DEMO)/mha_bert.onnx --target host --shape batch=1,seq=128 -o $(DEMO)/mha_bert.host
	$(BF) compile $(DEMO)/ffn_bert.onnx --target host --shape batch=1,seq=128 -o $(DEMO)/ffn_bert.host
	$(BF) verify $(DEMO)/mha_bert.onnx --target host --shape batch=1,seq=128
	$(BF) verify $(DEMO)/ffn_bert.onnx --target host --shape batch=1,seq=128
	@echo "== short tuning run (8 trials per task; a full tune: --trials-per-task 256 or more)"
	$(BF) tune $(DEMO)/ffn_bert.onnx --target host --shape batch=1,seq=128 --trials-per-task 8 --tuning-db $(DEMO)/tuning
	$(BF) tune $(DEMO)/mha_bert.onnx --target host --shape batch=1,seq=128 --trials-per-task 4 --tuning-db $(DEMO)/tuning
	$(BF) verify $(DEMO)/ffn_bert.onnx --target host --shape batch=1,seq=128 --tuning-db $(DEMO)/tuning
	@echo "== ONNX Runtime vs blockforge untuned vs tuned"
	$(NOBLAS) $(BF) bench $(DEMO)/mha_bert.onnx --shape batch=1,seq=128 --tuning-db $(DEMO)/tuning --repeat 20
	$(NOBLAS) $(BF) bench $(DEMO)/ffn_bert.onnx --shape batch=1,seq=128 --tuning-db $(DEMO)/tuning --repeat 20
	@if $(BIN)/python -c "import sys; from blockforge.targets import resolve; sys.exit(resolve('x86-64-avx512').run_problem() is not None)"; then \
	  echo "== with the shipped records for x86-64-avx512 (benchmarks/ship_records.py), re-checked on this CPU first"; \
	  rm -rf $(DEMO)/shipped-tuning && cp -r $(SHIPPED) $(DEMO)/shipped-tuning && \
	  $(BF) tune $(DEMO)/mha_bert.onnx --target x86-64-avx512 --shape batch=1,seq=128 --tuning-db $(DEMO)/shipped-tuning --check-only --no-progress && \
	  $(BF) tune $(DEMO)/ffn_bert.onnx --target x86-64-avx512 --shape batch=1,seq=128 --tuning-db $(DEMO)/shipped-tuning --check-only --no-progress && \
	  $(NOBLAS) $(BF) bench $(DEMO)/mha_bert.onnx --target x86-64-avx512 --shape batch=1,seq=128 --tuning-db $(DEMO)/shipped-tuning --repeat 20 && \
	  $(NOBLAS) $(BF) bench $(DEMO)/ffn_bert.onnx --target x86-64-avx512 --shape batch=1,seq=128 --tuning-db $(DEMO)/shipped-tuning --repeat 20; \
	else echo "(this CPU has no AVX-512: the shipped x86-64-avx512 records are not used)"; fi

# The aarch64 edge tests' Debian packages are installed first where that is possible (root and
# apt-get; EDGE_DEPS=0 skips it). The last thing printed is which test groups were skipped and
# what enables each (tests/conftest.py). pytest exits 5 when it collected nothing: a failure.
SKIP_SUMMARY := build/skipped-groups.txt
# The 40 slowest tests are printed too: the clean-clone run is the one profile that counts.
DURATIONS ?= --durations=40
test: install
	@set +e; status=$$(.ci/edge-deps); rm -f $(SKIP_SUMMARY); \
	EDGE_DEPS_STATUS="$$status" $(BIN)/pytest $(XDIST) --skip-summary $(SKIP_SUMMARY) $(DURATIONS) $(PYTEST_ARGS); rc=$$?; \
	if [ -s $(SKIP_SUMMARY) ]; then cat $(SKIP_SUMMARY); fi; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

check: $(DEPS_STAMP)
	@$(BIN)/python tests/devtree.py $(DEV_SRC) >/dev/null
	PYTHONPATH=$(CURDIR)/$(DEV_SRC) $(BIN)/python -m pytest -q $(XDIST) -m "not slow and not long" $(CHECK_TESTS) $(PYTEST_ARGS)

# Tests too long for `make test` (tuning a whole real export: ~11 min on 2 cores).
# The edge app's parser fuzz and the .npz fuzz of `run`, longer than make test's 20 s.
fuzz-edge: install
	EDGE_FUZZ_SECONDS=600 EDGE_FUZZ_NPZ=3000 $(BIN)/pytest tests/robustness/test_edge_fuzz.py -s

test-long: install
	$(BIN)/pytest -m long

clean:
	rm -rf $(VENV) build *.egg-info artifacts/demo artifacts/logs

# The robustness figures quoted in the README (bad-input cases, fuzz inputs, kill points).
robustness: install
	$(BIN)/pytest tests/robustness -v -s

# The benchmark suite (long; not part of `make test`). TRIALS=N tunes first.
TRIALS ?= 0
bench: install
	benchmarks/run.sh --trials-per-task $(TRIALS)

# ONNX's node conformance cases for the transformer op set through the blockforge ONNX
# backend, every case (`make test` runs a subset); skips list each exclusion's reason.
onnx-backend: install
	ONNX_BACKEND_CASES=all $(BIN)/pytest -q -rs tests/test_onnx_backend.py -k test_node_case

# The peer table (benchmarks/peers.py): BERT-base MHA/FFN/block against ORT, ORT's fused
# kernels and OpenVINO (long; not part of `make test`). PEERS_ARGS="--repeat 20 --only mha".
PEERS_STAMP := $(VENV)/.peers-installed
PEERS_ARGS ?=
$(PEERS_STAMP): pyproject.toml | $(DEPS_STAMP)
	$(BIN)/pip install -q ".[bench,peers]"
	touch $@

bench-peers: install $(PEERS_STAMP)
	$(NOBLAS) $(BIN)/python benchmarks/peers.py $(PEERS_ARGS)
