# Benchmarks (issue 6). Included by the Makefile (`-include mk/*.mk`).
#   make bench          full run: builds models/full-random{,-int8,-int4} once (cached, git-ignored), then
#                       loadtest/bench.py writes docs/benchmarks/results.json, summary.png and docs/benchmarks.md
#   make bench-engine   quick engine-only look: single-stream RTF and stages of every bundle, no HTTP, no reference
# BENCH_ARGS passes options through, e.g. `make bench BENCH_ARGS="--parts single latency --reps 5"`.
BENCH_ARGS ?=

bench: $(VENV)/.dev native
	$(BIN)/python loadtest/bench.py $(BENCH_ARGS)

bench-engine: $(VENV)/.dev native
	$(BIN)/python loadtest/bench.py --parts single latency --merge $(BENCH_ARGS)
