# The two commands of the README. Both set up .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test setup bench clean

setup: $(STAMP)

# torch is pinned to the local CPU build (constraints.txt) so no multi-GB CUDA build is pulled.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test,ref]"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/rudder fetch-model
	$(VENV)/bin/rudder generate --chat --seed 7 --max-tokens 120 \
		"In two sentences, why do sailors use a rudder?"

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) benchmarks/decode.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
