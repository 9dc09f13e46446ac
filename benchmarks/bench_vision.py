"""Time the vision tower on one square image: ours (``qwen4exp.layers.vision.VisionTower``) against upstream
transformers' ``Qwen4ExpVisionModel`` with the same dummy weights, in the same process.

    python benchmarks/bench_vision.py                  # 1024x1024, the real tower (presets.flash_next())
    python benchmarks/bench_vision.py --size 64 --depth 2 --reps 2   # CPU smoke test

The real widths (27 blocks, width 1152, 16 heads, 16-px patches, 2x2 merge): a 1024x1024 image is 64x64 = 4096
patches -> 1024 text-width tokens. CUDA (bf16) when available, else CPU (fp32). Upstream runs with its ``sdpa``
attention (one call per image segment). Reported: the median wall time of ``--reps`` calls after ``--warmup``
calls (CUDA synchronised), and the relative difference of the two outputs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from qwen4exp import presets  # noqa: E402
from qwen4exp.configuration import Qwen4ExpVisionConfig  # noqa: E402
from qwen4exp.layers.vision import VisionTower  # noqa: E402


def build(depth: int | None, device, dtype, attn: str = "sdpa"):
    from transformers.models.qwen4_exp import configuration_qwen4_exp as UC, modeling_qwen4_exp as UM

    vd = presets.flash_next().vision_config.to_dict()
    for k in ("model_type", "transformers_version", "architectures"):
        vd.pop(k, None)
    if depth is not None:
        vd["depth"] = depth
    ucfg = UC.Qwen4ExpVisionConfig(**vd)
    ucfg._attn_implementation = attn
    torch.manual_seed(0)
    up = UM.Qwen4ExpVisionModel(ucfg).eval()
    with torch.no_grad():  # dummy weights: small random values everywhere (no trivial LayerNorms)
        for n, p in up.named_parameters():
            p.normal_(1.0 if "norm" in n and n.endswith("weight") else 0.0, 0.02)
    ours = VisionTower(Qwen4ExpVisionConfig(**vd)).eval()
    ours.load_state_dict(up.state_dict(), strict=True)
    return up.to(device, dtype), ours.to(device, dtype), vd


def median_time(fn, reps: int, warmup: int, cuda: bool) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def run(size: int = 1024, depth: int | None = None, reps: int = 10, warmup: int = 3, device: str | None = None,
        dtype: str | None = None) -> dict:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype or ("bf16" if device == "cuda" else "fp32")]
    up, ours, vd = build(depth, device, dt)
    P, m = vd["patch_size"], vd["spatial_merge_size"]
    if size % (P * m):
        raise SystemExit(f"--size must be a multiple of patch_size * spatial_merge_size = {P * m}")
    g = size // P
    grid = torch.tensor([[1, g, g]], device=device)
    g_ = torch.Generator(device=device).manual_seed(1)
    px = torch.randn(g * g, ours.patch_dim, device=device, generator=g_).to(dt)
    with torch.inference_mode():
        a = up(px, grid_thw=grid).pooler_output
        b = ours(px, grid)
        rel = ((b.float() - a.float()).norm() / a.float().norm()).item()
        cuda = device == "cuda"
        t_up = median_time(lambda: up(px, grid_thw=grid), reps, warmup, cuda)
        t_ours = median_time(lambda: ours(px, grid), reps, warmup, cuda)
    return {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "dtype": str(dt).split(".")[-1],
            "size": size, "depth": vd["depth"], "width": vd["hidden_size"], "patches": g * g,
            "tokens_out": b.shape[0], "ours_ms": t_ours * 1e3, "upstream_ms": t_up * 1e3,
            "speedup": t_up / t_ours, "rel_diff": rel}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=1024, help="image side in pixels (default 1024)")
    ap.add_argument("--depth", type=int, default=None, help="override the tower depth (smoke tests)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available)")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--json", default=None, help="also write the result here")
    a = ap.parse_args(argv)
    r = run(a.size, a.depth, a.reps, a.warmup, a.device, a.dtype)
    print(f"vision tower, one {r['size']}x{r['size']} image ({r['patches']} patches -> {r['tokens_out']} tokens), "
          f"depth {r['depth']}, width {r['width']}, {r['device']} {r['dtype']}")
    print(f"  ours      {r['ours_ms']:10.2f} ms")
    print(f"  upstream  {r['upstream_ms']:10.2f} ms   (ours {r['speedup']:.2f}x faster; outputs rel diff "
          f"{r['rel_diff']:.1e})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    return r


if __name__ == "__main__":
    main()
