"""QSA in vLLM's terms.

Caches: ONE vLLM attention layer ``{prefix}.attn`` per QSA layer (paged, prefix-cached and freed with the request
like any attention cache) with the main K/V's heads, whose pages vLLM pads (the layer's spec asks for it) to also
hold the indexer's keys: per page, the key of each of its blocks of r tokens, and a ring of the raw keys of its open
block (``qwen4exp.ops.qsa.layout``). A block key is computed once, when its last token is processed, and read back
for every later query; a raw key lives only until its block completes. Per token that is the main K/V plus d_i / r
key elements, as upstream's separate compressed-key cache, in one KV-cache group.

Selection + attention run through ``qwen4exp.ops.qsa`` over the paged views. No vLLM attention kernel ever reads
this cache, so the plugin owns its layout: each token row is [K | V], written at vLLM's slot mapping
(``write_paged``) and read back through the block table (``paged_rows``). That is independent of the CPU
attention ISA (vec / AMX / NEON packs K differently) and of the dtype (fp32, bf16, FP8 work).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch

from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention

from .. import envs
from ..layers.qsa import QSAAttention
from ..ops.qsa import (block_mean, decode_cache_writes, output_gate, qsa_attend_paged, qsa_decode_paged,
                       qsa_prefill_paged, qsa_select_paged, reused_block_ids, warm_up_decode, warm_up_prefill,
                       write_paged)
from ..ops.qsa import layout as qlayout
from ..ops.qsa.reference import write_ring
from ..ops.qsa.step import DecodeInputs, decode_inputs, decode_writes
from .layers import eager_segment, vllm_linear

logger = init_logger("vllm.plugins.qwen4exp")  # (as the package's: shown and formatted like vLLM's own)

# Requests of a mixed step with up to this many queries (decodes, MTP verifications, short prefill chunks) are
# served together, one row per query (``qsa_decode_paged``); longer chunks one by one (``qsa_prefill_paged``).
BATCHED_MAX_QUERIES = 8
# A step in which every request has the same number of queries, up to this many (MTP verification and draft prefill:
# 1 + k each), runs the sync-free decode path (``_decode_step``), which a FULL CUDA graph captures.
UNIFORM_MAX_QUERIES = 8


_WARMED: set = set()  # the cache layouts whose prefill kernels this process compiled at start-up (``_warm_up``)

_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _kv_cache(attn: Attention) -> torch.Tensor:
    """The layer's paged cache; an FP8 cache (``--kv-cache-dtype fp8``; vLLM allocates it as bytes) viewed in its
    FP8 type, so writes round to it and reads widen back (unit scales: see ``QSAMixer.check_kv_scales``)."""
    kv = attn.kv_cache
    if isinstance(kv, (list, tuple)):
        kv = kv[get_forward_context().virtual_engine]
    if kv.dtype == torch.uint8:
        fp8 = _FP8.get(attn.kv_cache_dtype)
        if fp8 is None:
            raise NotImplementedError(f"qwen4exp QSA: kv_cache_dtype {attn.kv_cache_dtype!r} is not supported "
                                      f"(bf16/fp16/fp32 or {', '.join(_FP8)})")
        kv = kv.view(fp8)
    return kv


def qsa_cache_backend(chosen: type) -> type:
    """The attention backend class for the QSA cache layer, given ``chosen``, the one vLLM picked for it.

    No vLLM attention kernel ever reads this cache (our kernels take the block table, lengths and slots only), so
    where vLLM picked FlashAttention the layer gets a subclass whose metadata builder skips FlashAttention 3's
    ahead-of-time scheduler metadata (same cache layout, block sizes, CUDA-graph support): a GPU launch and two
    buffer writes a step fewer, metadata nothing reads. It also keeps the step's host lengths where vLLM's host
    copies are exact (``host_lengths_of``), so an eager step reads none back from the GPU. Any other backend (CPU,
    FlashInfer, ...) stays."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    return _lean_flash_backend() if chosen is FlashAttentionBackend else chosen


