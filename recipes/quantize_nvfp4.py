"""Make an NVFP4 checkpoint of a BF16 Qwen4Exp checkpoint with NVIDIA Model Optimizer (nvidia-modelopt 0.47).

    python recipes/quantize_nvfp4.py --model BF16_DIR [--out NVFP4_DIR] [--calib-file F] [--calib-tokens N]
        [--weight-only] [--mtp-experts fp8_block|bf16] [--ple-table fp8|bf16] [--eval-tokens N] [--modelopt-eval]

(``make quant`` installs modelopt into the venv, ``--no-deps``, with the few packages it needs to import.)

Steps:

1. Load the BF16 checkpoint with this package's HF classes (``Qwen4ExpForCausalLM``, or
   ``Qwen4ExpForConditionalGeneration`` for a composite config).
2. **ModelOpt calibrates**: ``mtq.quantize(model, NVFP4_EXPERTS_ONLY_CFG, forward_loop)``, ModelOpt's experts-only
   NVFP4 preset (``*.experts.*weight_quantizer`` / ``*.experts.*input_quantizer``, dynamic 16-blocks with E4M3
   scales, ``max`` calibration; the MTP head ``mtp.*``, routers, shared experts, attention and everything else stay
   unquantized by its own exclusion list). ``--weight-only``: the same preset with the input quantizers disabled
   (W4A16), calibrated on the weights alone, no text. Our routed experts are fused 3-D parameters, not
   ``nn.Linear``: ``qwen4exp.quant.modelopt_experts`` registers them with ModelOpt's own fused-experts wrapper
   (``_QuantFusedExperts``: a weight quantizer per expert, gate and up sharing one, and one input quantizer per GEMM
   shared by the experts, seeing only the tokens routed to each expert), hooked at ``Experts.expert_weights`` /
   ``Experts.quant_input`` rather than at ``F.linear``, whose expert-index recovery our fp32-accumulating forward
   would defeat. That is cleaner than a calibration-time copy of every expert as ``nn.Linear`` modules: no weight
   copies, ModelOpt's own quantizer layout and per-expert weight calibration, and nothing to map back. The
   calibration text is the tiny-coder corpus by default (``recipes/tokenizer_tiny.py``: the Python standard
   library's own source, "train" split, documents separated by ``<|endoftext|>``), or ``--calib-file``, cut into
   ``--seq-len`` windows, ``--calib-tokens`` in all, one window a forward.
3. **ModelOpt's scales**: each expert's ``weight_scale_2`` and each GEMM's ``input_scale`` from the calibrated
   quantizers with ModelOpt's export formulas (amax / (6 * 448): ``NVFP4QTensor.get_weights_scaling_factor_2_
   from_quantizer``, ``get_activation_scaling_factor``).
4. **Our writer writes** (``qwen4exp.quant.export.quantize_checkpoint(input_scales=..., weight_scales_2=...)``):
   the routed experts NVFP4 per expert (codes and E4M3 block scales derived with ModelOpt's global scales; the same
   arithmetic as ``NVFP4QTensor.quantize``), the MTP experts FP8 in 128x128 blocks (``--mtp-experts``), the PLE
   table FP8 per tensor (``--ple-table``), everything else BF16, and config.json's ``quantization_config``.
   ModelOpt's ``export_hf_checkpoint`` is not used: it does not know this module tree (fused experts it would
   re-split under other names, the PLE table and its shards, the hyper-connections, the MTP head's block FP8, the
   ignore list vLLM 0.32 needs for Qwen4Exp), and our writer is the one the HF reference and the vLLM plugin are
   tested against.
5. **Quality** on held-out text (the corpus' "heldout" split, ``--eval-tokens``, default 1,024, 0 to skip):
   perplexity and teacher-forced top-1 agreement with the BF16 model, for NVFP4 weight-only (the checkpoint's
   experts dequantized, activations BF16: what Hopper runs) and W4A4 (``emulate_w4a4=True``: activations
   fake-quantized with the checkpoint's input_scale, as Blackwell runs it); printed as a table and written to
   ``OUT/quality.json``. ``--modelopt-eval`` adds ModelOpt's own fake-quant model (its NVFP4 fake-quant needs CUDA:
   on a CPU the flag only says so).

6. **A model card**, ``OUT/README.md`` (in place of the BF16 checkpoint's, which describes the BF16 weights): the
   base checkpoint, what is NVFP4 / FP8 / BF16, the calibration, ModelOpt's and this package's versions, the date,
   the quality table and how to load and serve it.

``--out`` defaults to ``checkpoints/<model name>-nvfp4`` in qwen4exp's cache folder (``$QWEN4EXP_CACHE_DIR``, else
``$XDG_CACHE_HOME/qwen4exp`` or ``~/.cache/qwen4exp``): outside the source tree, where ``make clean`` does not reach.
Options: ``--device`` (default cuda when there is one), ``--seq-len`` (default 128), ``--dtype`` (bfloat16).
A missing model directory, an already-quantized model, a missing or empty calibration file fail with the name.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

import tokenizer_tiny as T  # noqa: E402

MODELOPT_PIN = "nvidia-modelopt==0.47.0"
SEPARATOR = T.ENDOFTEXT  # between documents, as the tiny-coder was trained


class RecipeError(Exception):
    """Bad input, named: the command line prints it and exits 2."""


# -- input checks ---------------------------------------------------------------------------------------------------
def check_model_dir(path: str) -> dict:
    """The BF16 checkpoint's config.json (a dict); RecipeError if ``path`` is not a checkpoint or already quantized."""
    if not os.path.isdir(path):
        raise RecipeError(f"--model {path}: no such directory")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise RecipeError(f"--model {path}: no config.json (not a checkpoint directory)")
    with open(cfg_path) as f:
        cfg = json.load(f)
    for where, c in (("config.json", cfg), ("config.json text_config", cfg.get("text_config") or {})):
        if c.get("quantization_config"):
            algo = c["quantization_config"].get("quant_algo", "?")
            raise RecipeError(f"--model {path}: already quantized ({where} has a quantization_config, quant_algo "
                              f"{algo!r}); pass the BF16 checkpoint")
    if os.path.exists(os.path.join(path, "hf_quant_config.json")):
        raise RecipeError(f"--model {path}: already quantized (it has an hf_quant_config.json); pass the BF16 "
                          f"checkpoint")
    if not any(f.endswith(".safetensors") for f in os.listdir(path)):
        raise RecipeError(f"--model {path}: no .safetensors weights")
    return cfg


