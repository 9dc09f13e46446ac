"""Checkpoint directories: reading them (safetensors headers and index, tokenizer size) and validating them against
the model before anything is allocated. The tensor layout itself (names, joins, expected shapes) is
``qwen4exp.checkpoint_layout``; ``check_tensors`` only walks it.

``validate_checkpoint``: the one check of a checkpoint directory that both runtimes (and ``qwen4exp-serve``) run
before allocating anything: config fields, safetensors headers and index, tensor names/shapes/dtypes, tokenizer size.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import defaultdict
from dataclasses import dataclass

# (CheckpointError, canonical_name and mtp_layout are also imported from here)
from .checkpoint_layout import (EXPERT_PART, PLE_ROWS, TABLE_SCALE_OF, CheckpointError, canonical_name,  # noqa: F401
                                check_shard_order, classify, expected_tensors, expert_shapes,
                                missing_error, missing_experts, mtp_layout)


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint directory at the path given (``missing_checkpoint``); also a ``FileNotFoundError``."""


# a Hugging Face Hub repo id as the Hub accepts it: ``name`` or ``namespace/name``, each 1-96 of [A-Za-z0-9_.-], not
# starting or ending with '-' or '.', no '--' or '..' (huggingface_hub.utils.validate_repo_id)
_HUB_PART = r"(?![-.])[A-Za-z0-9_.-]{1,96}(?<![-.])"
HUB_ID = re.compile(rf"{_HUB_PART}(/{_HUB_PART})?")


def looks_like_hub_id(name: str) -> bool:
    """``name`` has the form of a Hub repo id (``org/name`` or ``name``); a string that cannot be one (a leading
    ``.``, ``/`` or ``~``, two or more separators, characters the Hub does not allow) can only be a local path."""
    return bool(HUB_ID.fullmatch(name)) and "--" not in name and ".." not in name


def missing_checkpoint(path, hub: bool = False) -> str | None:
    """Why ``path`` names no checkpoint directory, in one line (None when it is a directory). ``hub``: the caller
    also accepts a Hugging Face Hub id (vLLM does), so a missing path that has the form of one (``looks_like_hub_id``)
    is left to it (None); a file is left to it too (vLLM serves GGUF files)."""
    path = str(path)
    if os.path.isdir(path):
        return None
    if os.path.exists(path):
        return None if hub else f"{path!r} is a file, not a checkpoint directory"
    if hub and looks_like_hub_id(path):
        return None
    home = os.path.expanduser(path)
    if home != path and os.path.isdir(home):  # a quoted ~: no shell expanded it
        where = f" ('~' is not expanded here: pass {home!r})"
    else:
        where = f" (resolved: {os.path.abspath(path)!r})" if not os.path.isabs(path) and home == path else ""
    if hub:
        return (f"no checkpoint directory at {path!r}{where}: no such directory, and not a Hugging Face "
                f"Hub id (org/name) either")
    hint = (f"; from_pretrained reads a local directory: for a Hub repo, download it first "
            f"(hf download {path} --local-dir DIR)" if looks_like_hub_id(path) and "/" in path else "")
    return f"no checkpoint directory at {path!r}{where}: no such directory{hint}"


# -- validation before anything is allocated (both runtimes, and qwen4exp-serve before it starts vLLM) -------------

_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
             "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
_FLOAT = {"F64", "F32", "F16", "BF16"}
_INT = {"I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8"}
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors dtype name (BF16, F32, I64, ...)
    shape: tuple[int, ...]
    file: str


