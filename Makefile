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

.PHONY: venv vllm-alias quant router vllm-src test test-fast demo serve tiny-vl bench clean

# The CPU stack (see docs/install.md): torch 2.13.0 (CPU) first, then the locked vllm-cpu 0.32.0 stack without
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

# vllm-cpu's `vllm` console script (`vllm serve`, `vllm --version`) asks importlib.metadata for the distribution
# "vllm" at start, but the CPU wheel's distribution is named "vllm-cpu": PackageNotFoundError before anything runs.
# The venv gets an alias distribution "vllm" (vllm-<V>+cpu.dist-info: METADATA, INSTALLER, RECORD, nothing else: no
# module, no entry point, no requirement) at the installed vllm-cpu version V with the local label "+cpu": vLLM's
# platform detection (vllm/platforms/__init__.py) reads version("vllm") first and picks the CPU platform only when it
# holds "cpu", as its own vllm-cpu fallback answers. Rewritten when vllm-cpu changes; `pip uninstall vllm` removes
# only the alias; left alone where a real "vllm" distribution is installed. `make vllm-alias VPY=/path/to/python`
# adds it to another environment with vllm-cpu.
define VLLM_ALIAS_PY
import glob, importlib, importlib.metadata as md, os, shutil, sysconfig
try:
    cpu = md.version("vllm-cpu")
except md.PackageNotFoundError:
    raise SystemExit("vllm-alias: no vllm-cpu distribution in this environment")
want = cpu if "cpu" in cpu else cpu + "+cpu"
site = sysconfig.get_paths()["purelib"]
for d in glob.glob(os.path.join(site, "vllm-*.dist-info")):
    try:
        ours = open(os.path.join(d, "INSTALLER")).read().strip() == "qwen4exp-vllm-alias"
    except OSError:
        ours = False
    if not ours:
        print(f"vllm-alias: a vllm distribution is installed ({os.path.basename(d)}); nothing to do")
        raise SystemExit(0)
    shutil.rmtree(d)
d = os.path.join(site, f"vllm-{want}.dist-info")
os.makedirs(d)
files = {"METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {want}\nSummary: alias of the installed "
                     f"vllm-cpu {cpu} distribution, for importlib.metadata.version('vllm') (qwen4exp Makefile)\n",
         "INSTALLER": "qwen4exp-vllm-alias\n"}
for name, text in files.items():
    with open(os.path.join(d, name), "w") as f:
        f.write(text)
with open(os.path.join(d, "RECORD"), "w") as f:
    f.writelines(f"{os.path.basename(d)}/{n},,\n" for n in (*files, "RECORD"))
importlib.invalidate_caches()
assert md.version("vllm") == want, md.version("vllm")
print(f"vllm-alias: importlib.metadata.version('vllm') -> {want} (vllm-cpu {cpu})")
endef
export VLLM_ALIAS_PY

VLLM_ALIAS_STAMP := $(VENV)/.vllm-alias-stamp
$(VLLM_ALIAS_STAMP): $(VENV)/.stamp
	$(VPY) -c "$$VLLM_ALIAS_PY"
	touch $@

vllm-alias:
	$(VPY) -c "$$VLLM_ALIAS_PY"

venv: $(VENV)/.stamp $(VLLM_ALIAS_STAMP)

# Triton (the GPU image's 3.6.0) BESIDE the venv, for the interpreter items of tests/ops/test_<op>.py: the GPU kernels
# run under Triton's CPU interpreter against their references and are compiled for sm_90, with no GPU. Not in the venv: vLLM's CPU build
# must not see Triton. fla-core (the GPU GDN kernels of the HF path) beside it, for the same kind of check.
TRITON_DIR := .cache/triton
$(TRITON_DIR)/.stamp: | $(VENV)/.stamp
	@mkdir -p .cache .tmp
	$(PIP) install -q --no-deps --target $(TRITON_DIR) triton==3.6.0 fla-core==0.6.0 einops==0.8.2
	touch $@

