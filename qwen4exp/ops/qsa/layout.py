"""The paged QSA cache page: one vLLM attention page per QSA layer holds the main K/V rows AND the indexer's keys.

A page of ``bs`` tokens (vLLM's block) is laid out as

    [ main K|V: n_kv heads x bs rows x 2 * hd ]  (vLLM's own view of the layer: [blocks, n_kv, bs, 2 * hd])
    [ block keys: bs / r keys, each ``s * r`` wide, s = ceil(d_i / r) ]  (the key of the page's j-th block of r tokens)
    [ raw ring: rr rows x d_i ]  (raw indexer keys of the page's open block; position p at row p % rr)
    [ stash: rr rows x 32 ]  (M-RoPE: the (t, h, w) position and index of the token at ring row p % rr)

which the layer's spec asks vLLM for as page padding (``tail_elements``). Per token that is the main K/V plus
d_i / r block-key elements (2,112 B at the real widths against 3,072 B when every token kept its raw key and a
block-key column): the raw keys live only as long as their block is open, in a ring of ``rr`` rows per page (a
block of r tokens never spans two pages, as bs % r == 0).

``rr`` (``ring_rows``) is large enough that a row read for position p was written by p itself, never by another
position of the same residue: a step writes the raw keys of its open blocks' positions before anything reads them,
and drafts rejected by MTP lie at most 2 k positions past the accepted ones (their rows are rewritten by the
step that reaches those positions again, before anything reads them).

Readers get ``index_kv``: a [pages, 1, bs, 2 * d_i] view in which block j's key is row j * r + r - 1, columns
[d_i, 2 d_i), the same contract as a dense per-token index cache, so the selection kernels and their references
read either. Here its rows are ``s`` elements apart (the view overlaps itself: only those rows and columns mean
anything); write block keys through ``keys`` ([pages, 1, bs / r, s * r]) only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def key_stride(d_i: int, r: int) -> int:
    """Elements between consecutive rows of the ``index_kv`` view (block keys are r rows apart)."""
    return -(-d_i // r)


def ring_rows(r: int, max_step_queries: int) -> int:
    """Ring rows per page. A row read for position p (an earlier token of p's open block, at least p - r + 1)
    must not have been rewritten by another position of the same residue since: the highest position written in
    between is a step's last query (up to ``max_step_queries`` - 1 past its first) or an MTP draft (up to 2 k
    past the accepted tokens: the target's verification and the draft's own steps, k + 1 <= max_step_queries).
    So more than 2 * max_step_queries + r - 2 rows; rounded up to a multiple of r."""
    need = 2 * max_step_queries + r
    return -(-need // r) * r


STASH = 32  # stash row width: 4 numbers (t, h, w, token index) of 8 base-8 digits (``qsa.stash_positions``)


def tail_elements(bs: int, d_i: int, r: int, rr: int) -> int:
    """Elements past the main K/V rows of a page: block keys, ring and stash (a multiple of 128: pages stay
    aligned for vector loads whatever the widths)."""
    if bs % r:
        raise ValueError(f"qwen4exp QSA: the cache block size {bs} is not a multiple of the block length r={r}")
    n = bs * key_stride(d_i, r) + rr * (d_i + STASH)
    return -(-n // 128) * 128


def ring_slots(slots: torch.Tensor, pos: torch.Tensor, bs: int, rr: int) -> torch.Tensor:
    """Flat rows of the ``ring`` view ([pages * rr]) of tokens at cache ``slots`` and positions ``pos``; -1 where the
    slot is negative (padding)."""
    return torch.where(slots >= 0, (slots // bs) * rr + pos % rr, -1)


def key_slots(slots: torch.Tensor, bs: int, r: int) -> torch.Tensor:
    """Flat rows of the ``keys`` view ([pages * bs / r]) of the blocks that the tokens at cache ``slots`` complete."""
    return (slots // bs) * (bs // r) + (slots % bs) // r


class IndexViews(NamedTuple):
    index_kv: torch.Tensor  # [pages, 1, bs, 2 * d_i] block key j at row j * r + r - 1, columns [d_i, 2 d_i)
    keys: torch.Tensor  # [pages, 1, bs // r, d_i] block keys (rows s * r apart: the writers' view)
    ring: torch.Tensor  # [pages, 1, rr, d_i] raw keys of open blocks, position p at row p % rr
    stash: torch.Tensor  # [pages, 1, rr, STASH] M-RoPE positions of the ring's tokens


def index_views(kv: torch.Tensor, d_i: int, r: int, rr: int) -> IndexViews:
    """The index views of a paged QSA cache ``kv`` ([pages, n_kv, bs, 2 * hd], vLLM's view of the layer, whose
    pages hold ``tail_elements`` more past the main rows)."""
    pages, _, bs, _ = kv.shape
    s = key_stride(d_i, r)
    main = sum((n - 1) * st for n, st in zip(kv.shape[1:], kv.stride()[1:])) + 1
    if main != kv.shape[1] * bs * kv.shape[3]:
        raise ValueError(f"qwen4exp QSA: the cache page is not dense (shape {tuple(kv.shape)}, strides "
                         f"{kv.stride()}); the index tail needs the main rows contiguous")
    need = main + tail_elements(bs, d_i, r, rr)
    if pages > 1 and kv.stride(0) < need:
        raise ValueError(f"qwen4exp QSA: a cache page of {kv.stride(0)} elements has no room for the index tail "
                         f"(needs {need}: was the layer's spec padded? see QSAMixer)")
    if pages and kv.untyped_storage().nbytes() < (kv.storage_offset() + (pages - 1) * kv.stride(0) + need) \
            * kv.element_size():
        raise ValueError(f"qwen4exp QSA: the cache storage ends before the last page's index tail")
    tail = kv.storage_offset() + main
    bst = kv.stride(0)
    index_kv = kv.as_strided((pages, 1, bs, 2 * d_i), (bst, 1, s, 1), tail - (r - 1) * s - d_i)
    w = s * r
    keys = kv.as_strided((pages, 1, bs // r, d_i), (bst, 1, w, 1), tail)
    ring0 = tail + bs * s
    ring = kv.as_strided((pages, 1, rr, d_i), (bst, 1, d_i, 1), ring0)
    stash = kv.as_strided((pages, 1, rr, STASH), (bst, 1, STASH, 1), ring0 + rr * d_i)
    return IndexViews(index_kv, keys, ring, stash)


def paged_cache(pages: int, n_kv: int, bs: int, hd: int, d_i: int, r: int, rr: int, dtype=torch.bfloat16,
                device="cpu", pad: int = 0) -> torch.Tensor:
    """A zeroed paged QSA cache [pages, n_kv, bs, 2 * hd] whose pages hold the index tail (+ ``pad`` elements,
    as vLLM pads pages to a common size): what the plugin gets from vLLM, for tests and benchmarks."""
    page = n_kv * bs * 2 * hd + tail_elements(bs, d_i, r, rr) + pad
    if dtype.itemsize == 1:
        buf = torch.zeros(pages * page, dtype=torch.uint8, device=device).view(dtype)
    else:
        buf = torch.zeros(pages * page, dtype=dtype, device=device)
    return buf.as_strided((pages, n_kv, bs, 2 * hd), (page, bs * 2 * hd, 2 * hd, 1))
