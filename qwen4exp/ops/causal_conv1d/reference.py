"""Causal depthwise conv1d over packed variable-length sequences, optionally dilated, with carried state.

For channel c and output time t (of one sequence, history = state followed by the new inputs):
    y[t, c] = act( sum_j w[c, j] * x[t - dilation * (K - 1 - j), c] )
Samples before the sequence start come from ``initial_state`` (zeros when absent). The state is the last
``(K - 1) * dilation`` inputs, oldest first, laid out [N, C, S].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..varlen import seq_lens


# Up to this many new tokens per sequence the taps are summed directly: a conv1d call costs more than the math there
# (and its multi-threaded kernel stalls on a busy CPU).
_SHORT = 8


def state_len(kernel_size: int, dilation: int = 1) -> int:
    return (kernel_size - 1) * dilation


def causal_conv1d(
    x: torch.Tensor,  # [T, C] packed
    weight: torch.Tensor,  # [C, K]
    cu_seqlens: torch.Tensor,  # [N+1]
    initial_state: torch.Tensor | None = None,  # [N, C, S]
    dilation: int = 1,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    T, C = x.shape
    K = weight.shape[-1]
    S = state_len(K, dilation)
    lens = seq_lens(cu_seqlens)
    N = lens.numel()
    L = int(lens.max()) if N else 0
    dtype = weight.dtype
    if L > _SHORT and N > 1 and N * L > 2 * T + N * S:
        return _packed_conv(x, weight, cu_seqlens, lens, initial_state, dilation, activation)
    # history[n, c, i]: i < S from the state, S <= i < S + len from the new tokens, the rest zero.
    hist = x.new_zeros((N, S + L, C), dtype=dtype)
    if initial_state is not None and S:
        hist[:, :S] = initial_state.transpose(1, 2).to(dtype)
    pos = torch.arange(L, device=x.device)
    valid = pos.unsqueeze(0) < lens.unsqueeze(1)  # [N, L]
    hist[:, S:][valid] = x.to(dtype)
    hist = hist.transpose(1, 2)  # [N, C, S+L]
    if L <= _SHORT:  # decode-sized inputs: the K taps as shifted multiply-adds (fp32, rounded once, as conv1d does)
        w = weight.float()
        y = sum(hist[:, :, j * dilation: j * dilation + L].float() * w[:, j, None] for j in range(K)).to(dtype)
    else:
        y = F.conv1d(hist, weight.unsqueeze(1), groups=C, dilation=dilation)  # [N, C, L]
    y = _act(y, activation)
    out = y.transpose(1, 2)[valid].to(x.dtype)
    # New state: the S samples ending at each sequence's last token.
    idx = lens.view(N, 1) + torch.arange(S, device=x.device).view(1, S)  # [N, S] into [0, S+L)
    final = hist.gather(2, idx.unsqueeze(1).expand(N, C, S)) if S else hist[:, :, :0]
    return out, final


def causal_conv1d_update(
    x: torch.Tensor,  # [N, C]: one new input per sequence (decode)
    weight: torch.Tensor,  # [C, K]
    state: torch.Tensor,  # [N, C, S]: the last S inputs, S = (K-1) * dilation
    dilation: int = 1,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``causal_conv1d`` for sequences of exactly one token: -> (y [N, C], new state [N, C, S]). The K taps as
    multiply-adds in fp32 rounded once (the short path of ``causal_conv1d``). Fixed shapes, no host sync."""
    K = weight.shape[-1]
    dtype = weight.dtype
    hist = torch.cat([state.to(dtype), x.to(dtype).unsqueeze(2)], 2)  # [N, C, S+1]
    w = weight.float()
    y = sum(hist[:, :, j * dilation].float() * w[:, j] for j in range(K)).to(dtype)
    return _act(y, activation).to(x.dtype), hist[:, :, 1:]


def _act(y, activation):
    if activation == "silu":
        return F.silu(y)
    if activation is not None:
        raise ValueError(f"causal_conv1d: unknown activation {activation!r}")
    return y


def causal_conv1d_packed(x, weight, cu_seqlens, initial_state=None, dilation=1, activation="silu"):
    """``causal_conv1d`` (same arguments and results) in the packed form alone. No value is read back to the host
    (the padded form needs the longest sequence's length, and its masked copies count their rows), so on a GPU it
    never waits for the device and an eager step's host stays ahead of it."""
    return _packed_conv(x, weight, cu_seqlens, seq_lens(cu_seqlens), initial_state, dilation, activation)


def _packed_conv(x, weight, cu_seqlens, lens, initial_state, dilation, activation):
    """Ragged batches (one long sequence among short ones): the sequences laid end to end, each behind its own state
    [state_n | tokens_n], as one conv1d input, so memory is O(T + N*S) rather than O(N * max_len). Sequence n's
    outputs look back at most S samples, i.e. never past its own state."""
    T, C = x.shape
    K = weight.shape[-1]
    S = state_len(K, dilation)
    N = lens.numel()
    dev, dtype = x.device, weight.dtype
    cu = cu_seqlens.to(device=dev, dtype=torch.long)
    seq_of = torch.repeat_interleave(torch.arange(N, device=dev), lens.to(dev), output_size=T)
    tok_pos = torch.arange(T, device=dev) + (seq_of + 1) * S  # packed row of every token
    state_pos = (cu[:-1] + torch.arange(N, device=dev) * S).unsqueeze(1) + torch.arange(S, device=dev)  # [N, S]
    hist = x.new_zeros((T + N * S, C), dtype=dtype)
    if initial_state is not None and S:
        hist[state_pos.reshape(-1)] = initial_state.transpose(1, 2).reshape(N * S, C).to(dtype)
    hist[tok_pos] = x.to(dtype)
    h = hist.t().unsqueeze(0)  # [1, C, P]
    y = F.conv1d(h, weight.unsqueeze(1), groups=C, dilation=dilation)[0]  # [C, P - S]: output i <-> input i + S
    out = _act(y[:, tok_pos - S], activation).t().to(x.dtype)
    last = (cu[1:] + torch.arange(N, device=dev) * S).unsqueeze(1) + torch.arange(S, device=dev)  # [N, S]
    final = h[0][:, last].permute(1, 0, 2)  # [N, C, S]
    return out, final
