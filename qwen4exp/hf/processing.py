"""``Qwen4ExpProcessor``: upstream's Qwen3-VL processor (chat template, Qwen2-VL image processor, placeholder
expansion, ``mm_token_type_ids``) whose video processor is optional.

transformers maps ``qwen4_exp`` to ``Qwen3VLProcessor``, whose video processor needs torchvision, so on a machine
without torchvision that processor does not load at all. This one loads the image processor transformers picks
(the Pillow one without torchvision) and the tokenizer, and adds the video processor only where torchvision is
installed; without it, videos are refused with a clear error. Importing ``qwen4exp.hf`` registers it with
``AutoProcessor`` under its name, so a checkpoint whose ``preprocessor_config.json`` names
``"processor_class": "Qwen4ExpProcessor"`` loads through ``AutoProcessor.from_pretrained``.
"""

from __future__ import annotations

import importlib.util

from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor


def has_torchvision() -> bool:
    return importlib.util.find_spec("torchvision") is not None


class Qwen4ExpProcessor(Qwen3VLProcessor):
    # sub-processors come from the signature: the video processor is attached in from_pretrained when possible
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        video_processor = kwargs.pop("video_processor", None)
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)
        self.video_processor = video_processor

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        proc = super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        if has_torchvision():
            from transformers import AutoVideoProcessor

            proc.video_processor = AutoVideoProcessor.from_pretrained(pretrained_model_name_or_path)
        return proc

    def __call__(self, images=None, text=None, videos=None, **kwargs):
        if videos is not None and self.video_processor is None:
            raise ValueError("qwen4exp: video inputs need transformers' video processor, which needs torchvision "
                             "(not installed here); images work without it")
        return super().__call__(images=images, text=text, videos=videos, **kwargs)


def register() -> None:
    """Make ``AutoProcessor`` find ``Qwen4ExpProcessor`` by name (``processor_class`` in a checkpoint's config)."""
    from transformers import AutoProcessor

    from ..configuration import Qwen4ExpConfig

    AutoProcessor.register(Qwen4ExpConfig, Qwen4ExpProcessor, exist_ok=True)
