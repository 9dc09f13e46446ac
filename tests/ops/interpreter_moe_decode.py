"""Triton checks of the MoE decode op (``qwen4exp.ops.moe_decode``), registered into ``interpreter.py`` (listed in
its MODULES): the router and the NVFP4 expert kernels under the CPU interpreter against the reference at small
sizes of the real structure (16 experts, top-4, hidden 256, intermediate 64; M = 1, 2, 4), each launch setting
the host picks or a knob allows (one and several down-projection groups, a partial group, several K steps, masked
K tails), and the custom operators' registration; in the compile step, the launches the host makes at the model's
sizes (512 experts, top-10, hidden 2560, intermediate 640; M = 1..4), compiled for sm_90 without register spills."""

from __future__ import annotations

import torch

from interpreter import BF, _describe, _registration, check, close, compile_check, settings, source
from moe_decode_cases import nvfp4_experts, routed_inputs, router_case


def _by_id(w, ids):
    order = ids.long().argsort(-1)
    return w.float().gather(-1, order), ids.long().gather(-1, order)


@check("moe_decode_router")
def check_moe_decode_router():
    from qwen4exp.ops.moe_decode import reference as ref, triton_kernel as tk
    cases = [(1, 256, 16, 4, BF, True, {}), (2, 256, 16, 4, BF, True, {}), (4, 256, 16, 4, BF, True, {}),
             (3, 96, 18, 5, BF, False, dict(ROUTER_BLOCK_E=8, ROUTER_BLOCK_D=32)),  # E, D tails; no renorm
             (4, 64, 16, 16, torch.float32, True, dict(ROUTER_BLOCK_E=2))]          # k = E, fp32
    for i, (M, D, E, k, dt, renorm, kw) in enumerate(cases):
        what = f"router M={M} D={D} E={E} k={k} {dt} renorm={renorm} {kw}"
        x, w = router_case(M, D, E, k, seed=10 + i, dtype=dt)
        want_l, want_w, want_ids = ref.router_topk(x, w, k, renorm)
        for rep in range(2):  # the second launch finds the ticket counter reset
            with settings(tk, **kw):
                lg, tw, ids = tk.router_topk_triton(x, w, k, renorm)
            assert lg.dtype == tw.dtype == dt and ids.dtype == torch.int64 and ids.shape == (M, k), what
            close(lg, want_l, 1e-5 if dt == torch.float32 else 2e-2, f"{what} logits", rtol=2 ** -7)
            gw, gi = _by_id(tw, ids)
            ww, wi = _by_id(want_w, want_ids)
            assert torch.equal(gi, wi), f"{what}: ids {ids.tolist()} vs {want_ids.tolist()}"
            close(gw, ww, 1e-6, f"{what} weights", rtol=2 ** -7)
            # descending weights, as torch.topk's
            assert bool((tw.float()[:, :-1] >= tw.float()[:, 1:]).all()), what


