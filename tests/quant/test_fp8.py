"""FP8 E4M3 references: hand-computed bytes, block scales, vLLM's scaled_dequantize as oracle, bad-input errors."""

import pytest
import torch

from qwen4exp.quant import QuantTensorError
from qwen4exp.quant.fp8 import (dequantize_fp8_block, dequantize_fp8_per_tensor, quantize_fp8_block,
                                quantize_fp8_per_row, quantize_fp8_per_tensor, validate_fp8_block,
                                validate_fp8_per_tensor)


def test_per_tensor_hand_computed_bytes():
    # amax 448 -> scale 1: 448 = 1.75 * 2^8 -> 0 1111 110 = 0x7E; 1 = 0 0111 000 = 0x38; -2 = 1 1000 000 = 0xC0;
    # 2^-9 (smallest subnormal) = 0x01; 1.0625 lies halfway between 1 and 1.125 -> even mantissa, 1.0 (0x38)
    w = torch.tensor([448.0, -448.0, 1.0, -2.0, 2.0 ** -9, 1.0625, 0.0, 1.1875])
    q, s = quantize_fp8_per_tensor(w)
    assert s.dtype == torch.float32 and float(s) == 1.0
    assert q.view(torch.uint8).tolist() == [0x7E, 0xFE, 0x38, 0xC0, 0x01, 0x38, 0x00, 0x3A]  # 1.1875 -> 1.25 (even)
    q, s = quantize_fp8_per_tensor(w * 2)  # amax 896 -> scale 2, same bytes
    assert float(s) == 2.0 and q.view(torch.uint8).tolist()[:4] == [0x7E, 0xFE, 0x38, 0xC0]
    q, s = quantize_fp8_per_tensor(torch.zeros(3))  # zero amax -> scale 1 (ModelOpt export_amax)
    assert float(s) == 1.0 and q.view(torch.uint8).tolist() == [0, 0, 0]


def test_per_tensor_dequant_is_vllm_ple_formula():
    torch.manual_seed(0)
    w = torch.randn(64, 8) * 0.02
    q, s = quantize_fp8_per_tensor(w)
    for dtype in (torch.bfloat16, torch.float32):
        d = dequantize_fp8_per_tensor(q, s, dtype)
        assert d.dtype == dtype
        assert torch.equal(d, q.to(dtype) * s.to(dtype))  # vLLM Qwen4ExpPLEFp8EmbeddingMethod.dequantize
    d = dequantize_fp8_per_tensor(q, s.reshape(1), torch.float32)
    for r in range(0, 64, 7):
        for c in range(8):
            assert d[r, c] == q[r, c].float() * s
    rel = ((d - w).abs() / w.abs().clamp_min(1e-30))[w.abs() > float(s) * 2 ** -6]
    assert rel.max() <= 2 ** -4  # normal E4M3: 3 mantissa bits, half an ulp is 1/16 relative


def test_per_row_is_per_tensor_of_each_row():
    """Per-row scales (the MTP drafts' FP8 LM head): each row exactly as the per-tensor quantizer does that row
    alone, whatever the chunking; an all-zero row gets scale 1."""
    torch.manual_seed(0)
    w = (torch.randn(37, 24) * torch.logspace(-3, 1, 37)[:, None]).to(torch.bfloat16)
    w[5] = 0
    for chunk in (1, 8, 37, 1000):
        q, s = quantize_fp8_per_row(w, chunk_rows=chunk)
        assert q.dtype == torch.float8_e4m3fn and s.shape == (37, 1) and s.dtype == torch.float32
        for r in range(37):
            qr, sr = quantize_fp8_per_tensor(w[r])
            assert torch.equal(q[r].view(torch.uint8), qr.view(torch.uint8)) and float(s[r]) == float(sr), (chunk, r)
    assert float(s[5]) == 1.0
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8_per_row(w[0])


def test_block_hand_computed():
    w = torch.zeros(256, 256)
    w[0, 0], w[5, 200], w[130, 3], w[255, 255] = 448.0, -896.0, 56.0, 0.0
    q, s = quantize_fp8_block(w)
    assert s.shape == (2, 2) and s.dtype == torch.float32
    assert s.tolist() == [[1.0, 2.0], [0.125, 1.0]]  # zero tile -> scale 1
    qb = q.view(torch.uint8)
    assert qb[0, 0] == 0x7E and qb[5, 200] == 0xFE and qb[130, 3] == 0x7E
    assert torch.equal(dequantize_fp8_block(q, s, torch.float32)[0, 0], torch.tensor(448.0))


