"""Train the tiny Qwen4Exp checkpoint that ships in ``qwen4exp/assets/tiny-coder`` (seeded, nothing downloaded).

    python recipes/train_tiny.py [--out qwen4exp/assets/tiny-coder] [--threads 2] [--device cpu|cuda]

Defaults: 1,500 steps of 8 x 256 tokens (3.1 M tokens, about one pass over the corpus), AdamW lr 3e-3 (40 warm-up
steps, cosine to 10 %), seed 0. Time: about 1 s a step on 2 idle CPU threads (~26 min in all), 0.22 s a step on one
GPU (~6 min; the shipped checkpoint was made so, with ``--device cuda``). On a GPU the model trains through the
torch reference ops (``QWEN4EXP_OPS=reference``). CPU and GPU runs differ in floating-point detail, not in recipe.
The corpus is the running Python's standard library, so another Python version trains on somewhat different text.

Data: the Python standard library's own ``.py`` files (``recipes/tokenizer_tiny.py`` picks them and holds out ~4 %
of the files), as plain source documents plus ChatML conversations made from its documented functions
("Write a Python function `name(args)`: <first docstring line>" -> the function's source), documents separated by
``<|endoftext|>``. The tokenizer is a byte-level BPE trained on the training files.

Model: every mechanism active -- GDN and QSA layers (QSA budget 64 tokens, compress ratio 4: block selection runs
from position 67 on, inside every training window), 4 hyper-connection streams, one PLE layer (on a GDN layer), MoE
with a shared expert, and one MTP layer trained jointly: loss = CE(next token) + ``--mtp-weight`` * CE(token after
next) where the MTP head pairs the target's pre-mixer state at q with the token at q+1 (``mtp_logits``).

Report: held-out cross-entropy (nats/token) of the model (fp32 and the saved bf16) against a unigram baseline (the
train-set unigram distribution, add-one smoothed, scored on the same held-out tokens), the MTP head's top-1
agreement with the main head on held-out text, greedy speculative decoding (``generate(use_mtp=True)``) mean
acceptance length on held-out prompts (and that its output equals plain greedy), and the wall time. The summary is
written to ``train_stats.json`` beside the weights (the tests read the unigram counts from it).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import platform
import sys
import textwrap
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

import tokenizer_tiny as T  # noqa: E402

DEFAULT_OUT = os.path.join(HERE, "..", "qwen4exp", "assets", "tiny-coder")


def model_config(vocab_size: int, eos_id: int, pad_id: int):
    """The tiny-coder config: 4 layers [GDN, QSA, GDN, QSA] + 1 MTP (QSA) layer, hidden 192, ~3.8 M parameters."""
    from qwen4exp import presets

    return presets.tiny_text(
        vocab_size=vocab_size, hidden_size=192, num_hidden_layers=4, full_attention_every=2,
        head_dim=64, linear_head_dim=64,  # attention heads 4 x 64 (2 KV heads); GDN 2 key / 4 value heads of 64
        hc_count=4, hc_lowrank=16,
        ple_layer_ids=(1,), ple_embed_dim=32, ngram_vocab_size_base=4000, heads_per_ngram=2, split_ngram_parts=4,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=96,
        indexer_budget=64, indexer_compress_ratio=4,  # indexer_n_heads 4, head dim 32 (preset)
        mtp_num_hidden_layers=1,
        eos_token_id=eos_id, bos_token_id=None, pad_token_id=pad_id, max_position_embeddings=4096,
        tie_word_embeddings=False, dtype="bfloat16",
    )


# ----------------------------------------------------------------------------------------------------------------
# data
def chat_examples(src: str, max_chars: int = 1500) -> list[str]:
    """ChatML conversations from the documented functions of one source file."""
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return []
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        seg = ast.get_source_segment(src, node)
        if not doc or not seg or len(seg) > max_chars:
            continue
        first = doc.strip().splitlines()[0].strip()
        if len(first) < 8:
            continue
        code = textwrap.dedent(" " * node.col_offset + seg)
        args = ast.unparse(node.args)
        if args.startswith("self, ") or args == "self":
            args = args[len("self"):].lstrip(", ")
        user = f"Write a Python function `{node.name}({args})`: {first}"
        out.append(f"{T.IM_START}user\n{user}{T.IM_END}\n{T.IM_START}assistant\n{code}{T.IM_END}\n")
    return out


def token_stream(tok, files: list[str], with_chat: bool = True) -> tuple[torch.Tensor, int, int]:
    """All documents of ``files`` (sources, then the chat conversations), each followed by <|endoftext|>.
    -> (ids [N], source documents, chat documents)."""
    eot = tok.token_to_id(T.ENDOFTEXT)
    docs = [t for t in (T.read_file(r) for r in files) if t]
    chats = [c for d in docs for c in chat_examples(d)] if with_chat else []
    ids: list[int] = []
    for enc in tok.encode_batch(docs + chats):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long), len(docs), len(chats)


# ----------------------------------------------------------------------------------------------------------------
# evaluation
def unigram_logprobs(counts: torch.Tensor) -> torch.Tensor:
    c = counts.double() + 1.0  # add-one smoothing
    return (c / c.sum()).log()


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, uni_lp: torch.Tensor, batch: int = 8) -> dict:
    """Held-out next-token CE, MTP (token after next) CE, and MTP/main top-1 agreement, over ``windows`` [N, S]."""
    model.eval()
    ce = ce_mtp = agree = n = n_mtp = 0.0
    for i in range(0, windows.shape[0], batch):
        ids = windows[i: i + batch]
        out = model(ids, use_cache=False, return_mtp_hidden=True)
        lg = out.logits.float()
        ce += F.cross_entropy(lg[:, :-1].reshape(-1, lg.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum").item()
        n += ids[:, 1:].numel()
        ml = model.mtp_logits(out["mtp_hidden"].float(), ids).float()[:, :-1]  # entry q predicts q+2
        ce_mtp += F.cross_entropy(ml.reshape(-1, ml.shape[-1]), ids[:, 2:].reshape(-1), reduction="sum").item()
        agree += (ml.argmax(-1) == lg[:, 1:-1].argmax(-1)).sum().item()  # main head at q+1 also predicts q+2
        n_mtp += ids[:, 2:].numel()
    targets = windows[:, 1:].reshape(-1)
    uni = -uni_lp[targets].mean().item()
    return {"heldout_ce": ce / n, "heldout_mtp_ce": ce_mtp / n_mtp, "mtp_top1_agreement": agree / n_mtp,
            "unigram_ce": uni, "heldout_tokens": int(n)}


@torch.no_grad()
def mtp_acceptance(model, prompts: list[torch.Tensor], max_new_tokens: int = 48, k: int = 3) -> dict:
    """generate(use_mtp=True) vs plain greedy on each prompt: equality and mean acceptance length."""
    model.eval()
    steps = accepted = 0
    equal = True
    for p in prompts:
        ids = p.unsqueeze(0)
        ref = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        out = model.generate(ids, max_new_tokens=max_new_tokens, use_mtp=True, num_speculative_tokens=k,
                             eos_token_id=None)
        equal &= torch.equal(out, ref)
        st = model.last_mtp_stats
        steps += st["verify_steps"]
        accepted += st["accepted_drafts"]
    return {"mtp_equals_greedy": bool(equal), "mean_acceptance_length": 1 + accepted / max(steps, 1),
            "num_speculative_tokens": k, "prompts": len(prompts), "max_new_tokens": max_new_tokens}


EXAMPLE_PROMPTS = [  # each ends mid-line: a prompt ending in a newline splits the usual "\n + indent" token
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if',
    'try:\n    import json\nexcept',
    'class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def __repr__(self):\n'
    '        return',
    'import os\n\n\ndef list_python_files(path):\n    """Return the names of the .py files in path."""\n    return [',
]
EXAMPLE_CHAT = "Write a Python function `is_prime(n)`: Return True if n is a prime number."


@torch.no_grad()
def examples(model, tok, max_new_tokens: int = 60) -> list[tuple[str, str]]:
    model.eval()
    outs = []
    eos = [tok.token_to_id(T.IM_END), tok.token_to_id(T.ENDOFTEXT)]
    chat = f"{T.IM_START}user\n{EXAMPLE_CHAT}{T.IM_END}\n{T.IM_START}assistant\n"
    for text in EXAMPLE_PROMPTS + [chat]:
        ids = torch.tensor([tok.encode(text).ids])
        g = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0)
        outs.append((text, tok.decode(g[0, ids.shape[1]:].tolist(), skip_special_tokens=False)))
    return outs


# ----------------------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--eval-windows", type=int, default=48)
    ap.add_argument("--stdlib", default=None, help="a copy of a standard library to read instead of this Python's")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)

    from tqdm import tqdm

    from qwen4exp import Qwen4ExpForCausalLM

    t_start = time.perf_counter()
    T.set_stdlib_dir(a.stdlib)
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    if dev.type == "cuda":  # train through the differentiable torch references, not the inference kernels
        os.environ.setdefault("QWEN4EXP_OPS", "reference")
    out_dir = os.path.abspath(a.out)

    # tokenizer + data --------------------------------------------------------------------------------------------
    tok = T.train_tokenizer(a.vocab_size)
    specials = T.save_tokenizer(tok, out_dir)
    train_files, held_files = T.corpus_files("train"), T.corpus_files("heldout")
    train, n_doc, n_chat = token_stream(tok, train_files)
    held, h_doc, h_chat = token_stream(tok, held_files)
    V = -(-tok.get_vocab_size() // 64) * 64
    print(f"tokenizer: {tok.get_vocab_size()} tokens (model vocab {V}); train: {len(train_files)} files, "
          f"{n_doc} sources + {n_chat} chats = {train.numel():,} tokens; held-out: {len(held_files)} files, "
          f"{h_doc} sources + {h_chat} chats = {held.numel():,} tokens")
    uni_counts = torch.bincount(train, minlength=V)
    uni_lp = unigram_logprobs(uni_counts)
    S = a.seq
    starts = torch.linspace(0, held.numel() - S - 1, a.eval_windows).long()
    windows = torch.stack([held[s: s + S] for s in starts.tolist()])

    # model -------------------------------------------------------------------------------------------------------
    cfg = model_config(V, specials[T.IM_END], specials[T.ENDOFTEXT])
    torch.manual_seed(a.seed)
    model = Qwen4ExpForCausalLM(cfg).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters ({n_params * 2 / 1e6:.2f} MB in bf16); layers {cfg.layer_types} "
          f"+ {cfg.mtp_num_hidden_layers} MTP; QSA budget {cfg.indexer_budget} (r={cfg.indexer_compress_ratio})")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=a.lr, betas=(0.9, 0.95))

    def lr_at(step):
        if step < a.warmup:
            return a.lr * (step + 1) / a.warmup
        t = (step - a.warmup) / max(1, a.steps - a.warmup)
        return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    gen = torch.Generator().manual_seed(a.seed)
    t_train = time.perf_counter()
    bar = tqdm(range(a.steps), desc="train", disable=a.no_progress, dynamic_ncols=True)
    ema = None
    for step in bar:
        model.train()
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        offs = torch.randint(0, train.numel() - S - 1, (a.batch,), generator=gen)
        ids = torch.stack([train[o: o + S] for o in offs.tolist()]).to(dev)
        out = model(ids, use_cache=False, return_mtp_hidden=True)
        lg = out.logits.float()
        loss_main = F.cross_entropy(lg[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
        ml = model.mtp_logits(out["mtp_hidden"], ids).float()[:, :-1]
        loss_mtp = F.cross_entropy(ml.reshape(-1, V), ids[:, 2:].reshape(-1))
        loss = loss_main + a.mtp_weight * loss_mtp
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        cur = (loss_main.item(), loss_mtp.item())
        ema = cur if ema is None else tuple(0.95 * e + 0.05 * c for e, c in zip(ema, cur))
        bar.set_postfix(ce=f"{ema[0]:.3f}", mtp=f"{ema[1]:.3f}", lr=f"{lr_at(step):.1e}",
                        tok_s=f"{(step + 1) * a.batch * S / (time.perf_counter() - t_train):.0f}")
        if a.no_progress and (step % 50 == 0 or step == a.steps - 1):
            print(f"step {step}: ce {ema[0]:.3f} mtp {ema[1]:.3f} ({time.perf_counter() - t_train:.0f} s)", flush=True)
    train_s = time.perf_counter() - t_train
    model = model.cpu()

    # evaluation, save (bf16), reload, evaluate the saved checkpoint ----------------------------------------------
    ev32 = evaluate(model, windows, uni_lp)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    T.save_tokenizer(tok, out_dir)  # generation_config.json etc. (after the model's config.json)
    loaded = Qwen4ExpForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    ev = evaluate(loaded, windows, uni_lp)
    prompts = [held[s: s + 64] for s in torch.linspace(0, held.numel() - 200, 4).long().tolist()]
    acc = mtp_acceptance(loaded, prompts)
    ex = examples(loaded, tok)
    wall = time.perf_counter() - t_start
    size = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))

    stats = {
        "recipe": "recipes/train_tiny.py", "args": {k: v for k, v in vars(a).items() if k not in ("out", "stdlib")},
        "corpus": f"standard library of {os.path.basename(os.path.normpath(T.stdlib_dir()))}",
        "python": platform.python_version(), "torch": torch.__version__,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "parameters": n_params, "train_tokens_seen": a.steps * a.batch * S, "train_stream_tokens": train.numel(),
        "train_files": len(train_files), "heldout_files": len(held_files),
        "train_seconds": round(train_s, 1), "wall_seconds": round(wall, 1),
        "heldout_fp32": {k: round(v, 4) if isinstance(v, float) else v for k, v in ev32.items()},
        "heldout_bf16_checkpoint": {k: round(v, 4) if isinstance(v, float) else v for k, v in ev.items()},
        "mtp_speculative": {k: round(v, 3) if isinstance(v, float) else v for k, v in acc.items()},
        "unigram_counts": uni_counts.tolist(),
    }
    with open(os.path.join(out_dir, "train_stats.json"), "w") as f:
        json.dump(stats, f)
        f.write("\n")

    print(f"\ntrained {a.steps} steps x {a.batch} x {S} tokens in {train_s:.0f} s (wall {wall:.0f} s)")
    print(f"held-out CE (nats/token): model {ev['heldout_ce']:.3f} (fp32 before saving {ev32['heldout_ce']:.3f}) "
          f"vs unigram {ev['unigram_ce']:.3f}  [{ev['heldout_tokens']} tokens]")
    print(f"MTP head: held-out CE (token after next) {ev['heldout_mtp_ce']:.3f}; top-1 agreement with the main "
          f"head {ev['mtp_top1_agreement']:.1%}")
    print(f"generate(use_mtp=True, k={acc['num_speculative_tokens']}): mean acceptance length "
          f"{acc['mean_acceptance_length']:.2f} over {acc['prompts']} held-out prompts; equals plain greedy: "
          f"{acc['mtp_equals_greedy']}")
    print(f"checkpoint: {out_dir} ({size / 1e6:.2f} MB)")
    for prompt, completion in ex:
        print("-" * 60 + f"\n{prompt}\033[1m{completion}\033[0m")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
