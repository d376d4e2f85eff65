# Two commands do all set-up: `make up` (install, migrate, create the operator, run) and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DATA := $(CURDIR)/var
export UNBROKEN_DATA_DIR ?= $(DATA)
export UNBROKEN_SECRET_KEY_FILE ?= $(DATA)/secret_key
export PYTHONPATH := $(CURDIR)

# The second NVRx release the trainer is tested with (the first, 0.4.1, is in requirements.lock).
NVRX_NEXT := 0.6.0
NVRX_NEXT_SITE := $(CURDIR)/.nvrx/$(NVRX_NEXT)/site
NVRX_WHEEL_TAGS := --only-binary=:all: --platform manylinux_2_39_x86_64 --python-version 3.11 --implementation cp
# And the third (docs/concepts/faults.md compares its attribution with ours): its wheel is tagged cp312 only.
NVRX_THIRD := 0.7.0
NVRX_THIRD_SITE := $(CURDIR)/.nvrx/$(NVRX_THIRD)/site
NVRX_THIRD_TAGS := --only-binary=:all: --platform manylinux_2_39_x86_64 --python-version 3.12 --implementation cp

.PHONY: up install nvrx-next nvrx-third lint test test-nvrx-next test-nvrx-third test-fast bench-ingest bench-fleet bench-recovery bench-checkpoint bench-dashboard bench-sdk bench-chaos bench-straggler bench-attribution bench-report k8s-e2e docs docs-serve clean

$(VENV)/.installed: requirements.lock trainer/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# torch is pinned to 2.13.0 in the lock: an unpinned torch would pull a multi-GB CUDA build.
	$(VENV)/bin/pip install -q -r requirements.lock
	# The training-side SDK (`import unbroken`), editable, as users install it: pip install ./trainer
	$(VENV)/bin/pip install -q --no-deps --no-build-isolation -e ./trainer
	touch $@

install: $(VENV)/.installed

# NVRx $(NVRX_NEXT) in its own site directory, ahead of .venv on PYTHONPATH when used (see
# requirements-nvrx-0.6.lock). Its cp311 wheel is tagged manylinux_2_39 for one compiled CUPTI module the
# layers never import, so pip is told the platform; the layers are pure Python and run here.
$(NVRX_NEXT_SITE)/.installed: requirements-nvrx-0.6.lock $(VENV)/.installed
	rm -rf $(dir $(NVRX_NEXT_SITE)) && mkdir -p $(NVRX_NEXT_SITE)
	$(VENV)/bin/pip download -q --no-deps $(NVRX_WHEEL_TAGS) -d $(dir $(NVRX_NEXT_SITE))wheel \
		nvidia-resiliency-ext==$(NVRX_NEXT)
	$(VENV)/bin/pip install -q --no-deps $(NVRX_WHEEL_TAGS) --target $(NVRX_NEXT_SITE) \
		$(dir $(NVRX_NEXT_SITE))wheel/nvidia_resiliency_ext-$(NVRX_NEXT)-*.whl
	$(VENV)/bin/pip install -q --no-deps --target $(NVRX_NEXT_SITE) -r requirements-nvrx-0.6.lock
	touch $@

nvrx-next: $(NVRX_NEXT_SITE)/.installed

# NVRx $(NVRX_THIRD) the same way (see requirements-nvrx-0.7.lock): a cp312-only wheel whose layers are pure
# Python, so pip is told Python 3.12; they import on 3.11.
$(NVRX_THIRD_SITE)/.installed: requirements-nvrx-0.7.lock $(VENV)/.installed
	rm -rf $(dir $(NVRX_THIRD_SITE)) && mkdir -p $(NVRX_THIRD_SITE)
	$(VENV)/bin/pip download -q --no-deps $(NVRX_THIRD_TAGS) -d $(dir $(NVRX_THIRD_SITE))wheel \
		nvidia-resiliency-ext==$(NVRX_THIRD)
	$(VENV)/bin/pip install -q --no-deps $(NVRX_THIRD_TAGS) --target $(NVRX_THIRD_SITE) \
		$(dir $(NVRX_THIRD_SITE))wheel/nvidia_resiliency_ext-$(NVRX_THIRD)-*.whl
	$(VENV)/bin/pip install -q --no-deps --target $(NVRX_THIRD_SITE) -r requirements-nvrx-0.7.lock
	touch $@

