# Two commands do all set-up: `make up` (install, migrate, create the operator, run) and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DATA := $(CURDIR)/var
export UNBROKEN_DATA_DIR ?= $(DATA)
export UNBROKEN_SECRET_KEY_FILE ?= $(DATA)/secret_key
export PYTHONPATH := $(CURDIR)

.PHONY: up install test test-fast bench-ingest bench-recovery bench-checkpoint bench-dashboard bench-sdk bench-chaos k8s-e2e clean

$(VENV)/.installed: requirements.lock trainer/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# torch is pinned to 2.13.0 in the lock: an unpinned torch would pull a multi-GB CUDA build.
	$(VENV)/bin/pip install -q -r requirements.lock
	# The training-side SDK (`import unbroken`), editable, as users install it: pip install ./trainer
	$(VENV)/bin/pip install -q --no-deps --no-build-isolation -e ./trainer
	touch $@

install: $(VENV)/.installed

$(DATA)/secret_key:
	mkdir -p $(DATA)
	umask 077; $(PYTHON) -c 'import secrets; print(secrets.token_urlsafe(50))' > $@

up: install $(DATA)/secret_key
	$(PY) manage.py migrate --noinput
	$(PY) manage.py collectstatic --noinput -v 0
	$(PY) manage.py ensure_operator
	$(PY) manage.py serve

test: install $(DATA)/secret_key
	$(PY) -m pytest

test-fast: install $(DATA)/secret_key
	$(PY) -m pytest -m "not slow"

bench-ingest: install $(DATA)/secret_key
	$(PY) tests/bench/bench_ingest.py

bench-recovery: install $(DATA)/secret_key
	$(PY) tests/bench/bench_recovery.py

bench-checkpoint: install $(DATA)/secret_key
	$(PY) tests/bench/bench_checkpoint.py

bench-dashboard: install $(DATA)/secret_key
	$(PY) tests/bench/bench_dashboard.py

bench-sdk: install $(DATA)/secret_key
	$(PY) tests/bench/bench_sdk.py

bench-chaos: install $(DATA)/secret_key
	$(PY) tests/bench/bench_chaos.py

k8s-e2e: install $(DATA)/secret_key
	$(PY) -m pytest tests/k8s_e2e -m k8s_e2e -v

clean:
	rm -rf $(DATA)/test $(DATA)/jobs test-artifacts
