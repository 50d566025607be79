# The container image (issue 22). Included by the Makefile (`-include mk/*.mk`).
#   make image [IMAGE=cosyvoice-lite] [BASE=auto|official|debian|<image>]   build docker/Dockerfile with docker (when
#       its daemon answers) or podman; BASE=auto: python:3.11-slim-bookworm when a registry gives it, else a Debian 12
#       base made with mmdebstrap (no registry needed)
#   make image-test [IMAGE_TEST_BASE=debian]   build it and run tests/test_image.py against the container (make test
#       runs the same file); prints test-artifacts/image/measurements.json
IMAGE           ?= cosyvoice-lite
BASE            ?= auto
IMAGE_TEST_BASE ?= debian

.PHONY: image image-test

image:
	$(PY) scripts/container_image.py build --tag $(IMAGE) --base $(BASE)

image-test: $(VENV)/.dev
	SKIP_SYSTEM_DEPS=$(SKIP_SYSTEM_DEPS) bash scripts/install_test_deps.sh
	IMAGE_TEST_BASE=$(IMAGE_TEST_BASE) $(BIN)/python -m pytest -q -p no:cacheprovider -rs tests/test_image.py $(PYTEST_ARGS)
	@cat test-artifacts/image/measurements.json
