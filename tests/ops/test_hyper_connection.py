"""``qwen4exp.ops.hyper_connection``: the gated HC mixer and write-back over n residual streams.

* the ops against per-token loops written from the equations (CPU: the references; CUDA: the kernels), upstream
  transformers' module as an extra oracle, the decoder layers' hand-over of the next mixer's norm;
* the CUDA path's host-side logic (``host``) on the CPU: which path ``hc_mix`` takes (a pure function of shapes and
  dtypes), and the many-token path with the references as its pieces against the reference and the loop;
* the kernels against the references at the model's widths (GPU), each asserting that the kernel path ran;
* the kernels under Triton's interpreter and compiled for sm_90 (no GPU).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from op_helpers import BF, F32, bf16_close, expect_kernel, gen, poison, rnd
from qwen4exp.ops import hyper_connection as hc
from qwen4exp.ops.cuda_graph import capture
from qwen4exp.ops.hyper_connection import host, reference as hc_ref
from qwen4exp.ops.norm import reference as norm_ref


def loop_hc_norm(H, w_norm, n, eps):
    """Per token and stream s: Hn_s = H_s / rms(H_s) * (1 + w_s), fp32."""
    D = H.shape[-1] // n
    flat, w_norm = H.float().reshape(-1, n * D), w_norm.float()
    out = torch.empty_like(flat)
    for t, tok in enumerate(flat):
        for s in range(n):
            h = tok[s * D:(s + 1) * D]
            out[t, s * D:(s + 1) * D] = h / torch.sqrt((h * h).mean() + eps) * (1 + w_norm[s * D:(s + 1) * D])
    return out.view(H.shape)


def loop_hc_mix(H, w_norm, W_down, W_up, W_inj, n, eps):
    """Per token: Hn_s = H_s / rms(H_s) * (1 + w_s); a = silu(W_down Hn / n); gamma = sigmoid(W_up a);
    x = mean_s gamma_s * Hn_s; c = 2 sigmoid(W_inj Hn / n). fp32."""
    D = H.shape[-1] // n
    Hn_all = loop_hc_norm(H, w_norm, n, eps).reshape(-1, n * D)
    W_down, W_up = W_down.float(), W_up.float()
    xs, cs = [], []
    for Hn in Hn_all:
        a = F.silu((W_down @ Hn) / n)
        gamma = torch.sigmoid(W_up @ a)
        x = sum(gamma[s * D:(s + 1) * D] * Hn[s * D:(s + 1) * D] for s in range(n)) / n
        xs.append(x)
        if W_inj is not None:
            cs.append(2 * torch.sigmoid((W_inj.float() @ Hn) / n))
    x = torch.stack(xs).view(*H.shape[:-1], D)
    c = torch.stack(cs).view(*H.shape[:-1], n) if W_inj is not None else None
    return x, c


def loop_hc_inject(H, c, y):
    """Per token and stream s: H_s + c_s * y, fp32."""
    n, D = c.shape[-1], y.shape[-1]
    out = H.float().clone().reshape(-1, n * D)
    for t, (ct, yt) in enumerate(zip(c.float().reshape(-1, n), y.float().reshape(-1, D))):
        for s in range(n):
            out[t, s * D:(s + 1) * D] += ct[s] * yt
    return out.view(H.shape)


def hc_weights(n, D, r_hc, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n * D, generator=g) * 0.2
    down = torch.randn(r_hc, n * D, generator=g) / math.sqrt(n * D)
    up = torch.randn(n * D, r_hc, generator=g) / math.sqrt(r_hc)
    inj = torch.randn(n, n * D, generator=g) / math.sqrt(n * D)
    return [t.to(dtype) for t in (w, down, up, inj)]


# =============================================================================================== ops vs loops
@pytest.mark.parametrize("shape", [(7,), (2, 5), (1,)])
@pytest.mark.parametrize("n,D", [(4, 16), (2, 8)])
@pytest.mark.parametrize("final", [False, True])
def test_hc_mix_matches_loop(device, shape, n, D, final):
    w, down, up, inj = (t.to(device) for t in hc_weights(n, D, 6, seed=n * D))
    H = torch.randn(*shape, n * D, device=device) * 3
    x, c = hc.hc_mix(H, w, down, up, None if final else inj, n, 1e-6)
    x_ref, c_ref = loop_hc_mix(H.cpu(), w.cpu(), down.cpu(), up.cpu(), None if final else inj.cpu(), n, 1e-6)
    assert x.shape == (*shape, D)
    torch.testing.assert_close(x.cpu(), x_ref, **F32)
    if final:
        assert c is None
    else:
        assert c.shape == (*shape, n)
        assert bool(((c > 0) & (c < 2)).all())
        torch.testing.assert_close(c.cpu(), c_ref, **F32)


def test_hc_mix_with_linear_modules_equals_weights():
    n, D, r_hc = 4, 16, 8
    w, down, up, inj = hc_weights(n, D, r_hc, seed=3)
    mods = []
    for W in (down, up, inj):
        lin = torch.nn.Linear(W.shape[1], W.shape[0], bias=False)
        with torch.no_grad():
            lin.weight.copy_(W)
        mods.append(lin)
    H = torch.randn(9, n * D)
    with torch.no_grad():
        x_m, c_m = hc.hc_mix(H, w, *mods, n, 1e-6)
    x_w, c_w = hc_ref.hc_mix(H, w, down, up, inj, n, 1e-6)
    assert torch.equal(x_m, x_w) and torch.equal(c_m, c_w)


def test_hc_inject_matches_loop(device):
    n, D = 4, 8
    H, c, y = torch.randn(2, 3, n * D), torch.rand(2, 3, n) * 2, torch.randn(2, 3, D)
    out = hc.hc_inject(H.to(device), c.to(device), y.to(device))
    torch.testing.assert_close(out.cpu(), loop_hc_inject(H, c, y), **F32)


@pytest.mark.parametrize("dtype", [torch.float32, BF])
def test_hc_inject_norm_matches_loops(device, dtype):
    """``hc_inject_norm`` = the write-back, then the next mixer's per-stream norm of the new streams: against the
    two loops (bf16: the new streams rounded once, as the model stores them, before their norm)."""
    n, D = 4, 16
    g = gen(11)
    H, c, y = rnd((5, n * D), g, 1.0, dtype), (torch.rand(5, n, generator=g) * 2).to(dtype), rnd((5, D), g, 1.0, dtype)
    w = rnd((n * D,), g, 0.3, dtype)
    Ho, Hn = hc.hc_inject_norm(*(t.to(device) for t in (H, c, y, w)), n, 1e-6)
    want_H = loop_hc_inject(H, c, y)
    want_Hn = loop_hc_norm(want_H.to(dtype), w, n, 1e-6)
    tol = F32 if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2e-2)
    assert Ho.dtype == Hn.dtype == dtype
    torch.testing.assert_close(Ho.float().cpu(), want_H, **tol)
    torch.testing.assert_close(Hn.float().cpu(), want_Hn, **tol)


@pytest.mark.parametrize("final", [False, True])
def test_hc_mix_with_its_norm_handed_in_matches_loop(device, final):
    """``hc_mix(..., Hn)``: the norm the caller hands in (``hc_inject_norm``'s) is what the mixer reads: the same x
    and c as the loop on the streams; and a different Hn gives a different x (it is read, not recomputed)."""
    n, D = 4, 16
    w, down, up, inj = (t.to(device) for t in hc_weights(n, D, 6, seed=21))
    inj = None if final else inj
    H = torch.randn(5, n * D, device=device) * 2
    Hn = torch.as_tensor(loop_hc_norm(H.cpu(), w.cpu(), n, 1e-6), device=device)
    x, c = hc.hc_mix(H, w, down, up, inj, n, 1e-6, Hn)
    x_ref, c_ref = loop_hc_mix(H.cpu(), w.cpu(), down.cpu(), up.cpu(), None if final else inj.cpu(), n, 1e-6)
    torch.testing.assert_close(x.cpu(), x_ref, **F32)
    assert (c is None) if final else torch.allclose(c.cpu(), c_ref, **F32)
    x2, _ = hc.hc_mix(H, w, down, up, inj, n, 1e-6, 2 * Hn)
    assert not torch.allclose(x2, x)


def test_decoder_layer_hands_the_next_norm_on():
    """``DecoderLayer.forward(..., then=)``: the same streams as without, plus their norm for ``then``; the next
    mixer is the following layer's first one unless that layer adds PLE first, and the final mixer at the end."""
    from qwen4exp.layers.hyper_connection import HyperConnection
    from qwen4exp.modeling import DecoderLayer, next_mixer
    from qwen4exp.presets import tiny_text
    cfg = tiny_text(num_hidden_layers=3, hidden_size=32, ple_layer_ids=(2,), full_attention_every=99)
    torch.manual_seed(0)
    layers = [DecoderLayer(cfg, i, with_ple=True) for i in range(3)]
    final = HyperConnection(cfg, inject=False)
    for m in [*layers, final]:
        for p in m.parameters():
            p.data.normal_(0, 0.1)
    assert next_mixer(layers, 0, final) is None  # layer 1 (one-indexed 2) adds PLE first
    assert next_mixer(layers, 1, final) is layers[2].attn_hyper_connection
    assert next_mixer(layers, 2, final) is final and next_mixer(layers, 2, None) is None
    H = torch.randn(3, 4 * 32)
    mix = torch.tanh
    plain, none = layers[2](H, mix)
    assert none is None
    H2, Hn = layers[2](H, mix, None, None, final)
    assert torch.equal(H2, plain)
    torch.testing.assert_close(Hn, loop_hc_norm(plain, final.hc_norm.weight.detach(), 4, 1e-6), **F32)
    with pytest.raises(RuntimeError, match="layer 1: its mixer reads H \\+ PLE"):
        layers[1](H, mix, lambda h: h, Hn)


@pytest.mark.parametrize("dtype", [torch.float32, BF])
def test_hc_mix_matches_upstream_module(dtype):
    """Upstream's ``Qwen4ExpTextGatedResidual`` with the same weights (bf16: same rounding points)."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp as um  # (an import error fails this test, loudly)
    n, D, r_hc = 4, 32, 12
    cfg = SimpleNamespace(hc_count=n, hidden_size=D, hc_lowrank=r_hc, rms_norm_eps=1e-6)
    mod = um.Qwen4ExpTextGatedResidual(cfg, use_combine=True)
    w, down, up, inj = hc_weights(n, D, r_hc, seed=5)
    with torch.no_grad():
        mod.hc_norm.weight.copy_(w)
        mod.input_mix_weight_down.weight.copy_(down)
        mod.input_mix_weight_up.weight.copy_(up)
        mod.block_inject_weight.weight.copy_(inj)
    mod = mod.to(dtype)
    H = (torch.randn(2, 6, n * D) * 2).to(dtype)
    with torch.no_grad():
        x_up, _, c_up = mod(H)
    x, c = hc_ref.hc_mix(H, mod.hc_norm.weight.detach(), mod.input_mix_weight_down.weight.detach(),
                         mod.input_mix_weight_up.weight.detach(), mod.block_inject_weight.weight.detach(), n, 1e-6)
    tol = F32 if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(x, x_up, **tol)
    torch.testing.assert_close(c, c_up, **tol)


# ============================================================================= the CUDA path's host-side logic
REF_PIECES = dict(rms_norm=norm_ref.grouped_rms_norm, finish=hc_ref.hc_finish, gate_mean=hc_ref.hc_gate_mean)


def stacked(down, inj, layout):
    """W_down / W_inj as the layers hold them: "apart" (own buffers), "adjacent" (consecutive rows of one buffer),
    "padded" (the vLLM layout: and zero rows up to a multiple of 8)."""
    if layout == "apart":
        return down, inj
    R, n = down.shape[0], inj.shape[0]
    pad = -(-(R + n) // 8) * 8 - R - n if layout == "padded" else 0
    buf = torch.cat([down, inj, down.new_zeros(pad, down.shape[1])])
    return buf[:R], buf[R:R + n]


@pytest.mark.parametrize("layout", ["apart", "adjacent", "padded"])
def test_adjacent_rows_views_the_joined_projection(layout):
    _, down, _, inj = hc_weights(4, 16, 6, seed=1)
    d, i = stacked(down, inj, layout)
    both = host.adjacent_rows(d, i, pad=8)
    if layout == "apart":
        assert both is None
    else:
        assert both.shape[0] == (16 if layout == "padded" else 10) and torch.equal(both[:10], torch.cat([d, i]))
    assert host.adjacent_rows(d, None, pad=8) is None


@pytest.mark.parametrize("layout", ["apart", "adjacent", "padded", "final"])
@pytest.mark.parametrize("hn_in", [False, True])
def test_many_tokens_path_with_reference_pieces_matches_loop(layout, hn_in):
    """``host.mix_many_tokens`` with the references in place of its custom operators (the norm, the activations of
    the stacked projections, the gated mean): the loop's x and c (fp32), for W_down / W_inj apart, joined, joined
    and padded, or no W_inj (the final mixer); lead dims kept; the norm computed or handed in."""
    n, D, R = 4, 16, 6
    w, down, up, inj = hc_weights(n, D, R, seed=7)
    down, inj = (down, None) if layout == "final" else stacked(down, inj, layout)
    H = torch.randn(3, 5, n * D) * 2
    Hn = loop_hc_norm(H, w, n, 1e-6) if hn_in else None
    x, c = host.mix_many_tokens(H, w, down, up, inj, n, 1e-6, Hn, **REF_PIECES)
    x_ref, c_ref = loop_hc_mix(H, w, down, up, inj, n, 1e-6)
    assert x.shape == (3, 5, D)
    torch.testing.assert_close(x, x_ref, **F32)
    if inj is None:
        assert c is None
    else:
        assert c.shape == (3, 5, n)
        torch.testing.assert_close(c, c_ref, **F32)


def test_many_tokens_path_with_reference_pieces_bf16_matches_reference():
    """In bf16 the pieces round where ``reference.hc_mix`` does: the same values up to the GEMM's summation order
    over the joined rows (a bf16 unit here and there)."""
    n, D, R = 4, 64, 12
    w, down, up, inj = hc_weights(n, D, R, seed=8, dtype=BF)
    H = (torch.randn(40, n * D) * 2).to(BF)
    for layout in ("apart", "padded"):
        d, i = stacked(down, inj, layout)
        x, c = host.mix_many_tokens(H, w, d, up, i, n, 1e-6, None, **REF_PIECES)
        xr, cr = hc_ref.hc_mix(H, w, d, up, i, n, 1e-6)
        bf16_close(x, xr, 0.9)
        bf16_close(c, cr, 0.9)


def meta(*shape, dtype=BF):
    return torch.empty(*shape, dtype=dtype, device="meta")


def mixer(T, n=4, D=2560, R=320, dtype=BF, inj=True, lead=()):
    """Meta tensors of a mixer call at the model's widths: (H, norm weight, W_down, W_up, W_inj, n)."""
    return (meta(*lead, T, n * D, dtype=dtype), meta(n * D), meta(R, n * D, dtype=dtype), meta(n * D, R, dtype=dtype),
            meta(n, n * D, dtype=dtype) if inj else None, n)


@pytest.mark.parametrize("T,hn,norm_first,path", [
    (1, False, False, "decode"), (4, False, False, "decode"),  # kernel A normalises
    (5, False, True, "decode"), (16, False, True, "decode"),   # the norm kernel first, then the Hn launches
    (17, False, True, "decode"), (32, False, True, "decode"),
    (33, False, False, "many_tokens"), (16384, False, False, "many_tokens"),
    (1, True, False, "decode"), (32, True, False, "decode"),   # Hn handed in (hc_inject_norm): up to MAX_T_HN
    (33, True, False, "many_tokens"),
])
def test_hc_mix_path_by_token_count(T, hn, norm_first, path):
    """Which path ``cuda.hc_mix`` takes, from the shapes alone (the model's widths): the decode launches up to
    MAX_T tokens (MAX_T_HN with Hn; the norm kernel first when it is not handed in past IN_KERNEL_NORM_MAX_T), the
    many-token path past them."""
    args = mixer(T)
    Hn = meta(*args[0].shape) if hn else None
    assert host.norm_first(*args, Hn) is norm_first
    after = meta(*args[0].shape) if norm_first else Hn
    assert host.mix_path(*args, after) == path


@pytest.mark.parametrize("T,hn", [(1, False), (1, True), (4, False), (16, False), (32, True)])
def test_hc_mix_path_cublas_switch(monkeypatch, T, hn):
    """``QWEN4EXP_HC_DECODE=cublas`` (an A/B of the decode path): decode sizes take the many-token path (cuBLAS
    projections), with no norm kernel before it (the many-token path normalises itself); unset, the decode
    launches."""
    from qwen4exp import envs

    args = mixer(T)
    Hn = meta(*args[0].shape) if hn else None
    monkeypatch.setenv("QWEN4EXP_HC_DECODE", "cublas")
    envs.reset()
    try:
        assert host.mix_path(*args, Hn) == "many_tokens"
        assert host.norm_first(*args, Hn) is False
    finally:
        monkeypatch.delenv("QWEN4EXP_HC_DECODE")
        envs.reset()
    assert host.mix_path(*args, Hn) == "decode"


@pytest.mark.parametrize("args,hn_dtype,path", [
    (mixer(2, lead=(2,)), None, "decode"),                                  # lead dims: 4 tokens
    (mixer(3, inj=False), None, "decode"),                                  # the final mixer
    (mixer(3, n=2, D=384, R=20), None, "decode"),
    (mixer(3, n=8, D=128, R=16), None, "decode"),
    (mixer(3, dtype=torch.float32), None, "reference"),                     # fp32 streams / weights
    (mixer(3, n=3, D=256, R=40), None, "reference"),                        # n not a power of two
    (mixer(3, n=4, D=200, R=40), None, "many_tokens"),                      # D not a multiple of 16
    (mixer(3, R=2048), None, "many_tokens"),                                # rank past kernel B's tile
    (mixer(3), torch.float32, "reference"),                                 # an fp32 Hn handed in
    (mixer(0), None, "many_tokens"),                                        # no tokens
])
def test_hc_mix_path_by_shapes_and_dtypes(args, hn_dtype, path):
    Hn = None if hn_dtype is None else meta(*args[0].shape, dtype=hn_dtype)
    assert not host.norm_first(*args, Hn)
    assert host.mix_path(*args, Hn) == path


def test_write_back_covers():
    H, c, y = meta(32, 4 * 2560), meta(32, 4), meta(32, 2560)
    assert host.inject_covers(H, c, y) and host.inject_norm_covers(H, c, y, meta(4 * 2560), 4)
    assert host.inject_covers(meta(2, 3, 64), meta(2, 3, 4), meta(2, 3, 16))  # lead dims
    assert not host.inject_covers(H.float(), c, y)                          # fp32 streams
    assert not host.inject_covers(meta(65536, 64), meta(65536, 4), meta(65536, 16))  # past the grid's axis
    assert not host.inject_covers(H, meta(32, 2), y)                        # H is not n x D
    assert not host.inject_norm_covers(H, c, y, meta(4 * 2560), 2)          # n disagrees with c
    assert not host.inject_norm_covers(H, c, y, meta(2560), 4)              # the weight spans all streams
    big = 20000
    assert not host.inject_norm_covers(meta(2, 2 * big), meta(2, 2), meta(2, big), meta(2 * big), 2)  # MAX_GROUP


# =================================================================================== GPU kernels vs references
def hc_case(T, n, D, R, with_inj, seed):
    g = gen(seed, "cuda")
    H = rnd((T, n * D), g, 3.0)
    nw = rnd((n * D,), g, 0.2)
    Wd = rnd((R, n * D), g, (n * D) ** -0.5 * 4)
    Wu = rnd((n * D, R), g, R ** -0.5 * 2)
    Wi = rnd((n, n * D), g, (n * D) ** -0.5 * 4) if with_inj else None
    return H, nw, Wd, Wu, Wi


@pytest.mark.gpu
@pytest.mark.parametrize("T,n,D,R,with_inj", [
    (1, 4, 2560, 320, True), (1, 4, 2560, 320, False), (2, 4, 2560, 320, True), (5, 4, 2560, 320, True),
    (16, 4, 2560, 320, True), (17, 4, 2560, 320, False), (32, 4, 2560, 320, True),
    (3, 4, 256, 40, True), (7, 2, 384, 20, True), (1, 8, 128, 16, True)])
def test_hc_mix_kernels_match_reference(T, n, D, R, with_inj):
    for rep in range(2):
        H, nw, Wd, Wu, Wi = hc_case(T, n, D, R, with_inj, seed=1000 * T + 10 * R + rep)
        poison()
        with expect_kernel("hc_mix"):
            x, c = hc.hc_mix(H, nw, Wd, Wu, Wi, n, 1e-6)
        xr, cr = hc_ref.hc_mix(H, nw, Wd, Wu, Wi, n, 1e-6)
        bf16_close(x, xr, 0.95)
        if with_inj:
            bf16_close(c, cr, 0.5)
        else:
            assert c is None


@pytest.mark.gpu
def test_hc_mix_lead_dims_fp32_weight_and_fallback():
    H, nw, Wd, Wu, Wi = hc_case(6, 4, 2560, 320, True, seed=7)
    with expect_kernel("hc_mix"):
        x, c = hc.hc_mix(H.view(2, 3, -1), nw.float(), Wd, Wu, Wi, 4, 1e-6)  # fp32 norm weight, [B, S, nD]
    xr, cr = hc_ref.hc_mix(H.view(2, 3, -1), nw.float(), Wd, Wu, Wi, 4, 1e-6)
    bf16_close(x, xr, 0.95)
    bf16_close(c, cr, 0.5)
    with pytest.raises(AssertionError, match="not its kernel"):  # fp32: the wrapper's fallback, the reference
        with expect_kernel("hc_mix"):
            x, c = hc.hc_mix(H.float(), nw, Wd.float(), Wu.float(), Wi.float(), 4, 1e-6)
    xr, cr = hc_ref.hc_mix(H.float(), nw, Wd.float(), Wu.float(), Wi.float(), 4, 1e-6)
    assert torch.equal(x, xr) and torch.equal(c, cr)


@pytest.mark.gpu
@pytest.mark.parametrize("T,with_inj,layout", [(17, False, "apart"), (32, True, "apart"), (32, True, "adjacent"),
                                               (32, True, "padded"), (33, True, "apart"), (64, False, "apart"),
                                               (16_384, True, "adjacent"), (16_384, True, "padded")])
def test_hc_mix_many_tokens_matches_reference(T, with_inj, layout):
    """The many-token path (cuBLAS projections, ``layout``: W_down and W_inj as row ranges of one buffer, one GEMM,
    + the norm, finish and gate-mean kernels) against the reference; up to MAX_T_HN tokens ``hc_mix`` takes the
    decode launches instead, so ``cuda.mix_many_tokens`` is called directly. The gate-mean kernel alone is
    bit-exact (same rounding points, an fp32 mean of four bf16 products)."""
    from qwen4exp.ops.hyper_connection import cuda as hc_cuda
    H, nw, Wd, Wu, Wi = hc_case(T, 4, 2560, 320, with_inj, seed=T)
    if with_inj:
        Wd, Wi = stacked(Wd, Wi, layout)
    assert host.many_tokens_covers(H, nw, Wd, Wu, Wi, 4) and not host.decode_covers(H, nw, Wd, Wu, Wi, 4)
    poison()
    with expect_kernel("rms_norm"):
        x, c = hc_cuda.mix_many_tokens(H.view(1, T, -1), nw, Wd, Wu, Wi, 4, 1e-6)
    xr, cr = hc_ref.hc_mix(H.view(1, T, -1), nw, Wd, Wu, Wi, 4, 1e-6)
    assert x.shape == xr.shape
    # one GEMM over [W_down; W_inj] is another cuBLAS problem than the reference's W_down alone: at 16,384 tokens
    # its kernel sums K in another order, so the SiLU input differs by an fp32 rounding and x by one bf16 unit in
    # ~30% of the elements (the 2-unit bound of bf16_close holds everywhere)
    bf16_close(x, xr, 0.6 if layout != "apart" and T > 64 else 0.95)
    if with_inj:
        bf16_close(c, cr, 0.5)
    else:
        assert c is None
    if T > host.MAX_T_HN:
        with expect_kernel("hc_mix"):
            x2, _ = hc.hc_mix(H.view(1, T, -1), nw, Wd, Wu, Wi, 4, 1e-6)
        assert torch.equal(x2, x)
    g, Hn = rnd((T, 4 * 2560), gen(T, "cuda"), 3.0), rnd((T, 4 * 2560), gen(T + 1, "cuda"), 2.0)
    assert torch.equal(hc_cuda.hc_gate_mean_op(g, Hn, 4), hc_ref.hc_gate_mean(g, Hn, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("pdl,block_d", [(False, 8), (True, 32), (True, 16)])
def test_hc_mix_launch_variants(pdl, block_d):
    """Launch settings: programmatic dependent launch on / off, kernel B's column tile (few and many tokens; past
    IN_KERNEL_SILU_MAX_T tokens the finish kernel between A and B)."""
    from qwen4exp.ops.hyper_connection import triton_kernel as tk
    saved = tk.USE_PDL, tk.B_BLOCK_D, tk.B_BLOCK_D_MANY
    tk.USE_PDL, tk.B_BLOCK_D, tk.B_BLOCK_D_MANY = pdl, block_d, block_d
    try:
        for T in (1, 2, 3, 8, 16):
            H, nw, Wd, Wu, Wi = hc_case(T, 4, 2560, 320, True, seed=77 + T)
            poison()
            x, c = tk.hc_mix_triton(H, nw, Wd, Wu, Wi, 4, 1e-6)
            xr, cr = hc_ref.hc_mix(H, nw, Wd, Wu, Wi, 4, 1e-6)
            bf16_close(x, xr, 0.95)
            bf16_close(c, cr, 0.5)
    finally:
        tk.USE_PDL, tk.B_BLOCK_D, tk.B_BLOCK_D_MANY = saved


@pytest.mark.gpu
@pytest.mark.parametrize("hn", [False, True])
def test_hc_mix_finish_kernel_at_verification_sizes(hn):
    """By default, at 2-4 tokens (MTP verification) the finish kernel runs between the two launches (at one token
    kernel B finishes the down projection itself), and the result matches the reference."""
    from qwen4exp.ops.hyper_connection import cuda as hc_cuda, triton_kernel as tk
    for T in (1, 2, 3, 4):
        H, nw, Wd, Wu, Wi = hc_case(T, 4, 2560, 320, True, seed=90 + T)
        Hn = hc_ref.grouped_rms_norm(H, nw, 2560, 1e-6) if hn else None
        poison()
        tk.LAUNCHED.clear()
        with expect_kernel("hc_mix"):
            x, c = hc_cuda.hc_mix(H, nw, Wd, Wu, Wi, 4, 1e-6, Hn)
        assert ("hc_finish" in tk.LAUNCHED) == (T > 1), (T, sorted(tk.LAUNCHED))
        xr, cr = hc_ref.hc_mix(H, nw, Wd, Wu, Wi, 4, 1e-6, Hn)
        bf16_close(x, xr, 0.95)
        bf16_close(c, cr, 0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("hn", [False, True])
def test_hc_mix_fused_ticket_at_verification_sizes(monkeypatch, hn):
    """QWEN4EXP_HC_DECODE=fused-ticket: kernel A's last program of each row block finishes the down projection (a, c)
    and kernel B reads a, at every decode token count: no finish kernel, the result as the reference, the counters
    zero after each call, and a CUDA graph of it replays to the same bits (the last arriver sums the partials in a
    fixed order, whichever program it is)."""
    from qwen4exp import envs
    from qwen4exp.ops.hyper_connection import cuda as hc_cuda, triton_kernel as tk
    monkeypatch.setenv("QWEN4EXP_HC_DECODE", "fused-ticket")
    envs.reset()
    try:
        for T in (1, 2, 3, 4, 8, 16) + ((32,) if hn else ()):
            H, nw, Wd, Wu, Wi = hc_case(T, 4, 2560, 320, True, seed=190 + T)
            Hn = hc_ref.grouped_rms_norm(H, nw, 2560, 1e-6) if hn else None
            for inj in (Wi, None):
                poison()
                tk.LAUNCHED.clear()
                with expect_kernel("hc_mix"):
                    x, c = hc_cuda.hc_mix(H, nw, Wd, Wu, inj, 4, 1e-6, Hn)
                assert "hc_finish" not in tk.LAUNCHED and "hc_down" in tk.LAUNCHED, sorted(tk.LAUNCHED)
                assert not tk._TICKETS[H.device].any(), tk._TICKETS[H.device][:8].tolist()
                xr, cr = hc_ref.hc_mix(H, nw, Wd, Wu, inj, 4, 1e-6, Hn)
                bf16_close(x, xr, 0.95)
                if inj is not None:
                    bf16_close(c, cr, 0.5)
                else:
                    assert c is None
        graph, out = capture(lambda: hc_cuda.hc_mix(H, nw, Wd, Wu, Wi, 4, 1e-6, Hn))
        for _ in range(3):  # replays reuse the counters: each must leave them zero
            graph.replay()
        torch.cuda.synchronize()
        x, c = hc_cuda.hc_mix(H, nw, Wd, Wu, Wi, 4, 1e-6, Hn)
        assert torch.equal(out[0], x) and torch.equal(out[1], c)
        assert not tk._TICKETS[H.device].any()
    finally:
        monkeypatch.delenv("QWEN4EXP_HC_DECODE")
        envs.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("T,n,D", [(1, 4, 2560), (5, 4, 2560), (33, 4, 2560), (3, 2, 384)])
def test_hc_inject_kernel_is_bit_exact(T, n, D):
    g = gen(T + D, "cuda")
    H, y = rnd((T, n * D), g, 3.0), rnd((T, D), g)
    c = (2 * torch.rand(T, n, generator=g, device="cuda")).to(BF)
    poison()
    with expect_kernel("hc_inject"):
        out = hc.hc_inject(H, c, y)
    assert torch.equal(out, hc_ref.hc_inject(H, c, y))


@pytest.mark.gpu
@pytest.mark.parametrize("T,n,D", [(1, 4, 2560), (32, 4, 2560), (1000, 4, 2560), (3, 2, 384)])
def test_hc_inject_norm_kernel_matches_reference(T, n, D):
    """The write-back and the next mixer's norm in one pass: H' bit-exact (as hc_inject), Hn' as the norm kernel
    (the mean square summed in another order: one bf16 unit now and then)."""
    g = gen(T + 3 * D, "cuda")
    H, y, nw = rnd((T, n * D), g, 3.0), rnd((T, D), g), rnd((n * D,), g, 0.2)
    c = (2 * torch.rand(T, n, generator=g, device="cuda")).to(BF)
    poison()
    with expect_kernel("hc_inject_norm"):
        Ho, Hn = hc.hc_inject_norm(H, c, y, nw, n, 1e-6)
    Hr, Hnr = hc_ref.hc_inject_norm(H, c, y, nw, n, 1e-6)
    assert torch.equal(Ho, Hr)
    bf16_close(Hn, Hnr, 0.99)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 5, 16, 17, 32, 33, 64])
def test_hc_mix_kernels_with_norm_handed_in(T):
    """``hc_mix(..., Hn)`` (after ``hc_inject_norm``): the decode launches read Hn in place of H and skip the norm
    (up to MAX_T_HN tokens, so batch-32 decode), the many-token path skips its norm kernel; the same x and c as
    the reference given the same Hn, and as the norm computed inside."""
    H, nw, Wd, Wu, Wi = hc_case(T, 4, 2560, 320, True, seed=900 + T)
    Hn = hc_ref.grouped_rms_norm(H, nw, 2560, 1e-6)
    assert host.decode_covers(H, nw, Wd, Wu, Wi, 4, Hn) == (T <= max(host.MAX_T, host.MAX_T_HN))
    poison()
    with expect_kernel("hc_mix"):
        x, c = hc.hc_mix(H, nw, Wd, Wu, Wi, 4, 1e-6, Hn)
    xr, cr = hc_ref.hc_mix(H, nw, Wd, Wu, Wi, 4, 1e-6, Hn)
    bf16_close(x, xr, 0.95)
    bf16_close(c, cr, 0.5)
    with expect_kernel("hc_mix") as ran:
        x2, c2 = hc.hc_mix(H, nw, Wd, Wu, Wi, 4, 1e-6)  # (past IN_KERNEL_NORM_MAX_T: the norm kernel first)
    assert ("rms_norm" in ran) == (T > host.IN_KERNEL_NORM_MAX_T), ran
    bf16_close(x2, xr, 0.95)
    bf16_close(c2, cr, 0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8])  # 8: kernels A, finish and B chained by programmatic dependent launch
def test_hc_ops_in_cuda_graph_and_compile(T):
    from qwen4exp.ops.hyper_connection import cuda as hc_cuda
    H, nw, Wd, Wu, Wi = hc_case(T, 4, 2560, 320, True, seed=3)
    y = rnd((T, 2560), gen(4, "cuda"))
    x0, c0 = hc_cuda.hc_mix(H, nw, Wd, Wu, Wi, 4, 1e-6)

    def step(H):
        x, c = hc_cuda.hc_mix(H, nw, Wd, Wu, Wi, 4, 1e-6)
        H, Hn = hc_cuda.hc_inject_norm(H, c, y + x, nw, 4, 1e-6)
        x, c = hc_cuda.hc_mix(H, nw, Wd, Wu, Wi, 4, 1e-6, Hn)
        return hc_cuda.hc_inject(H, c, y + x)

    ref_out = step(H)
    graph, out = capture(lambda: step(H))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref_out)
    compiled = torch.compile(step, fullgraph=True)
    assert torch.equal(compiled(H), ref_out)
    assert torch.equal(hc_cuda.hc_mix(H, nw, Wd, Wu, Wi, 4, 1e-6)[0], x0)  # deterministic


