# Everything a fresh machine needs: `make run` (the main job) and `make test` (the suite).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.omnidit-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install run test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

# The main job. Until the embedded default model lands, it builds a random-weight
# `small` FLUX checkpoint and generates with it.
run: install
	test -f out/flux-small/model_index.json || $(BIN)/omnidit make-random flux small out/flux-small
	$(BIN)/omnidit generate out/flux-small "a photo of a cat" --size 256x256 --steps 8 -o out/omnidit.png

test: install
	$(BIN)/python -m pytest -q tests

bench: install
	$(BIN)/python -m benchmarks.engine_throughput --quick

clean:
	rm -rf $(VENV) out
