# Parity on a second size, not committed (CosyVoice2 and Fun-CosyVoice3). Included by the Makefile (`-include mk/*.mk`).
# Not run by CI: it needs the official CosyVoice checkout at ace7c47 and an environment with torch and the official deps
# (tests/reference/tiny-cosyvoice3/README.md, "Environment"). For each family: a random checkpoint of PARITY_SIZE built by
# the official classes, the official code's fixtures written beside it (as in tests/reference/tiny-cosyvoice*), our
# fp32 export (--verify), then `service verify`; the target fails when any check is beyond tolerance.
#   make parity-medium OFFICIAL=/tmp/CosyVoice OFFICIAL_PY=venv-official/bin/python OFFICIAL_WHEELS=wheels
#       [PARITY_SIZE=medium] [PARITY_OUT=/tmp/parity] [PARITY_THREADS=1]   (-j2: both families side by side)
#   make parity-medium-cosyvoice2 (or -cosyvoice3): one family
# The official side runs on one torch thread, as for the committed fixtures: the builder scales each weight by its
# default init's std, a threaded sum whose last bits (at medium size, the text embedding's) follow the thread count.
# PARITY_THREADS is for our export and verify only.
# OFFICIAL_WHEELS holds the torchaudio, dashscope and WeTextProcessing wheels the README's `pip download` fetches.
OFFICIAL        ?=
OFFICIAL_PY     ?= venv-official/bin/python
OFFICIAL_WHEELS ?= wheels
PARITY_SIZE     ?= medium
PARITY_OUT      ?= /tmp/parity
PARITY_THREADS  ?= 1
PARITY_DEFAULT_PROMPTS := $(REF)/tiny/prompts
parity_wheel = $(or $(firstword $(wildcard $(OFFICIAL_WHEELS)/$(1))),$(error parity: no $(1) in OFFICIAL_WHEELS=$(OFFICIAL_WHEELS)))

.PHONY: parity-medium
parity-medium: parity-medium-cosyvoice2 parity-medium-cosyvoice3

# $* is the family's version (2 or 3): scripts/cosyvoice$*_checkpoint.py, cosyvoice$*_fixtures.py.
parity-medium-cosyvoice%: DIR = $(PARITY_OUT)/cosyvoice$*-$(PARITY_SIZE)
parity-medium-cosyvoice%: $(VENV)/.dev
	@test -d "$(OFFICIAL)/cosyvoice" || { echo "parity-medium: set OFFICIAL= to the official checkout at ace7c47" >&2; exit 2; }
	rm -rf $(DIR) && mkdir -p $(DIR)/checkpoint/prompts && cp $(PARITY_DEFAULT_PROMPTS)/*.wav $(DIR)/checkpoint/prompts/
	OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 $(OFFICIAL_PY) scripts/cosyvoice$*_checkpoint.py build \
		--official $(OFFICIAL) --size $(PARITY_SIZE) --seed 0 --out $(DIR)/checkpoint \
		--qwen-ranks $(call parity_wheel,dashscope-*.whl) --torchaudio-wheel $(call parity_wheel,torchaudio-*.whl)
	OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 $(OFFICIAL_PY) scripts/cosyvoice$*_fixtures.py \
		--official $(OFFICIAL) --checkpoint $(DIR)/checkpoint --prompts $(DIR)/checkpoint/prompts --out $(DIR)/checkpoint \
		--torchaudio-wheel $(call parity_wheel,torchaudio-*.whl) --wetext-rules $(call parity_wheel,wetextprocessing-*.whl) \
		--threads 1 --no-repeat
	OMP_NUM_THREADS=$(PARITY_THREADS) $(BIN)/python export/export_onnx.py --model-dir $(DIR)/checkpoint --out $(DIR)/bundle \
		--verify --test-model --threads $(PARITY_THREADS)
	$(BIN)/python -m service verify --bundle $(DIR)/bundle --fixtures $(DIR)/checkpoint --threads $(PARITY_THREADS) \
		> $(DIR)/verify.txt; status=$$?; grep -v ' ok$$' $(DIR)/verify.txt; exit $$status