def read_calib_file(path: str) -> str:
    if not os.path.isfile(path):
        raise RecipeError(f"--calib-file {path}: no such file")
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if not text.strip():
        raise RecipeError(f"--calib-file {path}: the file is empty (no calibration text)")
    return text


def import_modelopt():
    """``modelopt.torch.quantization`` (and our experts' registration); RecipeError naming the install if absent."""
    # known-harmless noise at import / conversion: transformers 5.19 is newer than modelopt's tested range (only its
    # HF export and trainer paths care; we use neither), and modelopt's KV-cache attention auto-detection does not
    # apply to this model (the experts-only config quantizes no attention)
    warnings.filterwarnings("ignore", message=r"transformers .* is not tested with current version of modelopt")
    warnings.filterwarnings("ignore", message=r"Could not create a quantized attention class")
    try:
        import modelopt.torch.quantization as mtq
    except ImportError as e:
        raise RecipeError(f"nvidia-modelopt is not importable ({e}): run `make quant` (it installs {MODELOPT_PIN} "
                          f"with --no-deps plus the small packages it needs)") from e
    from qwen4exp.quant import modelopt_experts

    modelopt_experts.register()
    return mtq, modelopt_experts


# -- text -----------------------------------------------------------------------------------------------------------
def separator_id(tok) -> int:
    i = tok.convert_tokens_to_ids(SEPARATOR)
    if isinstance(i, int) and i != tok.unk_token_id and i is not None:
        return i
    if tok.eos_token_id is None:
        raise RecipeError("the tokenizer has neither <|endoftext|> nor an EOS token to separate documents")
    return int(tok.eos_token_id)


