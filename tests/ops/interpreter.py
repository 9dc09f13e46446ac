"""The Triton kernels checked without a GPU: against their torch references under Triton's CPU interpreter, then
every launch that ran compiled ahead of time for Hopper (sm_90). Run by ``tests/ops/conftest.py`` (the
``triton_checks`` fixture: one subprocess per step per session), or by hand:

  TRITON_INTERPRET=1 python tests/ops/interpreter.py run OUT [NAME ...]
      the named checks (default: all), each kernel launcher (``*_triton``) against its reference on small random
      inputs (every program of every grid, sequentially); per-check results to OUT/checks.json
      ({name: {status: passed / failed / skipped, message, seconds}}, rewritten after each check), the kernels'
      launches (argument types, compile-time constants, warps) to OUT/launches.json
  python tests/ops/interpreter.py compile OUT [PART PARTS]
      every distinct recorded launch (with PART PARTS: every PARTS-th from the PART-th, the compile checks only in
      part 0, results to OUT/compiled-PART.json) compiled for sm_90 (Triton's front end, its GPU passes, LLVM and ptxas to a
      cubin: the GPU build, libdevice math and bf16 dots, not the interpreter's), within Hopper's shared memory per
      program, without register spills for the kernels in NO_SPILL; then the compile checks. Results to
      OUT/compiled.json ({"kernels": {kernel: {status, message}}, "checks": {name: {status, message}}}).

Registering checks (this module, and the modules in MODULES, imported for their registrations):

    from interpreter import BF, check, close, skip

    @check("rms_norm")
    def check_rms_norm():
        ...  # raise (an assert) on a mismatch; skip("why") when it cannot run here

    @compile_check("qsa_row_views")
    def check_qsa_row_views(target): ...  # in the compile step (no interpreter), given the GPUTarget

and a pytest item per check in the op's test file: ``@pytest.mark.triton_check("rms_norm")`` over
``def test_...(triton_checks): triton_checks.passed("rms_norm")`` (``triton_checks.compiled(kernel)`` for a
kernel's sm_90 build, ``triton_checks.compile_check(name)``).

Needs Triton importable (``make test`` installs the GPU image's version, 3.6.0, in .cache/triton beside the venv,
which keeps vLLM's CPU build free of Triton; fla-core beside it for the GDN check). The interpreter rounds
fp32 -> bf16 stores by truncation; the kernels round explicitly where it matters (``ops/triton_utils.round_bf16``),
so the tolerances are the GPU tests'.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import sys
import time
import traceback
from typing import Callable

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (os.path.dirname(os.path.dirname(HERE)), HERE):  # the repository (qwen4exp), tests/ops (check modules)
    if _p not in sys.path:
        sys.path.insert(0, _p)

BF = torch.bfloat16
MODULES = ("interpreter_qsa_ple", "interpreter_moe_decode")  # other check modules (tests/ops/<name>.py), if present
TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
         torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1",
         torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
OPTIONS = ("num_warps", "num_stages")
SMEM_MAX = 232448  # shared memory one program may use on Hopper (227 KiB): more fails at launch, not at compile

# kernels that must not spill registers at any recorded launch (decode-path kernels: a spilled register is read and
# written through local memory at every use), and kernels that must not at the launches with these constants (the
# test widths of the others compile to other layouts)
NO_SPILL = {"_hc_finish_kernel", "_hc_inject_kernel", "_hc_inject_norm_kernel", "_hc_gate_mean_kernel",
            "_rms_norm_kernel", "_shared_gate_combine_kernel", "_norm_rope_kernel", "_rope_kernel",
            "_ple_mix_decode_kernel", "_ngram_gather_decode_kernel", "_ple_gather_kernel"}
NO_SPILL_AT = {"_qsa_attn_kernel": {"HD": 256}, "_hc_down_kernel": {"TICKET": True}}
# bytes of spill stores a kernel of NO_SPILL / NO_SPILL_AT may have: in the launcher's build (its arguments' divisibility
# by 16) ptxas keeps one 16-bit value of the ticket HC down kernel in local memory across its loop (one STL.S16 /
# LDL.S16 pair a loop step at 48-64 registers, an L1 hit); the build without that divisibility does not
SPILL_BYTES_ALLOWED = {"_hc_down_kernel": 4}

CHECKS: dict[str, Callable[[], None]] = {}
COMPILE_CHECKS: dict[str, Callable] = {}


class Skipped(Exception):
    """Raised by ``skip``: the check cannot run here (a missing optional package); not a failure."""


def skip(reason: str):
    raise Skipped(reason)


def _register(table, kind):
    def deco(name):
        def add(fn):
            if name in table:
                raise ValueError(f"two {kind} named {name!r}")
            table[name] = fn
            return fn
        return add
    return deco


check = _register(CHECKS, "interpreter checks")
compile_check = _register(COMPILE_CHECKS, "compile checks")


def close(got, want, atol, what, rtol=0.0):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    err = (got.float() - want.float()).abs()
    bad = err > atol + rtol * want.float().abs()
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off, max abs err {err.max().item()}"


@contextlib.contextmanager
def settings(module, **values):
    """The module's launch settings (its upper-case knobs) set to ``values`` inside the block, restored after it."""
    saved = {k: getattr(module, k) for k in values}
    for k, v in values.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(module, k, v)


