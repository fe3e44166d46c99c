# Two entry points, both self-contained on a fresh machine:
#   make demo   creates .venv, installs, writes the bundled tiny drafter + target, validates them and
#               compiles the artifact (graph passes, kernels, cubin, packed weights) for the local GPU,
#               or for the default target sm_121 on a machine without one; with a GPU it then runs it
#               against the numpy reference
#   make test   creates .venv, installs, lints and runs the test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
DEMO   := artifacts/demo
HAS_GPU := $(PY) -c "from dflash_compiler.targets import device_compute_capability as d; d()" 2>/dev/null

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
	$(VENV)/bin/dflash-compile compile $(DEMO)/checkpoint/drafter --target-model $(DEMO)/checkpoint/target \
		--target $$($(HAS_GPU) && echo auto || echo sm_121) --max-batch 4 --max-seq-len 1024 \
		--dump-dir $(DEMO)/graphs -o $(DEMO)/tiny-dflash
	if $(HAS_GPU); then $(VENV)/bin/dflash-compile run $(DEMO)/tiny-dflash --drafter $(DEMO)/checkpoint/drafter \
		--target-model $(DEMO)/checkpoint/target; else echo "no GPU here: artifact built, not run"; fi

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) artifacts/*/ .pytest_cache .ruff_cache
