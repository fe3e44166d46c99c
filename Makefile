# Two entry points, both self-contained on a fresh machine:
#   make demo   creates .venv, installs, writes the bundled tiny drafter + target, validates them and
#               plans the build (graph passes, KV cache, memory), dumping the graph after every pass
#   make test   creates .venv, installs, lints and runs the test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
DEMO   := artifacts/demo

.PHONY: demo test lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[compile,runtime,dev]'
	touch $(STAMP)

demo: $(STAMP)
	rm -rf $(DEMO)
	$(VENV)/bin/dflash-compile make-example tiny-dflash $(DEMO)/checkpoint --seed 0
	$(VENV)/bin/dflash-compile validate $(DEMO)/checkpoint/drafter --target-model $(DEMO)/checkpoint/target
	$(VENV)/bin/dflash-compile plan $(DEMO)/checkpoint/drafter --target-model $(DEMO)/checkpoint/target \
		--max-batch 4 --max-seq-len 1024 --dump-dir $(DEMO)/graphs

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) artifacts/*/ .pytest_cache .ruff_cache