def load_modules() -> dict[str, str]:
    """Import the other check modules (their @check registrations) -> {module: error} for those that failed."""
    errors = {}
    for mod in MODULES:
        if os.path.exists(os.path.join(HERE, mod + ".py")):
            try:
                importlib.import_module(mod)
            except Exception:  # noqa: BLE001  (reported on each check the session asked for)
                errors[mod] = traceback.format_exc(limit=6)
    return errors


# --------------------------------------------------------------------------------------------------------- HC
def _hc_case(g, T, n, D, R, inj, scale=1.0):
    H = (torch.randn(T, n * D, generator=g) * 2 * scale).to(BF)
    nw = (torch.randn(n * D, generator=g) * 0.1 * scale).to(BF)
    Wd = (torch.randn(R, n * D, generator=g) / (n * D) ** 0.5 * scale).to(BF)
    Wu = (torch.randn(n * D, R, generator=g) / R ** 0.5 * scale).to(BF)
    Wi = (torch.randn(n, n * D, generator=g) / (n * D) ** 0.5 * scale).to(BF) if inj else None
    return H, nw, Wd, Wu, Wi


HC_SMALL = ((1, 4, 256, 40, True), (3, 4, 256, 40, False), (6, 2, 384, 20, True), (9, 4, 256, 40, False))