def corpus_windows(tok, split: str, n_tokens: int, seq: int):
    """[n, seq] token ids from the tiny-coder corpus (``recipes/tokenizer_tiny.py``): the split's files in order,
    each followed by the separator, cut into ``n_tokens // seq`` windows (what tests/quant/test_hf_nvfp4.py's
    ``_windows`` makes)."""
    import torch

    n = max(1, n_tokens // seq)
    sep, ids = separator_id(tok), []
    for rel in T.corpus_files(split):
        text = T.read_file(rel)
        if text:
            ids += tok(text, verbose=False)["input_ids"] + [sep]
        if len(ids) >= n * seq:
            break
    if len(ids) < n * seq:
        raise RecipeError(f"the corpus' {split!r} split ({T.stdlib_dir()}) has {len(ids)} tokens, fewer than "
                          f"{n} x {seq}")
    return torch.tensor(ids[: n * seq]).view(n, seq)


def text_windows(tok, text: str, n_tokens: int, seq: int, name: str):
    """Windows of ``seq`` tokens (the last one may be shorter) of ``text``, ``n_tokens`` at most -> list of [1, s]."""
    import torch

    ids = tok(text, verbose=False)["input_ids"][:n_tokens]
    if len(ids) < 2:
        raise RecipeError(f"--calib-file {name}: {len(ids)} token(s) of text, too few to calibrate on")
    return [torch.tensor(ids[i: i + seq]).view(1, -1) for i in range(0, len(ids), seq) if len(ids[i: i + seq]) > 1]


def calibration_windows(tok, args) -> list:
    if args.calib_file:
        return text_windows(tok, read_calib_file(args.calib_file), args.calib_tokens, args.seq_len, args.calib_file)
    return list(corpus_windows(tok, "train", args.calib_tokens, args.seq_len).split(1))


# -- progress -------------------------------------------------------------------------------------------------------
def progress(it, total: int, desc: str):
    """tqdm when it is installed, else a plain bar on stderr."""
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        yield from tqdm(it, total=total, desc=desc, unit="win", file=sys.stderr, dynamic_ncols=True)
        return
    t0 = time.time()
    for i, x in enumerate(it, 1):
        yield x
        filled = int(30 * i / max(total, 1))
        print(f"\r{desc}: [{'#' * filled}{'.' * (30 - filled)}] {i}/{total} {time.time() - t0:5.1f}s", end="",
              file=sys.stderr, flush=True)
    print(file=sys.stderr)


# -- models ---------------------------------------------------------------------------------------------------------
def model_class(cfg: dict):
    from qwen4exp.hf.modeling import Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration

    return Qwen4ExpForConditionalGeneration if "text_config" in cfg else Qwen4ExpForCausalLM


class Scorer:
    """Teacher-forced scoring on held-out windows: the BF16 reference's top-1 predictions are kept, each model's
    cross-entropy and top-1 agreement with them computed window by window."""

    def __init__(self, windows, device):
        self.windows, self.device, self.ref_top = windows, device, None

    def score(self, model, desc: str) -> dict:
        import torch
        import torch.nn.functional as F

        ce_sum, agree, n = 0.0, 0, 0
        tops = []
        with torch.no_grad():
            for i, w in enumerate(progress(self.windows, len(self.windows), desc)):
                w = w.view(1, -1).to(self.device)
                logits = model(w, use_cache=False).logits.float()[0, :-1]
                target = w[0, 1:]
                ce_sum += float(F.cross_entropy(logits, target, reduction="sum"))
                top = logits.argmax(-1)
                tops.append(top.cpu())
                if self.ref_top is not None:
                    agree += int((top.cpu() == self.ref_top[i]).sum())
                n += target.numel()
        if self.ref_top is None:
            self.ref_top, agree = tops, n
        ce = ce_sum / n
        return {"ce": ce, "perplexity": math.exp(ce), "top1_vs_bf16": agree / n, "tokens": n}


def release() -> None:
    """Give the memory of the models just deleted back (the CUDA cache too)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- the recipe -----------------------------------------------------------------------------------------------------
def experts_only_config(mtq, weight_only: bool) -> dict:
    """ModelOpt's ``NVFP4_EXPERTS_ONLY_CFG``; weight-only: its expert input quantizers disabled (W4A16)."""
    import copy

    cfg = copy.deepcopy(mtq.NVFP4_EXPERTS_ONLY_CFG)
    if weight_only:
        cfg["quant_cfg"] = list(cfg["quant_cfg"]) + [{"quantizer_name": "*.experts.*input_quantizer",
                                                      "enable": False}]
    return cfg


def default_out(model: str, environ=None) -> str:
    """``--out``'s default: ``<qwen4exp cache folder>/checkpoints/<model dir name>-nvfp4`` (outside the tree)."""
    from qwen4exp import envs

    env = os.environ if environ is None else environ
    base = envs.get("QWEN4EXP_CACHE_DIR", env) or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "qwen4exp")
    return os.path.join(base, "checkpoints", os.path.basename(os.path.normpath(model)) + "-nvfp4")