@check("moe_decode_experts")
def check_moe_decode_experts():
    from qwen4exp.ops.moe_decode import reference as ref, triton_kernel as tk
    E, D, I, k = 16, 256, 64, 4
    t = nvfp4_experts(E, D, I, seed=1)
    launch_settings = [{}, dict(W2_EXPERTS=4), dict(W2_EXPERTS=3, W13_BLOCK_K=64, W2_BLOCK_K=32, W2_BLOCK_N=64),
                       dict(W2_EXPERTS=3, W13_BLOCK_K=64, W2_BLOCK_K=32)]
    for M in (1, 2, 4):
        x, w, ids = routed_inputs(M, D, k, E, seed=M)
        want = ref.experts_nvfp4(x, *t.values(), w, ids)
        for kw in launch_settings:
            with settings(tk, **kw):
                got = tk.experts_nvfp4_triton(x, *t.values(), w, ids)
            assert got.dtype == BF and got.shape == (M, D)
            # one bf16 unit of an activation (another summation order) moves an output by far less than this
            close(got, want, 1e-2, f"experts M={M} {kw}", rtol=2 ** -7)
            # the shift decode scales x and the group scales by powers of two, the select decode does not: the
            # same products and sums, so the same bits
            with settings(tk, DECODE="select", **kw):
                sel = tk.experts_nvfp4_triton(x, *t.values(), w, ids)
            assert torch.equal(got, sel), f"experts M={M} {kw}: shift and select decodes differ"
    # fp32, int32 ids, repeated ids across tokens, D and I that are not powers of two (masked K tails)
    E, D, I, k = 6, 80, 48, 3
    t = nvfp4_experts(E, D, I, seed=2)
    x, w, ids = routed_inputs(3, D, k, E, seed=3, dtype=torch.float32)
    ids[1] = ids[0]
    want = ref.experts_nvfp4(x, *t.values(), w, ids)
    for kw in ({}, dict(W2_EXPERTS=1)):
        with settings(tk, **kw):
            got = tk.experts_nvfp4_triton(x, *t.values(), w, ids.int())
        close(got, want, 1e-5, f"experts fp32 {kw}", rtol=1e-5)
    # the shift decode's range: activations from 2^-60 to 2^12 in one token (wider would overflow the SiLU in both),
    # the same bits as the select decode
    x = x * torch.pow(2.0, torch.randint(-60, 13, x.shape, generator=torch.Generator().manual_seed(4)).float())
    with settings(tk, W2_EXPERTS=1):
        got = tk.experts_nvfp4_triton(x, *t.values(), w, ids.int())
        with settings(tk, DECODE="select"):
            sel = tk.experts_nvfp4_triton(x, *t.values(), w, ids.int())
    assert bool(got.isfinite().all()) and torch.equal(got, sel), \
        f"experts fp32, wide activations: shift and select decodes differ\n{got}\n{sel}"
    with settings(tk, DECODE="bits"):
        try:
            tk.experts_nvfp4_triton(x, *t.values(), w, ids.int())
        except ValueError as e:
            assert "DECODE='bits'" in str(e), e
        else:
            raise AssertionError("DECODE='bits' was accepted")


