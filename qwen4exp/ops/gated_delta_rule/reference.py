"""Gated delta rule (Gated DeltaNet's recurrence), in two equivalent forms, over packed variable-length sequences.

Per value head with state S in R^{d_k x d_v} (fp32), for each token t:
    S <- exp(g_t) S;   delta = beta_t (v_t - S^T k_t);   S <- S + k_t delta^T;   o_t = S^T q_t
with q, k L2-normalised (when ``use_qk_l2norm``) and q scaled by ``scale`` (default d_k^-1/2). q and k may have
fewer heads than v: value head h reads key head h // (H_v / H_k) (consecutive grouping).

``recurrent_gated_delta_rule`` walks the tokens one by one (the oracle, and the decode path).
``chunk_gated_delta_rule`` processes chunks of ``chunk_size`` tokens with the UT transform: inside a chunk with
cumulative log-decay G_i = sum_{j<=i} g_j and entry state S0, the deltas solve the unit lower-triangular system
    (I + A) delta = beta * (v - exp(G) K S0),   A_ij = beta_i exp(G_i - G_j) k_i.k_j  (j < i)
and then  o_i = exp(G_i) S0^T q_i + sum_{j<=i} exp(G_i - G_j) (q_i.k_j) delta_j,
          S_end = exp(G_C) S0 + sum_j exp(G_C - G_j) k_j delta_j^T.
"""

from __future__ import annotations

import torch

from ..varlen import pad_packed, seq_lens


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prep(q, k, v, g, beta, scale, use_qk_l2norm):
    hv, hk = v.shape[-2], k.shape[-2]
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if hv != hk:
        q = q.repeat_interleave(hv // hk, dim=-2)
        k = k.repeat_interleave(hv // hk, dim=-2)
    q = q * (scale if scale is not None else q.shape[-1] ** -0.5)
    return q, k, v, g, beta


def recurrent_gated_delta_rule(
    q: torch.Tensor,  # [T, Hk, dk]
    k: torch.Tensor,  # [T, Hk, dk]
    v: torch.Tensor,  # [T, Hv, dv]
    g: torch.Tensor,  # [T, Hv] log decay (<= 0)
    beta: torch.Tensor,  # [T, Hv]
    cu_seqlens: torch.Tensor,  # [N+1]
    initial_state: torch.Tensor | None = None,  # [N, Hv, dk, dv]
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    out_dtype = v.dtype
    q, k, v, g, beta = _prep(q, k, v, g, beta, scale, use_qk_l2norm)
    lens = seq_lens(cu_seqlens)
    N, Hv, dk, dv = lens.numel(), v.shape[1], q.shape[-1], v.shape[-1]
    S = (initial_state.float().clone() if initial_state is not None
         else q.new_zeros((N, Hv, dk, dv)))
    if q.shape[0] == N and (N == 0 or int(lens.min()) == 1):  # decode: one token per sequence, nothing to pad
        qp, kp, vp, gp, bp = (t.unsqueeze(1) for t in (q, k, v, g, beta))
        valid = torch.ones(N, 1, dtype=torch.bool, device=q.device)
    else:
        qp, valid = pad_packed(q, cu_seqlens)
        kp, _ = pad_packed(k, cu_seqlens)
        vp, _ = pad_packed(v, cu_seqlens)
        gp, _ = pad_packed(g, cu_seqlens)  # padding: g = 0, beta = 0, k = 0 leave S unchanged
        bp, _ = pad_packed(beta, cu_seqlens)
    outs = []
    for t in range(qp.shape[1]):
        S = S * gp[:, t].exp()[..., None, None]
        kv = torch.einsum("nhkv,nhk->nhv", S, kp[:, t])
        delta = bp[:, t, :, None] * (vp[:, t] - kv)
        S = S + kp[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("nhkv,nhk->nhv", S, qp[:, t]))
    o = torch.stack(outs, 1) if outs else vp
    return o[valid].to(out_dtype), S


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    out_dtype = v.dtype
    q, k, v, g, beta = _prep(q, k, v, g, beta, scale, use_qk_l2norm)
    lens = seq_lens(cu_seqlens)
    N, Hv, dk, dv = lens.numel(), v.shape[1], q.shape[-1], v.shape[-1]
    L = int(lens.max())
    Lp = -(-L // chunk_size) * chunk_size
    C, nc = chunk_size, Lp // chunk_size

    def chunked(x):  # [T, H, ...] -> [N, H, nc, C, ...]
        xp, _ = pad_packed(x, cu_seqlens, Lp)
        xp = xp.view(N, nc, C, *x.shape[1:])
        return xp.movedim(3, 1)

    qc, kc, vc = chunked(q), chunked(k), chunked(v)  # [N, H, nc, C, d]
    gc, bc = chunked(g), chunked(beta)  # [N, H, nc, C]
    G = gc.cumsum(-1)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # [.., i, j]
    kk = kc @ kc.transpose(-1, -2)
    A = (bc.unsqueeze(-1) * kk * decay).tril(-1)
    Tm = A + torch.eye(C, device=q.device)
    # W = T^-1 (beta v), U = T^-1 (beta exp(G) k)
    rhs = torch.cat([bc.unsqueeze(-1) * vc, (bc * G.exp()).unsqueeze(-1) * kc], -1)
    sol = torch.linalg.solve_triangular(Tm, rhs, upper=False, unitriangular=True)
    W, U = sol[..., :dv], sol[..., dv:]
    qk = (qc @ kc.transpose(-1, -2)) * decay  # [.., i, j] incl. diagonal
    q_dec = qc * G.exp().unsqueeze(-1)
    k_to_end = kc * (G[..., -1:] - G).exp().unsqueeze(-1)
    end_decay = G[..., -1].exp()  # [N, H, nc]
    S = (initial_state.float().clone() if initial_state is not None
         else q.new_zeros((N, Hv, dk, dv)))
    out = torch.empty_like(vc)
    for c in range(nc):
        delta = W[:, :, c] - U[:, :, c] @ S  # [N, H, C, dv]
        out[:, :, c] = q_dec[:, :, c] @ S + qk[:, :, c] @ delta
        S = S * end_decay[:, :, c, None, None] + k_to_end[:, :, c].transpose(-1, -2) @ delta
    o = out.movedim(1, 3).reshape(N, Lp, Hv, dv)
    valid = torch.arange(Lp, device=q.device).unsqueeze(0) < lens.unsqueeze(1)
    return o[valid].to(out_dtype), S
