# One virtualenv (.venv) for every target. `make run` installs serving deps only (no torch);
# `make test` installs the export/dev set (torch==2.13.0 pinned) and the test servers (redis, nginx, chromium).
# `make test SKIP_SYSTEM_DEPS=1 PYTEST_ARGS='-m "not integration and not browser"'` needs neither root nor those servers.
PY        ?= python3
VENV      := .venv
BIN       := $(VENV)/bin
PIP       := $(BIN)/python -m pip install -q --disable-pip-version-check
HOST      ?= 127.0.0.1
PORT      ?= 8000
GRPC_PORT ?= $(or $(TTS_GRPC_PORT),50000)
MODEL_DIR ?= models/tiny
REF       ?= tests/reference
PYTEST_ARGS ?=
SKIP_SYSTEM_DEPS ?=
# CPU-only torch wheels (pip's --extra-index-url for the installs that bring torch; docker/Dockerfile has the same ARG).
# Without it pip on Linux takes the multi-GB CUDA build of the pinned torch. Left out, with a notice, when it does
# not answer (pip would retry it for every package); empty = pip's configured indexes only.
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu

.PHONY: run test check lint typecheck export bench bench-engine loadtest soak clean-bench native

# Our native kernels (service/engine/native: the kit's operators and CPU probe; service/layers/native: the fused layers
# families share; service/families/*/native: a family's own), built by scripts/build_native.sh as the image builds them. Optional: without a C compiler it prints a
# notice and the engine runs ONNX Runtime's graphs.
NATIVE_LIB := service/engine/native/libcosyvoice_lite_native.so

native: $(NATIVE_LIB)

$(NATIVE_LIB): $(wildcard service/engine/native/*.c service/engine/native/*.h service/layers/native/*.c service/layers/native/*.h \
		service/families/*/native/*.c service/families/*/native/*.h) \
		scripts/build_native.sh
	sh scripts/build_native.sh

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.lite: requirements-lite.txt | $(BIN)/python
	$(PIP) -r requirements-lite.txt
	touch $@

$(VENV)/.dev: requirements-lite.txt requirements-export.txt requirements-dev.txt requirements-pipecat.txt | $(BIN)/python
	index="$$($(BIN)/python scripts/pip_index_args.py '$(TORCH_INDEX_URL)')" && $(PIP) $$index -r requirements-dev.txt
	$(PIP) --no-deps --upgrade --target $(VENV)/pipecat -r requirements-pipecat.txt
	touch $@ $(VENV)/.lite

run: $(VENV)/.lite native
	TTS_HOST=$(HOST) TTS_PORT=$(PORT) TTS_GRPC_PORT=$(GRPC_PORT) TTS_MODEL_DIR=$(MODEL_DIR) $(BIN)/python -m service.api

test: $(VENV)/.dev native
	SKIP_SYSTEM_DEPS=$(SKIP_SYSTEM_DEPS) bash scripts/install_test_deps.sh
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(VENV)/.dev
	$(BIN)/ruff check service export tests loadtest scripts $(wildcard examples)

# Strict on service/ (pyproject.toml: [[tool.mypy.overrides]]).
typecheck: $(VENV)/.dev
	$(BIN)/mypy service

check: lint typecheck test

# Export an official checkpoint: make export CHECKPOINT=/path/to/CosyVoice-300M-SFT OUT=models/cosyvoice-300m-sft
CHECKPOINT ?= pretrained_models/CosyVoice-300M-SFT
OUT        ?= models/cosyvoice-300m-sft
export: $(VENV)/.dev
	$(BIN)/python export/export_onnx.py --model-dir $(CHECKPOINT) --out $(OUT) --verify --quantize int8

# The committed tiny bundle, reproduced bit for bit from the reference checkpoint (tests/test_export_cli.py
# re-exports with TINY_FLAGS). It declares instruct: the reference fixtures include official instruct runs on it.
TINY_NAME  := CosyVoice-300M-SFT-tiny-random
TINY_FLAGS := --verify --test-model --instruct --model-name $(TINY_NAME)
models/tiny: $(VENV)/.dev
	$(BIN)/python export/export_onnx.py --model-dir $(REF)/tiny --out models/tiny $(TINY_FLAGS) --tokenizer $(REF)/tiny/multilingual.tiktoken

# The committed tiny CosyVoice2 bundle (`make run MODEL_DIR=models/tiny-cosyvoice2`): the int8 export of the reference
# checkpoint tests/reference/tiny-cosyvoice2 (55 MB on disk where the fp32 export takes 89 MB), audio is noise.
TINY2_NAME := CosyVoice2-0.5B-tiny-random
models/tiny-cosyvoice2: $(VENV)/.dev
	rm -rf models/.tiny-cosyvoice2.tmp
	$(BIN)/python export/export_onnx.py --model-dir $(REF)/tiny-cosyvoice2 --out models/.tiny-cosyvoice2.tmp/bundle \
		--verify --test-model --quantize int8 --model-name $(TINY2_NAME)
	rm -rf models/tiny-cosyvoice2 && mv models/.tiny-cosyvoice2.tmp/bundle-int8 models/tiny-cosyvoice2
	rm -rf models/.tiny-cosyvoice2.tmp

# The committed tiny Fun-CosyVoice3 bundle (`make run MODEL_DIR=models/tiny-cosyvoice3`): the int8 export of the reference
# checkpoint tests/reference/tiny-cosyvoice3 (22 MB on disk), audio is noise.
TINY3_NAME := Fun-CosyVoice3-0.5B-tiny-random
models/tiny-cosyvoice3: $(VENV)/.dev
	rm -rf models/.tiny-cosyvoice3.tmp
	$(BIN)/python export/export_onnx.py --model-dir $(REF)/tiny-cosyvoice3 --out models/.tiny-cosyvoice3.tmp/bundle \
		--verify --test-model --quantize int8 --model-name $(TINY3_NAME)
	rm -rf models/tiny-cosyvoice3 && mv models/.tiny-cosyvoice3.tmp/bundle-int8 models/tiny-cosyvoice3
	rm -rf models/.tiny-cosyvoice3.tmp

# Fragments: benchmarks (mk/bench.mk) and deployment/load tests (mk/deploy.mk).
-include mk/*.mk
