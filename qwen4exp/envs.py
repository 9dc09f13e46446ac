"""Every environment switch the package reads, declared once: name, type, default, one-line doc.

Read a switch as ``envs.QWEN4EXP_OPS`` (any name declared below). Each is parsed on first read and kept for the
process (vLLM's workers are fresh processes and read their own); ``envs.reset()`` forgets the parsed values, for
tests that change the environment. A value outside a switch's choices is an error naming the variable.

    python -m qwen4exp.envs        # the table of switches, their defaults and current values
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class Switch:
    name: str
    kind: str  # "bool", "choice", "float", "int" or "path"
    default: Any
    doc: str
    choices: tuple[str, ...] = ()

    def parse(self, raw: Optional[str]) -> Any:
        if raw is None or raw.strip() == "":
            return self.default
        v = raw.strip()
        if self.kind == "bool":
            if v.lower() in _TRUE:
                return True
            if v.lower() in _FALSE:
                return False
            raise ValueError(f"{self.name} must be 0 or 1 (or true/false), got {raw!r}")
        if self.kind == "choice":
            if v.lower() not in self.choices:
                raise ValueError(f"{self.name} must be one of {', '.join(self.choices)}; got {raw!r}")
            return v.lower()
        if self.kind == "float":
            try:
                x = float(v)
            except ValueError:
                raise ValueError(f"{self.name} must be a number, got {raw!r}") from None
            if x < 0:
                raise ValueError(f"{self.name} must be >= 0, got {raw!r}")
            return x
        if self.kind == "int":
            try:
                i = int(v)
            except ValueError:
                raise ValueError(f"{self.name} must be an integer, got {raw!r}") from None
            if i < 0:
                raise ValueError(f"{self.name} must be >= 0, got {raw!r}")
            return i
        return v  # path


SWITCHES: dict[str, Switch] = {s.name: s for s in (
    Switch("QWEN4EXP_VLLM", "bool", True,
           "serve Qwen4Exp with this plugin's model (1) or leave it to vLLM's in-tree qwen4_exp (0)"),
    Switch("QWEN4EXP_OPS", "choice", "auto",
           "auto: each op's fast kernel where registered for the device (Triton on CUDA), its torch reference "
           "elsewhere; reference: the torch references everywhere", ("auto", "reference")),
    Switch("QWEN4EXP_VLLM_GDN", "choice", "auto",
           "vLLM plugin's Gated DeltaNet: auto (vLLM's GDN layer on GPUs for 128-wide heads, ours otherwise), "
           "ours (qwen4exp.layers.gdn, the HF reference's numerics) or vllm (vLLM's GDN layer and kernels)",
           ("auto", "ours", "vllm")),
    Switch("QWEN4EXP_PLE_TABLE", "choice", "host",
           "vLLM plugin on GPUs: the PLE n-gram table in pinned host memory, rows gathered over UVA (host: the real "
           "51B-parameter table fits no GPU) or in GPU memory (gpu: fastest when it fits)", ("host", "gpu")),
    Switch("QWEN4EXP_PLE_PREFETCH", "bool", False,
           "vLLM plugin on GPUs: the PLE layer's table gather and key/value projections start on a side CUDA "
           "stream at the top of the forward, overlapping the layers before it"),
    Switch("QWEN4EXP_PLE_VERIFY", "choice", "batched",
           "vLLM plugin, MTP verification of the PLE layer's states (n-gram context, conv): batched (every position "
           "of every request in one call of the one-token kernels) or stepped (one position at a time, each with "
           "its own state gathers and writes: the former way, for A/B runs)", ("batched", "stepped")),
    Switch("QWEN4EXP_MTP_DRAFT_HEAD", "choice", "bf16",
           "vLLM plugin, MTP drafts' LM head on GPUs with FP8 (compute capability 8.9+): bf16 (the shared head) or "
           "fp8 (a per-row FP8 copy of it, built at the first draft step: half the bytes each draft step reads, "
           "~0.6 GiB more memory at the real vocabulary; drafts only, the target's logits stay bf16, so output is "
           "unchanged and only the drafts' near-ties may differ)", ("bf16", "fp8")),
    Switch("QWEN4EXP_MTP_DRAFT_VOCAB", "int", 0,
           "vLLM plugin, MTP drafts score only this many of the most frequent tokens (plus the tokenizer's special "
           "and added ones) instead of the whole vocabulary, e.g. 32768: each draft step reads that many rows of the "
           "LM head; the target scores every token, so output is unchanged, only acceptance may change; 0: all "
           "(qwen4exp.vllm.draft_vocab)"),
    Switch("QWEN4EXP_MTP_DRAFT_VOCAB_FILE", "path", "",
           "vLLM plugin, the token ranking QWEN4EXP_MTP_DRAFT_VOCAB takes its tokens from: a JSON list of token ids "
           "most frequent first (tools/draft_vocab.py writes one from a corpus); empty: the lowest ids (byte-level "
           "BPE numbers tokens in merge order, frequent first)"),
    Switch("QWEN4EXP_HC_DECODE", "choice", "fused",
           "HC mixer on CUDA at decode sizes: fused (two Triton launches chained by programmatic dependent launch; "
           "at one token each program of the second finishes the down projection itself, from 2 tokens a small "
           "finish kernel between them does), fused-ticket (an open A/B at one token: the same two launches at "
           "every token count, the last program of the first to finish a row block summing its split-K partials) "
           "or cublas (the many-token path: cuBLAS projections around the norm, activation and gated-mean kernels, "
           "as upstream's; slower at every decode size on an H100)", ("fused", "fused-ticket", "cublas")),
    Switch("QWEN4EXP_MOE_DECODE", "bool", False,
           "the MoE decode kernels (qwen4exp.ops.moe_decode: router GEMV + top-k in one launch, NVFP4 W4A16 expert "
           "GEMVs) on CUDA for <= 4 tokens; 0: that op's torch reference. Not wired into the vLLM model yet, so it "
           "only affects direct calls of the op (tests, benchmarks/bench_ops.py)"),
    Switch("QWEN4EXP_QSA_PREFILL_SELECT", "choice", "vllm",
           "QSA prefill chunks past the budget on CUDA: vllm (vLLM's cooperative / persistent top-k on fp32 scores, "
           "as upstream's prefill, where vLLM has loaded them and the budget is one of its k values; else ours) or "
           "triton (our select on int64 sort keys; the decode's tie order, lower block id first)",
           ("triton", "vllm")),
    Switch("QWEN4EXP_QSA_HOST_LENGTHS", "choice", "vllm",
           "vLLM plugin on GPUs: where an eager QSA step (prefill, mixed) takes its requests' lengths: vllm (the host "
           "copies vLLM's metadata carries, where they are exact; no device read), device (read back from the GPU "
           "each step: a sync, the former way) or check (both, and a mismatch fails the step: for GPU tests)",
           ("vllm", "device", "check")),
    Switch("QWEN4EXP_QSA_WARMUP", "bool", True,
           "vLLM plugin on GPUs: compile every QSA kernel variant of prefills and eager decode rows at start-up "
           "(after the KV caches are allocated), so no request waits on a Triton compile; 0: compile on first use"),
    Switch("QWEN4EXP_SESSION_TTL", "float", 10.0,
           "AgentScheduler (--scheduler-cls qwen4exp.serving.scheduler.AgentScheduler): seconds a session's finished "
           "turn keeps its KV blocks pinned for the next turn (0: no pins; agent traces: ~86% of next turns within "
           "1 s, ~95% within 10 s)"),
    Switch("QWEN4EXP_CONTINUATION_CHUNK", "int", 2048,
           "AgentScheduler: in a step where a session's next turn waits for its held blocks, no prefill takes more "
           "than this many tokens (rounded down to whole hybrid blocks, at least one; never less than the waiting "
           "turn's own new tokens), so the next turn does not queue behind a long first-turn prefill; 0: off"),
    Switch("QWEN4EXP_PAUSE_CHUNK", "int", 4096,
           "AgentScheduler: while a session is in a tool pause (its finished turn's blocks held for its next turn), "
           "no step schedules more than this many prefill tokens (rounded down to whole hybrid blocks, at least one; "
           "decode tokens come on top), so a next turn that arrives mid-step waits for a short step, not a whole "
           "--max-num-batched-tokens one; first turns then prefill in more, shorter steps; 0: off"),
    Switch("QWEN4EXP_TOKENIZE_CACHE_TOKENS", "int", 4_000_000,
           "vLLM plugin, API server of a Qwen4Exp model: token ids of prompt pieces (the text between added tokens "
           "such as <|im_end|>) kept in an LRU cache, so a resent conversation is tokenized only where it is new "
           "(exact: off for a tokenizer that fails its self-check); 0: off"),
    Switch("QWEN4EXP_IDLE_TRIM", "float", 0.5,
           "vLLM plugin on CPU: seconds without a model forward after which the worker hands its freed heap memory "
           "back to the OS (glibc malloc_trim; without it RSS grows with served requests); 0: never"),
    Switch("QWEN4EXP_FAULT_INJECT", "int", None,
           "tests only: a token id; the vLLM plugin's model forward raises (RuntimeError naming it) in every step "
           "whose input holds that token, to test how the server handles an engine fault; unset: off"),
    Switch("QWEN4EXP_CACHE_DIR", "path", "",
           "qwen4exp-serve's cache folder (vLLM and inductor caches), and recipes/quantize_nvfp4.py's default output "
           "(checkpoints/<model>-nvfp4); default $XDG_CACHE_HOME/qwen4exp or ~/.cache/qwen4exp"),
)}

# Read by the tests, tools, benchmarks and the Makefile (not by the package, so not through ``get``): declared here
# so that every QWEN4EXP_* name has one place that says what it does (``tests/test_envs.py`` checks both tables).
DEV_SWITCHES: dict[str, Switch] = {s.name: s for s in (
    Switch("QWEN4EXP_BENCH_BASE_URL", "path", "",
           "tests/test_bench.py: also run the benchmark's tests against this OpenAI server (an `external` case)"),
    Switch("QWEN4EXP_BENCH_MODEL", "path", "", "tests/test_bench.py: the model name of QWEN4EXP_BENCH_BASE_URL"),
    Switch("QWEN4EXP_BENCH_TOKENIZER", "path", "",
           "tests/test_bench.py: the tokenizer for QWEN4EXP_BENCH_BASE_URL's model (default: its name)"),
    Switch("QWEN4EXP_BENCH_DIR", "path", "", "benchmarks/bench_vllm_cpu.py: where its work folders go (default: "
           "the system's temporary folder)"),
    Switch("QWEN4EXP_CHECK_EAGER", "bool", False, "tools/vllm_gpu_check.py: run the engines eagerly (no CUDA graphs)"),
    Switch("QWEN4EXP_CHECK_TIMEOUT", "float", 300.0, "tools/vllm_gpu_check.py: seconds per engine run"),
    Switch("QWEN4EXP_FAILURE_LOG", "path", "", "tests/conftest.py: append each failed test's report to this file as "
           "it fails (the GPU suite sets it: tools/gpu_device.sh)"),
    Switch("QWEN4EXP_INTERPRETER_TIMEOUT", "float", 2400.0,
           "tests/ops: seconds for the Triton checks under the CPU interpreter (one subprocess a session)"),
    Switch("QWEN4EXP_PYSPY", "path", "", "benchmarks/bench_vllm_gpu.py (set by --py-spy): the py-spy executable "
           "that records each timed window"),
    Switch("QWEN4EXP_PYSPY_OUT", "path", "", "benchmarks/bench_vllm_gpu.py: the py-spy tables' path prefix"),
    Switch("QWEN4EXP_PYSPY_RATE", "int", 1000, "benchmarks/bench_vllm_gpu.py: py-spy samples a second"),
    Switch("QWEN4EXP_REQUIRE_MODELOPT", "bool", False, "tests/quant: fail (not skip) without nvidia-modelopt "
           "(`make test` sets it: its set-up installs modelopt)"),
    Switch("QWEN4EXP_TEST_GPU_SHARE", "bool", False, "GPU tests: each engine takes a small share of the GPU and a "
           "fixed KV cache, so the suite's parts run at once on one GPU (tools/gpu_device.sh SUITE_SHARE=1)"),
    Switch("QWEN4EXP_TRITON_PATH", "path", "", "tests: the Triton the offline kernel checks import (default "
           ".cache/triton, which `make test` installs)"),
)}

if TYPE_CHECKING:  # each switch's type for type checkers and editors (vLLM's envs.py does the same); the values
    # come from ``__getattr__``; tests/test_envs.py keeps this list in step with SWITCHES (names, kinds)
    QWEN4EXP_VLLM: bool
    QWEN4EXP_OPS: str
    QWEN4EXP_VLLM_GDN: str
    QWEN4EXP_PLE_TABLE: str
    QWEN4EXP_PLE_PREFETCH: bool
    QWEN4EXP_PLE_VERIFY: str
    QWEN4EXP_MTP_DRAFT_HEAD: str
    QWEN4EXP_MTP_DRAFT_VOCAB: int
    QWEN4EXP_MTP_DRAFT_VOCAB_FILE: str
    QWEN4EXP_HC_DECODE: str
    QWEN4EXP_MOE_DECODE: bool
    QWEN4EXP_QSA_PREFILL_SELECT: str
    QWEN4EXP_QSA_HOST_LENGTHS: str
    QWEN4EXP_QSA_WARMUP: bool
    QWEN4EXP_SESSION_TTL: float
    QWEN4EXP_CONTINUATION_CHUNK: int
    QWEN4EXP_PAUSE_CHUNK: int
    QWEN4EXP_TOKENIZE_CACHE_TOKENS: int
    QWEN4EXP_IDLE_TRIM: float
    QWEN4EXP_FAULT_INJECT: Optional[int]
    QWEN4EXP_CACHE_DIR: str

KIND_TYPES = {"bool": "bool", "choice": "str", "float": "float", "int": "int", "path": "str"}  # Switch.kind -> type

_values: dict[str, Any] = {}


def get(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The parsed value of switch ``name``: from the process environment (parsed once, then kept), or from
    ``environ`` when given (a mapping such as a child process's environment; parsed every call, nothing kept)."""
    if name not in SWITCHES:
        raise AttributeError(f"qwen4exp.envs has no switch {name!r}")
    if environ is not None:
        return SWITCHES[name].parse(environ.get(name))
    if name not in _values:
        _values[name] = SWITCHES[name].parse(os.environ.get(name))
    return _values[name]


def reset() -> None:
    """Forget the parsed values: the next read parses the environment again."""
    _values.clear()


def __getattr__(name: str) -> Any:
    if name.startswith("QWEN4EXP_"):
        return get(name)
    raise AttributeError(f"module 'qwen4exp.envs' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(SWITCHES))


def table(current: Callable[[str], Optional[str]] = os.environ.get, switches: Optional[dict] = None) -> str:
    """A Markdown table of the switches (the README links this module; ``python -m qwen4exp.envs`` prints it, then
    the development switches' table)."""
    rows = ["| switch | values | default | set here | what |", "| --- | --- | --- | --- | --- |"]
    for s in (SWITCHES if switches is None else switches).values():
        values = {"bool": "0 / 1", "path": "a folder", "float": "seconds", "int": "an integer"}.get(s.kind, " / ".join(s.choices))
        default = {True: "1", False: "0"}.get(s.default, s.default) if s.kind == "bool" else (s.default or "(see doc)")
        rows.append(f"| `{s.name}` | {values} | {default} | {current(s.name) or ''} | {s.doc} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
    print("\nRead by the tests, tools, benchmarks and the Makefile:\n")
    print(table(switches=DEV_SWITCHES))
