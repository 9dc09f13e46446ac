"""The Triton checks of QSA and PLE (registered into ``interpreter.py``; one pytest item each in
``test_qsa.py`` / ``test_ple.py``): each kernel launcher against its torch reference under Triton's CPU interpreter
on small random inputs, every launch path a default call can take (the settings that pick among them varied here),
and the QSA decode / prefill once at the real model widths, so that the compile step builds those variants too."""

from __future__ import annotations

import contextlib

import torch
from interpreter import BF, check, close, compile_check, settings
from op_helpers import paged_qsa_case, qsa_inputs

from qwen4exp.ops import _registry


@contextlib.contextmanager
def launch_signatures():
    """The launches inside the block as what each compiled variant depends on: ``interpreter._describe`` (the
    kernel, every argument's type, i32 or i64 for integers, the constexprs, the launch options) and Triton's value
    specialisation (an integer argument's ``== 1`` and ``% 16 == 0``, a pointer's 16-byte alignment, unless the
    kernel's ``do_not_specialize`` / ``do_not_specialize_on_alignment`` name it). A warm-up covers later calls when
    their launches are a subset of its own."""
    import json

    from interpreter import _describe, on_launch
    seen = set()

    def unspecialised(kernel, key):
        return {kernel.arg_names[x] if isinstance(x, int) else x for x in kernel.kwargs.get(key) or ()}

    def record(kernel, args, kwargs):
        ints = unspecialised(kernel, "do_not_specialize")
        ptrs = unspecialised(kernel, "do_not_specialize_on_alignment")
        values = {}
        for name, a in zip(kernel.arg_names, args):
            if isinstance(a, int) and not isinstance(a, bool) and name not in ints:
                values[name] = [a == 1, a % 16 == 0]
            elif isinstance(a, torch.Tensor) and name not in ptrs:
                values[name] = a.data_ptr() % 16 == 0
        d = _describe(kernel.fn, args, kwargs)
        d.pop("divisible")  # (the values below say it as the launcher does, do_not_specialize included)
        seen.add(json.dumps(dict(d, values=values), sort_keys=True))

    with on_launch(record):
        yield seen


# ------------------------------------------------------------------------------------------------------------ QSA
@check("qsa_topk")
def check_qsa_topk():
    """``top_ids`` by each select a default call can take (the in-register select in one launch with 0 and 2
    threshold bits a step, the split select over chunks of keys, the chunked radix select) = the reference's block
    sets, ties to the lower ids; torch.topk of the sort keys (the unpaged op's select) = the reference's order."""
    from qwen4exp.ops.qsa import launch, reference as ref, triton_kernel as tk
    torch.manual_seed(0)
    m = 16
    cases = ((10, 3, False), (17, 2, True), (300, 4, False), (300, 4, True), (2049, 2, True),
             (300, 3, "narrow"), (300, 3, "bf16"), (300, 3, "equal"), (40, 2, "none"),
             (5000, 1, False), (9000, 1, "bf16"))  # (the 4096 / 8192 / 16384-key variants too)
    ways = {"small bits=0": dict(TOPK_SPLIT=0, TOPK_SMALL_BITS=0),
            "small bits=2": dict(TOPK_SPLIT=0, TOPK_SMALL_BITS=2),
            "radix": dict(TOPK_SPLIT=0, TOPK_SMALL_MAX=0),
            "split 256 bits=2": dict(TOPK_SPLIT=256, TOPK_SPLIT_BITS=2),
            "split 256 bits=0": dict(TOPK_SPLIT=256, TOPK_SPLIT_BITS=0),
            "split 4096 bits=2": dict(TOPK_SPLIT=4096, TOPK_SPLIT_BITS=2)}
    for Nb, Tq, ties in cases:
        sc = torch.randn(Tq, Nb)
        if ties is True:
            sc = sc.round().clamp(min=0)  # many exact ties (zeros and small integers)
        elif ties == "narrow":  # all in [1, 2): sign and exponent bits shared (the search starts past them)
            sc = torch.rand(Tq, Nb) + 1.0
        elif ties == "bf16":  # bf16 values: the low 16 bits shared by every key (the search stops above them)
            sc = (torch.rand(Tq, Nb) * 3).to(torch.bfloat16).float()
        elif ties == "equal":  # every key the same score: the ids decide
            sc = torch.full((Tq, Nb), 0.75)
        nc = torch.randint(0, Nb + 1, (Tq,))
        nc[0] = Nb
        if ties == "none":  # no visible block at all (nothing selected)
            nc[:] = 0
        keys = ref._order_keys(sc, torch.arange(Nb)[None] < nc[:, None])
        want = ref.select_blocks(sc, nc, m)
        for way, values in ways.items():
            with settings(launch, **values):
                got = tk.top_ids(keys, m)
            for t in range(Tq):
                a = [x for x in got[t].tolist() if x >= 0]
                b = sorted(x for x in want[t].tolist() if x >= 0)
                assert a == b and (got[t] >= 0).sum() == (want[t] >= 0).sum(), (Nb, ties, way, t)
        top = tk.top_keys(keys, min(m, Nb))
        ids = torch.where(top == tk.INT64_MIN, -1, 4294967295 - (top & 4294967295))
        assert torch.equal(ids, want), (Nb, ties, "torch.topk of the sort keys")


def _paged(lens, seed, shared_table):
    seqs = [[t.to(BF) for t in qsa_inputs(L, Hq=6, Hkv=2, d=64, hi=4, di=32, seed=seed + i)]
            for i, L in enumerate(lens)]
    return seqs, paged_qsa_case(seqs, lens, 4, 16, 16 if shared_table else 64, shared_table=shared_table)