class _Launch:
    """Stands in for a jitted kernel: ``kernel[grid](*args, **kw)`` records the launch (nothing runs)."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def __getitem__(self, grid):
        return lambda *args, **kw: self.log.append((self.name, grid))


@check("moe_decode_capture_safe")
def check_moe_decode_capture_safe():
    """The wrappers' host paths at the model's sizes on meta tensors (launches recorded, not run), every aten op
    they issue seen by a dispatch mode: no op touches a CPU tensor (no host -> device copy, nothing a CUDA graph
    capture refuses), and from the second call on they only allocate their outputs and view tensors (the scratch
    buffers and tickets are made on the first call, before any capture, and reused)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from qwen4exp.ops.moe_decode import triton_kernel as tk

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.cpu = [], []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.ops.append(str(func))
            flat = [*args, *(kwargs or {}).values(), *(out if isinstance(out, (tuple, list)) else (out,))]
            self.cpu += [str(func) for t in flat if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
            return out

    E, D, I, k = 512, 2560, 640, 10
    u8, f8, f32 = torch.uint8, torch.float8_e4m3fn, torch.float32

    def meta(*shape, dtype=BF):
        return torch.empty(*shape, dtype=dtype, device="meta")

    log = []
    names = ("_router_topk_kernel", "_w13_silu_kernel", "_w2_combine_kernel")
    saved = {n: getattr(tk, n) for n in names}
    try:
        for n in names:
            setattr(tk, n, _Launch(n, log))
        for M in (1, 4):
            x = meta(M, D)
            experts = (meta(E, 2 * I, D // 2, dtype=u8), meta(E, 2 * I, D // 16, dtype=f8), meta(E, dtype=f32),
                       meta(E, D, I // 2, dtype=u8), meta(E, D, I // 16, dtype=f8), meta(E, dtype=f32))
            W = meta(E, D)
            for call in range(2):
                with Ops() as mode:
                    _, tw, ids = tk.router_topk_triton(x, W, k, True)
                    tk.experts_nvfp4_triton(x, *experts, tw, ids)
                what = f"M={M} call {call}"
                assert not mode.cpu, f"{what}: ops on CPU tensors {mode.cpu}"
                if call:
                    extra = [o for o in mode.ops if not o.startswith(("aten.empty.", "aten.view.", "aten.detach."))]
                    assert not extra, f"{what}: ops besides output allocations and views: {extra}"
    finally:
        for n, f in saved.items():
            setattr(tk, n, f)
    assert {n for n, _ in log} == set(names), log


@check("moe_decode_registration")
def check_moe_decode_registration():
    def fakes(ops, t):
        lg, tw, ids = ops["router_topk"](t(2, 256), t(16, 256), 4, True)
        assert lg.shape == (2, 16) and tw.shape == (2, 4) and tw.dtype == BF and ids.dtype == torch.int64
        u8, f8, f32 = torch.uint8, torch.float8_e4m3fn, torch.float32
        out = ops["experts_nvfp4"](t(3, 256), t(16, 128, 128, dtype=u8), t(16, 128, 16, dtype=f8), t(16, dtype=f32),
                                   t(16, 256, 32, dtype=u8), t(16, 256, 4, dtype=f8), t(16, dtype=f32), t(3, 4),
                                   t(3, 4, dtype=torch.int64))
        assert out.shape == (3, 256) and out.dtype == BF
    _registration("qwen4exp.ops.moe_decode.cuda", ("router_topk", "experts_nvfp4"), fakes)


def _ptx_loops(ptx: str) -> list[str]:
    """The bodies of the PTX's loops: from a label to a later branch back to it."""
    import re
    labels = {m.group(1): m.end() for m in re.finditer(r"^(\$L__\w+):", ptx, re.M)}
    return [ptx[labels[m.group(1)]:m.start()] for m in re.finditer(r"\bbra(?:\.uni)?\s+(\$L__\w+);", ptx)
            if m.group(1) in labels and labels[m.group(1)] < m.start()]


@compile_check("moe_decode_real_sizes")
def check_moe_decode_real_sizes(target):
    """The launchers run on meta tensors of the model's sizes with the kernel launch intercepted (nothing runs),
    so the launches compiled are the host's own (its block sizes, groups, padding), then each compiled for sm_90:
    within Hopper's shared memory, no register spills (decode kernels: a spill goes through local memory)."""
    import triton
    from triton.runtime.jit import JITFunction

    from interpreter import SMEM_MAX, ptxas_resources
    from qwen4exp.ops.moe_decode import triton_kernel as tk

    E, D, I, k = 512, 2560, 640, 10
    launches = {}
    orig = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        d = _describe(self.fn, args, kwargs)
        launches[repr(d)] = d

    def meta(*shape, dtype=BF):
        return torch.empty(*shape, dtype=dtype, device="meta")

    u8, f8, f32 = torch.uint8, torch.float8_e4m3fn, torch.float32
    JITFunction.run = record
    try:
        for M in (1, 2, 3, 4):
            for dt in (BF, f32):
                x = meta(M, D, dtype=dt)
                tk.router_topk_triton(x, meta(E, D, dtype=dt), k, True)
                for decode in ("shift", "select"):
                    with settings(tk, DECODE=decode):
                        tk.experts_nvfp4_triton(
                            x, meta(E, 2 * I, D // 2, dtype=u8), meta(E, 2 * I, D // 16, dtype=f8),
                            meta(E, dtype=f32), meta(E, D, I // 2, dtype=u8), meta(E, D, I // 16, dtype=f8),
                            meta(E, dtype=f32), meta(M, k, dtype=dt), meta(M, k, dtype=torch.int64))
    finally:
        JITFunction.run = orig
    names = {d["name"] for d in launches.values()}
    assert names == {"_router_topk_kernel", "_w13_silu_kernel", "_w2_combine_kernel"}, names
    problems = []
    for d in launches.values():
        what = f"{d['name']} {d['constexprs']} {d['options']}"
        fn = getattr(tk, d["name"])
        c = triton.compile(source(fn, d), target=target,
                           options=d["options"])
        regs, spill = ptxas_resources(c.asm["ptx"], c.metadata.target.arch)
        if d["name"] != "_router_topk_kernel" and any("ftz" in body for body in _ptx_loops(c.asm["ptx"])):
            # the shift decode's subnormal weights (E2M1 x 2^-126) must reach the products unflushed (the SiLU's
            # exp after the loop may flush)
            problems.append(f"{what}: flush-to-zero fp32 arithmetic in a loop of the PTX")
        print(f"resources {what}: {regs} registers, {spill} bytes spilled, {c.metadata.shared} B shared", flush=True)
        # (in the launcher's build, divisibility by 16 included, ptxas keeps 4 bytes of the fp32 router at one
        # token in local memory; bf16, the served dtype, and the other widths spill nothing)
        allowed = 4 if d["name"] == "_router_topk_kernel" and not d["constexprs"]["BF16"] else 0
        if spill > allowed or c.metadata.shared > SMEM_MAX:
            problems.append(f"{what}: {regs} registers, {spill} bytes spilled, {c.metadata.shared} B shared")
    assert not problems, "\n".join(problems)