@functools.cache
def _lean_flash_backend():
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionMetadataBuilder

    class QSACacheMetadataBuilder(FlashAttentionMetadataBuilder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.aot_schedule = False  # (build() then asks for no scheduler metadata)
            spec = getattr(self.vllm_config, "speculative_config", None)
            self.max_decode_queries = 1 + int(spec.num_speculative_tokens or 0) if spec is not None else 0

        def build(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
            md = super().build(common_prefix_len, common_attn_metadata, *args, **kwargs)
            try:
                md.qwen4exp_host_lengths = host_lengths_of(common_attn_metadata, self.max_decode_queries)
            except AttributeError:  # (a metadata class with __slots__: the layers read the device's lengths)
                pass
            return md

    class QSACacheBackend(FlashAttentionBackend):
        @staticmethod
        def get_builder_cls():
            return QSACacheMetadataBuilder

    return QSACacheBackend


def _once_per_forward(name: str, m, key, compute):
    """``compute()``, once per forward pass for the metadata object ``m`` (and ``key``): all QSA layers share one
    KV-cache group, so one metadata object, and what they derive from it alike is worked out by the first. Kept on
    the forward context, which vLLM makes anew for every forward pass (metadata objects or their tensors may be
    reused across steps, so they cannot carry it)."""
    fc = get_forward_context()
    memo = getattr(fc, name, None)
    if memo is not None and memo[0] is m and memo[1] == key:
        return memo[2]
    got = compute()
    try:
        setattr(fc, name, (m, key, got))
    except AttributeError:  # (a context class with __slots__: no memo)
        pass
    return got


def uniform_queries(m) -> int:
    """The number of queries every request of this step has, where that is 1 (decode) or equal for all and at most
    ``UNIFORM_MAX_QUERIES`` (MTP: 1 + k); else 0. From host values only (no sync): with each request at most
    ``max_query_len`` queries, ``num_actual_tokens == max_query_len * requests`` means all have that many. Inside a
    FULL graph capture vLLM pads requests and tokens alike, so the test holds there too."""
    nq = int(m.max_query_len)
    if nq <= 1:
        return 1
    if nq <= UNIFORM_MAX_QUERIES and int(m.num_actual_tokens) == nq * m.seq_lens.shape[0]:
        return nq
    return 0


def host_lengths_of(cm, max_decode_queries: int) -> tuple[list[int], list[int]] | None:
    """The step's query starts and sequence lengths as host lists from the host copies in vLLM's common metadata
    ``cm`` (no device read), where those are exact; else None. vLLM's host sequence lengths are exact except for
    decode rows under asynchronous speculative decoding (an upper bound there: last step's accepted drafts are
    known on the device only), and its host query starts except for those rows under adaptive verification. So:
    exact always without speculative decoding (``max_decode_queries`` 0), and with it when every request of the
    step is a prefill (vLLM's ``is_prefilling``, or more queries than a verification holds)."""
    qsl = getattr(cm, "query_start_loc_cpu", None)
    ub = getattr(cm, "seq_lens_cpu_upper_bound", None)
    if qsl is None or ub is None or qsl.device.type != "cpu" or ub.device.type != "cpu":
        return None
    q, s = qsl.tolist(), ub.tolist()
    if len(q) != len(s) + 1:
        return None
    if max_decode_queries:
        pre = getattr(cm, "is_prefilling", None)
        pre = pre.tolist() if pre is not None and pre.device.type == "cpu" and pre.numel() == len(s) else None
        for b in range(len(s)):
            n = q[b + 1] - q[b]
            if 0 < n <= max_decode_queries and not (pre is not None and pre[b]):
                return None  # a decode or verification row: its host length may run ahead of the device's
    return q, s


def _host_lengths(m) -> tuple[list[int], list[int]]:
    """The step's query starts and sequence lengths as host lists: the exact host copies our metadata builder kept
    (``host_lengths_of``), else one device-to-host copy per step and metadata object (a sync: the host stops
    there until the GPU has run everything queued before, and an eager step's host then trails its GPU)."""
    how = envs.QWEN4EXP_QSA_HOST_LENGTHS
    host = getattr(m, "qwen4exp_host_lengths", None) if how != "device" else None
    if host is not None and how != "check":
        return host
    dev = _once_per_forward("_qwen4exp_host_lengths", m, None,
                            lambda: (m.query_start_loc.tolist(), m.seq_lens.tolist()))
    if host is not None and (list(host[0]), list(host[1])) != (list(dev[0]), list(dev[1])):
        raise RuntimeError(f"qwen4exp QSA: vLLM's host lengths (query starts {host[0]}, sequence lengths {host[1]}) "
                           f"differ from the device's ({dev[0]}, {dev[1]})")
    return dev


def _to_device(lists: list, device) -> list[torch.Tensor]:
    """Host index lists (or int arrays) -> int64 tensors on ``device`` with ONE copy (through pinned memory on GPUs,
    queued on the stream without waiting for it: a plain tensor(..., device=cuda) from pageable memory can block the
    host)."""
    sizes = [len(x) for x in lists]
    if any(isinstance(x, np.ndarray) for x in lists):
        flat = torch.from_numpy(np.concatenate([np.asarray(x, dtype=np.int64) for x in lists]))
    else:
        flat = torch.tensor([v for x in lists for v in x], dtype=torch.long)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    else:
        flat = flat.to(device)
    return list(torch.split(flat, sizes))


class QSACacheLayer(Attention):
    """A QSA layer's vLLM cache layer: vLLM's attention layer for the main K/V (its backend and metadata), whose
    spec pads each page by the index tail (``ops.qsa.layout.tail_elements``: block keys, raw-key ring, M-RoPE
    stash). vLLM pads the other layers' pages to the same size; nothing else changes for it."""

    def __init__(self, *args, index_dim: int, r: int, ring: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.qsa_index = (index_dim, r, ring)

    def get_kv_cache_spec(self, vllm_config):
        spec = super().get_kv_cache_spec(vllm_config)
        if spec is None:
            return spec
        d_i, r, rr = self.qsa_index
        tail = qlayout.tail_elements(spec.block_size, d_i, r, rr) * spec.dtype.itemsize
        return dataclasses.replace(spec, page_size_padded=spec.real_page_size_bytes + tail)


class QSAMixer(QSAAttention):
    """Our QSA math (``QSAAttention``: same parameter names as the checkpoint) plus its caches, held in ONE vLLM
    attention layer (``QSACacheLayer``): the main K/V rows, and in each page's tail the indexer's block keys and the
    ring of its open block's raw keys (``ops.qsa.layout``). One layer, so one KV-cache group with the main K/V's
    block size: prefix-cache hits land on its block boundaries (a separate, narrower index cache got 4x longer
    blocks, and hits had to end on those), and vLLM's MTP proposer, which wants every draft layer in one group,
    takes the same class."""

    def __init__(self, config, vllm_config, prefix: str, rotary, share_selection: bool = False):
        super().__init__(config, vllm_linear, prefix)
        # MTP draft layer of a model with index_share_for_mtp_iteration: draft steps 1+ reuse the block selection
        # of step 0 (``set_skip_topk`` / ``compact_topk_indices`` of the draft model, driven by vLLM's proposer)
        self.share_selection = share_selection
        self.reuse_selection = False
        self._kept: torch.Tensor | None = None  # [rows, m] int32: the last selecting step's block ids per token row
        self._kept_fresh = False  # _kept holds a selection of the current drafting round (not a stale one)
        self._kept_rows = vllm_config.scheduler_config.max_num_batched_tokens
        self.eager_name = prefix
        self._max_len = vllm_config.model_config.max_model_len
        sc = vllm_config.scheduler_config  # the most single-query rows an eager step batches (``_decode_batch``)
        self._max_rows = min(sc.max_num_batched_tokens or 1 << 30, BATCHED_MAX_QUERIES * sc.max_num_seqs)
        self.rotary = [rotary]  # shared module, kept out of this module's parameters
        self.ring_rows = qlayout.ring_rows(self.r, UNIFORM_MAX_QUERIES)
        self.cache_layer = QSACacheLayer(self.n_kv, self.head_dim, self.scale, num_kv_heads=self.n_kv,
                                         cache_config=vllm_config.cache_config, prefix=f"{prefix}.attn",
                                         index_dim=self.indexer.head_dim, r=self.r, ring=self.ring_rows)
        # (the implementation object stays FlashAttention's where the lean subclass is swapped in: only vLLM's
        # metadata builder, looked up through the layer's backend class, changes)
        self.cache_layer.attn_backend = qsa_cache_backend(self.cache_layer.attn_backend)
        self.attn = self.cache_layer
        self._views: tuple | None = None  # (cache tensor key, IndexViews)

    def index_views(self, kv: torch.Tensor) -> qlayout.IndexViews:
        """The index views of the layer's cache ``kv`` (made once per cache tensor)."""
        key = (kv.data_ptr(), tuple(kv.shape), kv.stride(), kv.dtype)
        if self._views is None or self._views[0] != key:
            self._views = (key, qlayout.index_views(kv, self.indexer.head_dim, self.r, self.ring_rows))
        return self._views[1]

    _scales_checked = False

    def check_kv_scales(self) -> None:
        """FP8 caches store K/V as they are (scale 1); a checkpoint with calibrated K/V scales is refused, naming
        the layer, rather than read wrongly."""
        a = self.cache_layer
        ks, vs = getattr(a, "_k_scale_float", 1.0), getattr(a, "_v_scale_float", 1.0)
        if (ks, vs) != (1.0, 1.0) and a.kv_cache_dtype in _FP8:
            raise NotImplementedError(f"qwen4exp QSA {a.layer_name}: FP8 KV cache with calibrated scales "
                                      f"(k {ks}, v {vs}) is not supported yet; serve with --kv-cache-dtype auto")
        self._scales_checked = True

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        p = self.project(x, cos, sin)
        out = eager_segment(self, torch.empty_like(p.q), p.q, p.k, p.v, p.index_q, p.index_k_raw, positions, p.gate)
        return self.output(out, None)  # (gated in the segment)

    def eager_forward(self, out, q, k, v, index_q, index_k_raw, positions, gate) -> None:
        """Cache writes, block keys, selection + attention for this step's tokens, the output gate applied (an eager
        graph segment: reads the step's attention metadata on the host). Rows past the step's real tokens (graph
        padding) are zero. A uniform decode batch gets the gate inside the attention's merge kernel (no kernels of
        its own); other steps after it."""
        if not self._warmed:  # the first forward pass with the KV caches in place (vLLM's warm-up or capture runs)
            self._warmed = self._warm_up(q)
        md = get_forward_context().attn_metadata
        if md is None or self.attn.layer_name not in md:  # profiling / warm-up run: no metadata
            out.zero_()
            return
        m = md[self.attn.layer_name]  # main K/V and index rows: one cache layer, one metadata and block table
        if not self._scales_checked:
            self.check_kv_scales()
        nq = uniform_queries(m)
        if nq > 1 and positions.dim() == 2 and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
            nq = 0  # M-RoPE prompt chunks may hold image tokens (their block keys rotate at stored positions): the
            # general path; FULL graphs capture decode batches only, whose tokens are text
        if nq:  # pure decode, or 1 + k queries for every request (MTP): the graph-capturable path
            self._decode_step(out, q, k, v, index_q, index_k_raw, m, positions, nq, gate)
            return
        out.zero_()
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("qwen4exp QSA: only batches of equally many queries per request (decodes, MTP "
                               f"verifications) can be captured in a FULL CUDA graph (got max_query_len="
                               f"{m.max_query_len}, {m.num_actual_tokens} tokens, {m.seq_lens.shape[0]} requests)")
        n = int(m.num_actual_tokens)
        qsl, seq_lens = _host_lengths(m)
        nreq = len(seq_lens)
        pos3 = None
        if positions.dim() == 2:  # M-RoPE (t, h, w): token indices from the step's lengths, not from positions
            pos3 = positions[:, :n].long()
            pos1 = token_indices(qsl, seq_lens, positions.device)
        else:
            pos1 = positions[:n].long()
        r = self.r
        # 1. main K/V into the paged cache
        kv = _kv_cache(self.attn)
        slots = m.slot_mapping[:n].long()
        write_paged(kv, slots, k[:n], v[:n])
        # 2. the keys of the blocks this step's tokens complete (earlier raw keys of their blocks from the pages'
        #    rings), then the raw keys of the blocks still open into the rings
        views = self.index_views(kv)
        ikv = views.index_kv
        raw = index_k_raw[:n]
        self._complete_blocks(raw, qsl, seq_lens, m, views, slots, pos3)
        self._keep_open(raw, qsl, seq_lens, m, views, slots, pos1, pos3)
        # 3. selection + attention: the queries of requests with few of them (decodes, MTP verifications, short
        #    chunks) in one batched call, each longer chunk through the paged prefill op (Triton on GPUs)
        few = [b for b in range(nreq) if 0 < qsl[b + 1] - qsl[b] <= BATCHED_MAX_QUERIES]
        if few:
            self._decode_batch(out, q, index_q, pos1, few, qsl, seq_lens, m, kv, ikv)
        done = set(few)
        for b in range(nreq):
            s, e = qsl[b], qsl[b + 1]
            if e <= s or b in done:
                continue
            out[s:e] = qsa_prefill_paged(q[s:e], pos1[s:e], index_q[s:e], kv, m.block_table[b], ikv, seq_lens[b],
                                         r, self.budget, self.scale, self.index_scale).to(out.dtype)
            if self.share_selection:  # the chunk's last query: the row a later draft step may reuse
                self._keep(qsa_select_paged(pos1[e - 1:e], index_q[e - 1:e], ikv, m.block_table[b:b + 1],
                                            max(1, seq_lens[b] // r), r, self.budget, self.index_scale),
                           slice(e - 1, e))
        out[:n] = output_gate(out[:n], gate[:n])

    _warmed = False

    def _warm_up(self, q) -> bool:
        """At the first forward pass after vLLM allocated the KV caches (its warm-up and CUDA-graph capture runs,
        which may or may not carry attention metadata): compile the paged prefill's and the eager decode rows' kernel
        variants on this layer's real cache views, once a process per cache layout (``QWEN4EXP_QSA_WARMUP``).
        vLLM's own warm-ups run there too; ours would otherwise compile while serving (the first long prompts:
        seconds at the real widths; the first MTP verifications and mixed steps as contexts grow). False: not yet
        (no caches: the profiling run; or inside a graph capture), try again at the next pass."""
        if not (q.is_cuda and envs.QWEN4EXP_QSA_WARMUP):
            return True
        if torch.cuda.is_current_stream_capturing():
            return False
        kv = _kv_cache(self.attn)
        if kv.dim() != 4 or kv.numel() == 0:
            return False  # the profiling run, before the caches exist
        views = self.index_views(kv)
        ikv = views.index_kv
        key = (str(kv.device), kv.dtype, q.dtype, tuple(kv.shape[1:]), kv.stride(), tuple(ikv.shape[1:]),
               ikv.stride(), self.n_heads, self.indexer.n_heads, self.r, self.budget, self._max_len, self._max_rows)
        if key in _WARMED:
            return True
        _WARMED.add(key)
        import time

        t0 = time.perf_counter()
        try:
            cases = warm_up_prefill(kv, ikv, self.n_heads, self.indexer.n_heads, self._max_len, self.r, self.budget,
                                    self.scale, self.index_scale, q.dtype)
            cases += warm_up_decode(kv, ikv, self.n_heads, self.indexer.n_heads, self._max_len, self._max_rows,
                                    self.r, self.budget, self.scale, self.index_scale, q.dtype)
            # the block keys a prefill step completes (its index-key norm kernel), as ``_complete_blocks``, and the
            # writes of keys, ring and stash rows (one padding row each: stores nothing)
            d_i = self.indexer.head_dim
            cb, sb = self.rotary[0](torch.arange(0, 16 * self.r, self.r, device=q.device), q.dtype)
            self.block_keys(block_mean(torch.zeros(16 * self.r, d_i, dtype=q.dtype, device=q.device), self.r), cb,
                            sb)
            none = torch.full((1,), -1, dtype=torch.long, device=q.device)
            for view in (views.keys, views.ring, views.stash):
                half = torch.zeros(1, 1, view.shape[-1] // 2, dtype=view.dtype, device=q.device)
                write_paged(view, none, half, half)
            # a decode step's K|V rows + index update in one launch (``decode_cache_writes``), as eager decode
            # batches past the captured sizes run it; a padding row again
            zero = torch.zeros(1, dtype=torch.long, device=q.device)
            kv1 = torch.zeros(1, self.n_kv, self.head_dim, dtype=q.dtype, device=q.device)
            c1, s1 = self.rotary[0](zero, q.dtype)
            kn = self.indexer.k_layernorm
            decode_cache_writes(kv, ikv, views.ring, none, zero, zero > 0, kv1, kv1, torch.zeros(1, d_i, dtype=q.dtype,
                                device=q.device), kn.weight, kn.eps, c1, s1, self.r)
            torch.cuda.synchronize(q.device)
        except Exception as e:  # (e.g. out of memory): the kernels then compile on first use, as without it
            logger.warning("qwen4exp QSA: the kernel warm-up stopped (%s: %s); kernels compile on first use",
                           type(e).__name__, e)
            return True
        logger.info("qwen4exp QSA: prefill and eager decode kernels warmed up for up to %d tokens (%d cases) in "
                    "%.1f s", self._max_len, len(cases), time.perf_counter() - t0)
        return True

    def _complete_blocks(self, raw, qsl, seq_lens, m, views, slots, pos3=None) -> None:
        """The key of every block completed by this step's tokens, into its page's key row. All requests at once:
        which blocks complete and where each of their r raw keys comes from (this step's rows, or the page's ring
        for positions of earlier steps) is worked out on the host from the step's lengths (``block_plan``: once a
        forward pass, the same for every QSA layer), then ONE gather of the earlier raw keys, one mean-pool, one
        norm + RoPE and one write for all blocks."""
        r = self.r
        n = raw.shape[0]
        plan = _once_per_forward("_qwen4exp_block_plan", m, (r, n),
                                 lambda: block_plan(qsl, seq_lens, r, n, raw.device))
        if plan is None:
            return
        src_t, first_t, last_t, owner_t, pos_t, host = plan
        rows = raw
        bs = views.index_kv.shape[2]
        if pos_t.numel():
            pages = m.block_table[owner_t].gather(1, (pos_t // bs).unsqueeze(1)).squeeze(1).long()
            prev = views.ring[pages, 0, pos_t % self.ring_rows]
            rows = torch.cat([raw, prev.to(raw.dtype)], 0)
        if pos3 is None:
            cb, sb = self.rotary[0](first_t, raw.dtype)
        else:  # M-RoPE: rotate at the (t, h, w) position of each block's first token
            first, first_rows, block_owner = host
            cb, sb = self.rotary[0](block_start_positions(pos3, first, first_rows, block_owner, qsl, views, m),
                                    raw.dtype)
        keys = self.block_keys(block_mean(rows[src_t], r), cb, sb).to(raw.dtype)
        ks = slots[last_t]
        h = keys.shape[1] // 2
        write_paged(views.keys, qlayout.key_slots(ks, bs, r), keys[:, None, :h], keys[:, None, h:])

    def _keep_open(self, raw, qsl, seq_lens, m, views, slots, pos1, pos3=None) -> None:
        """The raw keys of this step's tokens whose block may still be open after it, into their pages' rings
        (and, with M-RoPE, their positions into the stash), for the step that completes the block: of a long chunk,
        the positions from its last block start on; of a request with few queries (decodes, MTP verifications),
        all of them, as drafts it rejects leave blocks open that this step completed."""
        def plan():
            rows = ring_rows_of_step(qsl, seq_lens, self.r)
            return _to_device([rows], raw.device)[0] if rows else None

        rows_t = _once_per_forward("_qwen4exp_ring_rows", m, self.r, plan)  # (the same for every QSA layer)
        if rows_t is None:
            return
        p = pos1[rows_t]
        ring_slots = write_ring(views.ring, views.index_kv.shape[2], slots[rows_t], p, raw[rows_t], write_paged)
        if pos3 is not None:
            stash_positions(views.stash, ring_slots, p, pos3[:, rows_t])

    def _decode_step(self, out, q, k, v, index_q, index_k_raw, m, positions=None, nq: int = 1, gate=None) -> None:
        """A batch of ``nq`` queries per request (decode: 1; MTP verification and draft prefill: 1 + k): cache
        writes, the key of any block a token completes, selection + attention, all with fixed shapes and no host
        sync, so a FULL CUDA graph can capture it (``ops.qsa.step``). Row b * nq + j is query j of request b.
        Requests that pad a captured batch have seq_len 0, slot -1 and a null block table: they write nothing and
        read the null block (finite, discarded)."""
        kv = _kv_cache(self.attn)
        views = self.index_views(kv)
        ikv = views.index_kv
        inp = self._decode_inputs(m, index_k_raw.dtype, positions, nq)
        n = inp.n
        if out.shape[0] > n:
            out[n:].zero_()
        kn = self.indexer.k_layernorm
        decode_writes(kv, views, k, v, index_k_raw, inp, kn.weight, kn.eps, self.r, nq)
        # n_blocks: every block the table can hold while capturing (replays serve any length), else the step's max
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            n_blocks = inp.block_table.shape[1] * kv.shape[2] // self.r
            if nq > 1:
                _log_capture_once(nq)
        else:
            n_blocks = max(1, int(m.max_seq_len) // self.r)
        out[:n] = self._attend_decodes(q[:n], index_q[:n], inp.pos, inp.block_table, kv, ikv, n_blocks,
                                       gate=None if gate is None else gate[:n])

    def _decode_inputs(self, m, dtype, positions=None, nq: int = 1) -> DecodeInputs:
        """``ops.qsa.step.decode_inputs`` of the step's metadata: the same for every QSA layer of the step (one
        KV-cache group: one metadata object), so computed once a forward pass (``_once_per_forward``; inside a
        captured graph the first layer's kernels serve the later layers)."""
        return _once_per_forward(
            "_qwen4exp_decode_inputs", m, (dtype, self.r, nq),
            lambda: decode_inputs(m.seq_lens, m.block_table, m.slot_mapping, nq, self.r, self.rotary[0], dtype,
                                  positions))

    def _decode_batch(self, out, q, index_q, pos1, reqs, qsl, seq_lens, m, kv, ikv) -> None:
        """Every query of the requests ``reqs`` of a mixed step in one batched call, one row per query with its own
        position and its request's block-table row (no per-request loop)."""
        rows, owner = _to_device([[i for b in reqs for i in range(qsl[b], qsl[b + 1])],
                                  [b for b in reqs for _ in range(qsl[b], qsl[b + 1])]], q.device)
        n_blocks = max(1, max(seq_lens[b] for b in reqs) // self.r)
        out[rows] = self._attend_decodes(q[rows], index_q[rows], pos1[rows], m.block_table[owner], kv, ikv, n_blocks,
                                         rows)

    def _attend_decodes(self, q, index_q, pos, bt, kv, ikv, n_blocks: int, rows=None, gate=None) -> torch.Tensor:
        """Selection + attention of single queries, main K/V and index rows read through the layer's one block
        table (``qsa_decode_paged``: one Triton pass on GPUs). ``rows``: the queries' token rows in the step (None:
        rows 0..B-1), where a sharing draft layer keeps their selection; ``gate``: the output gate, applied."""
        if not self.share_selection:
            return qsa_decode_paged(q, pos, index_q, kv, bt, ikv, bt, n_blocks, self.r, self.budget, self.scale,
                                    self.index_scale, gate)
        if self.reuse_selection and self._kept_fresh:
            ids = reused_block_ids(self._kept[: pos.shape[0]], pos, self.r)
            _log_reuse_once(self.eager_name)
        else:
            ids = qsa_select_paged(pos, index_q, ikv, bt, n_blocks, self.r, self.budget, self.index_scale)
            self._keep(ids, slice(0, ids.shape[0]) if rows is None else rows)
        return qsa_attend_paged(q, pos, kv, bt, ids, self.r, self.budget, self.scale, gate)

    def _keep(self, ids: torch.Tensor, rows) -> None:
        """Remember the block ids [n, m] selected for this step's token rows ``rows`` (a slice or an index tensor)."""
        if self._kept is None or self._kept.device != ids.device:
            # int32: block ids < 2^31; [max_num_batched_tokens, budget / r] (32 MB at 16,384 x 512)
            self._kept = torch.full((self._kept_rows, ids.shape[1]), -1, dtype=torch.int32, device=ids.device)
        self._kept[rows] = ids.to(torch.int32)
        self._kept_fresh = True

    def set_reuse(self, reuse: bool) -> None:
        """vLLM's ``set_skip_topk``: True for draft steps 1+; False before step 0 of a round, which also forgets the
        last round's selection (a layer that did not select in this round, e.g. the second of two MTP layers,
        selects afresh instead of reusing a stale one)."""
        self.reuse_selection = bool(reuse) and self.share_selection
        if not reuse:
            self._kept_fresh = False

    def keep_rows(self, row_indices: torch.Tensor) -> None:
        """After a draft's step 0: request i's kept selection becomes the one of its token row ``row_indices[i]``
        (its last query), so that steps 1+ (one query per request, row i = request i) find it in row i."""
        if self._kept is not None:
            n = row_indices.numel()
            self._kept[:n] = self._kept.index_select(0, row_indices.to(self._kept.device).long())


# -- M-RoPE (images / video): the block key of a block rotates at the (t, h, w) position of its first token -------
# Blocks completed in the step of their first token read it from the step's positions. For a block that started in
# an earlier step, its first token's (t, h, w) position was stashed beside its ring row (``stash_positions``): four
# numbers (t, h, w and the token's index, to tell a current entry from an older token's), base-8 digits + 1, exact
# in every cache dtype (FP8 included). A token written by a decode step stashes nothing; its position is then
# extrapolated from this step's first token (exact for text after the last image).
_DIGITS, _BASE = 8, 8  # positions < 8^8


def block_plan(qsl: list[int], seq_lens: list[int], r: int, n: int, device):
    """Where the blocks a step completes take their raw keys: (source rows [blocks * r] (< n: this step's rows;
    n + i: the i-th earlier position), each block's first position, the row of its last token, the request and
    position of each earlier one, as device tensors, and (first positions, first rows (-1: earlier), requests) as
    host lists for M-RoPE); None when no block completes. Host work from the step's lengths, a few array ops per
    request (a 16k-token chunk's 4k blocks built one by one in Python held the GPU ~3 ms, run 30), one copy to the
    device."""
    parts: dict[str, list] = {k: [] for k in ("src", "first", "last", "prev_owner", "prev_pos", "first_rows",
                                              "block_owner")}
    n_prev = 0  # earlier positions so far
    for b in range(len(seq_lens)):
        s, e = qsl[b], qsl[b + 1]
        if e <= s:
            continue
        start = seq_lens[b] - (e - s)  # position of row s
        base = (start // r) * r
        nfull = (seq_lens[b] - base) // r  # blocks from base on that end within this step
        if not nfull:
            continue
        back = start - base  # earlier positions of the first block (only it reaches back)
        if back:
            parts["src"].append(np.arange(n + n_prev, n + n_prev + back))
            parts["prev_owner"].append(np.full(back, b))
            parts["prev_pos"].append(np.arange(base, start))
            n_prev += back
        parts["src"].append(np.arange(s, s + nfull * r - back))
        j = np.arange(nfull) * r  # block starts past base
        parts["first"].append(base + j)
        parts["last"].append(s - back + j + r - 1)
        parts["first_rows"].append(np.where(j >= back, s - back + j, -1))
        parts["block_owner"].append(np.full(nfull, b))
    if not parts["first"]:
        return None
    cat = {k: np.concatenate(v) if v else np.zeros(0, dtype=np.int64) for k, v in parts.items()}
    dev = _to_device([cat[k] for k in ("src", "first", "last", "prev_owner", "prev_pos")], device)
    return (*dev, tuple(cat[k].tolist() for k in ("first", "first_rows", "block_owner")))


def ring_rows_of_step(qsl: list[int], seq_lens: list[int], r: int) -> list[int]:
    """The rows of an eager step whose raw keys go into the rings (``QSAMixer._keep_open``): every row of a request
    with few queries (a decode or an MTP verification, whose rejected drafts may leave open a block this step
    completed), and of a longer chunk the rows from its last block start on."""
    rows = []
    for b in range(len(seq_lens)):
        s, e = qsl[b], qsl[b + 1]
        if e - s > BATCHED_MAX_QUERIES:
            rows.extend(range(max(s, e - seq_lens[b] % r), e))
        elif e > s:
            rows.extend(range(s, e))
    return rows


def token_indices(qsl: list[int], seq_lens: list[int], device) -> torch.Tensor:
    """Index of every token of the step in its sequence (row s of request b is token seq_len - query_len)."""
    lens = [qsl[b + 1] - qsl[b] for b in range(len(seq_lens))]
    off = torch.tensor([seq_lens[b] - lens[b] - qsl[b] for b in range(len(seq_lens))], dtype=torch.long)
    idx = torch.repeat_interleave(off, torch.tensor(lens, dtype=torch.long)) + torch.arange(qsl[-1])
    return idx.to(device)


def _digits(x: torch.Tensor) -> torch.Tensor:
    """[..., k] non-negative ints -> [..., k * _DIGITS] base-8 digits + 1."""
    d = torch.stack([(x // _BASE ** i) % _BASE for i in range(_DIGITS)], -1) + 1
    return d.reshape(*x.shape[:-1], -1)


def stash_positions(stash: torch.Tensor, ring_slots: torch.Tensor, idx: torch.Tensor, pos3: torch.Tensor) -> None:
    """Stash (t, h, w) positions ``pos3`` [3, k] and token indices ``idx`` [k] at the ring slots of their tokens."""
    vals = torch.cat([pos3.T.clamp(min=0), idx.unsqueeze(1)], 1).long()  # [k, 4]
    row = torch.zeros(vals.shape[0], stash.shape[-1], dtype=stash.dtype, device=stash.device)
    row[:, : 4 * _DIGITS] = _digits(vals).to(stash.dtype)
    h = stash.shape[-1] // 2
    write_paged(stash, ring_slots, row[:, None, :h], row[:, None, h:])


def block_start_positions(pos3, first, first_rows, owners, qsl, views, m) -> torch.Tensor:
    """(t, h, w) positions [3, nblocks] of the blocks' first tokens (indices ``first``; ``first_rows``: their rows
    in this step, -1 for a token of an earlier step; ``owners``: each block's request)."""
    dev = pos3.device
    out = pos3[:, torch.tensor([max(f, 0) for f in first_rows], dtype=torch.long, device=dev)].clone()
    early = [j for j, f in enumerate(first_rows) if f < 0]
    if not early:
        return out
    owner_t = torch.tensor([owners[j] for j in early], dtype=torch.long, device=dev)
    pp = torch.tensor([first[j] for j in early], dtype=torch.long, device=dev)
    bs, rr = views.index_kv.shape[2], views.ring.shape[2]
    pages = m.block_table[owner_t].gather(1, (pp // bs).unsqueeze(1)).squeeze(1).long()
    row = views.stash[pages, 0, pp % rr, : 4 * _DIGITS]
    digits = row.float().round().long().view(len(early), 4, _DIGITS) - 1
    weights = torch.tensor([_BASE ** i for i in range(_DIGITS)], device=dev)
    stored = (digits.clamp(min=0) * weights).sum(-1)  # [early, 4]
    ok = ((digits >= 0).all(-1).all(-1) & (stored[:, 3] == pp)).tolist()
    for k, j in enumerate(early):
        if ok[k]:
            out[:, j] = stored[k, :3]
        else:  # not stored: extrapolate back from the request's first row s of this step (token index start)
            s0 = qsl[owners[j]]
            start = _request_start(m, owners[j], qsl)
            out[:, j] = pos3[:, s0] - (start - first[j])
    return out


def _request_start(m, b: int, qsl) -> int:
    _, seq_lens = _host_lengths(m)
    return seq_lens[b] - (qsl[b + 1] - qsl[b])


@functools.cache
def _log_reuse_once(layer: str) -> None:
    logger.info("qwen4exp MTP %s: draft steps 1+ reuse step 0's QSA block selection "
                "(index_share_for_mtp_iteration)", layer)


@functools.cache
def _log_capture_once(nq: int) -> None:
    logger.info("qwen4exp QSA: capturing FULL CUDA graphs of %d queries per request (MTP verification / draft "
                "prefill)", nq)
