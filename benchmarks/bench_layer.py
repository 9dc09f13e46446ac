"""Decoder layers at the real widths, replayed in a CUDA graph on the device image's own torch and Triton (no vLLM):
the kernel-iteration harness of issue 50 item 2. A kernel change costs seconds of device time here instead of a
vLLM kit's staging and an engine's start.

    python benchmarks/bench_layer.py [--kinds gdn,qsa] [--batch 1,8] [--queries 1] [--ctx 50000] [--copies 4]
        [--moe kernel] [--set QWEN4EXP_HC_DECODE=fused-ticket ...] [--profile DIR] [--csv FILE] [--e2e gdn=US,qsa=US]

A case is ``--copies`` decoder layers of one kind (``modeling.DecoderLayer``, the definition both runtimes build),
chained as in the model: HC mix in, the token mixer, HC write-back normalised for the MoE's mixer, the MoE (router,
routed NVFP4 experts, gated shared expert), HC write-back normalised for the next layer's mixer. Each copy has its
own weights, states and caches, so the replays read them from HBM as a model step does (no copy fits the L2).

* GDN: ``GatedDeltaNet``'s decode form (one token a sequence: conv update + fla's fused recurrent kernel; fla from
  ``PYTHONPATH``, e.g. the carried ``.whl/fla``), its states updated in place. The plugin's GPU default is vLLM's
  GDN layer (the same fla recurrence, vLLM's conv kernel), so expect GDN to differ a little from the served layer.
* QSA: the plugin's decode path itself (``ops.qsa.step``: cache writes, block-key completion; ``qsa_decode_paged``
  with the output gate in its merge), over paged caches filled with a ``--ctx``-token history per request (shuffled
  pages of ``--block-size`` tokens), q / k / v / indexer projections as ONE GEMM (``colocate_projections``).
* MoE: the router and the routed experts through ``ops.moe_decode`` (``--moe kernel``: its Triton kernels, in
  slices of up to 4 tokens; ``--moe reference``: the torch reference); random NVFP4 codes and scales (timing does
  not depend on the values); the shared expert's gate and up projections as one GEMM. The served model's routed
  experts are vLLM's NVFP4 MoE (HUMMING on Hopper), which this harness does not have.
* ``--queries N``: N queries a request (MTP verification: 1 + drafts); GDN runs each request's N tokens as one
  sequence (the packed conv, then fla's recurrent kernel over them).

Per case: the median time of a graph replay (CUDA events) over the copies; kernels a layer and the costliest ones
(a profile of a few replays); the bytes a layer must move (weights, the selected experts, states, the QSA reads) and
the achieved fraction of the copy bandwidth measured in the same run. ``--e2e KIND=US``: the per-layer time of the
served model (``bench_vllm_gpu.py --profile``'s census) for the ratio column; the harness should be within ~15%.
``--device cpu`` (tiny config, eager, references): a smoke run, what the CPU test drives.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (bench_ops: the experts, timing, bandwidth)

from qwen4exp import envs  # noqa: E402
from qwen4exp.configuration import INDEXED, LINEAR, Qwen4ExpTextConfig  # noqa: E402
from qwen4exp.layers.linear import default_linear  # noqa: E402
from qwen4exp.layers.moe import MoE, SwiGLU  # noqa: E402
from qwen4exp.layers.rope import RotaryEmbedding  # noqa: E402
from qwen4exp.modeling import DecoderLayer, colocate_projections  # noqa: E402
from qwen4exp.ops import _registry, moe_decode  # noqa: E402
from qwen4exp.ops.moe_decode import host as moe_host  # noqa: E402
from qwen4exp.ops.layout import colocate_rows, stacked_weight  # noqa: E402
from qwen4exp.ops.qsa import block_mean, layout, qsa_decode_paged, write_paged  # noqa: E402
from qwen4exp.ops.qsa.reference import write_ring  # noqa: E402
from qwen4exp.ops.qsa.step import decode_inputs, decode_writes  # noqa: E402
from qwen4exp.presets import _flash_next_text, tiny_text  # noqa: E402

KINDS = {"gdn": LINEAR, "qsa": INDEXED}


def text_config(tiny: bool) -> Qwen4ExpTextConfig:
    """The real widths (FN, 4 layers: 3 GDN + 1 QSA), or the tests' tiny config."""
    if tiny:
        return tiny_text(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, ple_layer_ids=())
    return Qwen4ExpTextConfig(**_flash_next_text(num_hidden_layers=4, ple_layer_ids=[]))


