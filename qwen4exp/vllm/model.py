"""Qwen4Exp for vLLM, assembled from ``qwen4exp.modeling.DecoderLayer`` and ``qwen4exp.layers`` (no second copy of
the math). Runtime pieces bound here:

* GDN: our ``GatedDeltaNet`` math with its conv + recurrent state in vLLM's hybrid (Mamba) cache (default), or
  vLLM's ``QwenGatedDeltaNetAttention`` C++ CPU kernels (``QWEN4EXP_VLLM_GDN=vllm``; see ``gdn_impl``).
* QSA: ``qwen4exp.vllm.qsa.QSAMixer`` (paged K/V + a paged per-token index cache).
* PLE: our ``PLE`` math with its conv state and n-gram context in a SHORT_CONV Mamba state (``StateSlots``).
* MoE: our router + shared expert, vLLM FusedMoE experts; HC: our math, replicated weights.
* Embedding ``VocabParallelEmbedding``; head ``ParallelLMHead`` + ``LogitsProcessor``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import nn

from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateCopyFuncCalculator,
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
    get_temporal_copy_spec,
)
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid, SupportsMRoPE
from vllm.model_executor.models.utils import WeightsMapper
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.sequence import IntermediateTensors
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import MambaSpec

from .. import envs
from ..configuration import _INDEXED_ALIASES, INDEXED, LINEAR
from ..layers.hyper_connection import HyperConnection
from ..layers.ple import PLE
from ..modeling import DecoderLayer, colocate_projections, embed_streams, next_mixer
from .layers import (FusedMoEBlock, StateSlots, check_cudagraph_mode, eager_segment, gdn_mixer, ngram_table_factory,
                     our_gdn, rotary_embedding, vllm_linear)
from . import memory, patches
from . import multimodal as mm
from .qsa import QSAMixer
from .weights import load_qwen4exp_weights

logger = init_logger("vllm.plugins.qwen4exp")


def _layer_type(config, i: int) -> str:
    t = config.layer_types[i]
    if t == LINEAR:
        return LINEAR
    if t in _INDEXED_ALIASES:
        return INDEXED
    raise ValueError(f"qwen4exp: layer {i} has unsupported layer type {t!r}")


class Qwen4ExpVllmTextModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "model"):
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix=f"{prefix}.embed_tokens")
        self.rotary_emb = rotary_embedding(config, vllm_config)
        dtype = vllm_config.model_config.dtype
        layers = []
        ple_table = ngram_table_factory(vllm_config, ple_table_on_host())  # (None: the layer's own, on the device)
        self.ple_states = nn.ModuleDict()
        self._ple_embed_steps: dict[str, _PleEmbedStep] = {}
        for i in range(config.num_hidden_layers):
            lt = _layer_type(config, i)
            lp = f"{prefix}.layers.{i}"
            if lt == LINEAR:
                mixer = (gdn_mixer(config, vllm_config, f"{lp}.linear_attn") if gdn_impl(config) == "vllm"
                         else our_gdn(config, vllm_config, f"{lp}.linear_attn"))
            else:
                mixer = QSAMixer(config, vllm_config, f"{lp}.self_attn", self.rotary_emb)
            layer = decoder_layer(config, i, lp, mixer, lt, ple_table=ple_table)
            if layer.ple is not None:
                st = StateSlots(PLE.state_shapes(config), (dtype, torch.int32), f"{lp}.ple_state")
                embed_step = _PleEmbedStep(layer.ple, st)
                st.step = functools.partial(_ple_mix_step, layer.ple, st, embed_step)
                st.decode_form = True
                self.ple_states[str(i)] = st
                self._ple_embed_steps[str(i)] = embed_step
            layers.append(layer)
        self.layers = nn.ModuleList(layers)
        self.fault_token = envs.QWEN4EXP_FAULT_INJECT  # tests only (tests/test_engine_faults.py); None: off
        self.ple_state_pads = nn.ModuleList(_ple_state_pads(config, vllm_config, self.ple_states, prefix, dtype))
        self.hyper_connection_mixer = HyperConnection(config, inject=False, linear=vllm_linear,
                                                      prefix=f"{prefix}.hyper_connection_mixer")
        sc = vllm_config.speculative_config
        self.keep_mtp_hidden = sc is not None and sc.method == "mtp"
        if self.keep_mtp_hidden:
            # The MTP hand-off lives in a persistent buffer that forward copies into (vLLM's contract for
            # get_mtp_target_hidden_states): a tensor produced inside a CUDA graph sits in the graphs' shared memory
            # pool, where later replays (the final mixer's, the draft's) may overwrite it before the draft reads it.
            n_max = max(vllm_config.scheduler_config.max_num_batched_tokens,
                        max(vllm_config.compilation_config.cudagraph_capture_sizes or [0]))
            self.register_buffer("mtp_hidden", torch.zeros(n_max, config.hc_count * config.hidden_size,
                                                           dtype=vllm_config.model_config.dtype), persistent=False)
        else:
            self.mtp_hidden = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        c = self.config
        if self.fault_token is not None:
            inject_fault(input_ids, self.fault_token)
        emb = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        H = embed_streams(emb, c.hc_count)
        cos, sin = self.rotary_emb(positions, emb.dtype)
        # PLE embeddings (n-gram rows gathered from the host table, key/value projections): they need only the
        # token ids, so with prefetching on they start here, on a side stream, behind the layers before theirs
        ple_kv = {}
        for key, step in self._ple_embed_steps.items():
            ple_kv[key] = step(input_ids, emb.dtype)
        Hn = None  # H normalised for the next mixer (each layer's last write-back makes it)
        for i, layer in enumerate(self.layers):
            mixer = layer.mixer
            if layer.layer_type == LINEAR:
                mix = mixer  # OurGDN / vLLM GDN: x -> y, state bound through the forward context
            else:
                def mix(x, mixer=mixer):
                    return mixer(x, positions, cos, sin)
            ple_fn = None
            if layer.ple is not None:
                def ple_fn(H, st=self.ple_states[str(i)], kv=ple_kv[str(i)]):
                    return st(torch.empty_like(H), H, kv)
            H, Hn = layer(H, mix, ple_fn, Hn, next_mixer(self.layers, i, self.hyper_connection_mixer))
        if self.keep_mtp_hidden:  # the pre-final-mixer streams [T, nD]: what the MTP draft head consumes
            self.mtp_hidden[: H.shape[0]].copy_(H)  # (vLLM never schedules more rows than the buffer has)
        out, _ = self.hyper_connection_mixer(H, Hn)
        return out


def inject_fault(input_ids: torch.Tensor, token: int) -> None:
    """``QWEN4EXP_FAULT_INJECT``: raise, as a bug inside our layers would, in a step whose batch holds ``token``
    (a host sync each step: tests only)."""
    if bool((input_ids == token).any()):
        raise RuntimeError(f"qwen4exp: injected fault (QWEN4EXP_FAULT_INJECT={token}): token id {token} is in "
                           f"this step's input")


def decoder_layer(config, i: int, prefix: str, mixer: nn.Module, layer_type: str, **kw) -> DecoderLayer:
    """The shared ``DecoderLayer`` with vLLM linears and vLLM's MoE block (``FusedMoEBlock``: FusedMoE routed
    experts fed by our router, the shared expert's gate and up projections as one GEMM); used by the target model
    and the MTP draft head."""
    return DecoderLayer(config, i, linear=vllm_linear, prefix=prefix, mixer=mixer, layer_type=layer_type,
                        moe=FusedMoEBlock, **kw)


def _ple_step_unused(*_):
    raise RuntimeError("qwen4exp: a PLE state pad was run (it only holds cache-group places)")


def _ple_state_pads(config, vllm_config, ple_states, prefix: str, dtype) -> list:
    """Unused PLE-shaped state layers that keep vLLM's KV cache groups few.

    vLLM's hybrid cache manager puts layers of equal cache spec into groups of one common size, the size being the
    smallest number of layers any spec has (``kv_cache_utils._get_kv_cache_groups_uniform_page_size``). With one
    PLE state beside n GDN and m QSA layers that size is 1: one group per layer (13 on FN-12L, 49 on the full
    model), and every step builds attention metadata, a block table and slot mappings for each. Padding the PLE
    spec up to the QSA layer count (with the MTP head's, when it drafts) restores groups of that size (5 on FN-12L:
    3 GDN, 1 PLE, 1 QSA). The pads share the PLE group's blocks, which vLLM would pad to the group size anyway,
    so they cost no cache memory; nothing ever reads them."""
    if not ple_states:
        return []
    n_attn = sum(_layer_type(config, i) != LINEAR for i in range(config.num_hidden_layers))
    sc = vllm_config.speculative_config
    if sc is not None and sc.method == "mtp":
        n_attn += getattr(config, "mtp_num_hidden_layers", 1) or 1
    first = min(ple_states, key=int)
    pads = []
    for j in range(1, n_attn - len(ple_states) + 1):
        st = StateSlots(PLE.state_shapes(config), (dtype, torch.int32),
                        f"{prefix}.layers.{first}.ple_state_pad{j}")
        st.step = _ple_step_unused
        pads.append(st)
    return pads


def ple_prefetch() -> bool:
    """``QWEN4EXP_PLE_PREFETCH=1``: the PLE embedding step (host-table gather + key/value projections) starts at the
    top of the forward on a side CUDA stream, overlapping the layers before the PLE layer (GPUs only). Off by
    default: the same step then runs on the main stream right before the layer."""
    return envs.QWEN4EXP_PLE_PREFETCH and _on_gpu()


class _PleEmbedStep:
    """Phase 1 of a PLE layer's step (``PLE.embed`` over the batch: the n-gram context state advances here) as an
    eager graph segment writing [T, nD + D] (keys | values) into a buffer for phase 2 (``_ple_mix_step``, another
    eager segment: the conv state). ``ahead``: phase 1 runs on a side stream that first waits for the main one, and
    phase 2 starts with ``join``, the main stream waiting for it. Both waits sit inside the eager segments: in a
    FULL CUDA graph capture they are captured (a fork and a join of the graph); under breakable graphs the
    segments run eagerly at every replay, and so do the waits."""

    def __init__(self, ple, st: StateSlots):
        self.ple, self.st = ple, st
        self.eager_name = f"{st.prefix}.embed"
        self.ahead = ple_prefetch()  # (read once, as the PLE table's place)
        self.stream = None  # the side stream (created on first use)

    def __call__(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        n, D = self.ple.n, self.ple.D
        out = torch.empty(ids.shape[0], n * D + D, dtype=dtype, device=ids.device)
        return eager_segment(self, out, ids)

    def eager_forward(self, out: torch.Tensor, ids: torch.Tensor) -> None:
        if not self.ahead:
            out.copy_(_ple_embed(self.ple, self.st, ids, out.dtype))
            return
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=ids.device)
        self.stream.wait_stream(torch.cuda.current_stream(ids.device))
        with torch.cuda.stream(self.stream):
            out.copy_(_ple_embed(self.ple, self.st, ids, out.dtype))

    def join(self, device) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(device).wait_stream(self.stream)


def _ple_embed(ple, st: StateSlots, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Phase 1 over the batch: [T, nD + D] keys | values; the n-gram context lives in vLLM's per-request state
    slots (slot 1; the conv state, slot 0, is phase 2's). Only the n-gram rows follow the state (an MTP verification
    steps them one position at a time); the key and value projections then run once over all T rows."""
    T = ids.shape[0]

    def fn(rows, cu, states):
        emb, ctx = ple.ple_embedding(ids[rows], cu, states[1].long(), dtype)
        return emb, (None, ctx)

    def verify(nd, nq, states):  # MTP verification: every position in one call
        emb, ctx = ple.ple_embedding.verify(ids[: nd * nq], states[1], nq, dtype)
        return emb, (None, ctx)

    emb = st.run(fn, T, ids.device, (None, ple.ple_embedding.eos), uses=(1,),
                 verify=verify if ple.context_len > 0 and _ple_verify_batched() else None)
    if emb is None:  # profiling / warm-up: one fresh sequence, no state
        ctx = torch.full((1, ple.context_len), ple.ple_embedding.eos, dtype=torch.long, device=ids.device)
        emb, _ = fn(slice(0, T), torch.tensor([0, T], device=ids.device), (None, ctx))
    k, v = ple.project(emb)
    return torch.cat([k, v], -1)


