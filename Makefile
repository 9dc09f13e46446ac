# qwen4exp — set-up, tests and the main job. Everything lands in ./.venv and ./.cache (git-ignored).
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
# vLLM's and inductor's files stay inside the work tree
export VLLM_CACHE_ROOT := $(CURDIR)/.cache/vllm
export TORCHINDUCTOR_CACHE_DIR := $(CURDIR)/.cache/inductor
export VLLM_RPC_BASE_PATH := $(CURDIR)/.cache/rpc
export TMPDIR := $(CURDIR)/.tmp
export VLLM_CPU_KVCACHE_SPACE ?= 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: venv quant test test-fast demo serve bench clean

# The CPU stack (see README "Versions"): torch 2.13.0 (CPU) first, then the locked vllm-cpu 0.32.0 stack without
# dependency resolution (so nothing pulls a CUDA torch), then this package in editable mode.
$(VENV)/.stamp: pyproject.toml requirements-cpu.lock
	@mkdir -p .cache .tmp
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps -r requirements-cpu.lock
	-$(PIP) uninstall -q -y torchvision torchaudio torchcodec triton
	$(PIP) install -q --no-deps --no-build-isolation -e .
	$(VPY) -c "import torch, transformers, vllm, qwen4exp; print('venv ok: torch', torch.__version__, 'transformers', transformers.__version__)"
	touch $@

venv: $(VENV)/.stamp

# Triton (the GPU image's 3.6.0) BESIDE the venv, for the interpreter items of tests/ops/test_<op>.py: the GPU kernels
# run under Triton's CPU interpreter against their references and are compiled for sm_90, with no GPU. Not in the venv: vLLM's CPU build
# must not see Triton. fla-core (the GPU GDN kernels of the HF path) beside it, for the same kind of check.
TRITON_DIR := .cache/triton
$(TRITON_DIR)/.stamp: | $(VENV)/.stamp
	@mkdir -p .cache .tmp
	$(PIP) install -q --no-deps --target $(TRITON_DIR) triton==3.6.0 fla-core==0.6.0 einops==0.8.2
	touch $@

# NVIDIA ModelOpt 0.47 in the venv, for recipes/quantize_nvfp4.py and its test: with --no-deps, as its own pins would
# move the locked stack; requirements-quant.lock names it and the three packages its import needs beyond that stack.
QUANT_STAMP := $(VENV)/.quant-stamp
$(QUANT_STAMP): requirements-quant.lock | $(VENV)/.stamp
	@mkdir -p .cache .tmp
	$(PIP) install -q --no-deps -r requirements-quant.lock
	$(VPY) -W ignore -c "import modelopt.torch.quantization, qwen4exp.quant.modelopt_experts; print('modelopt ok')"
	touch $@

quant: $(QUANT_STAMP)

# QWEN4EXP_REQUIRE_MODELOPT: the recipe's test fails (not skips) without modelopt, as this target installs it
test: venv $(TRITON_DIR)/.stamp $(QUANT_STAMP)
	@mkdir -p .cache .tmp
	QWEN4EXP_REQUIRE_MODELOPT=1 $(VPY) -m pytest -q -ra --durations=15 tests

test-fast: venv
	$(VPY) -m pytest -q -ra tests -m "not vllm and not slow"

# The demo's server listens on 127.0.0.1 (PORT=N picks its port). Ctrl-C, SIGTERM (make forwards it), SIGHUP (a
# closed terminal) or make's own death stop the server and every process it started (qwen4exp/demo.py).
DEMO_PORT = $(if $(PORT),--port $(PORT))
demo: venv
	@mkdir -p .cache .tmp
	$(VPY) -m qwen4exp.demo $(DEMO_PORT)

serve: venv
	@mkdir -p .cache .tmp
	$(VPY) -m qwen4exp.demo --serve $(DEMO_PORT)

bench: venv
	$(VPY) benchmarks/bench_hf_reference.py

clean:
	rm -rf .cache .tmp .pytest_cache
