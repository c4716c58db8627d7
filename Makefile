# The whole set-up is two commands: `make demo` and `make test` (each creates the venv if missing).
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel, pinned: an unpinned torch would pull a CUDA build of several GB. GPU clusters
# install their own CUDA torch instead (README, "On a GPU cluster").
TORCH_CPU ?= torch==2.13.0

.PHONY: setup demo test clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_CPU)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

# Every `make demo` trains afresh into runs/demo (the README's next commands read it); an earlier
# demo run there is moved aside first, kept, since a fresh run never overwrites a run's history.
demo: setup
	@if [ -e runs/demo ]; then kept=runs/demo-$$(date +%Y%m%d-%H%M%S); mv runs/demo $$kept; \
	  echo "The previous demo run is kept in $$kept."; fi
	$(VENV)/bin/tetrad train configs/demo.toml --run.dir=runs/demo
	@echo "The tetrad command lives in $(VENV)/bin: run 'source $(VENV)/bin/activate' to put it on PATH."

# Tests run on as many pytest workers as the machine has cores, up to 4 (each test's ranks are
# processes of their own, one thread each): on CI's 2 cores the suite takes about two thirds of
# its one-worker time. worksteal: a worker that runs out takes the rest of another's queue.
test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n auto --maxprocesses=4 --dist worksteal

clean:
	rm -rf $(VENV) runs .pytest_cache
