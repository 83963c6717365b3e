# Every install goes through constraints.txt (torch 2.13.0 CPU wheel, torchvision 0.28.0).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
export OMP_NUM_THREADS ?= 1
export MPLBACKEND ?= Agg

.PHONY: demo test install benchmark benchmark-quick clean

$(VENV)/.installed: setup.py constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test,examples]'
	touch $@

install: $(VENV)/.installed

## The main job: train on digits with a live cockpit; writes runs/digits.{json,jsonl,png}
demo: install
	$(PY) -m cockpit_like.demo

## The test suite (what CI runs)
test: install
	$(PY) -m pytest -q

benchmark: install
	$(PY) benchmarks/overhead.py

benchmark-quick: install
	$(PY) benchmarks/overhead.py --quick

clean:
	rm -rf $(VENV) runs build *.egg-info
