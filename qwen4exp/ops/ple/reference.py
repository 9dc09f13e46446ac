"""PLE hashed n-gram embedding: context ids, hashing, table lookup; and the gated, convolved mix into the streams.

Token context "shift right without crossing EOS": for the token at t, T_0 = id_t and for k >= 1
T_k = id_{t-k} unless t-k is before the sequence start or an EOS sits at some p with t-k <= p < t ... except that
the first EOS met walking back from t-1 is itself kept. Equivalently: T_k = id_{t-k} if the segment that holds t
(segments end after each EOS) reaches back to t-k, else EOS. Packed sequences carry the previous ``n-1`` ids as
context (EOS-filled for a fresh sequence).

Hash for order o (2..n): m_o = XOR_{j<o} (T_j * mu_j) (int64, wrap-free), head g of that order reads row
(m_o mod size_g) + offset_g of the one shared table.
"""

from __future__ import annotations

import math

import torch

from ..varlen import seq_lens

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def splitmix64(z: int) -> int:
    z = (z + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def hash_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """Odd multipliers mu_j <= (2^63-1)/V so that id * mu never overflows int64."""
    bound = ((1 << 63) - 1) // max(vocab_size, 1)
    half = max(1, bound // 2)
    base = seed + 10007 * ple_index
    return [2 * (splitmix64((base + _GOLDEN * (j + 1)) & _MASK64) % half) + 1 for j in range(ngram_size)]


def _is_prime(x: int) -> bool:
    if x < 2:
        return False
    if x % 2 == 0:
        return x == 2
    return all(x % d for d in range(3, math.isqrt(x) + 1, 2))


def head_table_sizes(base: int, num_heads: int, ple_index: int) -> list[int]:
    """Consecutive primes >= base; PLE layer q takes primes q*G .. q*G+G-1 of that sequence."""
    out, p, need, skip = [], base - 1, num_heads, ple_index * num_heads
    while need:
        p += 1
        while not _is_prime(p):
            p += 1
        if skip:
            skip -= 1
        else:
            out.append(p)
            need -= 1
    return out


def table_rows(sizes: list[int], divisor: int) -> int:
    return -(-sum(sizes) // divisor) * divisor


def ngram_context(
    ids: torch.Tensor,  # [T] packed token ids
    cu_seqlens: torch.Tensor,  # [N+1]
    prev: torch.Tensor,  # [N, n-1] previous ids (oldest first), EOS-filled at sequence start
    eos: int,
) -> torch.Tensor:
    """[T, n]: column k is T_k (the id k tokens back, EOS past a segment boundary). Every size comes from the
    shapes (T tokens, N sequences, n-1 carried ids each), so nothing waits for the device: a prefill chunk's host
    keeps running ahead of the GPU (docs/performance.md, run 31: what its syncs cost a 50k prefill)."""
    ctx_len = prev.shape[1]
    T, N = ids.numel(), cu_seqlens.numel() - 1
    total = T + N * ctx_len  # history per sequence: prev ids then new ids, packed as [N*(n-1) + T]
    dev = ids.device
    lens = seq_lens(cu_seqlens)
    hist_lens = lens + ctx_len
    hist_cu = torch.zeros(N + 1, dtype=torch.long, device=dev)
    hist_cu[1:] = hist_lens.cumsum(0)
    seq_of = torch.repeat_interleave(torch.arange(N, device=dev), hist_lens, output_size=total)
    local = torch.arange(total, device=dev) - hist_cu[seq_of]
    # where each carried id and each new token sits in the history (token t of sequence b: t + (b + 1) * (n-1))
    prev_at = (hist_cu[:-1].unsqueeze(1) + torch.arange(ctx_len, device=dev)).reshape(-1)
    tok_seq = torch.repeat_interleave(torch.arange(N, device=dev), lens, output_size=T)
    new_at = torch.arange(T, device=dev) + (tok_seq + 1) * ctx_len
    hist = torch.empty(total, dtype=torch.long, device=dev)
    hist[prev_at] = prev.long().reshape(-1)
    hist[new_at] = ids.long()
    # segment start = one past the last EOS strictly before each position (within the history)
    pos = local
    eos_at = torch.where(hist == eos, pos, torch.full_like(pos, -1))
    # cumulative max within each sequence: offset by sequence so that maxima do not leak across sequences
    big = total + 2  # > any local position + 1
    keyed = torch.where(eos_at >= 0, eos_at + seq_of * big, seq_of * big - 1)
    last_eos_incl = torch.cummax(keyed, 0).values - seq_of * big
    last_eos_before = torch.cat([last_eos_incl.new_full((1,), -1), last_eos_incl[:-1]])
    last_eos_before = torch.where(local == 0, torch.full_like(local, -1), last_eos_before)
    seg_start = last_eos_before + 1
    cols = [hist]
    gidx = torch.arange(total, device=dev)
    for k in range(1, ctx_len + 1):
        src = local - k
        ok = (src >= 0) & (src >= seg_start)
        cols.append(torch.where(ok, hist[(gidx - k).clamp_min(0)], torch.full_like(hist, eos)))
    return torch.stack(cols, 1)[new_at]


def ngram_context_decode(ids: torch.Tensor, prev: torch.Tensor, eos: int) -> torch.Tensor:
    """``ngram_context`` for one new token per sequence (decode): ids [N], prev [N, n-1] -> [N, n]. Fixed shapes,
    no host sync (usable inside a CUDA graph). T_k = prev[-k] unless an EOS sits among the k ids back from t-1
    to t-k (the segment of t then starts after it), else EOS."""
    c = prev.shape[1]
    hist = torch.cat([prev.long(), ids.long().unsqueeze(1)], 1)  # [N, c+1]: ids t-c .. t
    is_eos = hist[:, :c] == eos
    # EOS anywhere in t-k .. t-1 <=> in columns c-k .. c-1: a suffix-OR over the history columns
    eos_since = is_eos.flip(1).cummax(1).values  # [:, k-1]: EOS in t-k .. t-1
    cols = [hist[:, c]] + [torch.where(eos_since[:, k - 1], torch.full_like(hist[:, c], eos), hist[:, c - k])
                           for k in range(1, c + 1)]
    return torch.stack(cols, 1)


def ngram_ids(
    ctx: torch.Tensor,  # [T, n] from ngram_context
    multipliers: torch.Tensor,  # [n] int64
    head_sizes: torch.Tensor,  # [G] int64
    head_offsets: torch.Tensor,  # [G] int64
    heads_per_ngram: int,
) -> torch.Tensor:
    """[T, G] row ids into the shared table (heads ordered by n-gram order, then head)."""
    n = ctx.shape[1]
    prod = ctx.long() * multipliers.view(1, n)
    blocks = []
    mixed = prod[:, 0]
    for order in range(2, n + 1):
        mixed = torch.bitwise_xor(mixed, prod[:, order - 1])
        g0 = (order - 2) * heads_per_ngram
        sz = head_sizes[g0: g0 + heads_per_ngram]
        blocks.append(torch.remainder(mixed.unsqueeze(1), sz.view(1, -1)) + head_offsets[g0: g0 + heads_per_ngram])
    return torch.cat(blocks, 1)


def ngram_lookup_decode(
    ids: torch.Tensor,  # [N] one new token id per sequence
    prev: torch.Tensor,  # [N, n-1] the previous ids (oldest first), n >= 2
    eos: int,
    multipliers: torch.Tensor,
    head_sizes: torch.Tensor,
    head_offsets: torch.Tensor,
    heads_per_ngram: int,
    table: torch.Tensor,
    scale: torch.Tensor | None,
    out_dtype: torch.dtype | None,
    lookup=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode: context, hashed rows and the table gather of one token per sequence -> (embeddings [N, G*d_g] on
    ids' device, the new context [N, n-1]: prev shifted by one, the id last). ``lookup``: the gather (default
    ``ple_lookup`` here; the CUDA path hands in its kernel, which gathers a pinned host table for GPU ids through
    unified addressing)."""
    ctx = ngram_context_decode(ids, prev, eos)
    rows = ngram_ids(ctx, multipliers, head_sizes, head_offsets, heads_per_ngram)
    emb = gather_to(ids.device, table, rows, scale, out_dtype, lookup or ple_lookup)
    return emb, torch.cat([prev[:, 1:], ids.unsqueeze(1).to(prev.dtype)], 1)


def gather_to(device: torch.device, table: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor | None,
              out_dtype: torch.dtype | None, lookup) -> torch.Tensor:
    """``lookup(table, rows, scale, out_dtype)`` with the result on ``device``: a pinned host table with rows for a GPU
    is gathered by the GPU (only the rows cross the bus), any other table where it is."""
    dev = device if table.device.type == "cpu" and device.type != "cpu" else table.device
    return lookup(table, rows.to(dev), scale, out_dtype).to(device)


def ple_lookup(table: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Gather [T, G] rows of a [R, d_g] table (bf16/fp32, or fp8 with a per-tensor ``scale``) -> [T, G*d_g]."""
    emb = table[rows.reshape(-1)]
    dt = out_dtype or (table.dtype if scale is None else torch.bfloat16)
    if scale is not None:
        emb = (emb.float() * scale.float()).to(dt)
    return emb.to(dt).view(*rows.shape[:-1], -1)


def ple_mix(
    H: torch.Tensor,  # [T, n*D] the streams
    k: torch.Tensor,  # [T, n*D] normed n-gram keys
    v: torch.Tensor,  # [T, D] n-gram values
    query_norm_weight: torch.Tensor,  # [n*D] zero-centred, per-stream statistic
    conv_norm_weight: torch.Tensor,  # [n*D]
    conv_weight: torch.Tensor,  # [n*D, K] depthwise
    cu_seqlens: torch.Tensor | None,  # None: one token per sequence (decode)
    conv_state: torch.Tensor | None,  # [N, n*D, (K-1)*dilation]
    n: int,
    eps: float,
    dilation: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PLE(H) = u + SiLU(conv(GroupedNorm(u))), u_s = sigmoid(sign(d_s) sqrt(max(|d_s|, 1e-6))) v with
    d_s = <k_s, GroupedNorm(H)_s> / sqrt(D) -> (PLE(H) [T, n*D], new conv state). Every step in H's dtype, as the
    checkpoint's reference computes it (norms in fp32 inside)."""
    from ..causal_conv1d import causal_conv1d, causal_conv1d_update
    from ..norm import grouped_rms_norm

    T, nD = H.shape
    D = nD // n
    q = grouped_rms_norm(H, query_norm_weight, D, eps).view(T, n, D)
    d = (k.view(T, n, D) * q).sum(-1, keepdim=True) / math.sqrt(D)
    d = d.abs().clamp_min(1e-6).sqrt() * d.sign()
    u = (torch.sigmoid(d) * v.unsqueeze(1)).flatten(1)
    un = grouped_rms_norm(u, conv_norm_weight, D, eps)
    if cu_seqlens is None:
        z, conv_state = causal_conv1d_update(un, conv_weight, conv_state, dilation=dilation, activation="silu")
    else:
        z, conv_state = causal_conv1d(un, conv_weight, cu_seqlens, conv_state, dilation=dilation,
                                      activation="silu")
    return u + z, conv_state
