"""Gated hyper-connection (HC) mixer over n residual streams (stream-major: stream s is H[..., s*D:(s+1)*D]).

    Hn    = grouped zero-centred RMSNorm of H (per stream), affine (1 + w) over all nD elements
    a     = silu((W_down Hn) / n)                       [r_hc]
    gamma = sigmoid(W_up a)                             [nD]
    x     = mean_s gamma_s * Hn_s                       [D]   (the block input)
    c     = 2 sigmoid((W_inj Hn) / n)                   [n]   (the injection weights; absent in the final mixer)
Write-back after the block output y:  H_s <- H_s + c_s * y  (on the raw, un-normalised streams).
``hc_inject_norm`` is the write-back followed by the next mixer's norm (Hn of the new streams), which ``hc_mix``
then takes instead of normalising again: one pass over the streams on the GPU instead of two.
Rounding follows the HF reference: norm in fp32 cast once, the rest in the activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..norm.reference import grouped_rms_norm


def _as_fn(w):
    return w if callable(w) and not isinstance(w, torch.Tensor) else (lambda x: F.linear(x, w))


def hc_mix(
    H: torch.Tensor,  # [..., n*D]
    norm_weight: torch.Tensor,  # [n*D]
    down,  # [r, n*D] weight, or any linear module (e.g. quantized)
    up,  # [n*D, r] weight or module
    inj,  # [n, n*D] weight or module, or None (final mixer)
    n: int,
    eps: float,
    Hn: torch.Tensor | None = None,  # [..., n*D] grouped_rms_norm(H, norm_weight), when the caller has it
) -> tuple[torch.Tensor, torch.Tensor | None]:
    D = H.shape[-1] // n
    if Hn is None:
        Hn = grouped_rms_norm(H, norm_weight, D, eps)
    a = F.silu(_as_fn(down)(Hn) / n)
    gamma = torch.sigmoid(_as_fn(up)(a))
    x = (gamma.unflatten(-1, (n, D)) * Hn.unflatten(-1, (n, D))).mean(-2)
    c = None if inj is None else 2 * torch.sigmoid(_as_fn(inj)(Hn) / n)
    return x, c


def hc_inject(H: torch.Tensor, c: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """H [..., n*D] + c [..., n] (x) y [..., D] -> [..., n*D]."""
    return H + (y.unsqueeze(-2) * c.unsqueeze(-1)).flatten(-2)


def hc_inject_norm(H: torch.Tensor, c: torch.Tensor, y: torch.Tensor, norm_weight: torch.Tensor, n: int,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The write-back, then the grouped norm of the new streams (the next ``hc_mix``'s ``Hn``): (H', Hn')."""
    H = hc_inject(H, c, y)
    return H, grouped_rms_norm(H, norm_weight, H.shape[-1] // n, eps)


def hc_finish(d: torch.Tensor, R: int, n: int, ni: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The activations of ``hc_mix`` from its two projections side by side, d = [W_down Hn | W_inj Hn | ...]
    [..., >= R + ni] (the GPU's many-token path runs both as one GEMM): (a = silu(d[:R] / n) [..., R],
    c = 2 sigmoid(d[R:R + ni] / n) [..., ni]); columns past R + ni are not read."""
    return F.silu(d[..., :R] / n), 2 * torch.sigmoid(d[..., R:R + ni] / n)


def hc_gate_mean(g: torch.Tensor, Hn: torch.Tensor, n: int) -> torch.Tensor:
    """The block input of ``hc_mix`` from the up projection's output g = W_up a [..., nD] and the normalised streams:
    x = mean_s sigmoid(g_s) * Hn_s [..., D]."""
    D = g.shape[-1] // n
    return (torch.sigmoid(g).unflatten(-1, (n, D)) * Hn.unflatten(-1, (n, D))).mean(-2)