# ----------------------------------------------------------------------------------------------------------- MoE
class NVFP4Experts(nn.Module):
    """Routed experts in ``ops.moe_decode``'s plain NVFP4 layout (codes, group scales, per-expert global scales),
    random: the kernels' time does not depend on the values."""

    def __init__(self, config, device, gen: torch.Generator | None = None):
        super().__init__()
        from bench_ops import moe_decode_weights

        E, D, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
        for name, t in zip(("w13", "w13_scale", "w13_gs", "w2", "w2_scale", "w2_gs"),
                           moe_decode_weights(E, D, I, device, gen, 0.02)):
            self.register_buffer(name, t)

    def _apply(self, fn, recurse=True):  # built on its device; ``.to(dtype)`` must not cast the FP8 scales
        return self

    def expert_bytes(self) -> int:
        return sum(b[0].numel() * b.element_size() + 4 for b in (self.w13, self.w13_scale, self.w2, self.w2_scale))

    def forward(self, x, topk_weights, topk_ids):
        return moe_decode.experts_nvfp4(x, self.w13, self.w13_scale, self.w13_gs, self.w2, self.w2_scale,
                                        self.w2_gs, topk_weights, topk_ids)


class MergedSwiGLU(SwiGLU):
    """The shared expert with its gate and up projections as one GEMM (as the plugin's merged linear)."""

    def forward(self, x):
        w = stacked_weight([self.gate_proj.weight, self.up_proj.weight])
        if w is None:
            return super().forward(x)
        gate, up = F.linear(x, w).chunk(2, -1)
        return self.down_proj(F.silu(gate) * up)


class DecodeMoE(MoE):
    """The MoE block with the router and the routed experts through ``ops.moe_decode``. Its kernels take up to
    ``MAX_TOKENS`` tokens; a larger batch goes through them in slices of that many (their programs are per token
    and expert anyway), not through the torch reference, whose dequantized experts would dominate the time."""

    def forward(self, x):
        shared = self.shared_expert(x)
        step = moe_host.MAX_TOKENS if envs.QWEN4EXP_MOE_DECODE else x.shape[0]
        routed = []
        for s in range(0, x.shape[0], step):
            xs = x[s: s + step]
            _, w, ids = moe_decode.router_topk(xs, self.gate.weight, self.gate.top_k, self.gate.norm_topk)
            routed.append(self.experts(xs, w, ids))
        return self.combine(x, shared, routed[0] if len(routed) == 1 else torch.cat(routed))


# ------------------------------------------------------------------------------------------------- states, caches
@dataclass
class GDNState:
    conv: torch.Tensor  # [B, conv_dim, K-1]
    ssm: torch.Tensor  # [B, n_v, d_k, d_v] fp32


@dataclass
class QSACache:
    kv: torch.Tensor  # [pages, n_kv, bs, 2 hd] (page 0: the null page, as vLLM's)
    views: layout.IndexViews
    block_table: torch.Tensor  # [B, pages a request] int32
    seq_lens: torch.Tensor  # [B] int32: history + this step's queries
    slot_mapping: torch.Tensor  # [B * nq] int64
    history: dict = field(default_factory=dict)  # (tests) k, v, raw [B, ctx, ...] as written