def _decode_case():
    lens = [1, 9, 37, 150, 203]
    seqs, (kv, bt, ikv, ibt) = _paged(lens, 700, False)
    pos = torch.tensor(lens) - 1
    q, iq = torch.stack([s[0][-1] for s in seqs]), torch.stack([s[3][-1] for s in seqs])
    return lens, seqs, q, pos, iq, kv, bt, ikv, ibt


@check("qsa_decode")
def check_qsa_decode():
    """The paged decode against the reference: slot ranges of one chunk, of all 3 chunks, of 2 + 1 (an uneven last
    range); rows looked up ahead or not; the few-query and the many-query settings."""
    from qwen4exp.ops.qsa import launch, reference as ref, triton_kernel as tk
    r, budget = 4, 32
    lens, seqs, q, pos, iq, kv, bt, ikv, ibt = _decode_case()
    want = ref.qsa_decode_paged(q, pos, iq, kv, bt, ikv, ibt, 60, r, budget, 0.3, 0.4)
    n4 = 4 * len(lens)
    for sb, programs, prefetch, many in ((64, 512, True, 99), (16, 10 ** 6, True, 99), (16, 1, True, 99),
                                         (16, n4, True, 99), (16, n4, False, 99), (16, 10 ** 6, False, 99),
                                         (64, n4, True, 1), (16, n4, True, 1), (16, n4, False, 1)):
        with settings(launch, ATTN_SLOT_BLOCK=sb, ATTN_SLOT_BLOCK_MANY=sb, ATTN_PROGRAMS=programs,
                      ATTN_MANY_QUERIES=many, ATTN_PREFETCH=prefetch, ATTN_PREFETCH_MANY=prefetch):
            got = tk.qsa_decode_paged_triton(q, pos, iq, kv, bt, ikv, ibt, 60, r, budget, 0.3, 0.4)
        close(got, want, 0.05, f"decode paged SB={sb} programs={programs} prefetch={prefetch} many>={many}")


@check("qsa_decode_gated")
def check_qsa_decode_gated():
    """The output gate applied by the merge (a strided view of a [Q | gate] projection, as the model hands it in)
    equals ``output_gate`` of the ungated result, bf16 product by product, both through the decode and through the
    attend half; few- and many-query settings."""
    from qwen4exp.ops.qsa import launch, reference as ref, triton_kernel as tk
    r, budget = 4, 32
    lens, seqs, q, pos, iq, kv, bt, ikv, ibt = _decode_case()
    g = torch.Generator().manual_seed(7)
    qg = (torch.randn(q.shape[0], q.shape[1], 2 * q.shape[2], generator=g) * 3).to(q.dtype)
    gate = qg[..., q.shape[2]:]  # [B, Hq, d], row stride 2 * Hq * d, head stride 2 * d
    assert not gate.is_contiguous()
    want_ref = ref.qsa_decode_paged(q, pos, iq, kv, bt, ikv, ibt, 60, r, budget, 0.3, 0.4, gate)
    plain = ref.qsa_decode_paged(q, pos, iq, kv, bt, ikv, ibt, 60, r, budget, 0.3, 0.4)
    assert torch.equal(want_ref, ref.output_gate(plain, gate))
    for many in (99, 1):
        with settings(launch, ATTN_MANY_QUERIES=many):
            ungated = tk.qsa_decode_paged_triton(q, pos, iq, kv, bt, ikv, ibt, 60, r, budget, 0.3, 0.4)
            got = tk.qsa_decode_paged_triton(q, pos, iq, kv, bt, ikv, ibt, 60, r, budget, 0.3, 0.4, gate)
            sel = tk.qsa_select_paged_triton(pos, iq, ikv, ibt, 60, r, budget, 0.4)
            attended = tk.qsa_attend_paged_triton(q, pos, kv, bt, sel, r, 0.3, gate)
        # the merge rounds the output, the sigmoid and the product as output_gate's torch ops do (bit for bit on the
        # GPU: tests/ops/test_qsa.py); here the interpreter truncates the ungated store and has numpy's exp: 4 units
        close(got, ref.output_gate(ungated, gate), 0.0, f"gated decode many>={many}", rtol=2 ** -5)
        close(attended, got, 0.0, f"gated attend many>={many}")
        close(got, want_ref, 0.05, f"gated decode vs reference many>={many}")


