# Deployment targets, included by the Makefile (`include mk/deploy.mk`). Neither runs in CI.
#   make loadtest USERS=16 DURATION=2m [TARGET=http://127.0.0.1:8000]   headless Locust against a running server
#   make soak [MODEL_DIR=models/tiny-cosyvoice2] [SOAK_DURATION_S=300]  starts its own app, fails on idle RSS growth >= 5 %
#             [SOAK_ARGS="--set TTS_ACOUSTIC_BACKEND=openvino"]         (more options: python scripts/soak.py --help)
# Start the server for a load test with `make run` (rate limit off: TTS_RATE_LIMIT_PER_MINUTE=0), or point
# TARGET at nginx / an ingress. Reports: test-artifacts/loadtest/{tts_stats.csv,…,report.html}, test-artifacts/soak/.
USERS           ?= 8
SPAWN_RATE      ?= 2
DURATION        ?= 60s
TARGET          ?= http://$(HOST):$(PORT)
LOADTEST_OUT    ?= test-artifacts/loadtest
SOAK_DURATION_S ?= 300
SOAK_USERS      ?= 4
SOAK_OUT        ?= test-artifacts/soak
SOAK_ARGS       ?=

.PHONY: loadtest soak

loadtest: $(VENV)/.dev
	@$(BIN)/python -c "import sys, urllib.request; urllib.request.urlopen('$(TARGET)/healthz', timeout=5)" 2>/dev/null \
		|| { echo "loadtest: nothing answers at $(TARGET)/healthz; start the server (make run) or set TARGET=" >&2; exit 1; }
	mkdir -p $(LOADTEST_OUT)
	$(BIN)/locust -f loadtest/locustfile.py --headless --host $(TARGET) --users $(USERS) --spawn-rate $(SPAWN_RATE) \
		--run-time $(DURATION) --stop-timeout 30 --csv $(LOADTEST_OUT)/tts --html $(LOADTEST_OUT)/report.html --only-summary

soak: $(VENV)/.dev
	$(BIN)/python scripts/soak.py --duration-s $(SOAK_DURATION_S) --users $(SOAK_USERS) --model-dir $(MODEL_DIR) --out $(SOAK_OUT) \
		$(SOAK_ARGS)
