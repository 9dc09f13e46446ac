"""Gated DeltaNet (the ``linear_attention`` layers).

x -> [q|k|v] = W_qkv x -> causal depthwise conv (kernel K) + SiLU -> split; z = W_z x; b = W_b x; a = W_a x.
beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias) (fp32). Gated delta rule over q, k (L2-normed, q scaled by
d_k^-1/2) and v, per value head; value head h uses key head h // (n_v / n_k). Output: gated RMSNorm with z (plain
weight; sigmoid or SiLU gate), heads concatenated, W_out.

State per sequence: ``conv`` [N, conv_dim, K-1] (the last K-1 pre-conv projections) and ``ssm`` [N, n_v, d_k, d_v]
(fp32). Both are passed in and returned.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.causal_conv1d import causal_conv1d, causal_conv1d_update
from ..ops.gated_delta_rule import gated_delta_rule
from .linear import LinearFactory, default_linear
from .norms import GatedRMSNorm


class GatedDeltaNet(nn.Module):
    def __init__(self, config, linear: LinearFactory = default_linear, prefix: str = ""):
        super().__init__()
        D = config.hidden_size
        self.n_k, self.n_v = config.linear_num_key_heads, config.linear_num_value_heads
        self.d_k, self.d_v = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim, self.value_dim = self.n_k * self.d_k, self.n_v * self.d_v
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = config.linear_conv_kernel_dim
        self.in_proj_qkv = linear(D, self.conv_dim, prefix=f"{prefix}.in_proj_qkv")
        self.in_proj_z = linear(D, self.value_dim, prefix=f"{prefix}.in_proj_z")
        self.in_proj_b = linear(D, self.n_v, prefix=f"{prefix}.in_proj_b")
        self.in_proj_a = linear(D, self.n_v, prefix=f"{prefix}.in_proj_a")
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False,
                                padding=self.kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.n_v))
        self.A_log = nn.Parameter(torch.zeros(self.n_v))
        self.norm = GatedRMSNorm(self.d_v, eps=config.rms_norm_eps,
                                 activation=config.output_gate_type or config.hidden_act)
        self.out_proj = linear(self.value_dim, D, prefix=f"{prefix}.out_proj")

    @staticmethod
    def state_shapes(config) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """Per-sequence state of one layer: conv [conv_dim, K-1] (model dtype), recurrent [n_v, d_k, d_v] (fp32).
        The one source for every runtime's cache (``hf.cache``, the vLLM plugin's state slots)."""
        conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim + \
            config.linear_num_value_heads * config.linear_value_head_dim
        return ((conv_dim, config.linear_conv_kernel_dim - 1),
                (config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim))

    def forward(
        self,
        x: torch.Tensor,  # [T, D] packed
        cu_seqlens: torch.Tensor | None,  # [N+1]; None: one token per sequence (decode), N = T
        conv_state: torch.Tensor | None,  # [N, conv_dim, K-1]
        ssm_state: torch.Tensor | None,  # [N, n_v, d_k, d_v] fp32
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        T = x.shape[0]
        w = self.conv1d.weight.squeeze(1)
        if cu_seqlens is None:  # decode: sizes from the shapes (no host sync: a CUDA graph can capture it)
            if conv_state is None:
                conv_state = x.new_zeros(T, self.conv_dim, self.kernel - 1)
            mixed, conv_state = causal_conv1d_update(self.in_proj_qkv(x), w, conv_state, activation="silu")
            cu_seqlens = torch.arange(T + 1, device=x.device)
        else:
            mixed, conv_state = causal_conv1d(self.in_proj_qkv(x), w, cu_seqlens, conv_state, activation="silu")
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], -1)
        z = self.in_proj_z(x).view(T, self.n_v, self.d_v)
        beta = torch.sigmoid(self.in_proj_b(x))
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        o, ssm_state = gated_delta_rule(q.view(T, self.n_k, self.d_k), k.view(T, self.n_k, self.d_k),
                                        v.view(T, self.n_v, self.d_v), g, beta, cu_seqlens, ssm_state)
        o = self.norm(o, z).reshape(T, self.value_dim)
        return self.out_proj(o), conv_state, ssm_state
