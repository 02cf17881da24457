# The two commands of the README. Both set up .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
JS_STAMP := node_modules/.installed-stamp

.PHONY: demo test setup bench clean browser postgres

setup: $(STAMP) $(JS_STAMP) browser postgres

# The web page's tests drive Debian's Chromium (tests/test_web.py); apt installs it when missing.
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
	else \
		echo "make setup: Chromium is missing (tests/test_web.py needs it): run 'sudo apt-get install -y chromium chromium-driver'" >&2; \
		exit 1; \
	fi

# The registry's PostgreSQL tests start a throwaway cluster of Debian's PostgreSQL (tests/pg_util.py),
# and tests/test_hosts.py joins two network namespaces with iproute2's `ip`; apt installs them when missing.
postgres:
	@if { command -v initdb || ls /usr/lib/postgresql/*/bin/initdb; } >/dev/null 2>&1 && command -v ip >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql iproute2; \
	else \
		echo "make setup: PostgreSQL or iproute2 is missing (tests/test_store_postgres.py and tests/test_hosts.py need them): run 'sudo apt-get install -y postgresql iproute2'" >&2; \
		exit 1; \
	fi

# torch is pinned to the local CPU build (constraints.txt) so no multi-GB CUDA build is pulled.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test,ref,components,postgres]"
	touch $(STAMP)

# JavaScript controllers: componentize-js into the project's own node_modules (package.json).
$(JS_STAMP): package.json
	npm install --no-audit --no-fund --loglevel=error
	touch $(JS_STAMP)

demo: setup
	$(VENV)/bin/rudder fetch-model
	@echo "--- plain generation"
	$(VENV)/bin/rudder generate --chat --seed 7 --max-tokens 120 \
		"In two sentences, why do sailors use a rudder?"
	@echo "--- a Wasm controller constrains the answer to one of three strings"
	$(VENV)/bin/rudder run --controller choices --arg '["blue", "green", "red"]' --chat --seed 3 \
		"What colour is the sky on a clear day? One word."
	@echo "--- a Wasm controller forks the request into three sequences that all sample"
	$(VENV)/bin/rudder run --controller fork --arg 3 --chat --seed 7 --max-tokens 30 \
		"Give me a name for a boat."

test: setup
	$(PY) -m pytest -q

# llama-cpp-python builds llama.cpp from source (~11 min on 2 cores), for this CPU, without curl.
bench: setup
	CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF" $(PY) -m pip install --quiet -c constraints.txt -e ".[test,ref,bench]"
	$(PY) benchmarks/decode.py

clean:
	rm -rf $(VENV) node_modules .pytest_cache .hypothesis