@check("qsa_score_logits")
def check_qsa_score_logits():
    """The scores as fp32 logits (what vLLM's select reads) are the sort keys' scores; the same launch writes each
    query's visible block count (n_complete, capped at the table's blocks: 60 here, 51 for the longest)."""
    from qwen4exp.ops.qsa import triton_kernel as tk
    r = 4
    _, _, q, pos, iq, kv, bt, ikv, ibt = _decode_case()
    for nb in (60, 40):
        keys = tk.paged_score_keys(pos, iq, ikv, ibt, nb, r, 0.4)
        lg, vis = tk.paged_score_keys(pos, iq, ikv, ibt, nb, r, 0.4, logits=True)
        want_vis = torch.clamp((pos + 1) // r, max=nb).to(torch.int32)
        assert torch.equal(vis, want_vis), (nb, vis, want_vis)
        seen = torch.arange(nb)[None] < want_vis[:, None].long()
        bits = lg.contiguous().view(torch.int32).long()  # the fp32 bits as signed integers
        order = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        assert torch.equal(torch.where(seen, order, 0), torch.where(seen, keys >> 32, 0)), f"logits vs keys, nb={nb}"


@check("qsa_select_attend_halves")
def check_qsa_select_attend_halves():
    """The decode op's two halves on their own (MTP drafts sharing a selection): the select's block sets, the
    attention over a given selection with holes."""
    from qwen4exp.ops.qsa import reference as ref, triton_kernel as tk
    r, budget = 4, 32
    _, _, q, pos, iq, kv, bt, ikv, ibt = _decode_case()
    sel = tk.qsa_select_paged_triton(pos, iq, ikv, ibt, 60, r, budget, 0.4)
    want_sel = ref.qsa_select_paged(pos, iq, ikv, ibt, 60, r, budget, 0.4)
    assert torch.equal(sel.long().sort(dim=1).values, want_sel.sort(dim=1).values), (sel, want_sel)
    holed = want_sel.clone()
    holed[:, ::3] = -1
    close(tk.qsa_attend_paged_triton(q, pos, kv, bt, holed, r, 0.3),
          ref.qsa_attend_paged(q, pos, kv, bt, holed, r, budget, 0.3), 0.05, "attend paged, a given selection")


@check("qsa_unpaged")
def check_qsa_unpaged():
    """The unpaged op (five queries of one sequence past the budget; and in the dense regime)."""
    from qwen4exp.ops.qsa import reference as ref, triton_kernel as tk
    r, budget, L = 4, 32, 150
    _, seqs, *_ = _decode_case()
    qq, k, v, iqq, bk = seqs[3]
    p = torch.arange(L - 5, L)
    got = tk.qsa_attention_triton(qq[-5:], k, v, p, iqq[-5:], bk[: L // r], r, budget, 0.3, 0.4)
    close(got, ref.qsa_attention(qq[-5:], k, v, p, iqq[-5:], bk, r, budget, 0.3, 0.4), 0.05, "unpaged")
    p = torch.arange(20, 25)  # at most m complete blocks: every token up to the query, no indexer
    got = tk.qsa_attention_triton(qq[:5], k, v, p, None, None, r, budget, 0.3, 0.4)
    close(got, ref.qsa_attention(qq[:5], k, v, p, None, None, r, budget, 0.3, 0.4), 0.05, "unpaged dense")


@check("qsa_prefill")
def check_qsa_prefill():
    """The paged prefill: split attention / looping attention (128- and 32-slot steps, the 32-slot one with the
    row prefetch); one query chunk / chunks by the keys' bytes / by the query cap."""
    from qwen4exp.ops.qsa import launch, reference as ref, triton_kernel as tk
    r, budget = 4, 32
    lens = [9, 150, 203]
    seqs, (kv, bt, ikv, _) = _paged(lens, 500, True)
    for loop_min, keys_bytes, max_q, sb, pf in ((1, 1 << 30, 1 << 14, 128, False),
                                                (10 ** 9, 8 * 7 * 50, 1 << 14, 128, False),
                                                (5, 1 << 30, 7, 128, False), (1, 1 << 30, 1 << 14, 32, True)):
        with settings(launch, LOOP_MIN_QUERIES=loop_min, PREFILL_KEYS_BYTES=keys_bytes, PREFILL_MAX_QUERIES=max_q,
                      LOOP_SLOT_BLOCK=sb, LOOP_PREFETCH=pf):
            for b, (L, (q, k, v, iq, bk)) in enumerate(zip(lens, seqs)):
                for n in (1, min(L, 40)):
                    pos = torch.arange(L - n, L)
                    got = tk.qsa_prefill_paged_triton(q[-n:], pos, iq[-n:], kv, bt[b], ikv, L, r, budget, 0.3, 0.4)
                    want = ref.qsa_prefill_paged(q[-n:], pos, iq[-n:], kv, bt[b], ikv, L, r, budget, 0.3, 0.4)
                    close(got, want, 0.05, f"prefill L={L} n={n} loop_min={loop_min} keys_bytes={keys_bytes} "
                                           f"slots={sb} prefetch={pf}")


_KEY_MIN = -(2 ** 63)


def _key_scores(keys):
    """int64 sort keys -> the fp32 scores they order (0 where not visible)."""
    k32 = (keys >> 32).to(torch.int32)
    bits = torch.where(k32 < 0, k32 ^ 0x7FFFFFFF, k32)
    return torch.where(keys == _KEY_MIN, 0.0, bits.view(torch.float32))


@check("qsa_score_prefill_logits")
def check_qsa_score_prefill_logits():
    """The prefill scores as fp32 logits (vLLM's select, where it is loaded) are the sort keys' scores over each
    query's visible blocks, and the visible counts are min(n_complete, n_blocks); also with small tiles, where
    tiles past every query's end skip their work (a prefill's first queries), and with the heads stacked into one
    product (``launch.SCORE_STACK_HEADS``): the same sort keys (bit for bit on the GPU; under the interpreter,
    whose fp32 product sums in a shape-dependent order, the same visible blocks and scores within fp32 noise)."""
    from qwen4exp.ops.qsa import launch, triton_kernel as tk
    r = 4
    lens = [203]
    seqs, (kv, bt, ikv, _) = _paged(lens, 502, True)
    q, iq = seqs[0][0], seqs[0][3]
    L, n = 203, 70  # two query tiles, a partial one
    saved = launch.SCORE_BLOCK_M, launch.SCORE_BLOCK_N, launch.SCORE_STACK_HEADS
    base = {}
    try:
        for bm, bn, stack in ((64, 64, False), (16, 16, False), (16, 16, True), (64, 64, True)):
            launch.SCORE_BLOCK_M, launch.SCORE_BLOCK_N, launch.SCORE_STACK_HEADS = bm, bn, stack
            for first in (False, True):  # the last n queries of the sequence, or its first n
                pos = torch.arange(0, n) if first else torch.arange(L - n, L)
                qi = iq[:n] if first else iq[-n:]
                for nb in (L // r, 40):
                    keys = tk.prefill_score_keys(pos, qi, ikv, bt[0], nb, r, 0.4)
                    # tiles and stacking change the product's shape, and the interpreter's fp32 matmul (numpy)
                    # sums in a shape-dependent order: the same visible blocks and ids, scores within fp32 noise
                    # (on the GPU each output is one accumulation over DI whatever the tile)
                    want_keys = base.setdefault((first, nb), keys)
                    what = (bm, bn, stack, first, nb)
                    assert torch.equal(keys == _KEY_MIN, want_keys == _KEY_MIN), what
                    assert torch.equal(keys & 0xFFFFFFFF, want_keys & 0xFFFFFFFF), what
                    close(_key_scores(keys), _key_scores(want_keys), 1e-6, f"scores {what}", rtol=1e-5)
                    lg, vis = tk.prefill_score_keys(pos, qi, ikv, bt[0], nb, r, 0.4, logits=True)
                    assert lg.stride(0) % 4 == 0 and lg.dtype == torch.float32
                    want_vis = torch.clamp((pos + 1) // r, max=nb).to(torch.int32)
                    assert torch.equal(vis, want_vis), (nb, vis, want_vis)
                    seen = torch.arange(nb)[None] < want_vis[:, None].long()
                    bits = lg.contiguous().view(torch.int32).long()
                    order = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
                    assert torch.equal(torch.where(seen, order, 0), torch.where(seen, keys >> 32, 0)), \
                        f"logits vs keys, nb={nb}, tiles {bm}x{bn}, stack={stack}, first={first}"
    finally:
        launch.SCORE_BLOCK_M, launch.SCORE_BLOCK_N, launch.SCORE_STACK_HEADS = saved


@check("qsa_prefill_warmup")
def check_qsa_prefill_warmup():
    """``prefill_warmup_cases``: every kernel variant a prefill call of any length (and any chunking) can launch is
    launched by one of its cases, at the real sizes (m = 512) and at small settings where every select and both
    attentions appear within 120 blocks; ``warm_up_prefill`` runs those cases on the given caches (and none where
    the kernels do not cover the queries' dtype)."""
    import random

    from qwen4exp.ops.qsa import host, launch, triton_kernel as tk
    rng = random.Random(0)

    def covered(max_blocks, m, Hkv, n=3000):
        cases = host.prefill_warmup_cases(max_blocks, m, 4, Hkv)
        have = set().union(*(host.prefill_variants(t, nb, m, 4, Hkv) for t, nb in cases))
        for _ in range(n):
            t = rng.choice((rng.randint(1, 300), rng.randint(1, 40_000)))
            nb = rng.randint(1, max_blocks)
            missing = host.prefill_variants(t, nb, m, 4, Hkv) - have
            assert not missing, (max_blocks, m, t, nb, missing)
        return cases, have

    for max_blocks in (100, 12_500, 65_536, 200_000):
        cases, have = covered(max_blocks, 512, 2)
        assert len(cases) <= 20, cases
    assert {("topk", "radix"), ("attn_loop",)} <= have and any(v[:2] == ("topk", "split") for v in have)
    small = dict(LOOP_MIN_QUERIES=6, TOPK_SMALL_MIN=16, TOPK_SMALL_MAX=64, TOPK_SPLIT=32, TOPK_SPLIT_MAX_ROWS=3,
                 ATTN_MANY_QUERIES=3)
    seqs, (kv, bt, ikv, _) = _paged([150], 900, True)
    with settings(launch, **small):
        cases, have = covered(120, 8, 2, 1500)
        assert {("topk", "radix"), ("topk", "split-chunks"), ("attn_loop",), ("attn", True), ("attn", False)} <= have
        tk.LAUNCHED.clear()
        with launch_signatures() as warm, _registry.record():  # (record: the launches are kept in tk.LAUNCHED)
            got = tk.warm_up_prefill(kv, ikv, 6, 4, 4 * 120, 4, 32, 0.3, 0.4)
        assert got == cases, (got, cases)
        # real prefills (indexed and dense, looping and split attention, one-query remainders) launch nothing the
        # warm-up did not: no argument of another dtype (run 24: dense block ids were int64, the selects' int32)
        q, iq = seqs[0][0], seqs[0][3]
        with launch_signatures() as calls, _registry.record():
            for L, n in ((150, 40), (150, 3), (150, 1), (20, 10), (20, 2), (60, 7), (33, 33)):
                tk.qsa_prefill_paged_triton(q[L - n:L], torch.arange(L - n, L), iq[L - n:L], kv, bt[0], ikv, L, 4,
                                            32, 0.3, 0.4)
        assert warm and calls <= warm, calls - warm
        assert {"qsa_score_prefill", "qsa_topk", "qsa_topk_split", "qsa_attn_loop", "qsa_attn",
                "qsa_merge"} <= set(tk.LAUNCHED), sorted(tk.LAUNCHED)
        assert tk.warm_up_prefill(kv, ikv, 6, 4, 4 * 120, 4, 32, 0.3, 0.4, dtype=torch.float32) == []


@check("qsa_decode_warmup")
def check_qsa_decode_warmup():
    """``decode_warmup_cases``: every kernel variant a paged decode of up to ``max_rows`` single queries can launch
    (``decode_variants``: with vLLM's select loaded or not) is launched by one of its cases, at m = 512 and at small
    settings; ``warm_up_decode`` runs them (and none for fp32 queries)."""
    import random

    from qwen4exp.ops.qsa import host, launch, triton_kernel as tk
    rng = random.Random(1)
    loaded = host.vllm_topk_loaded

    def covered(max_rows, max_blocks, m, Hkv, n=3000):
        cases = host.decode_warmup_cases(max_rows, max_blocks, m, 4, Hkv)
        have = set().union(*(host.decode_variants(b, nb, m, 4, Hkv) for b, nb in cases))
        for _ in range(n):
            b, nb = rng.randint(1, max_rows), rng.randint(1, max_blocks)
            missing = host.decode_variants(b, nb, m, 4, Hkv) - have
            assert not missing, (max_rows, max_blocks, m, b, nb, missing)
        return cases, have

    try:
        for vllm_select in (False, True):
            host.vllm_topk_loaded = lambda v=vllm_select: v
            for max_rows, max_blocks, Hkv in ((8, 100, 2), (256, 12_500, 2), (2048, 65_536, 2), (8192, 65_536, 1)):
                cases, have = covered(max_rows, max_blocks, 512, Hkv)
                assert len(cases) <= 24, cases
            assert (("score_paged", True) in have) == vllm_select and ("topk", "radix") in have
    finally:
        host.vllm_topk_loaded = loaded
    small = dict(TOPK_SMALL_MIN=16, TOPK_SMALL_MAX=64, TOPK_SPLIT=32, TOPK_SPLIT_MAX_ROWS=3, ATTN_MANY_QUERIES=3)
    seqs, (kv, bt, ikv, _) = _paged([150], 901, True)
    with settings(launch, **small), settings(host, VLLM_TOPK=False):
        cases, have = covered(12, 120, 8, 2, 1500)
        assert {("topk", "radix"), ("topk", "split-chunks"), ("attn", True), ("attn", False)} <= have
        tk.LAUNCHED.clear()
        with launch_signatures() as warm, _registry.record():  # (record: the launches are kept in tk.LAUNCHED)
            assert tk.warm_up_decode(kv, ikv, 6, 4, 4 * 120, 12, 4, 32, 0.3, 0.4) == cases
        # real decode rows (every row dense, past the budget, mixed; 1 to 12 rows) launch nothing the warm-up did not
        q, iq = seqs[0][0], seqs[0][3]
        with launch_signatures() as calls, _registry.record():
            for n_blocks, lens in ((5, [4, 9, 20]), (37, [150, 20, 99]), (37, [150]), (37, [150] * 12),
                                   (8, [33] * 5)):
                pos = torch.tensor(lens) - 1
                rows = bt[:1].expand(len(lens), -1)
                tk.qsa_decode_paged_triton(q[pos], pos, iq[pos], kv, rows, ikv, rows, n_blocks, 4, 32, 0.3, 0.4)
        assert warm and calls <= warm, calls - warm
        assert {"qsa_score_paged", "qsa_topk", "qsa_topk_split", "qsa_attn", "qsa_merge"} <= set(tk.LAUNCHED)
        assert tk.warm_up_decode(kv, ikv, 6, 4, 4 * 120, 12, 4, 32, 0.3, 0.4, dtype=torch.float32) == []


@check("qsa_fp8_caches")
def check_qsa_fp8_caches():
    from qwen4exp.ops.qsa import reference as ref, triton_kernel as tk
    r, budget = 4, 32
    lens = [9, 150, 203]
    seqs, (kv, bt, ikv, _) = _paged(lens, 900, True)
    pos = torch.tensor(lens) - 1
    q, iq = torch.stack([s[0][-1] for s in seqs]), torch.stack([s[3][-1] for s in seqs])
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        k8, i8 = kv.clamp(-400, 400).to(dt), ikv.clamp(-400, 400).to(dt)
        got = tk.qsa_decode_paged_triton(q, pos, iq, k8, bt, i8, bt, 60, r, budget, 0.3, 0.4)
        close(got, ref.qsa_decode_paged(q, pos, iq, k8, bt, i8, bt, 60, r, budget, 0.3, 0.4), 0.05, f"{dt} decode")
        n = 30
        p = pos[2:] - torch.arange(n - 1, -1, -1)
        got = tk.qsa_prefill_paged_triton(seqs[2][0][-n:], p, seqs[2][3][-n:], k8, bt[2], i8, lens[2], r, budget,
                                          0.3, 0.4)
        want = ref.qsa_prefill_paged(seqs[2][0][-n:], p, seqs[2][3][-n:], k8, bt[2], i8, lens[2], r, budget, 0.3,
                                     0.4)
        close(got, want, 0.05, f"{dt} prefill")


@check("qsa_write_paged")
def check_qsa_write_paged():
    from qwen4exp.ops.qsa import reference as ref, triton_kernel as tk
    g = torch.Generator().manual_seed(11)
    for blocks, H, bs, d, N in ((12, 2, 16, 64, 9), (4, 1, 64, 32, 5)):  # main K|V cache, index cache shapes
        kv = torch.randn(blocks, H, bs, 2 * d, generator=g).to(BF)
        kv2 = kv.clone()
        slots = torch.randperm(blocks * bs, generator=g)[:N]
        slots[::3] = -1  # padding rows store nothing
        k = torch.randn(N, H, 2 * d, generator=g).to(BF)[..., :d]  # strided rows
        v = torch.randn(N, H, d, generator=g).to(BF)
        tk.write_paged_triton(kv, slots, k, v)
        ref.write_paged(kv2, slots, k, v)
        assert torch.equal(kv, kv2), "write_paged"


@check("qsa_index_update")
def check_qsa_index_update():
    from qwen4exp.ops.qsa import layout
    from qwen4exp.ops.qsa import reference as ref, triton_kernel as tk
    g = torch.Generator().manual_seed(12)
    B, di, RD, ibs, nb, r, rr = 9, 64, 32, 16, 60, 4, 20

    def twin_caches(n_kv):
        """Two paged caches of the same random contents, their index views, and a flat view of a cache."""
        kv = layout.paged_cache(nb, n_kv, ibs, 16, di, r, rr, pad=8)
        n = kv.untyped_storage().nbytes() // 2
        kv.as_strided((n,), (1,), 0).copy_((torch.randn(n, generator=g) * 2).to(BF))
        kv2 = layout.paged_cache(nb, n_kv, ibs, 16, di, r, rr, pad=8)
        kv2.untyped_storage().copy_(kv.untyped_storage())
        views = layout.index_views(kv, di, r, rr), layout.index_views(kv2, di, r, rr)
        return kv, kv2, *views, lambda t: t.as_strided((n,), (1,), 0)

    kv, kv2, a, b, flat = twin_caches(1)
    bt = (torch.randperm(nb - 1, generator=g)[: B * 6] + 1).view(B, 6).int()
    pos = torch.tensor([0, 1, 2, 3, 4, 7, 11, 63, 90])
    slots = bt.gather(1, (pos // ibs).unsqueeze(1)).squeeze(1).long() * ibs + pos % ibs
    slots[-1] = -1
    raw = (torch.randn(B, di + 16, generator=g) * 2).to(BF)[:, :di]
    w = (torch.randn(di, generator=g) * 0.2).to(BF)
    ang = torch.randn(B, RD // 2, generator=g) * 30
    cos, sin = torch.cat([ang, ang], -1).cos().to(BF), torch.cat([ang, ang], -1).sin().to(BF)
    tk.index_update_triton(a.index_kv, a.ring, slots, pos, slots >= 0, raw, w, 1e-6, cos, sin, r)
    ref.index_update_decode(b.index_kv, b.ring, slots, pos, slots >= 0, raw, w, 1e-6, cos, sin, r)
    close(flat(kv), flat(kv2), 1e-3, "index_update_decode", rtol=2 ** -7)
    # the decode step's K|V rows written by the same launch (``decode_cache_writes``): two KV heads of 16
    kv, kv2, a, b, flat = twin_caches(2)
    k = (torch.randn(B, 2, 32, generator=g) * 2).to(BF)[..., :16]  # strided, as a view of a projection's output
    v = (torch.randn(B, 2, 16, generator=g) * 2).to(BF)
    tk.index_update_triton(a.index_kv, a.ring, slots, pos, slots >= 0, raw, w, 1e-6, cos, sin, r, kv, k, v)
    ref.decode_cache_writes(kv2, b.index_kv, b.ring, slots, pos, slots >= 0, k, v, raw, w, 1e-6, cos, sin, r)
    assert torch.equal(kv, kv2), "decode_cache_writes: K|V rows"
    close(flat(kv), flat(kv2), 1e-3, "decode_cache_writes", rtol=2 ** -7)
    # an MTP verification, 4 consecutive tokens a request in one launch: blocks completed from this step's earlier
    # rows (read from raw), from the ring alone, from both, and a padding request
    nq, bt4 = 4, bt[:4]
    pos4 = torch.tensor([5, 6, 7, 8, 12, 13, 14, 15, 62, 63, 64, 65, 0, 0, 0, 0])
    req = torch.arange(16) // nq
    slots4 = bt4[req].gather(1, (pos4 // ibs).unsqueeze(1)).squeeze(1).long() * ibs + pos4 % ibs
    slots4[12:] = -1
    raw4 = (torch.randn(16, di, generator=g) * 2).to(BF)
    ang4 = torch.randn(16, RD // 2, generator=g) * 30
    cos4, sin4 = torch.cat([ang4, ang4], -1).cos().to(BF), torch.cat([ang4, ang4], -1).sin().to(BF)
    k4, v4 = (torch.randn(16, 2, 16, generator=g) * 2).to(BF), (torch.randn(16, 2, 16, generator=g) * 2).to(BF)
    tk.index_update_triton(a.index_kv, a.ring, slots4, pos4, slots4 >= 0, raw4, w, 1e-6, cos4, sin4, r, kv, k4, v4,
                           nq)
    ref.decode_cache_writes(kv2, b.index_kv, b.ring, slots4, pos4, slots4 >= 0, k4, v4, raw4, w, 1e-6, cos4, sin4,
                            r, nq)
    assert torch.equal(kv, kv2), "decode_cache_writes at 4 queries: K|V and ring rows"
    close(flat(kv), flat(kv2), 1e-3, "decode_cache_writes at 4 queries", rtol=2 ** -7)


@check("qsa_real_widths")
def check_qsa_real_widths():
    """Qwen3.8-Flash-Next's QSA widths (24 / 2 heads x 256, indexer 4 x 128, budget 2048 in blocks of 4, a
    1,568-token page as vLLM picked on the H200) on a context past the budget: decode with the few- and the
    many-query (batch-32) settings, prefill looping and split."""
    from qwen4exp.ops.qsa import launch, reference as ref, triton_kernel as tk
    r, budget, L, bs = 4, 2048, 2100, 1568
    seq = [t.to(BF) for t in qsa_inputs(L, Hq=24, Hkv=2, d=256, hi=4, di=128, seed=3)]
    kv, bt, ikv, _ = paged_qsa_case([seq], [L], r, bs, bs, shared_table=True)
    q, k, v, iq, bk = seq
    pos = torch.tensor([L - 1])
    want = ref.qsa_decode_paged(q[-1:], pos, iq[-1:], kv, bt, ikv, bt, L // r, r, budget, 0.0625, 0.1)
    for many in (launch.ATTN_MANY_QUERIES, 1):
        with settings(launch, ATTN_MANY_QUERIES=many):
            got = tk.qsa_decode_paged_triton(q[-1:], pos, iq[-1:], kv, bt, ikv, bt, L // r, r, budget, 0.0625, 0.1)
            gate = torch.randn(1, 24, 512).to(BF)[..., 256:]  # the [Q | gate] projection's gate half
            gated = tk.qsa_decode_paged_triton(q[-1:], pos, iq[-1:], kv, bt, ikv, bt, L // r, r, budget, 0.0625,
                                               0.1, gate)
        close(got, want, 0.05, f"decode real widths ATTN_MANY_QUERIES={many}")
        close(gated, ref.output_gate(got, gate), 0.0, f"gated decode real widths many={many}", rtol=2 ** -5)
    for loop_min in (1, 10 ** 9):  # looping / split attention
        with settings(launch, LOOP_MIN_QUERIES=loop_min):
            p = torch.arange(L - 2, L)
            got = tk.qsa_prefill_paged_triton(q[-2:], p, iq[-2:], kv, bt[0], ikv, L, r, budget, 0.0625, 0.1)
        want = ref.qsa_prefill_paged(q[-2:], p, iq[-2:], kv, bt[0], ikv, L, r, budget, 0.0625, 0.1)
        close(got, want, 0.05, f"prefill real widths loop_min={loop_min}")


@check("qsa_registration")
def check_qsa_registration():
    """QSA's custom operators: each defined (in-place ones with a mutable schema) with a fake giving the kernels'
    output shapes to torch.compile / CUDA-graph tracing."""
    from interpreter import _registration

    def fakes(ops, t):
        i64, i32 = dict(dtype=torch.int64), dict(dtype=torch.int32)
        assert ops["qsa_attention"](t(3, 6, 64), t(40, 2, 64), t(40, 2, 64), t(3, **i64), t(3, 4, 32), t(10, 32), 4,
                                    32, 0.3, 0.4).shape == (3, 6, 64)
        assert ops["qsa_decode_paged"](t(3, 6, 64), t(3, **i64), t(3, 4, 32), t(9, 2, 16, 128), t(3, 5, **i32),
                                       t(9, 1, 16, 64), t(3, 5, **i32), 40, 4, 32, 0.3, 0.4, None).shape == (3, 6, 64)
        assert ops["qsa_decode_paged"](t(3, 6, 64), t(3, **i64), t(3, 4, 32), t(9, 2, 16, 128), t(3, 5, **i32),
                                       t(9, 1, 16, 64), t(3, 5, **i32), 40, 4, 32, 0.3, 0.4,
                                       t(3, 6, 64)).shape == (3, 6, 64)
        ids = ops["qsa_select_paged"](t(3, **i64), t(3, 4, 32), t(9, 1, 16, 64), t(3, 5, **i32), 40, 4, 32, 0.4)
        assert ids.shape == (3, 8) and ids.dtype == torch.int64
        assert ops["qsa_attend_paged"](t(3, 6, 64), t(3, **i64), t(9, 2, 16, 128), t(3, 5, **i32), ids, 4,
                                       0.3, None).shape == (3, 6, 64)
        assert ops["qsa_prefill_paged"](t(7, 6, 64), t(7, **i64), t(7, 4, 32), t(9, 2, 16, 128), t(5, **i32),
                                        t(9, 1, 16, 64), 70, 4, 32, 0.3, 0.4).shape == (7, 6, 64)
        assert ops["qsa_write_paged"](t(4, 2, 16, 64), t(3, **i64), t(3, 2, 32), t(3, 2, 32)) is None
        assert ops["qsa_index_update_decode"](t(9, 1, 16, 64), t(9, 1, 20, 32), t(3, **i64), t(3, **i64),
                                              t(3, dtype=torch.bool), t(3, 32), t(32), 1e-6, t(3, 16), t(3, 16),
                                              4) is None
        assert ops["qsa_decode_writes"](t(9, 2, 16, 64), t(9, 1, 16, 64), t(9, 1, 20, 32), t(3, **i64), t(3, **i64),
                                        t(3, dtype=torch.bool), t(3, 2, 32), t(3, 2, 32), t(3, 32), t(32), 1e-6,
                                        t(3, 16), t(3, 16), 4, 1) is None
    _registration("qwen4exp.ops.qsa.cuda",
                  ("qsa_attention", "qsa_decode_paged", "qsa_select_paged", "qsa_attend_paged", "qsa_prefill_paged",
                   "qsa_write_paged", "qsa_index_update_decode", "qsa_decode_writes"), fakes,
                  mutating=("qsa_write_paged", "qsa_index_update_decode", "qsa_decode_writes"))


@compile_check("qsa_row_views")
def check_qsa_row_views(target):
    """Positions and block-table rows arrive as views whose start may or may not be 16-byte aligned (where the
    request sits in the step): no QSA kernel may compile a variant per alignment of them (a JIT stall mid-serving).
    Every such parameter is marked, and the launch key of the prefill score kernel is the same for an aligned and a
    misaligned view."""
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    from qwen4exp.ops.qsa import attend, cache, launch, score, select
    marked = 0
    for mod in (score, select, attend, cache):
        for name, fn in vars(mod).items():
            if isinstance(fn, JITFunction) and name.endswith("_kernel"):  # (launched; helpers take what they get)
                for p in fn.params:
                    if p.name in launch.ROW_VIEWS:
                        assert p.do_not_specialize_on_alignment, f"{name}: {p.name} specialised on alignment"
                        marked += 1
    assert marked >= 8, marked
    k = score._qsa_score_prefill_kernel
    binder = create_function_from_signature(k.signature, k.params, CUDABackend(target))
    pos, bt = torch.arange(10), torch.zeros(4, 7, dtype=torch.int32)

    def key(p, row):
        args = (torch.zeros(8, 4, 128, dtype=BF), torch.zeros(2, 1, 16, 256, dtype=BF), row, p,
                torch.zeros(8, 64, dtype=torch.int64), 8, 64, 4, 0.5, 7, 512, 128, 8192, 256, 64)
        return str(binder(*args, HI=4, DI=128, IBS=16, BLOCK_M=64, BLOCK_N=64, debug=False)[1])

    assert key(pos[0:8], bt[0]) == key(pos[1:9], bt[1]), "prefill score kernel: a new variant per alignment"


# ------------------------------------------------------------------------------------------------------------ PLE
@check("ple_lookup")
def check_ple_lookup():
    """The row gather: an fp8 table dequantised by a scale, a bf16 table copied, an fp32 output."""
    from qwen4exp.ops.ple import reference as ref, triton_kernel as tk
    g = torch.Generator().manual_seed(5)
    table = (torch.randn(1001, 32, generator=g) * 120).clamp(-448, 448).to(torch.float8_e4m3fn)
    rows = torch.randint(0, 1001, (5, 4), generator=g)
    scale = torch.tensor(0.0173)
    close(tk.ple_lookup_triton(table, rows, scale), ref.ple_lookup(table, rows, scale), 0.0, "ple fp8", rtol=2 ** -7)
    close(tk.ple_lookup_triton(table, rows, scale, torch.float32), ref.ple_lookup(table, rows, scale, torch.float32),
          1e-6, "ple fp8 -> fp32", rtol=1e-6)
    tb = torch.randn(1001, 24, generator=g).to(BF)
    rows3 = torch.randint(0, 1001, (2, 3, 4), generator=g)  # lead dims kept
    assert torch.equal(tk.ple_lookup_triton(tb, rows3), ref.ple_lookup(tb, rows3)), "ple bf16"


@check("ngram_lookup_decode")
def check_ngram_lookup_decode():
    """Decode's n-gram context + hashing + gather in one launch against ``reference.ngram_lookup_decode``: contexts
    with EOS at every position (fresh sequences: all EOS), an fp8 table with a scale and a bf16 one without."""
    from qwen4exp.ops.ple import hash_multipliers, head_table_sizes, host, reference as ref, triton_kernel as tk
    g = torch.Generator().manual_seed(17)
    eos = 5
    for n, hpn, sdt in ((3, 8, torch.float8_e4m3fn), (4, 2, BF), (2, 3, BF)):
        C, G = n - 1, (n - 1) * hpn
        sizes = head_table_sizes(1000, G, 1)
        offs = [sum(sizes[:i]) for i in range(G)]
        mult = torch.tensor(hash_multipliers(248320, n, 1, 0), dtype=torch.long)
        hsz, hoff = torch.tensor(sizes), torch.tensor(offs)
        table = torch.randn(sum(sizes), 24, generator=g).to(sdt)
        scale = torch.tensor(0.05) if sdt != BF else None
        N = 4 * (C + 1)
        prev = torch.randint(0, 248320, (N, C), generator=g)
        for i in range(C):  # an EOS in each column for some rows, all-EOS rows
            prev[i::C + 1, i] = eos
        prev[C::C + 1] = eos
        ids = torch.randint(0, 248320, (N,), generator=g)
        ids[::3] = eos
        assert host.ngram_lookup_decode_covers(ids, prev)
        want, want_next = ref.ngram_lookup_decode(ids, prev, eos, mult, hsz, hoff, hpn, table, scale, None)
        got, got_next = tk.ngram_lookup_decode_triton(ids, prev, eos, mult, hsz, hoff, hpn, table, scale, None)
        assert torch.equal(got_next, want_next), f"n={n}: next context"
        close(got, want, 0.0, f"ngram_lookup_decode n={n}", rtol=2 ** -7)  # (the interpreter truncates the cast)


@check("ple_mix")
def check_ple_mix():
    """The decode-time PLE mix (one launch) against ``reference.ple_mix`` with one token per sequence: streams,
    keys and values strided as the vLLM model passes them (views into one keys|values buffer), a bf16 and an fp32
    conv state, a width that is not a power of two, and the real widths."""
    from qwen4exp.ops.ple import host, reference as ref, triton_kernel as tk
    g = torch.Generator().manual_seed(13)
    for T, n, D, K, dil, sdt in ((3, 4, 256, 4, 3, BF), (2, 2, 384, 3, 2, torch.float32), (1, 4, 2560, 4, 3, BF)):
        nD, S = n * D, (K - 1) * dil
        H = (torch.randn(T, nD, generator=g) * 2).to(BF)
        kv = torch.randn(T, nD + D, generator=g).to(BF)
        k, v = kv[:, :nD], kv[:, nD:]
        qw, cw = ((torch.randn(nD, generator=g) * 0.2).to(BF) for _ in range(2))
        wc = (torch.randn(nD, K, generator=g) * 0.5).to(BF)
        state = torch.randn(T, nD, S, generator=g).to(sdt)
        want, want_st = ref.ple_mix(H, k, v, qw, cw, wc, None, state, n, 1e-6, dil)
        assert host.ple_mix_decode_covers(H, k, v, qw, cw, wc, None, state, n)
        got, got_st = tk.ple_mix_decode_triton(H, k, v, qw, cw, wc, state, n, 1e-6, dil)
        # (fp32 sums in another order: a norm or the gate can move by one bf16 unit, and what follows it)
        close(got, want, 0.03, f"ple_mix T={T} D={D}", rtol=2 ** -6)
        assert got_st.dtype == want_st.dtype
        close(got_st, want_st, 0.03, f"ple_mix state T={T} D={D}", rtol=2 ** -6)
        assert torch.equal(got_st[..., :-1], want_st[..., :-1].to(got_st.dtype)) or sdt != BF  # shifted as is


@check("ple_registration")
def check_ple_registration():
    """PLE's custom operators with fakes giving the kernels' output shapes and dtypes."""
    from interpreter import _registration

    def fakes(ops, t):
        out, st = ops["ple_mix_decode"](t(3, 256), t(3, 256), t(3, 64), t(256), t(256), t(256, 4), t(3, 256, 9),
                                        4, 1e-6, 3)
        assert out.shape == (3, 256) and st.shape == (3, 256, 9) and st.dtype == BF
        i64 = dict(dtype=torch.int64)
        emb, nxt = ops["ngram_lookup_decode"](t(3, **i64), t(3, 2, **i64), 7, t(3, **i64), t(16, **i64),
                                              t(16, **i64), 8, t(100, 160, dtype=torch.float8_e4m3fn),
                                              t(1, dtype=torch.float32), BF)
        assert emb.shape == (3, 16 * 160) and emb.dtype == BF and nxt.shape == (3, 2)
        out = ops["ple_lookup"](t(100, 8, dtype=torch.float8_e4m3fn), t(3, 16, **i64), None, BF)
        assert out.shape == (3, 128) and out.dtype == BF
    _registration("qwen4exp.ops.ple.cuda", ("ple_lookup", "ngram_lookup_decode", "ple_mix_decode"), fakes)