# The newest transformers (and the kernels package its from_pretrained wants) BESIDE the venv, for the parity job
# against its in-tree qwen4_exp (tests/test_parity_newest_transformers.py, which builds the same when it is missing):
# --no-deps, so the venv stays on its lock; the stamp is a copy of the lock. A failed install does not stop the
# suite: that test fails, with pip's error.
NEWEST_TF_DIR := .cache/transformers-newest
$(NEWEST_TF_DIR)/.stamp: requirements-transformers-newest.lock | $(VENV)/.stamp
	@mkdir -p .cache .tmp
	rm -rf $(NEWEST_TF_DIR)
	$(PIP) install -q --no-deps --target $(NEWEST_TF_DIR) -r requirements-transformers-newest.lock \
	  && cp requirements-transformers-newest.lock $@ \
	  || echo "transformers-newest: install failed; tests/test_parity_newest_transformers.py will fail naming it"

# NVIDIA ModelOpt 0.47 in the venv, for recipes/quantize_nvfp4.py and its test: with --no-deps, as its own pins would
# move the locked stack; requirements-quant.lock names it and the three packages its import needs beyond that stack.
QUANT_STAMP := $(VENV)/.quant-stamp
$(QUANT_STAMP): requirements-quant.lock | $(VENV)/.stamp
	@mkdir -p .cache .tmp
	$(PIP) install -q --no-deps -r requirements-quant.lock
	$(VPY) -W ignore -c "import modelopt.torch.quantization, qwen4exp.quant.modelopt_experts; print('modelopt ok')"
	touch $@

quant: $(QUANT_STAMP)

# vllm-router 0.1.17 (the optional extra "router") in the venv, for N replicas behind one endpoint with session
# affinity (python -m qwen4exp.replicas, docs/scale-out.md) and tests/test_router.py: --no-deps, one wheel with the
# Rust router inside, plus orjson, the one requirement of its launcher that requirements-cpu.lock lacks.
ROUTER_STAMP := $(VENV)/.router-stamp
$(ROUTER_STAMP): requirements-router.lock | $(VENV)/.stamp
	@mkdir -p .cache .tmp
	$(PIP) install -q --no-deps -r requirements-router.lock
	$(VENV)/bin/vllm-router --help > /dev/null && echo "vllm-router ok"
	touch $@

router: $(ROUTER_STAMP)

# The Python source of the newer supported vLLM wheels (qwen4exp.vllm.patches.CONTRACT_WHEELS: 0.33.0, 0.34.0), for
# the version-keyed patch contract (tests/test_vllm_patch_contract.py reads it with ast: no import, no CUDA):
# `pip download --no-deps` of each wheel once, only its vllm/**.py kept in .cache/vllm-src/VERSION (the wheel is
# deleted). A failed download does not stop the suite: the contract test fails, naming the missing source.
VLLM_SRC_STAMP := .cache/vllm-src/.stamp
$(VLLM_SRC_STAMP): qwen4exp/vllm/patches.py tools/vllm_source.py | $(VENV)/.stamp
	@mkdir -p .cache .tmp
	$(VPY) tools/vllm_source.py && touch $@ || echo "vllm-src: download failed; tests/test_vllm_patch_contract.py will say which source is missing"

vllm-src: $(VLLM_SRC_STAMP)

# QWEN4EXP_REQUIRE_MODELOPT: the recipe's test fails (not skips) without modelopt, as this target installs it
test: venv $(TRITON_DIR)/.stamp $(QUANT_STAMP) $(ROUTER_STAMP) $(NEWEST_TF_DIR)/.stamp $(VLLM_SRC_STAMP)
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

# MODEL=DIR (on make's command line only) serves that checkpoint instead of the embedded tiny-coder
serve: venv
	@mkdir -p .cache .tmp
	$(VPY) -m qwen4exp.demo --serve $(DEMO_PORT) $(if $(filter command line,$(origin MODEL)),--model '$(MODEL)')

# A tiny composite (image + text) checkpoint with random weights, to try images with (README "Images"):
# .cache/tiny-vl (config, weights, tokenizer with the vision tokens, image processor config, example.png)
tiny-vl: venv
	@mkdir -p .cache .tmp
	$(VPY) recipes/vision_tiny.py --out .cache/tiny-vl

bench: venv
	$(VPY) benchmarks/bench_hf_reference.py

clean:
	rm -rf .cache .tmp .pytest_cache