def read_safetensors_header(fn: str) -> dict[str, TensorInfo]:
    """The tensors a safetensors file declares, from its header only (no tensor data read). A file whose header or
    data is cut short, or whose header is not the format's JSON, raises CheckpointError naming the file (and the
    first tensor that lies beyond its end)."""
    size = os.path.getsize(fn)
    with open(fn, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"qwen4exp: {fn}: truncated safetensors file ({size} bytes, no header)")
        n = int.from_bytes(raw, "little")
        if n > size - 8:
            raise CheckpointError(f"qwen4exp: {fn}: truncated safetensors file (its header is {n} bytes, the file "
                                  f"{size})")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"qwen4exp: {fn}: not a safetensors file (unreadable header: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"qwen4exp: {fn}: not a safetensors file (header is no JSON object)")
    data = size - 8 - n
    out: dict[str, TensorInfo] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = info["dtype"], tuple(int(x) for x in info["shape"]), info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(f"qwen4exp: {fn}: tensor {name} has a malformed header entry {info!r}") from None
        if e > data:
            raise CheckpointError(f"qwen4exp: {fn}: truncated safetensors file: tensor {name} ends at data byte {e}, "
                                  f"the file holds {data} data bytes")
        if dtype in _ITEMSIZE and (e - b) != math.prod(shape) * _ITEMSIZE[dtype]:
            raise CheckpointError(f"qwen4exp: {fn}: tensor {name} ({dtype} {list(shape)}) spans {e - b} bytes")
        out[name] = TensorInfo(dtype, shape, fn)
    return out


def checkpoint_tensors(path: str) -> dict[str, TensorInfo]:
    """Every tensor of a checkpoint directory, from the safetensors headers. With ``model.safetensors.index.json``,
    a shard it names that is absent, or a tensor it places in a shard that does not hold it, raises CheckpointError
    naming both."""
    idx = os.path.join(path, INDEX)
    if os.path.exists(idx):
        try:
            with open(idx, encoding="utf-8") as f:
                wm = json.load(f)["weight_map"]
            if not isinstance(wm, dict):
                raise TypeError
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"qwen4exp: {idx}: not a safetensors index (needs a JSON object 'weight_map' "
                                  f"of tensor -> file{'; ' + str(e) if isinstance(e, ValueError) else ''})") from None
        out: dict[str, TensorInfo] = {}
        headers: dict[str, dict[str, TensorInfo]] = {}
        for shard in sorted(set(wm.values())):
            fn = os.path.join(path, shard)
            if not os.path.isfile(fn):
                raise CheckpointError(f"qwen4exp: {idx} names shard {shard}, which is missing from {path}")
            headers[shard] = read_safetensors_header(fn)
            out.update(headers[shard])
        for name, shard in wm.items():
            if name not in headers[shard]:
                raise CheckpointError(f"qwen4exp: {idx} places tensor {name} in {shard}, which does not hold it")
        return out
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"qwen4exp: no .safetensors files in {path}")
    out = {}
    for f in files:
        out.update(read_safetensors_header(os.path.join(path, f)))
    return out


def _dtype_ok(ck: str, floating: bool, fp8_ok: bool) -> bool:
    if floating:
        return ck in _FLOAT or (fp8_ok and ck == "F8_E4M3")
    return ck in _INT


