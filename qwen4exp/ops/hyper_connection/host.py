"""The HC CUDA path's host-side logic, in plain torch (no Triton, no device checks), so that CPU tests run it with
the references plugged in: what the kernels cover and which path ``hc_mix`` takes, from shapes and dtypes alone,
and the many-token path as a function of its pieces. ``cuda.py`` adds the device checks and plugs in its custom
operators.

``hc_mix`` on CUDA (``cuda.hc_mix``):

* decode sizes (up to MAX_T tokens; MAX_T_HN with the streams' norm Hn handed in): the two fused launches of
  ``triton_kernel.hc_mix_triton``; past IN_KERNEL_NORM_MAX_T tokens without Hn, the norm kernel runs first and
  the launches read its Hn (``norm_first``);
* more tokens: ``mix_many_tokens``, the reference's projections on cuBLAS around three small kernels (the grouped
  norm, the activations, the gated stream mean);
* anything else (other dtypes, shapes, stream counts): the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import envs
from ..layout import stacked_weight
from ..norm.host import MAX_GROUP

MAX_T = 16  # up to here the decode launches; past it the many-token path is faster (kernel A's per-program norm of
# the streams grows with the tokens, while cuBLAS's projections stay flat)
MAX_T_HN = 32  # the same with Hn handed in (``hc_inject_norm``): kernel A is then a plain split-K GEMM, with no norm,
# so batch-32 decode stays on the decode launches
IN_KERNEL_NORM_MAX_T = 4  # without Hn, kernel A normalises up to here; past it one norm launch first and the Hn path
# are faster (below, about even, and one launch fewer)


def _tokens(H) -> int:
    return H.numel() // H.shape[-1] if H.shape[-1] else 0


def _norm_fits(H, Hn) -> bool:
    """A handed-in norm (or none) that the kernels can read in place of H."""
    return Hn is None or (Hn.dtype == torch.bfloat16 and Hn.shape == H.shape)


def decode_covers(H, norm_weight, down, up, inj, n, Hn=None) -> bool:
    """``hc_mix_triton`` (the decode launches): bf16 streams and weights of the mixer's shapes, 1-8 streams (a power
    of two: the stream mean is a product by 1/n, exact only then) whose width kernel A splits in chunks of 16+
    columns, rank up to 1024, up to MAX_T tokens (MAX_T_HN with Hn)."""
    if not (H.dtype == down.dtype == up.dtype == torch.bfloat16 and (inj is None or inj.dtype == torch.bfloat16)):
        return False
    if not _norm_fits(H, Hn):
        return False
    NK, R = H.shape[-1], down.shape[0]
    D = NK // n if n else 0
    if envs.QWEN4EXP_HC_DECODE == "cublas":  # (A/B: decode sizes on the many-token path too)
        return False
    max_t = MAX_T if Hn is None else max(MAX_T, MAX_T_HN)
    return (0 < _tokens(H) <= max_t and n in (1, 2, 4, 8) and D * n == NK and D % 16 == 0 and R <= 1024
            and down.shape == (R, NK) and up.shape == (NK, R) and (inj is None or inj.shape == (n, NK))
            and norm_weight.numel() == NK)


def many_tokens_covers(H, norm_weight, down, up, inj, n, Hn=None) -> bool:
    """``mix_many_tokens``: bf16 streams and plain bf16 weights of the mixer's shapes, n a power of two up to 8."""
    if not (H.dtype == down.dtype == up.dtype == torch.bfloat16 and n in (1, 2, 4, 8)):
        return False
    if not _norm_fits(H, Hn):
        return False
    NK, R = H.shape[-1], down.shape[0]
    return (NK % n == 0 and down.shape == (R, NK) and up.shape == (NK, R) and norm_weight.numel() == NK
            and (inj is None or (inj.dtype == torch.bfloat16 and inj.shape == (n, NK))))