def slots_of(block_table: torch.Tensor, pos: torch.Tensor, bs: int) -> torch.Tensor:
    """Flat cache slots of positions ``pos`` [B, P] of each request."""
    return (block_table.long().gather(1, pos // bs) * bs + pos % bs).long()


def block_table(B: int, pages: int, device, gen=None) -> torch.Tensor:
    """[B, pages] int32: shuffled pages, page 0 left out (vLLM's null page, which padding rows write)."""
    return (torch.randperm(B * pages, device=device, generator=gen) + 1).view(B, pages).int()


def qsa_cache(attn, rotary, bt: torch.Tensor, ctx: int, nq: int, bs: int, dtype, device, gen=None,
              keep=False) -> QSACache:
    """A paged cache (block table ``bt``, one for every QSA layer as vLLM's one KV-cache group) holding a random
    ``ctx``-token history for each request, written the way the plugin writes a prefill: K/V rows, the key of every
    complete block (mean-pooled raw keys, normed, rotated at the block's first position) and the open block's raw
    keys in its page's ring."""
    r, d_i, hd, n_kv = attn.r, attn.indexer.head_dim, attn.head_dim, attn.n_kv
    rr = layout.ring_rows(r, 8)
    B, per = bt.shape
    kv = layout.paged_cache(B * per + 1, n_kv, bs, hd, d_i, r, rr, dtype, device)
    views = layout.index_views(kv, d_i, r, rr)
    hist = {}
    nfull = ctx // r
    for b in range(B):
        pos = torch.arange(ctx, device=device)
        sl = slots_of(bt[b:b + 1], pos[None], bs)[0]
        k = torch.randn(ctx, n_kv, hd, device=device, generator=gen).to(dtype)
        v = torch.randn(ctx, n_kv, hd, device=device, generator=gen).to(dtype)
        raw = torch.randn(ctx, d_i, device=device, generator=gen).to(dtype)
        write_paged(kv, sl, k, v)
        h = d_i // 2
        if nfull:
            cb, sb = rotary(pos[: nfull * r: r], dtype)
            keys = attn.block_keys(block_mean(raw[: nfull * r], r), cb, sb).to(dtype)
            ks = layout.key_slots(sl[r - 1: nfull * r: r], bs, r)
            write_paged(views.keys, ks, keys[:, None, :h], keys[:, None, h:])
        tail = pos[nfull * r:]
        if tail.numel():
            write_ring(views.ring, bs, sl[nfull * r:], tail, raw[nfull * r:], write_paged)
        if keep:
            for name, t in (("k", k), ("v", v), ("raw", raw)):
                hist.setdefault(name, []).append(t)
    step_pos = torch.arange(ctx, ctx + nq, device=device).expand(B, nq)
    slot_mapping = slots_of(bt, step_pos, bs).reshape(-1)
    seq = torch.full((B,), ctx + nq, dtype=torch.int32, device=device)
    return QSACache(kv, views, bt, seq, slot_mapping, {k: torch.stack(v) for k, v in hist.items()})


# --------------------------------------------------------------------------------------------------------- cases
def init_weights(module: nn.Module, gen: torch.Generator | None = None) -> None:
    """Random weights that keep activations O(1): linear rows ~ N(0, 1 / fan-in), norms near one, GDN's decay
    parameters in their usual ranges."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:  # (the conv's [C, 1, K]: fan-in K)
                p.copy_(torch.randn(p.shape, device=p.device, generator=gen) * p.shape[-1] ** -0.5)
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape, device=p.device).uniform_(0, math.log(16), generator=gen))
            elif name.endswith("dt_bias"):
                p.fill_(1.0)
            else:  # norm weights
                p.copy_(1 + 0.1 * torch.randn(p.shape, device=p.device, generator=gen))


class Case:
    """``copies`` decoder layers of one kind with their states, and the step that runs them all on B x nq tokens."""

    def __init__(self, config, kind: str, B: int, nq: int, ctx: int, copies: int, bs: int, dtype, device,
                 seed: int = 0, keep_history: bool = False):
        self.config, self.kind, self.B, self.nq, self.ctx = config, kind, B, nq, ctx
        self.dtype, self.device = dtype, device
        gen = torch.Generator(device=device).manual_seed(seed)
        lt = KINDS[kind]
        idx = config.layer_types.index(lt)
        T = B * nq
        with torch.device(device):
            self.rotary = RotaryEmbedding(config)
            self.rotary.use_table(ctx + nq + 1024)
            self.layers = nn.ModuleList()
            for _ in range(copies):
                def moe(cfg, linear, prefix):
                    return DecodeMoE(cfg, linear, prefix, experts=NVFP4Experts(cfg, device, gen),
                                     shared_expert=MergedSwiGLU(cfg.hidden_size, cfg.shared_expert_intermediate_size,
                                                                linear, f"{prefix}.shared_expert"))
                layer = DecoderLayer(config, idx, default_linear, layer_type=lt, with_ple=False, moe=moe)
                init_weights(layer, gen)
                self.layers.append(layer)
        self.layers.to(dtype)
        for layer in self.layers:
            if kind == "gdn":
                layer.linear_attn.A_log.data = layer.linear_attn.A_log.data.float()  # fp32, as the runtimes load it
            sh = layer.mlp.shared_expert
            colocate_rows([sh.gate_proj.weight, sh.up_proj.weight], pad=1)
        colocate_projections(self.layers)
        D, n = config.hidden_size, config.hc_count
        self.H = torch.randn(T, n * D, device=device, generator=gen).to(dtype)
        # the first copy's mixer reads streams normalised by the previous layer's last write-back, as in the model
        c = torch.rand(T, n, device=device, generator=gen).to(dtype)
        y = torch.randn(T, D, device=device, generator=gen).to(dtype)
        self.H, self.Hn = self.layers[0].attn_hyper_connection.inject_norm(self.H, c, y)
        self.states: list = []
        bt = block_table(B, -(-(ctx + nq) // bs), device, gen)
        for layer in self.layers:
            if kind == "gdn":
                (cd, km1), ssm = layer.linear_attn.state_shapes(config)
                self.states.append(GDNState(torch.randn(B, cd, km1, device=device, generator=gen).to(dtype),
                                            0.1 * torch.randn(B, *ssm, device=device, generator=gen)))
            else:
                self.states.append(qsa_cache(layer.self_attn, self.rotary, bt, ctx, nq, bs, dtype, device, gen,
                                             keep_history))
        if kind == "qsa":
            self.positions = torch.arange(ctx, ctx + nq, device=device).repeat(B)

    # the token mixers ------------------------------------------------------------------------------------------
    def gdn_mix(self, layer, st: GDNState):
        B, nq = self.B, self.nq

        def one(x):  # the states stored in place (fixed addresses, as the plugin's state slots)
            y, conv, ssm = layer.linear_attn(x, None, st.conv, st.ssm)
            st.conv.copy_(conv)
            st.ssm.copy_(ssm)
            return y

        cu = torch.arange(0, B * nq + 1, nq, device=self.device, dtype=torch.int32)

        def mix(x):  # nq > 1: each request's nq tokens as one sequence (packed conv + fla's recurrent kernel over
            # them: one launch each, as the served model's speculative GDN; it keeps only the last state)
            if nq == 1:
                return one(x)
            y, conv, ssm = layer.linear_attn(x, cu, st.conv, st.ssm)
            st.conv.copy_(conv)
            st.ssm.copy_(ssm)
            return y
        return mix

    def qsa_mix(self, layer, cache: QSACache, shared):
        attn = layer.self_attn
        kn = attn.indexer.k_layernorm

        def mix(x):
            cos, sin, inp = shared
            p = attn.project(x, cos, sin)
            decode_writes(cache.kv, cache.views, p.k, p.v, p.index_k_raw, inp, kn.weight, kn.eps, attn.r, self.nq)
            n_blocks = inp.block_table.shape[1] * cache.kv.shape[2] // attn.r
            o = qsa_decode_paged(p.q, inp.pos, p.index_q, cache.kv, inp.block_table, cache.views.index_kv,
                                 inp.block_table, n_blocks, attn.r, attn.budget, attn.scale, attn.index_scale,
                                 p.gate)
            return attn.output(o, None)
        return mix

    def qsa_step_inputs(self):
        """(cos, sin, ``DecodeInputs``) of the step, once for every QSA layer (the plugin: the model's rotary and
        ``_once_per_forward``); the copies' caches share lengths, slots and block tables."""
        c0 = self.states[0]
        cos, sin = self.rotary(self.positions, self.dtype)
        inp = decode_inputs(c0.seq_lens, c0.block_table, c0.slot_mapping, self.nq, self.layers[0].self_attn.r,
                            self.rotary, self.dtype)
        return cos, sin, inp

    def step(self) -> torch.Tensor:
        """One model step over the copies: -> the last copy's streams."""
        H, Hn = self.H, self.Hn
        shared = self.qsa_step_inputs() if self.kind == "qsa" else None
        for i, (layer, st) in enumerate(zip(self.layers, self.states)):
            mix = self.gdn_mix(layer, st) if self.kind == "gdn" else self.qsa_mix(layer, st, shared)
            then = self.layers[(i + 1) % len(self.layers)].attn_hyper_connection
            H, Hn = layer(H, mix, None, Hn, then)
        return H

    # bytes a layer must move -----------------------------------------------------------------------------------
    def layer_bytes(self) -> int:
        """Dense weights once, the selected experts (expected distinct count at B x nq tokens), GDN states read
        and written, QSA: the step's block keys and the selected K/V rows of every query."""
        layer, c = self.layers[0], self.config
        experts = layer.mlp.experts
        dense = sum(p.numel() * p.element_size() for p in layer.parameters())
        E, k, T = c.num_experts, c.num_experts_per_tok, self.B * self.nq
        distinct = E * (1 - (1 - k / E) ** T)
        by = dense + distinct * experts.expert_bytes()
        if self.kind == "gdn":
            st = self.states[0]
            by += 2 * (st.conv.numel() * st.conv.element_size() + st.ssm.numel() * 4)
        else:
            attn = layer.self_attn
            e = self.dtype.itemsize
            n_keys = (self.ctx + self.nq) // attn.r
            sel = min(self.ctx + self.nq, attn.budget + attn.r - 1)
            by += self.B * (n_keys * attn.indexer.head_dim * e + sel * attn.n_kv * attn.head_dim * 2 * e) * self.nq
        return int(by)


# ------------------------------------------------------------------------------------------------------ timing
def census(case: Case, graph, copies: int, top: int = 8, trace: str | None = None):
    """Kernels a layer and the costliest ones (name, launches a layer, us a layer) from a profile of graph
    replays."""
    from torch.profiler import ProfilerActivity, profile

    reps = 3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    rows = {}
    for ev in prof.events():
        if ev.device_type.name != "CUDA" or "memcpy" in ev.name.lower() or "memset" in ev.name.lower():
            continue
        n, t = rows.get(ev.name, (0, 0.0))
        rows[ev.name] = (n + 1, t + ev.device_time_total)
    per = reps * copies
    kernels = sum(n for n, _ in rows.values()) / per
    ranked = sorted(((t / per, n / per, name) for name, (n, t) in rows.items()), reverse=True)[:top]
    return kernels, ranked


def run_case(args, config, kind, B, nq, bw):
    from bench_ops import events_median

    from qwen4exp.ops.cuda_graph import capture

    case = Case(config, kind, B, nq, args.ctx, args.copies, args.block_size, torch.bfloat16, "cuda")
    with _registry.record() as ran:
        case.step()
    torch.cuda.synchronize()
    graph, _ = capture(case.step)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    us = events_median(graph.replay, args.reps) / args.copies
    trace = os.path.join(args.profile, f"layer-{kind}-b{B}-q{nq}.json") if args.profile else None
    kernels, ranked = census(case, graph, args.copies, trace=trace)
    by = case.layer_bytes()
    row = dict(kind=kind, batch=B, queries=nq, ctx=args.ctx, copies=args.copies, us_per_layer=round(us, 1),
               kernels_per_layer=round(kernels, 1), bytes_per_layer=by, roofline_us=round(by / bw * 1e6, 1),
               bw_fraction=round(by / (us * 1e-6) / bw, 3),
               paths=" ".join(f"{k}={v}" for k, v in sorted(ran.items())))
    e2e = args.e2e.get(kind)
    row["e2e_us"] = e2e
    row["vs_e2e"] = round(us / e2e, 3) if e2e else None
    del graph, case
    torch.cuda.empty_cache()
    return row, ranked


def parse_kv(items, conv=str):
    out = {}
    for it in items or []:
        for part in it.split(","):
            if part:
                k, _, v = part.partition("=")
                if not v:
                    raise SystemExit(f"bench_layer: {part!r} is not NAME=VALUE")
                out[k.strip()] = conv(v)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default="gdn,qsa")
    ap.add_argument("--batch", default="1,8", help="requests, comma list")
    ap.add_argument("--queries", type=int, default=1, help="queries a request (MTP verification: 1 + drafts)")
    ap.add_argument("--ctx", type=int, default=50_000, help="context of every request (QSA history)")
    ap.add_argument("--copies", type=int, default=4, help="layers of a kind, chained")
    ap.add_argument("--block-size", type=int, default=784, help="QSA cache page (tokens)")
    ap.add_argument("--moe", choices=("kernel", "reference"), default="kernel")
    ap.add_argument("--set", action="append", help="NAME=VALUE qwen4exp switches for the run")
    ap.add_argument("--e2e", action="append", help="KIND=US: the served model's per-layer time, for the ratio")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--profile", default=None, help="a folder for one chrome trace a case")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args(argv)
    args.e2e = parse_kv(args.e2e, float)
    for k, v in parse_kv(args.set).items():
        os.environ[k] = v
    os.environ["QWEN4EXP_MOE_DECODE"] = "1" if args.moe == "kernel" else "0"
    envs.reset()
    kinds = [k for k in args.kinds.split(",") if k]
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise SystemExit(f"bench_layer: --kinds {bad[0]!r}: one of {', '.join(KINDS)}")
    batches = [int(b) for b in args.batch.split(",") if b]
    if args.device == "cpu":
        return smoke(kinds, batches, args)
    if not torch.cuda.is_available():
        raise SystemExit("bench_layer: no CUDA device (--device cpu runs the tiny smoke run)")
    from bench_ops import measure_bandwidth

    config = text_config(tiny=False)
    bw = measure_bandwidth()
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | copy bandwidth {bw / 1e12:.2f} TB/s | "
          f"ctx {args.ctx}, {args.copies} copies, block {args.block_size}, moe {args.moe}, "
          f"switches {parse_kv(args.set) or '-'}", flush=True)
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    rows = []
    for kind in kinds:
        for B in batches:
            row, ranked = run_case(args, config, kind, B, args.queries, bw)
            rows.append(row)
            print(f"{kind} B={B} q={args.queries}: {row['us_per_layer']} us a layer, {row['kernels_per_layer']} "
                  f"kernels, {row['bytes_per_layer'] / 1e6:.1f} MB, roofline {row['roofline_us']} us "
                  f"({row['bw_fraction']:.0%} of the copy bandwidth)"
                  + (f", {row['vs_e2e']:.2f}x the served layer" if row["vs_e2e"] else ""), flush=True)
            print(f"   paths: {row['paths']}")
            for t, n, name in ranked:
                print(f"   {t:7.1f} us  x{n:4.1f}  {name[:100]}")
    if args.csv:
        os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return rows


def smoke(kinds, batches, args):
    """The tiny config on the CPU, eagerly, through the references: each case runs two steps."""
    config = text_config(tiny=True)
    rows = []
    for kind in kinds:
        for B in batches:
            case = Case(config, kind, B, args.queries, min(args.ctx, 64), min(args.copies, 2), 16, torch.float32,
                        "cpu")
            H = case.step()
            H = case.step()
            rows.append(dict(kind=kind, batch=B, queries=args.queries, finite=bool(torch.isfinite(H).all()),
                             bytes_per_layer=case.layer_bytes()))
            print(rows[-1])
    return rows


if __name__ == "__main__":
    main()