def check_tensors(tc, tensors: dict[str, TensorInfo], quantized: bool = False) -> None:
    """The checkpoint's tensors against those text config ``tc`` builds (``checkpoint_layout.expected_tensors``, with
    the MTP layers the checkpoint has): names, shapes and dtype kinds (float for weights, integer for the PLE hashing
    buffers; FP8 for a PLE table). Routed experts of a quantized checkpoint (``quantized``) are left to the
    quantized-expert checks, which know their packed layouts. Raises CheckpointError naming the tensor and its
    file."""
    canon: dict[str, tuple[str, TensorInfo]] = {}
    for k, info in tensors.items():
        n = canonical_name(k, composite=False)
        if n is not None:
            canon[n] = (k, info)
    expected = expected_tensors(tc, *mtp_layout(canon))
    if getattr(tc, "tie_word_embeddings", False):
        expected.pop("lm_head.weight", None)
    covered: set[str] = set()
    shards: dict[str, dict[int, tuple[str, TensorInfo]]] = defaultdict(dict)
    experts: dict[str, dict[tuple[int, str], tuple[str, TensorInfo]]] = defaultdict(dict)

    def at(info: TensorInfo) -> str:
        return f" (in {os.path.basename(info.file)})"

    def unexpected(k: str, info: TensorInfo, what: str = "the model (config.json) has no such tensor"):
        return CheckpointError(f"qwen4exp: unexpected tensor {k}{at(info)}: {what}")

    def mis_shaped(k: str, info: TensorInfo, want) -> CheckpointError:
        return CheckpointError(f"qwen4exp: tensor {k} has shape {list(info.shape)}, the config implies "
                               f"[{', '.join(map(str, want))}]{at(info)}")

    for n, (k, info) in canon.items():
        part = classify(n)
        if part.kind == PLE_ROWS:
            shards[part.target][part.index] = (k, info)
            continue
        if part.kind == TABLE_SCALE_OF and part.target + ".weight" in expected:
            continue  # an FP8 table's scale (checked with the table by the loaders)
        if quantized and ".mlp.experts." in n:
            base = n.split(".mlp.experts.")[0] + ".mlp.experts"
            covered.update(x for x in expected if x.startswith(base + "."))
            continue
        if part.kind == EXPERT_PART and part.field == "weight":
            experts[part.target][(part.index, part.proj)] = (k, info)
            continue
        want = expected.get(n)
        if want is None:
            raise unexpected(k, info)
        if info.shape != want.shape:
            raise mis_shaped(k, info, want.shape)
        if not _dtype_ok(info.dtype, want.floating, fp8_ok=n.endswith("ngram_embedding.weight")):
            kind = "a float dtype (BF16, F16, F32)" if want.floating else "an integer dtype"
            raise CheckpointError(f"qwen4exp: tensor {k} has dtype {info.dtype}, expected {kind}{at(info)}")
        covered.add(n)
    for base, parts in shards.items():
        want = expected.get(base + ".weight")
        if want is None:
            raise unexpected(*next(iter(parts.values())), f"the model has no PLE table {base}")
        order = check_shard_order(base, parts)
        rows = 0
        for s in order:
            k, info = parts[s]
            if len(info.shape) != 2 or info.shape[1] != want.shape[1]:
                raise mis_shaped(k, info, ["rows", want.shape[1]])
            if not _dtype_ok(info.dtype, True, fp8_ok=True):
                raise CheckpointError(f"qwen4exp: tensor {k} has dtype {info.dtype}, expected BF16/F16/F32 "
                                      f"or F8_E4M3{at(info)}")
            rows += info.shape[0]
        if rows != want.shape[0]:
            raise CheckpointError(f"qwen4exp: PLE table {base}: its {len(order)} shard(s) hold {rows} rows, the "
                                  f"config implies {want.shape[0]}")
        covered.add(base + ".weight")
    for base, per in experts.items():
        if (shapes := expert_shapes(expected, base)) is None:
            raise unexpected(*next(iter(per.values())), f"the model has no routed experts {base}")
        n_exp, want = shapes
        for (e, proj), (k, info) in per.items():
            if e >= n_exp:
                raise CheckpointError(f"qwen4exp: tensor {k}{at(info)}: expert {e} beyond num_experts {n_exp}")
            if info.shape != want[proj]:
                raise mis_shaped(k, info, want[proj])
            if not _dtype_ok(info.dtype, True, fp8_ok=False):
                raise CheckpointError(f"qwen4exp: tensor {k} has dtype {info.dtype}, expected a float dtype{at(info)}")
        if (absent := missing_experts(base, per, n_exp)):
            raise missing_error(absent)
        covered.update(f"{base}.{f}" for f in ("gate_up_proj", "down_proj"))
    if (missing := [k for k in expected if k not in covered]):
        raise missing_error(missing)


