"""The tests' tiny random composite (``Qwen4ExpForConditionalGeneration``) checkpoints: the builder is
``recipes/vision_tiny.py`` (one definition; ``make tiny-vl`` runs it for users), imported from there.

``build_vision_checkpoint(out_dir, seed, dtype, max_pixels, **text_overrides)``: weights made by upstream transformers
(saved in the official format), a tokenizer with the vision tokens at the config's ids, a chat template that renders
image / video content parts, a Qwen2-VL image processor config; no downloads. ``test_image(w, h, seed)``: a PIL image.
"""

from __future__ import annotations

import os
import sys

_RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")
if _RECIPES not in sys.path:
    sys.path.insert(0, _RECIPES)

from vision_tiny import (  # noqa: E402,F401
    CHAT_TEMPLATE,
    VISION_TOKENS,
    WORDS,
    build_vision_checkpoint,
    build_vision_tokenizer,
    randomize,
    randomize_tower,
    upstream_conditional,
    vision_token_ids,
    write_image_processor_config,
)
from vision_tiny import example_image as test_image  # noqa: E402,F401