nvrx-third: $(NVRX_THIRD_SITE)/.installed

$(DATA)/secret_key:
	mkdir -p $(DATA)
	umask 077; $(PYTHON) -c 'import secrets; print(secrets.token_urlsafe(50))' > $@

up: install $(DATA)/secret_key
	$(PY) manage.py migrate --noinput
	$(PY) manage.py collectstatic --noinput -v 0
	$(PY) manage.py ensure_operator
	$(PY) manage.py serve

# ruff with the rules in pyproject.toml ([tool.ruff.lint]) and the import contracts ([tool.importlinter]).
# `ruff check --fix .` applies the safe fixes (import order, unused noqa).
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache --no-logo

test: install nvrx-next nvrx-third $(DATA)/secret_key
	$(MAKE) --no-print-directory lint
	$(PY) -m pytest
	$(MAKE) --no-print-directory test-nvrx-next
	$(MAKE) --no-print-directory test-nvrx-third

# The trainer's NVRx tests (marked nvrx) again, with NVRx $(NVRX_NEXT) ahead of the .venv's 0.4.1.
test-nvrx-next: install nvrx-next $(DATA)/secret_key
	PYTHONPATH=$(NVRX_NEXT_SITE):$(CURDIR) $(PY) -m pytest -m nvrx -p no:cacheprovider \
		|| { echo "FAILED: the trainer's NVRx tests with nvidia-resiliency-ext $(NVRX_NEXT)"; exit 1; }

# The same with NVRx $(NVRX_THIRD).
test-nvrx-third: install nvrx-third $(DATA)/secret_key
	PYTHONPATH=$(NVRX_THIRD_SITE):$(CURDIR) $(PY) -m pytest -m nvrx -p no:cacheprovider \
		|| { echo "FAILED: the trainer's NVRx tests with nvidia-resiliency-ext $(NVRX_THIRD)"; exit 1; }

test-fast: install $(DATA)/secret_key
	$(PY) -m pytest -m "not slow"

bench-ingest: install $(DATA)/secret_key
	$(PY) tests/bench/bench_ingest.py

bench-fleet: install $(DATA)/secret_key
	$(PY) tests/bench/bench_fleet.py

# NVRX=$(NVRX_NEXT) runs it with that release (its site directory ahead of .venv's 0.4.1).
bench-recovery: install $(DATA)/secret_key $(if $(NVRX),nvrx-next)
	$(if $(NVRX),PYTHONPATH=$(NVRX_NEXT_SITE):$(CURDIR)) $(PY) tests/bench/bench_recovery.py $(ARGS)

bench-checkpoint: install $(DATA)/secret_key
	$(PY) tests/bench/bench_checkpoint.py

bench-dashboard: install $(DATA)/secret_key
	$(PY) tests/bench/bench_dashboard.py

bench-sdk: install $(DATA)/secret_key
	$(PY) tests/bench/bench_sdk.py

bench-chaos: install $(DATA)/secret_key
	$(PY) tests/bench/bench_chaos.py

bench-straggler: install $(DATA)/secret_key
	$(PY) tests/bench/bench_straggler.py

# The attribution matrix, each cell 3 times (ARGS="--cells level0-sigkill-r1,level2-hang-r1 --runs 3" for a subset).
bench-attribution: install $(DATA)/secret_key
	$(PY) tests/bench/bench_attribution.py $(ARGS)

# The documentation site (mkdocs.yml, docs/): built strictly, so a broken link, a missing reference or a
# field without a meaning fails; its reference pages are generated from the code (docs/gen_reference.py).
$(VENV)/.docs-installed: requirements-docs.lock $(VENV)/.installed
	$(VENV)/bin/pip install -q -c requirements.lock -r requirements-docs.lock
	touch $@

docs: install $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

docs-serve: install $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8001

# The resilience report's goodput projection against a measured run (docs/guides/resilience-report.md).
bench-report: install $(DATA)/secret_key
	$(PY) tests/bench/bench_report.py $(ARGS)

k8s-e2e: install $(DATA)/secret_key
	$(PY) -m pytest tests/k8s_e2e -m k8s_e2e -v

clean:
	rm -rf $(DATA)/test $(DATA)/jobs test-artifacts site