def norm_first(H, norm_weight, down, up, inj, n, Hn=None) -> bool:
    """Whether ``hc_mix`` runs the norm kernel before the decode launches: no Hn handed in (the first layer's mixer,
    the PLE layer's), more than IN_KERNEL_NORM_MAX_T tokens, and the decode launches take the call with an Hn."""
    return (Hn is None and IN_KERNEL_NORM_MAX_T < _tokens(H) <= MAX_T_HN
            and decode_covers(H, norm_weight, down, up, inj, n, H))


def mix_path(H, norm_weight, down, up, inj, n, Hn=None) -> str:
    """Which path ``hc_mix`` takes (after ``norm_first``): "decode", "many_tokens" or "reference"."""
    if decode_covers(H, norm_weight, down, up, inj, n, Hn):
        return "decode"
    if many_tokens_covers(H, norm_weight, down, up, inj, n, Hn):
        return "many_tokens"
    return "reference"


def adjacent_rows(down, inj, pad: int = 1):
    """[W_down; W_inj] as ONE [R + n, nD] view when W_inj's rows follow W_down's in memory (the vLLM model lays
    them out so: ``qwen4exp.modeling.colocate_projections``), else None: the many-token path then runs both
    projections as one GEMM. ``pad``: the view's rows rounded up to a multiple of it where the storage holds them
    (the vLLM layout zero-pads to 8 rows, so the GEMM's output rows are 16-byte aligned); rows past R + n are not
    W_inj's."""
    return stacked_weight([down, inj], pad)


def mix_many_tokens(H, norm_weight, down, up, inj, n, eps, Hn=None, *, rms_norm, finish, gate_mean):
    """``hc_mix`` past the decode launches' token counts, from its pieces (the CUDA path plugs in its kernels, the
    CPU tests the references): the grouped norm ``rms_norm(x, w, group, eps)`` (unless Hn is handed in), the
    projections W_down and W_inj on cuBLAS (as one GEMM where they sit together in memory, ``adjacent_rows``),
    their activations ``finish(d, R, n, n_inj) -> (a, c)`` (``reference.hc_finish``), the up projection, and the
    gated stream mean ``gate_mean(g, Hn, n) -> x`` (``reference.hc_gate_mean``). In the reference the norm and the
    mean are fp32 elementwise passes over [T, nD] (most of its time at prefill sizes) and the activations ~7 small
    launches: here one kernel each."""
    NK = H.shape[-1]
    D, R = NK // n, down.shape[0]
    Hn = rms_norm(H.reshape(-1, NK), norm_weight, D, eps) if Hn is None else Hn.reshape(-1, NK)
    # padded to 8 rows where the buffer has them: rows of R + n bf16 columns are not 16-byte aligned otherwise
    # (324 at the real widths), and cuBLAS then takes a slower kernel for this GEMM
    both = None if inj is None else adjacent_rows(down, inj, pad=8)
    NI = 0 if inj is None else inj.shape[0]
    if inj is None:
        d = F.linear(Hn, down)
    elif both is not None:
        d = F.linear(Hn, both)
    else:
        d = torch.cat([F.linear(Hn, down), F.linear(Hn, inj)], -1)
    a, c = finish(d, R, n, NI)
    x = gate_mean(F.linear(a, up), Hn, n)
    lead = H.shape[:-1]
    return x.view(*lead, D), (None if inj is None else c.view(*lead, n))


def inject_covers(H, c, y) -> bool:
    """``hc_inject_triton``: bf16 streams H [..., n * D], weights c [..., n] and block output y [..., D], fewer
    than 65,536 tokens (the kernel's grid puts the tokens on its second axis)."""
    if not (H.dtype == y.dtype == c.dtype == torch.bfloat16):
        return False
    n, D = c.shape[-1], y.shape[-1]
    return H.shape[-1] == n * D and H.shape[:-1] == y.shape[:-1] == c.shape[:-1] and _tokens(H) < 65536


def inject_norm_covers(H, c, y, norm_weight, n) -> bool:
    """``hc_inject_norm_triton``: what ``hc_inject_triton`` covers, n streams, a full-width norm weight, streams of
    up to MAX_GROUP (one program per token and stream holds one)."""
    return (inject_covers(H, c, y) and c.shape[-1] == n and norm_weight.numel() == H.shape[-1]
            and y.shape[-1] <= MAX_GROUP)