@pytest.mark.gpu
@pytest.mark.parametrize("T,hn", [(1, False), (1, True), (8, True)])
def test_hc_mix_cublas_decode_switch(monkeypatch, T, hn):
    """``QWEN4EXP_HC_DECODE=cublas`` (the decode-size A/B): ``hc_mix`` at decode sizes runs the many-token path (its
    norm kernel, cuBLAS), as close to the reference as the decode launches, and captures in a CUDA graph."""
    from qwen4exp import envs
    from qwen4exp.ops.hyper_connection import cuda as hc_cuda
    from qwen4exp.ops.hyper_connection import triton_kernel as tk
    H, nw, Wd, Wu, Wi = hc_case(T, 4, 2560, 320, True, seed=T + 40)
    Hn = hc_ref.grouped_rms_norm(H, nw, 2560, 1e-6) if hn else None
    monkeypatch.setenv("QWEN4EXP_HC_DECODE", "cublas")
    envs.reset()
    try:
        poison()
        tk.LAUNCHED.clear()
        with expect_kernel("hc_mix"):
            x, c = hc_cuda.hc_mix(H, nw, Wd, Wu, Wi, 4, 1e-6, Hn)
        assert "hc_finish" in tk.LAUNCHED and "hc_down" not in tk.LAUNCHED, sorted(tk.LAUNCHED)
        xr, cr = hc_ref.hc_mix(H, nw, Wd, Wu, Wi, 4, 1e-6, Hn)
        bf16_close(x, xr, 0.95)
        bf16_close(c, cr, 0.5)
        graph, out = capture(lambda: hc_cuda.hc_mix(H, nw, Wd, Wu, Wi, 4, 1e-6, Hn)[0])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, x)
    finally:
        monkeypatch.delenv("QWEN4EXP_HC_DECODE")
        envs.reset()


