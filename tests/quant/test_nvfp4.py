"""NVFP4 reference: hand-computed E2M1 / E4M3 values, per-element loops, and vLLM's own CPU helpers as oracles."""

import pytest
import torch

from qwen4exp.quant import QuantTensorError
from qwen4exp.quant.nvfp4 import (E2M1_VALUES, codes_to_values, dequantize_nvfp4, fake_quant_activation_nvfp4,
                                  pack_codes, pack_fp4, quantize_nvfp4, round_to_e2m1, unpack_codes, unpack_fp4,
                                  validate_nvfp4_tensors)

MAGS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_e2m1_code_table():
    vals = codes_to_values(torch.arange(16, dtype=torch.uint8))
    assert vals.tolist() == MAGS + [-m for m in MAGS]
    assert torch.signbit(vals[8]) and not torch.signbit(vals[0])  # code 8 is -0
    assert tuple(vals.tolist()) == E2M1_VALUES


def test_known_byte_low_nibble_first(vllm_oracle):
    b = torch.tensor([[0x2F]], dtype=torch.uint8)
    assert unpack_fp4(b).tolist() == [[-6.0, 1.0]]  # low nibble 0xF = -6 first, high 0x2 = 1.0
    assert vllm_oracle.break_fp4_bytes(b, torch.float32).tolist() == [[-6.0, 1.0]]
    assert pack_fp4(torch.tensor([[-6.0, 1.0]])).tolist() == [[0x2F]]
    every = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    assert torch.equal(unpack_fp4(every), vllm_oracle.break_fp4_bytes(every, torch.float32))
    assert torch.equal(pack_codes(unpack_codes(every)), every)


def test_pack_rejects_non_e2m1_values():
    with pytest.raises(ValueError, match="exact E2M1"):
        pack_fp4(torch.tensor([0.7, 1.0]))
    assert pack_fp4(torch.tensor([-0.0, 0.0])).tolist() == [0x08]


def test_rounding_ties_to_even_and_saturation(vllm_oracle):
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 100.0, 0.26, 0.74, 2.6, 4.9, -0.1, -0.75, -7.0])
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 0.5, 0.5, 3.0, 4.0, -0.0, -1.0, -6.0]
    codes = round_to_e2m1(x)
    assert codes_to_values(codes).tolist() == want
    assert codes[13] == 8  # -0.1 keeps its sign bit, as ModelOpt writes it
    assert torch.equal(codes_to_values(codes), vllm_oracle.cast_to_fp4(x.clone()))
    y = torch.randn(4096) * 4
    assert torch.equal(codes_to_values(round_to_e2m1(y)), vllm_oracle.cast_to_fp4(y.clamp(-6, 6).clone()))


def test_quantize_hand_computed():
    # global amax 2688 -> weight_scale_2 = 2688 / (6 * 448) = 1
    b0 = [2688.0, -1344.0] + [0.0] * 14                                # block amax 2688 -> scale 448 (0x7E)
    b1 = [6.0, 0.3, -0.75, 2.5, 1.25, 1.75, 3.5, 5.0, -5.1, 0.24, -0.2, 0, 0, 0, 0, 0]  # amax 6 -> scale 1 (0x38)
    b2 = [0.0] * 16                                                     # zero block -> scale 1
    b3 = [3.0, 1.5, -0.2] + [0.0] * 13                                  # amax 3 -> scale 0.5 (0x30)
    w = torch.tensor([b0 + b1 + b2 + b3])
    q, s, s2 = quantize_nvfp4(w)
    assert q.dtype == torch.uint8 and q.shape == (1, 32)
    assert s.dtype == torch.float8_e4m3fn and s.shape == (1, 4)
    assert s2.dtype == torch.float32 and s2.shape == () and float(s2) == 1.0
    assert s.view(torch.uint8).tolist() == [[0x7E, 0x38, 0x38, 0x30]]
    vals = unpack_fp4(q)[0].tolist()
    assert vals[:3] == [6.0, -3.0, 0.0]
    assert vals[16:27] == [6.0, 0.5, -1.0, 2.0, 1.0, 2.0, 4.0, 4.0, -6.0, 0.0, -0.0]
    assert vals[32:48] == [0.0] * 16
    assert vals[48:51] == [6.0, 3.0, -0.5]
    assert q[0, 0] == (13 << 4) | 7  # codes 7 (6.0) low, 13 (-3.0) high


