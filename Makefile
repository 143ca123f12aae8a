# Two entry points (see README): `make run` and `make test`. Both build .venv first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-latest clean

$(STAMP): pyproject.toml
	@py=$$(.ci/find-python) || exit 1; echo "using $$py"; rm -rf $(VENV); "$$py" -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,pinned]'
	@touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/jfusedq demo

test: $(STAMP)
	$(PY) -m pytest -n auto -q tests

# The same suite on the newest JAX/flax releases, in a separate environment.
test-latest:
	@py=$$(.ci/find-python) || exit 1; rm -rf .venv-latest; "$$py" -m venv .venv-latest
	.venv-latest/bin/python -m pip install -q --upgrade pip
	.venv-latest/bin/python -m pip install -q --upgrade -e '.[test]' jax jaxlib flax
	.venv-latest/bin/python -m pytest -n auto -q tests

clean:
	rm -rf $(VENV) .venv-latest
