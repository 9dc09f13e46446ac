"""The official checkpoint's tensor names, shared by every runtime's loader (``qwen4exp.hf.loading``,
``qwen4exp.vllm.weights``).

Layouts: composite (``model.language_model.*``, ``model.visual.*``) or text-only (``model.*``); experts fused
(``mlp.experts.gate_up_proj`` [E, 2I, D], ``down_proj`` [E, D, I]) or per expert (``EXPERT``); PLE tables as row
shards (``PLE_SHARD``, concatenated in numeric order); tensors no runtime reads (``IGNORED``).
"""

from __future__ import annotations

import re

# the final mixer's unused injection, and training artefacts (hashstats_*, token_lookup)
IGNORED = (re.compile(r"(^|\.)hyper_connection_mixer\.block_inject_weight\.weight$"),
           re.compile(r"\.hashstats_"), re.compile(r"\.token_lookup"))
# a PLE table's row shard s: groups (table module, s)
PLE_SHARD = re.compile(r"^(.*\.ngram_embedding)\.shards?[._](\d+)\.weight$")
# one expert's projection: groups (experts module, expert index, projection)
EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: the message names the tensor (missing, unexpected, mis-shaped)."""


def canonical_name(name: str, composite: bool) -> str | None:
    """Checkpoint name -> our parameter name (None: ignore). ``composite``: the model is the composite one
    (``model.language_model.*``); otherwise text-only (``model.*``, vision tensors ignored)."""
    if any(p.search(name) for p in IGNORED):
        return None
    if composite:
        if name.startswith("model.") and not name.startswith(("model.language_model.", "model.visual.")):
            name = "model.language_model." + name[len("model."):]
    else:
        if name.startswith("model.visual."):
            return None
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
    return name
