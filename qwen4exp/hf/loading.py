"""Official-checkpoint loading and saving for the HF runtime.

Accepted layouts (``qwen4exp.checkpoint_layout``, walked here): composite (``model.language_model.*``,
``model.visual.*``) or text-only (``model.*``); experts fused (``mlp.experts.gate_up_proj`` [E, 2I, D],
``down_proj`` [E, D, I]) or per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``); PLE tables as row shards
``ngram_embedding.shard_{s}.weight`` (concatenated in numeric order) with an optional per-tensor ``weight_scale``
(FP8 tables); ``mtp.*`` kept when the model has an MTP head. A missing or mis-shaped tensor fails the load with its
name; a path that is no directory fails it at once with ``CheckpointNotFoundError`` (a ``FileNotFoundError``) naming
the path (checkpoints are read from a local directory: a Hub repo is downloaded first).

Quantized checkpoints (ModelOpt ``quantization_config`` in config.json, or ``hf_quant_config.json``): routed experts
NVFP4 or block FP8, the PLE table FP8; ``qwen4exp.hf.quant`` says what is read and the two ``quant_mode`` values.
``save_pretrained`` writes such a model back in the format it was loaded from.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..checkpoint import CheckpointNotFoundError, checkpoint_tensors, validate_checkpoint
from ..checkpoint_layout import (EXPERT_PART, PLE_ROWS, CheckpointError, canonical_name, classify, fuse_experts,
                                 join_rows, missing_error, mtp_layout, split_rows)
from ..configuration import Qwen4ExpConfig, Qwen4ExpTextConfig
from ..layers.rope import RotaryEmbedding
from ..quant import QuantConfigError, QuantTensorError, load_quant_config
from ..quant.fp8 import validate_fp8_per_tensor
from .quant import QUANT_MODES, QuantizedExperts, build_quantized_experts, log, split_quantized_experts

__all__ = ["CheckpointError", "CheckpointNotFoundError", "canonical_name", "convert", "iter_checkpoint",
           "load_pretrained", "save_pretrained"]


def iter_checkpoint(path: str):
    """Yield (name, tensor) for every tensor of a checkpoint directory (its files as ``checkpoint_tensors`` finds
    them)."""
    for fn in sorted({info.file for info in checkpoint_tensors(path).values()}):
        with safe_open(fn, framework="pt") as f:
            for k in f.keys():
                yield k, f.get_tensor(k)


def convert(weights, composite: bool) -> dict[str, torch.Tensor]:
    """Official names -> ours, with the layout's joins applied (``checkpoint_layout``: PLE row shards into one
    table, per-expert weights into the fused experts)."""
    out: dict[str, torch.Tensor] = {}
    shards: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    for name, t in weights:
        name = canonical_name(name, composite)
        if name is None:
            continue
        part = classify(name)
        if part.kind == PLE_ROWS:
            shards[part.target][part.index] = t
        elif part.kind == EXPERT_PART and part.field == "weight":
            experts[part.target][part.index][part.proj] = t
        else:
            out[name] = t
    for base, parts in shards.items():
        out[f"{base}.weight"] = join_rows(base, parts)
    for base, per in experts.items():
        out.update(fuse_experts(base, per))
    return out


def load_pretrained(cls, path, dtype=None, device="cpu", config=None, quant_mode: str = "dequantize",
                    emulate_w4a4: bool = False):
    path = str(path)
    if quant_mode not in QUANT_MODES:
        raise ValueError(f"qwen4exp: quant_mode must be one of {', '.join(QUANT_MODES)}, got {quant_mode!r}")
    # config, headers, tensor names/shapes/dtypes and tokenizer size, before anything is allocated
    cfg = validate_checkpoint(path, config=config)
    composite = cls.config_class is Qwen4ExpConfig
    if composite and isinstance(cfg, Qwen4ExpTextConfig):
        cfg = Qwen4ExpConfig(text_config=cfg.to_dict())
    if not composite and isinstance(cfg, Qwen4ExpConfig):
        cfg = cfg.text_config
    qcfg, qraw = _quant_config(path)
    if emulate_w4a4 and qcfg is None:
        raise QuantConfigError(f"qwen4exp: emulate_w4a4=True needs a quantized (NVFP4) checkpoint; {path} has no "
                               f"quantization config")
    layout = "hf" if composite else "hf_text"
    weights = ((n, t) for k, t in iter_checkpoint(path) if (n := canonical_name(k, composite)) is not None)
    weights, qexperts = split_quantized_experts(weights, qcfg, layout)
    sd = convert(weights, composite)
    n_mtp, shared_head = mtp_layout(list(sd) + [f"{b}.x" for b in qexperts])
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if dtype is None:
        dt = getattr(cfg.get_text_config(), "dtype", None) or getattr(cfg, "dtype", None)
        dtype = getattr(torch, dt) if isinstance(dt, str) else (dt or torch.float32)
    with torch.device("meta"):
        model = cls(cfg, mtp_layers=n_mtp or None, mtp_shared_head=shared_head)
    tc = model.config.get_text_config()
    for base in qexperts:
        try:
            old_mod = model.get_submodule(base)
        except AttributeError:
            old_mod = None
        if not isinstance(old_mod, torch.nn.Module) or type(old_mod).__name__ != "Experts":
            raise CheckpointError(f"qwen4exp: checkpoint {path} has quantized tensors for {base}, which is no "
                                  f"routed-experts module of the model")
    if emulate_w4a4 and not any(a == "NVFP4" for a, _ in qexperts.values()):
        raise QuantConfigError(f"qwen4exp: emulate_w4a4=True needs NVFP4 (W4A4) routed experts; {path} has none")
    expected = dict(model.named_parameters())
    expected.update({k: v for k, v in model.named_buffers() if k in dict(model.state_dict())})
    # table scales (FP8 PLE) are optional buffers
    for name in [k for k in sd if k.endswith("ngram_embedding.weight_scale")]:
        mod = model.get_submodule(name[: -len(".weight_scale")])
        mod.set_scale(torch.empty((), device="meta"))
        expected[name] = mod.weight_scale
    for base in qexperts:  # their tensors were validated apart; the module is replaced below
        for k in [k for k in expected if k.startswith(base + ".")]:
            del expected[k]
    _check_ple_tables(sd, qcfg, layout)
    if (missing := [k for k in expected if k not in sd]):
        raise missing_error(missing, f"checkpoint {path}")
    unexpected = [k for k in sd if k not in expected]
    if unexpected:
        raise CheckpointError(f"qwen4exp: checkpoint {path} has unexpected tensor(s): {', '.join(unexpected[:10])}")
    for k, p in expected.items():
        t = sd[k]
        if tuple(t.shape) != tuple(p.shape):
            raise CheckpointError(f"qwen4exp: tensor {k} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
    model.to_empty(device=device)
    with torch.no_grad():
        for k, p in expected.items():
            t = sd[k]
            keep = t.dtype in (torch.int64, torch.int32) or t.dtype.is_floating_point is False or \
                k.endswith("weight_scale") or (k.endswith("ngram_embedding.weight") and t.element_size() == 1)
            target = model.get_submodule(k.rsplit(".", 1)[0]) if "." in k else model
            leaf = k.rsplit(".", 1)[-1]
            if keep:
                new = t.to(device)
            else:
                new = t.to(device=device, dtype=dtype if not _fp32_param(k) else torch.float32)
            if isinstance(getattr(target, leaf), torch.nn.Parameter):
                setattr(target, leaf, torch.nn.Parameter(new, requires_grad=False))
            else:
                target.register_buffer(leaf, new, persistent=True)
    n_nvfp4 = n_fp8 = 0
    for base, (algo, experts) in qexperts.items():
        parent, leaf = base.rsplit(".", 1)
        mod = build_quantized_experts(base, algo, experts, tc, packed=quant_mode == "packed", dtype=dtype,
                                      emulate_w4a4=emulate_w4a4, source=qcfg.source if qcfg else "config.json")
        setattr(model.get_submodule(parent), leaf, mod.to(device))
        n_nvfp4 += mod.fmt == "nvfp4"
        n_fp8 += mod.fmt == "fp8_block"
    if qexperts:
        what = " and ".join(x for x in (f"{n_nvfp4} NVFP4" if n_nvfp4 else "", f"{n_fp8} block-FP8" if n_fp8 else "")
                            if x)
        log.info("qwen4exp: %s routed-expert module(s) %s%s", what,
                 f"dequantized to {str(dtype).removeprefix('torch.')} at load" if quant_mode == "dequantize"
                 else "kept packed, dequantized per forward", " (W4A4 activations emulated)" if emulate_w4a4 else "")
    if qraw is not None:  # written back by save_pretrained
        model._qwen4exp_quant = qraw
    # non-persistent buffers (the RoPE frequencies and axis maps) are in no checkpoint and were left uninitialised
    # by the meta-device build: take every one from a freshly built module
    for mod in model.modules():
        if isinstance(mod, RotaryEmbedding):
            fresh = RotaryEmbedding(mod_config(model))
            for name in fresh._non_persistent_buffers_set:
                setattr(mod, name, getattr(fresh, name).to(device))
    model.eval()
    return model


def _quant_config(path: str):
    """-> (QuantConfig or None, (file name, raw dict) or None) as vLLM looks them up."""
    qcfg = load_quant_config(path)
    if qcfg is None:
        return None, None
    if qcfg.source == "hf_quant_config.json":
        with open(os.path.join(path, "hf_quant_config.json")) as f:
            return qcfg, ("hf_quant_config.json", json.load(f))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    q = cfg.get("quantization_config")
    if q is None:
        q = cfg.get("text_config", {}).get("quantization_config")
    return qcfg, ("config.json", q)


def _check_ple_tables(sd, qcfg, layout) -> None:
    """The PLE tables against the config: FP8 per tensor (weight e4m3 + scalar weight_scale) or BF16."""
    for name in [k for k in sd if k.endswith("ngram_embedding.weight")]:
        base = name[: -len(".weight")]
        t, scale = sd[name], sd.get(base + ".weight_scale")
        algo = None if qcfg is None else qcfg.layer_algo(base, layout)
        if algo not in (None, "FP8"):
            raise QuantConfigError(f"{qcfg.source}: quant_algo {algo!r} for the PLE table {base}: vLLM 0.32 reads a "
                                   f"PLE table as BF16 or FP8 per tensor only (list it in the ignore list, or FP8)")
        if algo == "FP8" or t.dtype == torch.float8_e4m3fn or scale is not None:
            validate_fp8_per_tensor(base, t, scale, t.shape[0], t.shape[1] if t.ndim == 2 else -1)
        if algo is None and qcfg is not None and qcfg.is_mixed and t.dtype == torch.float8_e4m3fn:
            raise QuantTensorError(f"{base}.weight: the table is stored FP8, but the quantization config does not "
                                   f"list it (vLLM would read it as BF16)")


def _fp32_param(name: str) -> bool:
    return name.endswith(".A_log")  # kept fp32 as vLLM does; upcast before exp either way


def mod_config(model):
    return model.config.get_text_config()


def save_pretrained(model, save_directory, max_shard_size: int | str = "50GB", **_):
    """Write config.json + the weights in the official layout (PLE tables as shards): one model.safetensors, or past
    ``max_shard_size`` (bytes, or a size such as "5GB", as transformers takes it; its default) numbered files
    with a model.safetensors.index.json, a tensor never split. A model loaded from a quantized checkpoint writes
    its quantized experts (``QuantizedExperts.checkpoint_tensors``) and its quantization config back."""
    from transformers.utils.hub import convert_file_size_to_int

    limit = convert_file_size_to_int(max_shard_size)
    os.makedirs(save_directory, exist_ok=True)
    quant = getattr(model, "_qwen4exp_quant", None)
    model.config.save_pretrained(save_directory)
    if quant is not None:
        fname, raw = quant
        if fname == "config.json":  # the config the model was loaded with, as it was
            p = os.path.join(save_directory, "config.json")
            with open(p) as f:
                cfg = json.load(f)
            cfg["quantization_config"] = raw
            with open(p, "w") as f:
                json.dump(cfg, f, indent=2, sort_keys=True)
        else:
            with open(os.path.join(save_directory, fname), "w") as f:
                json.dump(raw, f, indent=2)
    tc = model.config.get_text_config()
    out = {}
    qmods = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedExperts)}
    for n, m in qmods.items():
        out.update(m.checkpoint_tensors(n))
    for k, t in model.state_dict().items():
        if k.rsplit(".", 1)[0] in qmods:
            continue
        if k.endswith(".ngram_embedding.weight"):
            out.update(split_rows(k[: -len(".weight")], t, tc.split_ngram_parts))
            continue
        out[k] = t.contiguous()
    _save_shards(out, save_directory, limit)


def _save_shards(tensors: dict, directory: str, limit: int) -> None:
    """``tensors`` as model.safetensors, or, past ``limit`` bytes, as model-0000i-of-0000n.safetensors in order,
    each up to ``limit`` (a larger tensor alone), with the index transformers and vLLM read."""
    shards, size = [{}], 0
    for k, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > limit:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += n
    for stale in os.listdir(directory):  # (a previous save's files would mix with these)
        if re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?", stale):
            os.remove(os.path.join(directory, stale))
    if len(shards) == 1:
        save_file(shards[0], os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(directory, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