def tokenizer_vocab(path: str) -> tuple[str, int] | None:
    """(file, number of token ids) of the tokenizer files in ``path`` (tokenizer.json, else vocab.json; plus the
    added tokens of tokenizer_config.json): one more than the largest id. None without tokenizer files."""
    top, src = -1, None
    for fname in ("tokenizer.json", "vocab.json"):
        fn = os.path.join(path, fname)
        if not os.path.isfile(fn):
            continue
        try:
            with open(fn, encoding="utf-8") as f:
                tok = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"qwen4exp: {fn}: not valid JSON ({e})") from None
        vocab = tok.get("model", {}).get("vocab") if fname == "tokenizer.json" else tok
        if isinstance(vocab, dict):
            top = max([top, *(v for v in vocab.values() if isinstance(v, int))])
        elif isinstance(vocab, list):  # Unigram: [[piece, score], ...]
            top = max(top, len(vocab) - 1)
        for t in tok.get("added_tokens", []) if fname == "tokenizer.json" else []:
            if isinstance(t, dict) and isinstance(t.get("id"), int):
                top = max(top, t["id"])
        src = fn
        break
    fn = os.path.join(path, "tokenizer_config.json")
    if src is not None and os.path.isfile(fn):
        try:
            with open(fn, encoding="utf-8") as f:
                added = json.load(f).get("added_tokens_decoder") or {}
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"qwen4exp: {fn}: not valid JSON ({e})") from None
        ids = [int(i) for i in added if str(i).isdigit()]
        if ids and max(ids) > top:
            top, src = max(ids), fn
    return None if src is None else (src, top + 1)


def validate_checkpoint(path, *, config=None, weights: bool = True, tokenizer: bool = True):
    """One validation of a checkpoint directory before any runtime allocates anything: config.json (valid JSON,
    required fields, field types and invariants: ``configuration.validate_text_config``), the safetensors headers and
    index (``weights``: truncated files, missing shards, tensors no shard holds, names/shapes/dtypes against the model
    the config builds), and the tokenizer's size against ``vocab_size`` (``tokenizer``). Returns our config object
    (``config``, when given, is checked instead of config.json). Raises ConfigError (a field) or CheckpointError (a
    file or tensor), both ValueError, with one message naming it; a path that is no directory raises
    CheckpointNotFoundError (also a FileNotFoundError) naming the path."""
    from .configuration import load_config, text_config_of, validate_text_config

    path = str(path)
    if (missing := missing_checkpoint(path)) is not None:
        raise CheckpointNotFoundError(f"qwen4exp: {missing}")
    cfg = load_config(path) if config is None else config
    tc = text_config_of(cfg)
    validate_text_config(tc)
    if weights:
        from .quant import load_quant_config

        check_tensors(tc, checkpoint_tensors(path), quantized=load_quant_config(path) is not None)
    if tokenizer and (tv := tokenizer_vocab(path)) is not None and tv[1] > tc.vocab_size:
        raise CheckpointError(f"qwen4exp: tokenizer {tv[0]} has {tv[1]} token ids, more than the model's vocab_size "
                              f"{tc.vocab_size} (config.json): ids from {tc.vocab_size} on have no embedding row")
    return cfg


IMAGE_PROCESSOR_FILE = "preprocessor_config.json"


def check_image_processor_config(path, cfg) -> None:
    """A composite checkpoint (``vision_config``: a vision tower) served with images needs its image processor's
    config (patch and merge sizes, pixel limits, normalisation): ``preprocessor_config.json``, or
    ``processor_config.json`` with an ``image_processor`` entry, as transformers reads them. vLLM builds the processor
    at start-up and fails deep in a traceback without it; this raises CheckpointError with one line naming the file
    and the way to serve text only (``--language-model-only``). Text-only configs pass."""
    if getattr(cfg, "vision_config", None) is None:
        return
    path = str(path)
    if os.path.isfile(os.path.join(path, IMAGE_PROCESSOR_FILE)):
        return
    proc = os.path.join(path, "processor_config.json")
    if os.path.isfile(proc):
        try:
            with open(proc) as f:
                if "image_processor" in json.load(f):
                    return
        except (OSError, ValueError):
            pass  # (transformers fails on it as well: named below)
    raise CheckpointError(
        f"qwen4exp: {path} is a composite checkpoint (it has a vision tower) without {IMAGE_PROCESSOR_FILE}, the image "
        f"processor's config that serving images needs; add the one the checkpoint's release ships, or serve it as "
        f"text only with --language-model-only")
