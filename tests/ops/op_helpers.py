"""Helpers shared by the op tests (``tests/ops/test_<op>.py``): packed batches, seeded random tensors, the GPU
tests' poisoned memory and bf16 comparison, and ``expect_kernel`` (the dispatcher's record of what ran).

Imported by name (``from op_helpers import ...``): pytest puts ``tests/ops`` on ``sys.path`` for these files.
Plain torch only; nothing here imports Triton.
"""

from __future__ import annotations

import contextlib

import torch

from qwen4exp.ops import _registry

BF = torch.bfloat16
F32 = dict(rtol=1e-5, atol=1e-6)  # fp32 against an fp32 loop: summation order only


# ------------------------------------------------------------------------------------------------ packed batches
def cu_of(lens, device="cpu"):
    """Sequence lengths -> cu_seqlens [N + 1] (int64)."""
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.long, device=device)


def split_packed(x, lens):
    """Packed [T, ...] -> list of per-sequence tensors."""
    out, s = [], 0
    for n in lens:
        out.append(x[s: s + n])
        s += n
    return out


# -------------------------------------------------------------------------------------------------- random data
def gen(seed, device="cpu"):
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def rnd(shape, g, scale=1.0, dtype=BF):
    """randn on the generator's device, times ``scale``, cast to ``dtype``."""
    return (torch.randn(shape, generator=g, device=g.device) * scale).to(dtype)


# ------------------------------------------------------------------------------------------------- GPU checking
def poison():
    """Fill the CUDA caching allocator's free blocks (large and small pools) with NaN, so that a kernel's outputs
    and scratch buffers start out as NaN: an element it does not write shows up."""
    big = torch.full((96 << 20,), float("nan"), device="cuda")  # 384 MB
    small = [torch.full((1 << 17,), float("nan"), device="cuda") for _ in range(64)]  # 512 KB each
    del big, small


def rel(a, b) -> float:
    """Relative L2 error of a against b (fp32)."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bf16_close(a, b, min_equal):
    """Same rounding points as the reference, another fp32 summation order in the reductions: nearly all elements
    bit-equal (at least ``min_equal`` of them), the rest one or two bf16 units apart; no NaN (unwritten output)."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    assert not torch.isnan(a).any(), "unwritten (NaN) outputs"
    eq = (a == b).float().mean().item()
    torch.testing.assert_close(a.float(), b.float(), rtol=2 * 2 ** -8, atol=2e-2)
    assert eq >= min_equal, f"only {eq:.4f} of the elements bit-equal"
    return eq


@contextlib.contextmanager
def expect_kernel(*ops: str):
    """``with expect_kernel("rms_norm"): ...``: afterwards each op's last call must have run its kernel (not the
    reference, not a wrapper's fallback): the dispatcher's ``_registry.record()``. Yields the record."""
    with _registry.record() as ran:
        yield ran
    for op in ops:
        assert ran.get(op) == "kernel", f"{op}: {ran.get(op) or 'nothing'} ran, not its kernel ({ran})"


# ------------------------------------------------------------------------------------------------ QSA cases
# (test_qsa.py and the Triton interpreter checks, interpreter_qsa_ple.py)


def qsa_inputs(L, Hq=4, Hkv=2, d=8, hi=3, di=6, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(L, Hq, d, generator=gen)
    k = torch.randn(L, Hkv, d, generator=gen)
    v = torch.randn(L, Hkv, d, generator=gen)
    iq = torch.randn(L, hi, di, generator=gen)
    bk = torch.randn(L, di, generator=gen)  # block keys: one per possible block (only the first n(p) are read)
    return [t.to(dtype) for t in (q, k, v, iq, bk)]


def paged_qsa_case(seqs, lens, r, bs, ibs, seed=0, shared_table=False):
    """Page per-sequence (k, v, block keys) into the runtime layout (``qsa_ref.paged_rows``): [blocks, Hkv, bs,
    2d] K|V and a one-head index cache whose row j*r + r - 1 holds block j's key in its V half; physical blocks
    shuffled, every unused row garbage (1e3-scale noise; NaN in the index cache's K half, never read here).
    -> (kv, block_table, index_kv, index_block_table), block tables padded to the longest sequence (+1 column).
    ``shared_table``: both caches paged by one table (vLLM's one cache layer; needs ibs == bs)."""
    gen = torch.Generator().manual_seed(seed)
    hkv, d, di = seqs[0][1].shape[1], seqs[0][1].shape[2], seqs[0][4].shape[1]
    dt = seqs[0][1].dtype
    nbt, nbti = max(lens) // bs + 2, max(lens) // ibs + 2
    B = len(lens)
    kv = (torch.randn(B * nbt + 1, hkv, bs, 2 * d, generator=gen) * 1e3).to(dt)
    ikv = (torch.randn(B * nbti + 1, 1, ibs, 2 * di, generator=gen) * 1e3).to(dt)
    ikv[..., :di] = float("nan")
    perm, iperm = torch.randperm(B * nbt, generator=gen) + 1, torch.randperm(B * nbti, generator=gen) + 1
    if shared_table:
        assert ibs == bs
        iperm = perm
    bt, ibt = perm.view(B, nbt).int(), iperm.view(B, nbti).int()
    for b, (L, (q, k, v, iq, bk)) in enumerate(zip(lens, seqs)):
        p = torch.arange(L)
        kv[bt[b, p // bs].long(), :, p % bs] = torch.cat([k, v], -1)
        ends = r * torch.arange(L // r) + r - 1
        ikv[ibt[b, ends // ibs].long(), 0, ends % ibs, di:] = bk[: L // r]
    return kv, bt, ikv, ibt
