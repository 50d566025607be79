# Benchmarks (issue 6). Included by the Makefile (`-include mk/*.mk`).
#   make bench          full run: builds the full-size random-init bundles once (cached, git-ignored), then
#                       loadtest/bench.py writes docs/benchmarks/results.json, and from it alone docs/benchmarks.md,
#                       its plots and the README's per-family tables (loadtest/bench_report.py)
#   make bench-engine   quick engine-only look: single-stream RTF and stages of every bundle, no HTTP, no reference
#   make bench-report   rewrites docs/benchmarks.md, the plots and the README's tables from results.json (no measuring)
# BENCH_ARGS passes options through, e.g. `make bench BENCH_ARGS="--parts single latency --reps 5"`.
BENCH_ARGS ?=

bench: $(VENV)/.dev native
	$(BIN)/python loadtest/bench.py $(BENCH_ARGS)

bench-engine: $(VENV)/.dev native
	$(BIN)/python loadtest/bench.py --parts single latency --merge $(BENCH_ARGS)

.PHONY: bench-report
bench-report: $(VENV)/.dev
	$(BIN)/python loadtest/bench_report.py