def _loop_quantize(w, gs):
    """ModelOpt's rule one element at a time, float32 scalars."""
    out_codes = torch.empty(w.shape, dtype=torch.uint8)
    scales = torch.empty(w.shape[0], w.shape[1] // 16, dtype=torch.float8_e4m3fn)
    for o in range(w.shape[0]):
        for b in range(w.shape[1] // 16):
            blk = w[o, b * 16:(b + 1) * 16].float()
            s = blk.abs().max() / (6.0 * gs)
            s = torch.tensor(1.0) if s == 0 else s
            s = s.clamp(2.0 ** -9, 448.0).to(torch.float8_e4m3fn)
            scales[o, b] = s
            for i in range(16):
                v = float(blk[i] / (s.float() * gs))
                mag = abs(v)
                # nearest magnitude; on a tie the even code
                best = min(range(8), key=lambda k: (abs(MAGS[k] - mag), k % 2))
                out_codes[o, b * 16 + i] = best + (8 if v < 0 else 0)
    return out_codes, scales


def test_quantize_matches_per_element_loop():
    torch.manual_seed(0)
    w = (torch.randn(4, 64) * torch.tensor([0.01, 1.0, 30.0, 1e-4]).repeat_interleave(16)).to(torch.bfloat16)
    q, s, s2 = quantize_nvfp4(w)
    assert float(s2) == float(w.abs().max().float() / 2688.0)
    codes, scales = _loop_quantize(w, s2)
    assert torch.equal(unpack_codes(q), codes)
    assert torch.equal(s.view(torch.uint8), scales.view(torch.uint8))


def test_dequantize_matches_loop_and_vllm(vllm_oracle):
    torch.manual_seed(1)
    w = torch.randn(6, 48, dtype=torch.bfloat16) * 3
    q, s, s2 = quantize_nvfp4(w)
    deq = dequantize_nvfp4(q, s, s2, torch.float32)
    vals = unpack_fp4(q)
    for o in range(6):
        for i in range(48):
            want = vals[o, i] * (s[o, i // 16].float() * s2)
            assert deq[o, i] == want
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        ref = vllm_oracle.dequantize_to_dtype(q, s, s2, dtype, 16, swizzle=False)
        assert torch.equal(dequantize_nvfp4(q, s, s2, dtype), ref)
    # stacked experts [E, out, in/2] with one global scale each
    we = torch.randn(3, 8, 32) * torch.tensor([1.0, 10.0, 0.1]).view(3, 1, 1)
    parts = [quantize_nvfp4(we[e]) for e in range(3)]
    qe, se = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    s2e = torch.stack([p[2] for p in parts])
    deqe = dequantize_nvfp4(qe, se, s2e, torch.bfloat16)
    assert torch.equal(deqe, vllm_oracle.dequantize_to_dtype(qe, se, s2e, torch.bfloat16, 16, swizzle=False))
    for e in range(3):
        assert torch.equal(deqe[e], dequantize_nvfp4(*parts[e], torch.bfloat16))


def test_round_trip_error_bound_and_idempotence():
    torch.manual_seed(2)
    w = torch.randn(16, 128) * torch.logspace(-3, 2, 16).unsqueeze(1)
    q, s, s2 = quantize_nvfp4(w)
    deq = dequantize_nvfp4(q, s, s2, torch.float32)
    step = (s.float() * s2).repeat_interleave(16, dim=1)  # one E2M1 unit of each element's block
    # half the widest E2M1 gap (2, between 4 and 6) is one unit, and a normal E4M3 block scale (rounded by <= 1/16)
    # keeps |w| / unit <= 6.375, so saturation costs less than a unit too
    normal = (s.float() >= 2.0 ** -6).repeat_interleave(16, dim=1)
    assert (~normal).any() and normal.any()  # the small rows' block scales are E4M3 subnormals: coarser, unbounded
    assert ((deq - w).abs() <= step * 1.0 + 1e-12)[normal].all()
    rel = (deq - w).norm() / w.norm()
    assert rel < 0.12, rel
    # with normal block scales every block's amax lands on code ±6, so re-quantizing the dequantized weight (same
    # global scale) changes nothing but -0 -> +0
    w = torch.randn(16, 128) * 3
    q, s, s2 = quantize_nvfp4(w)
    deq = dequantize_nvfp4(q, s, s2, torch.float32)
    q2, sb, _ = quantize_nvfp4(deq, s2)
    assert torch.equal(sb.view(torch.uint8), s.view(torch.uint8))
    assert torch.equal(unpack_fp4(q2), unpack_fp4(q))


def test_global_scale_override_and_zero_tensor():
    w = torch.randn(2, 32)
    gs = torch.tensor(w.abs().max() / 2688.0 * 2)  # a fused gate/up pair's larger amax
    _, s, s2 = quantize_nvfp4(w, gs)
    assert float(s2) == float(gs)
    assert float(s.float().max()) <= 224.0  # the block scales use half the E4M3 range
    with pytest.raises(ValueError, match="global_scale"):
        quantize_nvfp4(w, 0.0)
    q, s, s2 = quantize_nvfp4(torch.zeros(2, 32))
    assert torch.isfinite(s.float()).all() and float(s2) > 0
    assert torch.equal(dequantize_nvfp4(q, s, s2, torch.float32), torch.zeros(2, 32))
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4(torch.zeros(2, 24))


@pytest.mark.parametrize("scale_mult", [1.0, 0.25, 8.0])
def test_activation_fake_quant_matches_vllm_emulation(vllm_oracle, scale_mult):
    torch.manual_seed(3)
    x = (torch.randn(7, 64) * 5).to(torch.bfloat16)
    x[0, :16] = 0  # a zero block
    input_scale = (x.abs().max().float() / 2688.0 * scale_mult).reshape(())
    mine = fake_quant_activation_nvfp4(x, input_scale)
    # vLLM passes input_global_scale_inv = 1 / input_scale (modelopt.py KNvfp4Dynamic, linear/nvfp4/emulation.py)
    ref = vllm_oracle.ref_nvfp4_quant_dequant(x, (1.0 / input_scale).to(torch.float32), 16)
    assert mine.dtype == x.dtype
    assert torch.equal(mine, ref)
    x3 = x.reshape(7, 2, 32)  # leading dims are flattened
    assert torch.equal(fake_quant_activation_nvfp4(x3, input_scale), mine.reshape(7, 2, 32))


def _good(out=8, inp=32):
    q, s, s2 = quantize_nvfp4(torch.randn(out, inp))
    return dict(weight=q, weight_scale=s, weight_scale_2=s2, input_scale=torch.tensor(0.01))


def test_validate_accepts_a_good_layer():
    validate_nvfp4_tensors("m", **_good(), in_features=32, out_features=8)
    t = _good()
    t["input_scale"] = None
    validate_nvfp4_tensors("m", **t, in_features=32, out_features=8, weight_only=True)
    t["weight_scale_2"] = t["weight_scale_2"].reshape(1)  # [1] is a scalar too
    validate_nvfp4_tensors("m", **t, in_features=32, out_features=8, weight_only=True)
    t["input_scale"] = torch.tensor([0.0, 0.0])  # W4A16: an input_scale is not read, whatever it holds
    validate_nvfp4_tensors("m", **t, in_features=32, out_features=8, weight_only=True)


@pytest.mark.parametrize("tensor,bad,msg", [
    ("weight", None, r"experts\.3\.gate_proj\.weight is missing"),
    ("weight_scale", None, r"gate_proj\.weight_scale is missing"),
    ("weight_scale_2", None, r"gate_proj\.weight_scale_2 is missing"),
    ("input_scale", None, r"gate_proj\.input_scale is missing"),
    ("weight", torch.zeros(8, 16, dtype=torch.int8), r"gate_proj\.weight must be torch\.uint8"),
    ("weight", torch.zeros(8, 32, dtype=torch.uint8), r"gate_proj\.weight must have shape \(8, 16\)"),
    ("weight_scale", torch.ones(8, 2), r"gate_proj\.weight_scale must be torch\.float8_e4m3fn"),
    ("weight_scale", torch.ones(8, 4).to(torch.float8_e4m3fn), r"gate_proj\.weight_scale must have shape \(8, 2\)"),
    ("weight_scale", torch.full((8, 2), float("nan")).to(torch.float8_e4m3fn), r"weight_scale holds NaN"),
    ("weight_scale_2", torch.tensor(1.0, dtype=torch.bfloat16), r"weight_scale_2 must be torch\.float32"),
    ("weight_scale_2", torch.ones(2), r"weight_scale_2 must be a per-tensor scalar"),
    ("weight_scale_2", torch.tensor(0.0), r"weight_scale_2 must be finite and > 0"),
    ("input_scale", torch.tensor(float("inf")), r"input_scale must be finite and > 0"),
    ("input_scale", torch.tensor([1.0], dtype=torch.float16), r"input_scale must be torch\.float32"),
])
def test_validate_names_the_bad_tensor(tensor, bad, msg):
    t = _good()
    t[tensor] = bad
    with pytest.raises(QuantTensorError, match=msg):
        validate_nvfp4_tensors("layers.0.mlp.experts.3.gate_proj", **t, in_features=32, out_features=8)


def test_validate_in_features_not_multiple_of_16():
    with pytest.raises(QuantTensorError, match=r"m\.weight: NVFP4 needs in_features to be a multiple of 16"):
        validate_nvfp4_tensors("m", **_good(), in_features=40, out_features=8)