# ======================================================================================= Triton checks (no GPU)
CHECKS = ("hc_mix", "hc_inject", "hc_inject_norm", "hc_finish", "hc_gate_mean", "hc_many_tokens", "hc_real_widths",
          "hc_registration")
KERNELS = ("_hc_down_kernel", "_hc_up_kernel", "_hc_finish_kernel", "_hc_inject_kernel", "_hc_inject_norm_kernel",
           "_hc_gate_mean_kernel")


@pytest.mark.triton_check("hc_mix")
def test_interpreter_mixer_decode_launches(triton_checks):
    triton_checks.passed("hc_mix")


@pytest.mark.triton_check("hc_inject")
def test_interpreter_write_back(triton_checks):
    triton_checks.passed("hc_inject")


@pytest.mark.triton_check("hc_inject_norm")
def test_interpreter_write_back_with_norm(triton_checks):
    triton_checks.passed("hc_inject_norm")


@pytest.mark.triton_check("hc_finish")
def test_interpreter_finish_kernel(triton_checks):
    triton_checks.passed("hc_finish")


@pytest.mark.triton_check("hc_gate_mean")
def test_interpreter_gate_mean_kernel(triton_checks):
    triton_checks.passed("hc_gate_mean")


@pytest.mark.triton_check("hc_many_tokens")
def test_interpreter_many_tokens_path(triton_checks):
    triton_checks.passed("hc_many_tokens")


@pytest.mark.triton_check("hc_real_widths")
def test_interpreter_real_widths(triton_checks):
    triton_checks.passed("hc_real_widths")


@pytest.mark.triton_check("hc_registration")
def test_custom_ops_schemas_and_fakes(triton_checks):
    triton_checks.passed("hc_registration")


@pytest.mark.triton_check(*CHECKS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernels_compile_for_hopper(triton_checks, kernel):
    triton_checks.compiled(kernel)