def _ple_mix_step(ple, st: StateSlots, embed_step: _PleEmbedStep, H: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Phase 2 over the batch: PLE(H) from phase 1's keys | values; the conv state in the state slots."""
    embed_step.join(H.device)
    T, nD = H.shape[0], H.shape[1]

    def fn(rows, cu, states):
        out, conv = ple.mix(H[rows], kv[rows, :nD], kv[rows, nD:], cu, states[0])
        return out, (conv, None)

    def verify(nd, nq, states):  # MTP verification: every position in two calls
        rows = nd * nq
        out, conv = ple.mix_verify(H[:rows], kv[:rows, :nD], kv[:rows, nD:], states[0], nq)
        return out, (conv, None)

    out = st.run(fn, T, H.device, (None, ple.ple_embedding.eos), uses=(0,),
                 verify=verify if ple.conv_state_len > 0 and _ple_verify_batched() else None)
    if out is None:  # profiling / warm-up: no state
        out, _ = fn(slice(0, T), torch.tensor([0, T], device=H.device), (None, None))
    return out


def _ple_verify_batched() -> bool:
    return envs.QWEN4EXP_PLE_VERIFY == "batched"


def _on_gpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cuda_alike()


def gdn_impl(config) -> str:
    """``QWEN4EXP_VLLM_GDN``: "ours" (CPU default; qwen4exp.layers.gdn math, bf16 inputs + fp32 state, matches the
    HF reference's numerics) or "vllm" (GPU default where its kernels apply, i.e. 128-wide GDN heads as in the real
    model: vLLM's GDN layer with its FLA/FlashInfer/CuTe kernels; on CPU its C++ kernels: faster on long prompts,
    ~1.5x the bf16 error). Small test models (64-wide heads) run ours on the GPU too. "auto" (the default) picks
    by that rule."""
    v = envs.QWEN4EXP_VLLM_GDN
    if v != "auto":
        return v
    return "vllm" if _on_gpu() and config.linear_key_head_dim == config.linear_value_head_dim == 128 else "ours"


def ple_table_on_host() -> bool:
    """``QWEN4EXP_PLE_TABLE``: "host" (GPU default: the n-gram table in pinned host memory, rows gathered over UVA;
    the real 51B-parameter table does not fit on a GPU) or "gpu" (table in GPU memory: fastest when it fits).
    On CPU the table is simply in memory."""
    return envs.QWEN4EXP_PLE_TABLE == "host" and _on_gpu()


def _text_config(vllm_config):
    return vllm_config.model_config.hf_text_config


class _Qwen4ExpBase(nn.Module, HasInnerState, IsHybrid, SupportsMRoPE):
    requires_raw_input_tokens = True
    model_prefix = "model"
    # For vLLM's quant config matching (``configure_quant_config``): checkpoint names -> our module names (composite
    # checkpoints' language model lives at model.*), and our fused modules' checkpoint shards (the shared expert's
    # gate_up_proj; vLLM's GDN projections). Our loader renames tensors itself (``weights.load_qwen4exp_weights``).
    hf_to_vllm_mapper = WeightsMapper(orig_to_new_prefix={"model.language_model.": "model.", "model.visual.": "visual."})
    packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"], "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"],
                              "in_proj_ba": ["in_proj_b", "in_proj_a"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = _text_config(vllm_config)
        self.config = config
        self.vllm_config = vllm_config
        check_cudagraph_mode(vllm_config)
        self.model = Qwen4ExpVllmTextModel(vllm_config=vllm_config, prefix="model")
        colocate_projections(self.model)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix="lm_head")
        self.logits_processor = LogitsProcessor(config.vocab_size)
        # the "model" stage of the patch table (qwen4exp.vllm.patches): whole-page copies for partial prefix-cache
        # hits (vLLM's skip some layers' bytes), eager logprob ranks on CPU
        patches.apply("model")
        from vllm.platforms import current_platform

        if current_platform.is_cpu() and memory.start_idle_trim():
            logger.info("qwen4exp: freed heap memory goes back to the OS after %g s idle (QWEN4EXP_IDLE_TRIM)",
                        envs.QWEN4EXP_IDLE_TRIM)
        logger.info("%s is served by the qwen4exp plugin (qwen4exp.vllm; GDN: %s, QSA: paged K/V + index cache, "
                    "PLE: per-request state, table in %s memory), not vLLM's in-tree qwen4_exp", type(self).__name__,
                    gdn_impl(config), "pinned host" if ple_table_on_host() else "device")

    # -- vLLM model protocol --------------------------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        if input_ids is None:
            raise ValueError("qwen4exp: PLE needs the raw token ids (input_ids)")
        memory.begin()
        try:
            return self.model(input_ids, positions, inputs_embeds)
        finally:
            memory.end()

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def get_mtp_target_hidden_states(self) -> torch.Tensor | None:
        """vLLM's MTP hand-off: a persistent buffer [max_num_batched_tokens, hc_count*H] whose first T rows hold the
        last forward's pre-final-mixer streams (what our MTP head takes in place of the single-stream output); vLLM
        slices the rows it needs."""
        return self.model.mtp_hidden

    def get_mrope_input_positions(self, input_tokens, mm_features):
        if mm_features:
            raise NotImplementedError("qwen4exp vLLM plugin: image/video inputs are not supported yet")
        positions = torch.arange(len(input_tokens), dtype=torch.long)
        return positions.unsqueeze(0).expand(3, -1), 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_qwen4exp_weights(self, weights)

    # -- hybrid-state declarations ---------------------------------------------------------------------------------
    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return MambaStateDtypeCalculator.gated_delta_net_state_dtype(
            vllm_config.model_config.dtype, vllm_config.cache_config.mamba_cache_dtype,
            vllm_config.cache_config.mamba_ssm_cache_dtype)

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        c = _text_config(vllm_config)
        sc = vllm_config.speculative_config
        # our GDN is replicated across TP ranks (full state per rank); vLLM's shards its heads
        tp = 1 if gdn_impl(c) == "ours" else vllm_config.parallel_config.tensor_parallel_size
        return MambaStateShapeCalculator.gated_delta_net_state_shape(
            tp, c.linear_num_key_heads, c.linear_num_value_heads,
            c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim,
            sc.num_speculative_tokens if sc else 0)

    @classmethod
    def get_mamba_state_copy_func(cls):
        return MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()

    @classmethod
    def get_mamba_state_copy_funcs(cls, mamba_types=None):
        return {
            MambaAttentionBackendEnum.GDN_ATTN: MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func(),
            MambaAttentionBackendEnum.SHORT_CONV: (get_temporal_copy_spec, get_temporal_copy_spec),
        }

    @classmethod
    def get_mamba_specs_from_config(cls, vllm_config: VllmConfig) -> tuple[MambaSpec, ...]:
        """GDN state and PLE state; the platform sizes the Mamba page for the larger one."""
        c = _text_config(vllm_config)
        specs = [MambaSpec(shapes=cls.get_mamba_state_shape_from_config(vllm_config),
                           dtypes=cls.get_mamba_state_dtype_from_config(vllm_config), block_size=-1,
                           tp_replicated=gdn_impl(c) == "ours")]
        if c.ple_layer_ids:
            specs.append(MambaSpec(shapes=PLE.state_shapes(c), dtypes=(vllm_config.model_config.dtype, torch.int32),
                                   block_size=-1, tp_replicated=True))
        return tuple(specs)


class Qwen4ExpForCausalLM(_Qwen4ExpBase):
    """Text-only checkpoints: ``model.*``, ``lm_head.weight``."""


@MULTIMODAL_REGISTRY.register_processor(**mm.PROCESSOR)
class Qwen4ExpForConditionalGeneration(_Qwen4ExpBase, mm.VisionInputs):
    """Composite checkpoints: ``model.language_model.*``, ``model.visual.*`` (the vision tower), ``lm_head.weight``.
    Images and video: ``qwen4exp.vllm.multimodal``."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.init_vision(vllm_config)

    def embed_input_ids(self, input_ids, multimodal_embeddings=None, *, is_multimodal=None):
        return mm.VisionInputs.embed_input_ids(self, input_ids, multimodal_embeddings, is_multimodal=is_multimodal)

    def get_mrope_input_positions(self, input_tokens, mm_features):
        return mm.VisionInputs.get_mrope_input_positions(self, input_tokens, mm_features)

    def get_language_model(self) -> nn.Module:
        return self

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = load_qwen4exp_weights(self, self.load_vision_weights(weights))
        return loaded | self.check_vision_loaded()
