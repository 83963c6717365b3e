# Every install goes through constraints.txt (torch 2.13.0 CPU wheel; no torchvision, see there).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
export OMP_NUM_THREADS ?= 1
export MPLBACKEND ?= Agg

.PHONY: demo test install benchmark benchmark-quick benchmark-deps clean

$(VENV)/.installed: setup.py constraints.txt requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -r requirements.txt
	# BackPACK (and curvlinops, a test oracle that requires BackPACK) without the torchvision
	# requirement: BackPACK only imports it in backpack.utils.examples
	$(PY) -m pip install --quiet -c constraints.txt --no-deps backpack-for-pytorch curvlinops-for-pytorch
	$(PY) -m pip install --quiet -c constraints.txt --no-deps -e .
	$(PY) -c "import importlib.util as u, sys; sys.exit('torchvision must not be installed (see constraints.txt)' if u.find_spec('torchvision') else 0)"
	touch $@

install: $(VENV)/.installed

## The main job: train on digits with a live cockpit; writes runs/digits.{json,jsonl,png}
demo: install
	$(PY) -m cockpit_like.demo

## The test suite (what CI runs): two pytest-xdist workers (one thread each), a test module per work unit,
## the slowest modules first (tests/conftest.py); TEST_WORKERS=0 runs it in one process. The sources are compiled
## first (under PYTHONDONTWRITEBYTECODE each worker and each child process compiled them again: 0.3 s per process)
TEST_WORKERS ?= 2
test: install
	$(PY) -m compileall -q -j 2 cockpit_like benchmarks examples tests > /dev/null
	$(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

## Benchmark-only dependencies (benchmarks/side_by_side.py: Opacus's ghost clipping as a reference)
benchmark-deps: install
	$(PY) -m pip install --quiet -c constraints.txt --no-deps opacus

benchmark: install
	$(PY) benchmarks/overhead.py

benchmark-quick: install
	$(PY) benchmarks/overhead.py --quick

clean:
	rm -rf $(VENV) runs build *.egg-info