def run(args) -> dict:
    """The recipe (see the module docstring) -> a summary: the scales written, the calibration amaxes ModelOpt
    found, the quality figures."""
    t_start = time.time()
    cfg = check_model_dir(args.model)
    if not args.out:
        args.out = default_out(args.model)
    if os.path.abspath(args.out) == os.path.abspath(args.model):
        raise RecipeError(f"--out {args.out}: must differ from --model")
    if args.calib_tokens < 1 or args.seq_len < 2 or args.eval_tokens < 0:
        raise RecipeError("--calib-tokens must be >= 1, --seq-len >= 2, --eval-tokens >= 0")
    if args.calib_file and not args.weight_only:
        read_calib_file(args.calib_file)  # fail before anything is loaded
    mtq, mx = import_modelopt()

    import torch
    from transformers import AutoTokenizer

    from qwen4exp.quant.export import quantize_checkpoint

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype)
    tok = AutoTokenizer.from_pretrained(args.model)
    cls = model_class(cfg)
    eval_windows = (list(corpus_windows(tok, "heldout", args.eval_tokens, args.seq_len).split(1))
                    if args.eval_tokens else [])
    scorer = Scorer(eval_windows, device)
    quality = {}

    print(f"loading {args.model} ({cls.__name__}, {args.dtype}, {device})")
    model = cls.from_pretrained(args.model, dtype=dtype, device=device).eval()
    if eval_windows:
        quality["BF16"] = scorer.score(model, "eval BF16")

    # -- ModelOpt: calibrate --------------------------------------------------------------------------------------
    qcfg = experts_only_config(mtq, args.weight_only)
    if args.weight_only:
        calib, forward_loop = [], None
        print("calibration: weight-only (W4A16): the weights alone, no text"
              + (" (--calib-file not read)" if args.calib_file else ""))
    else:
        calib = calibration_windows(tok, args)
        n_tok = sum(w.numel() for w in calib)
        src = args.calib_file or f"the tiny-coder corpus ('train' split of {T.stdlib_dir()})"
        print(f"calibration: {n_tok} tokens of {src}, {len(calib)} window(s) of <= {args.seq_len}")

        def forward_loop(m):
            with torch.no_grad():
                for w in progress(calib, len(calib), "calibrating"):
                    m(w.to(device), use_cache=False)

    log = io.StringIO()
    t0 = time.time()
    with contextlib.redirect_stdout(log):  # modelopt prints every quantizer it inserts
        model = mtq.quantize(model, qcfg, forward_loop)
    if args.verbose:
        print(log.getvalue())
    scales = mx.experts_scales(model)
    if not scales["weight_scales_2"]:
        raise RecipeError(f"--model {args.model}: ModelOpt found no routed experts to quantize")
    n_q = len(scales["weight_scales_2"])
    msg = f"modelopt: {n_q} routed-experts module(s) calibrated in {time.time() - t0:.1f} s"
    if not args.weight_only:
        a = [(v["gate_up"], v["down"]) for v in scales["input_amax"].values()]
        msg += (f"; GEMM input amax gate_up {min(x for x, _ in a):.3g}..{max(x for x, _ in a):.3g}, "
                f"down {min(y for _, y in a):.3g}..{max(y for _, y in a):.3g}")
    print(msg)

    if args.modelopt_eval:
        if device.type != "cuda":
            print("--modelopt-eval: skipped: ModelOpt's NVFP4 fake-quant forward needs CUDA (its dynamic block "
                  "quantizer asserts a CUDA tensor); this run is on the CPU")
        elif eval_windows:
            quality["modelopt fake-quant"] = scorer.score(model, "eval modelopt")
    del model
    release()

    # -- our writer -------------------------------------------------------------------------------------------------
    producer = {"name": "qwen4exp recipes/quantize_nvfp4.py", "version": "1",
                "calibration": f"nvidia-modelopt {_modelopt_version()} NVFP4_EXPERTS_ONLY_CFG"
                               + (" (weight-only)" if args.weight_only else "")}
    qc = quantize_checkpoint(args.model, args.out, weight_only=args.weight_only, mtp_experts=args.mtp_experts,
                             ple_table=args.ple_table,
                             input_scales=None if args.weight_only else scales["input_scales"],
                             weight_scales_2=scales["weight_scales_2"], producer=producer)
    print(f"wrote {args.out}: quant_algo {qc['quant_algo']}"
          + (f" ({', '.join(sorted({v['quant_algo'] for v in qc['quantized_layers'].values()}))})"
             if "quantized_layers" in qc else ""))

    # -- quality ----------------------------------------------------------------------------------------------------
    if eval_windows:
        m = cls.from_pretrained(args.out, dtype=dtype, device=device).eval()
        quality["NVFP4 weight-only"] = scorer.score(m, "eval NVFP4 weight-only")
        del m
        release()
        if not args.weight_only:
            m = cls.from_pretrained(args.out, dtype=dtype, device=device, emulate_w4a4=True).eval()
            quality["NVFP4 W4A4"] = scorer.score(m, "eval NVFP4 W4A4")
            del m
            release()
        print_quality(quality, eval_windows, args)
    summary = {
        "model": os.path.basename(os.path.normpath(args.model)),
        "quant_algo": qc["quant_algo"],
        "weight_only": args.weight_only,
        "calibration": {"source": "weights only" if args.weight_only else
                        (os.path.basename(args.calib_file) if args.calib_file else "tiny-coder corpus, train split"),
                        "tokens": sum(w.numel() for w in calib), "seq_len": args.seq_len,
                        "modelopt": _modelopt_version(), "config": "NVFP4_EXPERTS_ONLY_CFG"},
        "eval": {"source": "tiny-coder corpus, heldout split", "tokens": sum(w.numel() for w in eval_windows),
                 "windows": len(eval_windows), "seq_len": args.seq_len},
        "quality": {k: {**v, "delta_ce": v["ce"] - quality["BF16"]["ce"]} for k, v in quality.items()},
        "seconds": round(time.time() - t_start, 1),
    }
    with open(os.path.join(args.out, "quality.json"), "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(model_card(args, cfg, qc, summary, scales))
    print(f"model card: {os.path.join(args.out, 'README.md')}")
    summary["scales"] = scales
    return summary


def model_card(args, cfg: dict, qc: dict, summary: dict, scales: dict) -> str:
    """``OUT/README.md``: what the checkpoint is (base, formats, calibration, tools, date), its quality, how to use
    it. Replaces the base checkpoint's card, which ``quantize_checkpoint`` copied with the other files."""
    import qwen4exp

    name = os.path.basename(os.path.normpath(args.out))
    base = os.path.abspath(args.model)
    algo = "W4A16_NVFP4" if args.weight_only else "NVFP4"
    layers = qc.get("quantized_layers")
    if layers is None:  # (the plain form: routed experts only)
        layers = {b: {"quant_algo": algo} for b in scales["weight_scales_2"]}
    nvfp4 = sorted(b for b, v in layers.items() if v["quant_algo"] == algo)
    fp8_block = sorted(b for b, v in layers.items() if v["quant_algo"] == "FP8_PB_WO")
    ple = sorted(b for b, v in layers.items() if v["quant_algo"] == "FP8")
    arch = ", ".join(cfg.get("architectures") or ["?"])
    cal = summary["calibration"]
    acts = ("weight-only (W4A16: activations stay BF16, no `input_scale`)" if args.weight_only else
            f"W4A4: a static per-GEMM `input_scale` from ModelOpt's max calibration on {cal['tokens']:,} tokens of "
            f"{cal['source']} (windows of {cal['seq_len']})")
    has_mtp = bool((cfg.get("text_config") or cfg).get("mtp_num_hidden_layers"))
    mtp = ("none (no MTP head)" if not has_mtp else
           f"FP8 in 128x128 blocks (`weight_scale_inv`): {', '.join(f'`{b}`' for b in fp8_block)}" if fp8_block else
           "BF16 (`--mtp-experts bf16`)" if args.mtp_experts == "bf16" else
           "BF16 (block FP8 needs both expert dims to be multiples of 128)")
    lines = [
        f"# {name}",
        "",
        f"An NVFP4 checkpoint of the BF16 Qwen4Exp checkpoint `{base}` ({arch}), made on "
        f"{time.strftime('%Y-%m-%d', time.gmtime())} (UTC) by `recipes/quantize_nvfp4.py` of qwen4exp "
        f"{qwen4exp.__version__} with NVIDIA Model Optimizer (nvidia-modelopt {cal['modelopt']}, "
        f"`{cal['config']}`" + (", weight-only" if args.weight_only else "") + ").",
        "",
        "## What is quantized",
        f"- `config.json` `quantization_config`: `quant_method` modelopt, `quant_algo` {qc['quant_algo']}.",
        f"- Routed experts ({len(nvfp4)} module(s), `{nvfp4[0] if nvfp4 else '-'}` ...): {algo}, E2M1 weights in "
        f"groups of 16 with an E4M3 scale per group (`weight_scale`) and an FP32 global scale per expert and GEMM "
        f"(`weight_scale_2`); {acts}.",
        f"- MTP head's experts: {mtp}.",
        "- PLE n-gram table: " + (f"FP8 (E4M3) per tensor (`weight_scale`): {', '.join(f'`{b}`' for b in ple)}."
                                  if ple else "BF16" + (" (`--ple-table bf16`)." if args.ple_table == "bf16" else ".")),
        "- Everything else BF16: attention (QSA) and its indexer, Gated DeltaNet, shared experts and their gates, "
        "routers, embeddings and `lm_head`, hyper-connections, the PLE projections, norms"
        + (", the vision tower" if "vision_config" in cfg else "") + ".",
        "",
    ]
    q = summary["quality"]
    if q:
        ev = summary["eval"]
        lines += [f"## Quality (held-out text: {ev['tokens']:,} tokens of {ev['source']})",
                  "| | perplexity | top-1 vs BF16 |", "| --- | --- | --- |"]
        lines += [f"| {ROW_NAMES.get(k, k)} | {v['perplexity']:.3f} | {v['top1_vs_bf16']:.3f} |" for k, v in q.items()]
        lines += ["", "(`quality.json` holds these figures with the run's settings.)", ""]
    lines += [
        "## Use",
        "vLLM reads the quantization from the checkpoint (no flag): on GPUs (Hopper: weight-only FP4 MoE kernels; "
        "Blackwell: native W4A4) with the qwen4exp plugin installed,",
        "```bash",
        f"vllm serve {os.path.abspath(args.out)} --served-model-name {name}",
        "```",
        "on CPU (the experts are dequantized to BF16 at load) `qwen4exp-serve` with the same arguments. HF "
        "transformers: `qwen4exp.Qwen4ExpForCausalLM.from_pretrained(path)` (`Qwen4ExpForConditionalGeneration` for "
        "a composite checkpoint; `emulate_w4a4=True` runs the expert inputs as Blackwell does).",
        "",
        "## Made with",
        "```bash",
        "python recipes/quantize_nvfp4.py " + " ".join(_argv(args)),
        "```",
        f"The base checkpoint's own card: `{os.path.join(base, 'README.md')}`." if
        os.path.isfile(os.path.join(base, "README.md")) else "",
    ]
    return "\n".join(lines).rstrip() + "\n"


def _argv(args) -> list[str]:
    """The recipe's options as given (those that differ from the defaults), for the card."""
    defaults = vars(parser().parse_args(["--model", args.model]))
    out = ["--model", args.model, "--out", args.out]
    for k, v in vars(args).items():
        if k in ("model", "out", "device", "verbose") or v == defaults.get(k):
            continue
        flag = "--" + k.replace("_", "-")
        out += [flag] if v is True else [flag, str(v)]
    return out


def _modelopt_version() -> str:
    try:
        from importlib.metadata import version

        return version("nvidia-modelopt")
    except Exception:  # pragma: no cover
        return "?"


ROW_NAMES = {"BF16": "BF16", "NVFP4 weight-only": "NVFP4 weight-only (Hopper)", "NVFP4 W4A4": "NVFP4 W4A4 (Blackwell)",
             "modelopt fake-quant": "ModelOpt fake-quant (CUDA)"}


def print_quality(quality: dict, windows, args) -> None:
    n = sum(w.numel() for w in windows)
    base = quality["BF16"]["ce"]
    print(f"\nquality on {n:,} held-out tokens ({len(windows)} x {args.seq_len}, the corpus' 'heldout' split; "
          f"{quality['BF16']['tokens']:,} teacher-forced predictions):")
    print(f"  {'':28s} {'perplexity':>10s} {'CE':>8s} {'dCE':>8s} {'top-1 vs BF16':>14s}")
    for k, v in quality.items():
        print(f"  {ROW_NAMES.get(k, k):28s} {v['perplexity']:10.3f} {v['ce']:8.4f} {v['ce'] - base:+8.4f} "
              f"{v['top1_vs_bf16']:14.3f}")
    print(f"  (written to {os.path.join(args.out, 'quality.json')})")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the BF16 checkpoint directory")
    ap.add_argument("--out", help="the NVFP4 checkpoint directory to write (default: checkpoints/<model>-nvfp4 in "
                                  "$QWEN4EXP_CACHE_DIR, else ~/.cache/qwen4exp)")
    ap.add_argument("--calib-file", help="a UTF-8 text file to calibrate on (default: the tiny-coder corpus)")
    ap.add_argument("--calib-tokens", type=int, default=4096, help="calibration tokens (default 4096)")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens a calibration / evaluation window (128)")
    ap.add_argument("--weight-only", action="store_true", help="W4A16: no input_scale, no activation calibration")
    ap.add_argument("--mtp-experts", choices=("fp8_block", "bf16"), default="fp8_block")
    ap.add_argument("--ple-table", choices=("fp8", "bf16"), default="fp8")
    ap.add_argument("--eval-tokens", type=int, default=1024, help="held-out tokens to score (default 1024; 0: skip)")
    ap.add_argument("--modelopt-eval", action="store_true",
                    help="also score ModelOpt's own fake-quant model (needs CUDA)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--verbose", action="store_true", help="show ModelOpt's own conversion output")
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    try:
        run(args)
    except RecipeError as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