def test_block_dequant_matches_vllm_scaled_dequantize(vllm_oracle):
    torch.manual_seed(1)
    w = torch.randn(256, 384, dtype=torch.bfloat16) * torch.logspace(-2, 1, 256).unsqueeze(1).to(torch.bfloat16)
    q, s = quantize_fp8_block(w)
    gs = vllm_oracle.GroupShape(128, 128)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize_fp8_block(q, s, dtype), vllm_oracle.scaled_dequantize(q, s, gs, dtype))
    # ModelOpt's 4-D export [out/128, 1, in/128, 1] reads the same
    assert torch.equal(dequantize_fp8_block(q, s.reshape(2, 1, 3, 1)), dequantize_fp8_block(q, s))
    # stacked experts keep their leading dim
    qe, se = quantize_fp8_block(torch.stack([w.float(), 2 * w.float()]))
    assert se.shape == (2, 2, 3) and torch.equal(dequantize_fp8_block(qe, se)[1], dequantize_fp8_block(qe[1], se[1]))


def test_block_partial_output_tile_and_error_bound():
    torch.manual_seed(2)
    w = torch.randn(200, 256)  # the last output tile holds 72 rows
    q, s = quantize_fp8_block(w)
    assert q.shape == (200, 256) and s.shape == (2, 2)
    assert float(s[1, 0]) == float(w[128:, :128].abs().max() / 448.0)
    d = dequantize_fp8_block(q, s, torch.float32)
    for r, c in ((0, 0), (199, 255), (150, 17)):
        assert d[r, c] == q[r, c].float() * s[r // 128, c // 128]
    scale = s.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)
    assert ((d - w).abs() <= torch.maximum(w.abs() * 2 ** -4, scale * 2 ** -10)).all()


def test_validate_per_tensor():
    q, s = quantize_fp8_per_tensor(torch.randn(10, 4))
    validate_fp8_per_tensor("ple.t", q, s, 10, 4)
    validate_fp8_per_tensor("ple.t", q, s.reshape(1), 10, 4)
    cases = [
        (None, s, r"ple\.t\.weight is missing"),
        (q, None, r"ple\.t\.weight_scale is missing"),
        (q.view(torch.uint8), s, r"ple\.t\.weight must be torch\.float8_e4m3fn"),
        (q[:5], s, r"ple\.t\.weight must have shape \(10, 4\)"),
        (q, s.to(torch.bfloat16), r"ple\.t\.weight_scale must be torch\.float32"),
        (q, torch.ones(4), r"ple\.t\.weight_scale must be a per-tensor scalar"),
        (q, torch.tensor(-1.0), r"ple\.t\.weight_scale must be finite and > 0"),
        (q, torch.tensor(float("nan")), r"ple\.t\.weight_scale must be finite and > 0"),
    ]
    for weight, scale, msg in cases:
        with pytest.raises(QuantTensorError, match=msg):
            validate_fp8_per_tensor("ple.t", weight, scale, 10, 4)


def test_validate_block():
    q, s = quantize_fp8_block(torch.randn(200, 256))
    n = "mtp.layers.0.mlp.experts.1.down_proj"
    validate_fp8_block(n, q, s, 256, 200)
    validate_fp8_block(n, q, s.reshape(2, 1, 2, 1), 256, 200)
    cases = [
        (None, s, 256, 200, r"down_proj\.weight is missing"),
        (q, None, 256, 200, r"down_proj\.weight_scale is missing"),
        (q.to(torch.bfloat16), s, 256, 200, r"down_proj\.weight must be torch\.float8_e4m3fn"),
        (q, s, 256, 128, r"down_proj\.weight must have shape \(128, 256\)"),
        (q, s.double(), 256, 200, r"down_proj\.weight_scale must be torch\.float32"),
        (q, s[:1], 256, 200, r"down_proj\.weight_scale must have shape \(2, 2\)"),
        (q, torch.zeros(2, 2), 256, 200, r"down_proj\.weight_scale must be finite and > 0"),
    ]
    for weight, scale, i, o, msg in cases:
        with pytest.raises(QuantTensorError, match=msg):
            validate_fp8_block(n, weight, scale, i, o)
    q2, s2 = quantize_fp8_block(torch.randn(128, 200))
    with pytest.raises(QuantTensorError, match=r"in_features to be a multiple of 128"):
        validate_fp8_block(n, q2, s2, 200, 128)
    with pytest.raises(QuantTensorError, match=r"down_proj\.weight_scale_inv is missing"):
        validate_fp8_block(n, q, None, 256, 200, scale_name="weight_scale_inv")