def hc_mix_both_ways(args, what, own_norm=True):
    """``hc_mix_triton(*args)`` against the reference, with the norm in the kernels (unless not ``own_norm``) and
    with Hn handed in (the decode launches; past IN_KERNEL_SILU_MAX_T tokens the finish kernel between A and B)."""
    from qwen4exp.ops.hyper_connection import reference as ref, triton_kernel as tk
    from qwen4exp.ops.norm.reference import grouped_rms_norm
    xr, cr = ref.hc_mix(*args)
    H, nw, n, eps = args[0], args[1], args[5], args[6]
    for Hn in ((None,) if own_norm else ()) + (grouped_rms_norm(H, nw, H.shape[-1] // n, eps),):
        x, c = tk.hc_mix_triton(*args, Hn=Hn)
        way = f"hn_ready={Hn is not None}"
        close(x, xr, 0.07, f"hc_mix {what} {way}")
        if args[4] is not None:
            close(c, cr, 0.02, f"hc_mix c {what} {way}")
        else:
            assert c.shape == (H.shape[0], 0)


@check("hc_mix")
def check_hc_mix():
    from qwen4exp import envs
    from qwen4exp.ops.hyper_connection import triton_kernel as tk
    g = torch.Generator().manual_seed(3)
    for T, n, D, R, inj in HC_SMALL:
        hc_mix_both_ways((*_hc_case(g, T, n, D, R, inj), n, 1e-6), f"T={T}")
    # the finish kernel between A and B from 2 tokens on (above: T = 3, 6, 9), and at one token when set so
    assert tk.silu_in_kernel_max_t() == tk.IN_KERNEL_SILU_MAX_T == 1
    with settings(tk, IN_KERNEL_SILU_MAX_T=0):
        for inj in (True, False):
            hc_mix_both_ways((*_hc_case(g, 1, 4, 256, 40, inj), 4, 1e-6), f"T=1 finish kernel inj={inj}")
    # in-kernel finish past one token (the earlier default, 16-column tiles: bench_ops' comparison)
    with settings(tk, IN_KERNEL_SILU_MAX_T=4, B_BLOCK_D=16):
        hc_mix_both_ways((*_hc_case(g, 4, 4, 256, 40, True), 4, 1e-6), "T=4 in-kernel finish")
    saved = os.environ.get("QWEN4EXP_HC_DECODE")
    try:
        # fused-ticket: kernel A's last program of each row block finishes it (no finish kernel at any T); twice
        # over, so the second pass runs on the counters the first left (each must be zero again)
        os.environ["QWEN4EXP_HC_DECODE"] = "fused-ticket"
        envs.reset()
        assert tk.silu_in_kernel_max_t() == 0
        for rep in range(2):
            for T in (1, 2, 4, 8):
                for inj, R in ((True, 40), (False, 100)):  # R = 100: two row blocks of W_down, one partial
                    hc_mix_both_ways((*_hc_case(g, T, 4, 256, R, inj), 4, 1e-6),
                                     f"T={T} R={R} fused-ticket pass {rep}")
            cnt = tk._TICKETS[torch.device("cpu")]
            assert not cnt.any(), f"fused-ticket counters not reset: {cnt.tolist()}"
    finally:
        if saved is None:
            os.environ.pop("QWEN4EXP_HC_DECODE", None)
        else:
            os.environ["QWEN4EXP_HC_DECODE"] = saved
        envs.reset()
    assert tk.silu_in_kernel_max_t() == tk.IN_KERNEL_SILU_MAX_T


@check("hc_inject")
def check_hc_inject():
    from qwen4exp.ops.hyper_connection import reference as ref, triton_kernel as tk
    g = torch.Generator().manual_seed(4)
    for T, n, D, _, _ in HC_SMALL:
        H = (torch.randn(T, n * D, generator=g) * 2).to(BF)
        y, c = torch.randn(T, D, generator=g).to(BF), (torch.rand(T, n, generator=g) * 2).to(BF)
        # (the interpreter truncates the final fp32 -> bf16 store: one unit; on the GPU it is bit-exact)
        close(tk.hc_inject_triton(H, c, y), ref.hc_inject(H, c, y), 0.0, f"hc_inject T={T}", rtol=2 ** -7)


@check("hc_inject_norm")
def check_hc_inject_norm():
    from qwen4exp.ops.hyper_connection import reference as ref, triton_kernel as tk
    g = torch.Generator().manual_seed(5)
    for T, n, D, _, _ in HC_SMALL:
        H = (torch.randn(T, n * D, generator=g) * 2).to(BF)
        nw = (torch.randn(n * D, generator=g) * 0.1).to(BF)
        y, c = torch.randn(T, D, generator=g).to(BF), (torch.rand(T, n, generator=g) * 2).to(BF)
        Ho, Hno = tk.hc_inject_norm_triton(H, c, y, nw, n, 1e-6)
        Hr, Hnr = ref.hc_inject_norm(H, c, y, nw, n, 1e-6)
        close(Ho, Hr, 0.0, f"hc_inject_norm H T={T}", rtol=2 ** -7)
        close(Hno, Hnr, 0.05, f"hc_inject_norm Hn T={T}")


@check("hc_finish")
def check_hc_finish():
    from qwen4exp.ops.hyper_connection import reference as ref, triton_kernel as tk
    g = torch.Generator().manual_seed(6)
    for T, n, _, R, _ in HC_SMALL:
        d = (torch.randn(T, R + n, generator=g) * 4).to(BF)  # the many-token path's [W_down | W_inj] product
        want_a, want_c = ref.hc_finish(d, R, n, n)
        a, c = tk.hc_finish_triton(d, R, n)
        close(a, want_a, 0.0, "hc_finish a", rtol=2 ** -7)
        close(c, want_c, 0.0, "hc_finish c", rtol=2 ** -7)
        dp = torch.cat([d, torch.full((T, 4), float("nan"), dtype=BF)], 1)  # rows padded past R + n: not read
        a, c = tk.hc_finish_triton(dp, R, n, ni=n)
        close(a, want_a, 0.0, "hc_finish a (padded rows)", rtol=2 ** -7)
        close(c, want_c, 0.0, "hc_finish c (padded rows)", rtol=2 ** -7)
        a, c = tk.hc_finish_triton(d[:, :R], R, n)  # no injection (the final mixer); rows strided
        close(a, want_a, 0.0, "hc_finish a (no c)", rtol=2 ** -7)
        assert c.shape == (T, 0)


@check("hc_gate_mean")
def check_hc_gate_mean():
    from qwen4exp.ops.hyper_connection import reference as ref, triton_kernel as tk
    g = torch.Generator().manual_seed(7)
    for T, n, D, _, _ in HC_SMALL:
        gg = (torch.randn(T, n * D, generator=g) * 3).to(BF)
        Hn = (torch.randn(T, n * D, generator=g) * 2).to(BF)
        close(tk.hc_gate_mean_triton(gg, Hn, n), ref.hc_gate_mean(gg, Hn, n), 0.02, f"hc_gate_mean T={T}")


@check("hc_many_tokens")
def check_hc_many_tokens():
    """The many-token path (``host.mix_many_tokens``) with the Triton pieces in place of the custom ops: the W_down
    / W_inj projections as one product where they sit together (padded or not), apart, or W_down alone."""
    from qwen4exp.ops.hyper_connection import host, reference as ref, triton_kernel as tk
    from qwen4exp.ops.norm import triton_kernel as ntk
    pieces = dict(rms_norm=ntk.rms_norm_triton, finish=lambda d, R, n, ni: tk.hc_finish_triton(d, R, n, ni=ni),
                  gate_mean=tk.hc_gate_mean_triton)
    g = torch.Generator().manual_seed(8)
    n, D, R, T = 4, 256, 40, 20
    H, nw, Wd, Wu, Wi = _hc_case(g, T, n, D, R, True)
    for layout in ("apart", "adjacent", "padded", "final"):
        wd, wi = Wd, (None if layout == "final" else Wi)
        if layout in ("adjacent", "padded"):
            buf = torch.cat([Wd, Wi, Wd.new_zeros(4 if layout == "padded" else 0, Wd.shape[1])])
            wd, wi = buf[:R], buf[R:R + n]
        xr, cr = ref.hc_mix(H.view(2, T // 2, -1), nw, wd, Wu, wi, n, 1e-6)
        for Hn in (None, ref.grouped_rms_norm(H, nw, D, 1e-6).view(2, T // 2, -1)):
            x, c = host.mix_many_tokens(H.view(2, T // 2, -1), nw, wd, Wu, wi, n, 1e-6, Hn, **pieces)
            close(x, xr, 0.07, f"many tokens {layout} hn_ready={Hn is not None}")
            if wi is None:
                assert c is None
            else:
                close(c, cr, 0.02, f"many tokens c {layout} hn_ready={Hn is not None}")


@check("hc_real_widths")
def check_hc_real_widths():
    """Qwen3.8-Flash-Next's HC widths (4 x 2560 streams, rank 320) at decode sizes (T = 1; T = 32 with Hn handed in,
    as batch-32 decode runs it), so the compile step also builds (and checks the shared memory of) the variants
    the GPU runs."""
    from qwen4exp.ops.hyper_connection import reference as ref, triton_kernel as tk
    g = torch.Generator().manual_seed(7)
    n, D, R = 4, 2560, 320
    H = (torch.randn(1, n * D, generator=g) * 3).to(BF)
    nw = (torch.randn(n * D, generator=g) * 0.2).to(BF)
    Wd = (torch.randn(R, n * D, generator=g) * (n * D) ** -0.5 * 4).to(BF)
    Wu = (torch.randn(n * D, R, generator=g) * R ** -0.5 * 2).to(BF)
    Wi = (torch.randn(n, n * D, generator=g) * (n * D) ** -0.5 * 4).to(BF)
    hc_mix_both_ways((H, nw, Wd, Wu, Wi, n, 1e-6), "real widths")
    H32 = (torch.randn(32, n * D, generator=g) * 3).to(BF)  # (32 tokens: only with Hn, as host.mix_path sends them)
    hc_mix_both_ways((H32, nw, Wd, Wu, Wi, n, 1e-6), "real widths T=32", own_norm=False)
    y, cc = torch.randn(32, D, generator=g).to(BF), (torch.rand(32, n, generator=g) * 2).to(BF)
    close(tk.hc_inject_norm_triton(H32, cc, y, nw, n, 1e-6)[1], ref.hc_inject_norm(H32, cc, y, nw, n, 1e-6)[1],
          0.05, "hc_inject_norm real widths")


# ------------------------------------------------------------------------------------------------ norm, RoPE
@check("rms_norm")
def check_rms_norm():
    from qwen4exp.ops.norm import reference as ref, triton_kernel as tk
    g = torch.Generator().manual_seed(5)
    for shape, group in (((3, 4, 128), 128), ((2, 1280), 640), ((2, 10240), 2560)):
        x = (torch.randn(shape, generator=g) * 3).to(BF)
        w = (torch.randn(shape[-1], generator=g) * 0.1).to(BF)
        close(tk.rms_norm_triton(x, w, group, 1e-6), ref.grouped_rms_norm(x, w, group, 1e-6), 0.05,
              f"rms_norm {shape}/{group}")
    x = torch.randn(3, 256, generator=g)  # fp32
    w = torch.randn(256, generator=g) * 0.1
    close(tk.rms_norm_triton(x, w, 128, 1e-6), ref.grouped_rms_norm(x, w, 128, 1e-6), 1e-5, "rms_norm fp32")


@check("rms_norm_strided")
def check_rms_norm_strided():
    """Heads of a slice of a wider projection output (the layers pass views): per-head norms of [T, H, d] views
    at an offset, one head, and a head group of a [T, 2, 3, d] view."""
    from qwen4exp.ops.norm import reference as ref, triton_kernel as tk
    g = torch.Generator().manual_seed(6)
    wide = (torch.randn(3, 1000, generator=g) * 3).to(BF)
    for xs in (wide[:, 100:612].view(3, 4, 128), wide[:, 8:264].view(3, 2, 128), wide[:, :128].view(3, 1, 128),
               wide[:, :768].view(3, 2, 3, 128)[:, 1]):
        w = (torch.randn(128, generator=g) * 0.1).to(BF)
        close(tk.rms_norm_triton(xs, w, 128, 1e-6), ref.grouped_rms_norm(xs, w, 128, 1e-6), 0.05,
              f"rms_norm strided {tuple(xs.shape)} {xs.stride()}")


def _angles(g, T, R, dt=BF):
    ang = torch.randn(T, R // 2, generator=g) * 50
    return torch.cat([ang, ang], -1).cos().to(dt), torch.cat([ang, ang], -1).sin().to(dt)


@check("apply_rope")
def check_apply_rope():
    from qwen4exp.ops.rope import reference as ref, triton_kernel as tk
    g = torch.Generator().manual_seed(5)
    for dt in (BF, torch.float32):
        x = torch.randn(3, 2, 2 * 128, generator=g).to(dt)[..., :128]  # strided, as q out of [q | gate]
        for R in (32, 128):
            cos, sin = _angles(g, 3, R, dt)
            close(tk.apply_rope_triton(x, cos, sin), ref.apply_rope(x, cos, sin), 0.02 if dt == BF else 1e-5,
                  f"apply_rope R={R} {dt}")


@check("norm_rope")
def check_norm_rope():
    """The QSA query / key preparation: norm + RoPE of strided heads in one kernel."""
    from qwen4exp.ops.rope import reference as ref, triton_kernel as tk
    g = torch.Generator().manual_seed(6)
    for dt in (BF, torch.float32):
        xs = (torch.randn(3, 4 * 2 * 128, generator=g) * 3).to(dt).view(3, 4, 256)[..., :128]
        w = (torch.randn(128, generator=g) * 0.1).to(dt)
        for R in (32, 128):
            cos, sin = _angles(g, 3, R, dt)
            close(tk.norm_rope_triton(xs, w, 1e-6, cos, sin), ref.norm_rope(xs, w, 1e-6, cos, sin), 0.02,
                  f"norm_rope R={R} {dt}")


@check("norm_rope3")
def check_norm_rope3():
    """The QSA layer's three norm + RoPEs in one launch (queries as a strided view of [q | gate], keys, indexer
    queries of another head size): each output bit-equal to its own ``norm_rope_triton``, and close to the
    reference; with a group of no heads too."""
    from qwen4exp.ops.rope import host, reference as ref, triton_kernel as tk
    g = torch.Generator().manual_seed(7)
    for dt in (BF, torch.float32):
        for R, hk in ((32, 2), (64, 1), (32, 0)):
            T = 3
            q = (torch.randn(T, 4 * 2 * 128, generator=g) * 3).to(dt).view(T, 4, 256)[..., :128]
            k = (torch.randn(T, hk, 128, generator=g) * 2).to(dt)
            iq = torch.randn(T, 2, 64, generator=g).to(dt)
            ws = [(torch.randn(d, generator=g) * 0.1).to(dt) for d in (128, 128, 64)]
            eps = (1e-6, 1e-5, 1e-6)
            cos, sin = _angles(g, T, R, dt)
            groups = list(zip((q, k, iq), ws, eps))
            assert host.norm_rope3_covers(groups, cos, sin)
            got = tk.norm_rope3_triton(q, ws[0], eps[0], k, ws[1], eps[1], iq, ws[2], eps[2], cos, sin)
            for i, (x, w, e) in enumerate(groups):
                one = tk.norm_rope_triton(x, w, e, cos, sin)
                assert got[i].shape == x.shape and torch.equal(got[i], one), f"norm_rope3 group {i} R={R} {dt}"
                close(got[i], ref.norm_rope(x, w, e, cos, sin), 0.02, f"norm_rope3 group {i} R={R} {dt}")
    assert not host.norm_rope3_covers(groups[:2], cos, sin)  # three groups
    strided_w = torch.randn(64, 2, generator=g).to(dt)[:, 0]  # (a weight each group's kernel takes: dense)
    assert not host.norm_rope3_covers(groups[:2] + [(iq, strided_w, 1e-6)], cos, sin)


# ------------------------------------------------------------------------------------------------ MoE output
@check("moe_combine")
def check_moe_combine():
    from qwen4exp.ops.moe_combine import reference as ref, triton_kernel as tk
    g = torch.Generator().manual_seed(9)
    for T, D, dt in ((1, 2560, BF), (3, 640, BF), (4, 100, torch.float32)):
        x, s, r = (torch.randn(T, D, generator=g).to(dt) for _ in range(3))
        w = (torch.randn(1, D, generator=g) * D ** -0.5).to(dt)
        want = ref.shared_gate_combine(x, w, s, r)
        # bf16: one unit of the gate (2^-8 relative) times |shared| can move an element by a unit or two
        close(tk.shared_gate_combine_triton(x, w, s, r), want, 0.02 if dt == BF else 1e-5, f"shared_gate_combine "
              f"T={T} D={D}", rtol=2 ** -7 if dt == BF else 0.0)


# ------------------------------------------------------------------------------------- gated delta rule (fla)
def _fla_or_skip():
    try:
        import fla  # noqa: F401
    except ImportError as e:
        skip(f"no fla-core importable beside Triton ({e}; `make test` installs it in .cache/triton)")


@check("gdn_fla_recurrent")
def check_gdn_fla_recurrent():
    """The GPU GDN path calls flash-linear-attention's kernels on our packed layout: its fused recurrent kernel
    under the interpreter, fp32, against our reference (grouped value heads, L2-normalised q / k, carried and zero
    states). This pins the call's conventions without a GPU; the chunked kernels need one (the interpreter has no
    driver for their autotuner): the GPU tests."""
    _fla_or_skip()
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    from qwen4exp.ops.gated_delta_rule import fla_kernel, reference
    g = torch.Generator().manual_seed(0)
    for lens, hk, hv, d, with_state in [([20, 3, 1], 2, 4, 32, True), ([1, 1, 1, 1], 1, 3, 16, False)]:
        T = sum(lens)
        q, k, v = (torch.randn(T, h, d, generator=g) for h in (hk, hk, hv))
        gate = -F.softplus(torch.randn(T, hv, generator=g))
        beta = torch.sigmoid(torch.randn(T, hv, generator=g))
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
        h0 = torch.randn(len(lens), hv, d, d, generator=g) * 0.1 if with_state else None
        o, s = fla_kernel.run(fused_recurrent_gated_delta_rule, q, k, v, gate, beta, cu, h0, None, True)
        ro, rs = reference.recurrent_gated_delta_rule(q, k, v, gate, beta, cu, h0, None, True)
        eo, es = ((o - ro).norm() / ro.norm()).item(), ((s - rs).norm() / rs.norm()).item()
        assert o.shape == ro.shape and s.shape == rs.shape and eo < 1e-5 and es < 1e-5, (lens, eo, es)


# ---------------------------------------------------------------------------------- custom-op registrations
def _custom_ops(module_name):
    """The qwen4exp custom operators an op folder's cuda.py defines -> {name: CustomOp}."""
    from qwen4exp.ops import _registry
    mod = importlib.import_module(module_name)
    return {v.name: v for v in vars(mod).values() if isinstance(v, _registry.CustomOp)}


def _registration(module_name, want, fakes, mutating=()):
    """``want``: the operator names the module must define; ``fakes(t)``: calls them under FakeTensorMode with
    ``t(*shape, dtype=)`` CUDA fake tensors and checks the outputs' shapes / dtypes (what torch.compile and CUDA-graph
    tracing see). In-place operators (``mutating``) carry a mutable schema, the others none."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    ops = _custom_ops(module_name)
    assert sorted(ops) == sorted(want), (module_name, sorted(ops))
    for name in ops:
        schema = str(getattr(torch.ops.qwen4exp, name).default._schema)
        assert ("(a0!)" in schema) == (name in mutating), (name, schema)
    with FakeTensorMode():
        def t(*shape, dtype=BF):
            return torch.empty(*shape, dtype=dtype, device="cuda")
        fakes(ops, t)


@check("hc_registration")
def check_hc_registration():
    def fakes(ops, t):
        x, c = ops["hc_mix"](t(3, 256), t(256), t(16, 256), t(256, 16), t(4, 256), 4, 1e-6)
        assert x.shape == (3, 64) and c.shape == (3, 4) and x.device.type == "cuda"
        x, c = ops["hc_mix"](t(3, 256), t(256), t(16, 256), t(256, 16), None, 4, 1e-6)
        assert c.shape == (3, 0)
        x, c = ops["hc_mix"](t(3, 256), t(256), t(16, 256), t(256, 16), t(4, 256), 4, 1e-6, t(3, 256))
        assert x.shape == (3, 64) and c.shape == (3, 4)
        assert ops["hc_gate_mean"](t(5, 256), t(5, 256), 4).shape == (5, 64)
        a, c = ops["hc_finish"](t(5, 24), 16, 4, 4)
        assert a.shape == (5, 16) and c.shape == (5, 4)
        assert ops["hc_inject"](t(2, 256), t(2, 4), t(2, 64)).shape == (2, 256)
        Ho, Hn = ops["hc_inject_norm"](t(2, 256), t(2, 4), t(2, 64), t(256), 4, 1e-6)
        assert Ho.shape == Hn.shape == (2, 256)
    _registration("qwen4exp.ops.hyper_connection.cuda",
                  ("hc_mix", "hc_gate_mean", "hc_finish", "hc_inject", "hc_inject_norm"), fakes)


@check("norm_registration")
def check_norm_registration():
    def fakes(ops, t):
        assert ops["rms_norm"](t(2, 24, 256), t(256), 256, 1e-6).shape == (2, 24, 256)
    _registration("qwen4exp.ops.norm.cuda", ("rms_norm",), fakes)


@check("rope_registration")
def check_rope_registration():
    def fakes(ops, t):
        assert ops["apply_rope"](t(2, 24, 64), t(2, 64), t(2, 64)).shape == (2, 24, 64)
        assert ops["norm_rope"](t(2, 24, 64), t(64), 1e-6, t(2, 32), t(2, 32)).shape == (2, 24, 64)
        y = ops["norm_rope3"](t(2, 24, 64), t(64), 1e-6, t(2, 2, 64), t(64), 1e-6, t(2, 4, 32), t(32), 1e-6,
                              t(2, 32), t(2, 32))
        assert [tuple(a.shape) for a in y] == [(2, 24, 64), (2, 2, 64), (2, 4, 32)]
    _registration("qwen4exp.ops.rope.cuda", ("apply_rope", "norm_rope", "norm_rope3"), fakes)


@check("moe_combine_registration")
def check_moe_combine_registration():
    def fakes(ops, t):
        assert ops["shared_gate_combine"](t(2, 64), t(1, 64), t(2, 64), t(2, 64)).shape == (2, 64)
    _registration("qwen4exp.ops.moe_combine.cuda", ("shared_gate_combine",), fakes)


@check("gdn_registration")
def check_gdn_registration():
    _fla_or_skip()

    def fakes(ops, t):
        for name in ("gdn_chunk", "gdn_recurrent"):
            o, st = ops[name](t(7, 2, 32), t(7, 2, 32), t(7, 4, 16), t(7, 4, dtype=torch.float32), t(7, 4),
                              t(3, dtype=torch.int32), None, None, True)
            assert o.shape == (7, 4, 16) and st.shape == (2, 4, 32, 16) and st.dtype == torch.float32, name
    _registration("qwen4exp.ops.gated_delta_rule.cuda", ("gdn_chunk", "gdn_recurrent"), fakes)


# ------------------------------------------------------------------------------------------ record / compile
def _describe(fn, args, kwargs):
    """One launch -> {module, name, signature, constexprs, options} (JSON-able)."""
    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args))
    bound.update({k: v for k, v in kwargs.items() if k in params})
    sig, const = {}, {}
    for name, p in params.items():
        v = bound.get(name, p.default)
        if "constexpr" in str(p.annotation):
            sig[name], const[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + TYPES[v.dtype]
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            sig[name] = "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(v).__name__}")
    return dict(module=fn.__module__, name=fn.__name__, signature=sig, constexprs=const,
                options={k: kwargs[k] for k in OPTIONS if k in kwargs}, divisible=_divisible(bound))


def _divisible(bound) -> list[str]:
    """The arguments Triton's launcher marks divisible by 16 (``tt.divisibility``, which lets it vectorise loads and
    stores): integers that are multiples of 16 and tensors whose data pointer is (a meta tensor counts as a fresh,
    aligned allocation)."""
    names = []
    for name, v in bound.items():
        if isinstance(v, torch.Tensor):
            ptr = 0 if v.device.type == "meta" else v.data_ptr()
            if ptr % 16 == 0:
                names.append(name)
        elif isinstance(v, int) and not isinstance(v, bool) and v % 16 == 0:
            names.append(name)
    return names


def source(fn, d):
    """A recorded launch (``_describe``) as Triton's ``ASTSource``, with the divisibility the launcher would give
    its arguments, so that the sm_90 build is the one the GPU runs (older records without it: none)."""
    from triton.compiler import ASTSource
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in d.get("divisible", ())}
    return ASTSource(fn, d["signature"], constexprs=d["constexprs"], attrs=attrs)


def _write(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def _result(fn, *args):
    t0 = time.time()
    try:
        fn(*args)
        status, message = "passed", ""
    except Skipped as e:
        status, message = "skipped", str(e)
    except Exception:  # noqa: BLE001  (reported on the check's own pytest item)
        status, message = "failed", traceback.format_exc(limit=8)[-6000:]
    return dict(status=status, message=message, seconds=round(time.time() - t0, 2))


@contextlib.contextmanager
def on_launch(callback):
    """``callback(kernel, args, kwargs)`` (kernel: the interpreter's function, ``.fn`` the Python one) at every
    launch of our kernels (not fla's) inside the block, before the kernel runs."""
    from triton.runtime.interpreter import InterpretedFunction
    orig = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        if self.fn.__module__.startswith("qwen4exp."):
            callback(self, args, kwargs)
        return orig(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording
    try:
        yield
    finally:
        InterpretedFunction.run = orig


def run(out, names=()):
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    os.makedirs(out, exist_ok=True)
    module_errors = load_modules()
    launches = {}

    def record(kernel, args, kwargs):
        d = _describe(kernel.fn, args, kwargs)
        launches[json.dumps(d, sort_keys=True)] = d

    with on_launch(record):
        results = {}
        for name in (names or CHECKS):
            if name in CHECKS:
                results[name] = _result(CHECKS[name])
            else:
                why = "".join(f"\n{m} did not import:\n{e}" for m, e in module_errors.items())
                results[name] = dict(status="failed", message=f"no check named {name!r}{why}", seconds=0.0)
            print(f"{results[name]['status']} {name} ({results[name]['seconds']} s)", flush=True)
            _write(os.path.join(out, "checks.json"), results)
            _write(os.path.join(out, "launches.json"), list(launches.values()))
        print(f"{len(launches)} distinct launches recorded")


def compile_all(out, part: int = 0, parts: int = 1, dest: str = "compiled.json"):
    import triton
    from triton.backends.compiler import GPUTarget
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "compile without TRITON_INTERPRET"
    module_errors = load_modules()
    target = GPUTarget("cuda", 90, 32)
    with open(os.path.join(out, "launches.json")) as f:
        launches = json.load(f)
    # the interpreter runs the HC kernels without programmatic dependent launch (no such thing on a CPU): compile
    # those launches with it too, as the GPU runs them
    launches += [dict(d, constexprs=dict(d["constexprs"], PDL=True)) for d in launches
                 if d["constexprs"].get("PDL") is False]
    launches = launches[part::parts]
    errors: dict[str, list[str]] = {}
    for d in launches:
        what = f"{d['name']} {d['constexprs']} {d['options']}"
        problems = errors.setdefault(d["name"], [])
        try:
            fn = getattr(importlib.import_module(d["module"]), d["name"])
            k = triton.compile(source(fn, d), target=target,
                               options=d["options"])
            assert k.asm.get("cubin"), f"{what}: no cubin"
            assert k.metadata.shared <= SMEM_MAX, f"{what}: {k.metadata.shared} B of shared memory"
            at = NO_SPILL_AT.get(d["name"])
            if d["name"] in NO_SPILL or (at and all(d["constexprs"].get(c) == v for c, v in at.items())):
                regs, spill = ptxas_resources(k.asm["ptx"], k.metadata.target.arch)
                print(f"resources {what}: {regs} registers, {spill} bytes spilled", flush=True)
                assert regs > 0 and spill <= SPILL_BYTES_ALLOWED.get(d["name"], 0), \
                    f"{what}: {regs} registers, {spill} bytes of register spills"
        except Exception as e:  # noqa: BLE001  (reported on the kernel's pytest item)
            problems.append(f"{what}: {type(e).__name__}: {e}"[:3000])
    kernels = {name: dict(status="failed" if p else "passed", message="\n".join(p)) for name, p in errors.items()}
    checks = {}
    for name, fn in (COMPILE_CHECKS.items() if part == 0 else ()):
        checks[name] = _result(fn, target)
    for mod, e in module_errors.items():
        checks[f"import {mod}"] = dict(status="failed", message=e)
    _write(os.path.join(out, dest), dict(kernels=kernels, checks=checks))
    print(f"compiled {len(launches)} launches of {len(kernels)} kernels for sm_90; "
          f"failed: {sorted(k for k, r in kernels.items() if r['status'] != 'passed') or 'none'}")


def ptxas_resources(ptx: str, arch: int) -> tuple[int, int]:
    """Registers per thread and bytes of spill stores of a kernel's PTX, from ``ptxas -v`` (Triton's own ptxas)."""
    import re
    import subprocess
    import tempfile

    import triton
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        p = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    info = p.stdout + p.stderr
    assert p.returncode == 0, info[-2000:]
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    spill = int(re.search(r"(\d+) bytes spill stores", info).group(1))
    return regs, spill


def main(argv):
    if len(argv) >= 2 and argv[0] == "run":
        run(argv[1], argv[2:])
    elif len(argv) == 2 and argv[0] == "compile":
        compile_all(argv[1])
    elif len(argv) == 4 and argv[0] == "compile":
        compile_all(argv[1], int(argv[2]), int(argv[3]), f"compiled-{argv[2]}.json")
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    import interpreter  # the module the check modules register into (this script runs as another copy, __main__)

    interpreter.main(sys.argv[1:])
