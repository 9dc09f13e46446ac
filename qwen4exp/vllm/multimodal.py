"""Images in the vLLM plugin (``Qwen4ExpForConditionalGeneration``).

* Processing (our classes: vLLM's Qwen2/3-VL processing modules import torchvision at module level, so they cannot
  load on a CPU machine without it): the HF processor is ``qwen4exp.hf.processing.Qwen4ExpProcessor`` (upstream's
  Qwen3-VL processor with the Pillow Qwen2-VL image processor); each image's ``<|image_pad|>`` expands to its
  t * h * w / m^2 placeholder tokens; fields ``pixel_values`` (patches of all images, split per image) and
  ``image_grid_thw``. Video is not offered (transformers' video processor needs torchvision). A processed prompt
  with images longer than ``max_model_len`` gets a 400 counting the images' tokens (``check_images_fit``).
* The tower: ``qwen4exp.layers.vision.VisionTower`` (the same math as the HF reference), weights ``model.visual.*``.
* ``embed_multimodal``: one embedding tensor per image, in prompt order; ``embed_input_ids`` merges them over the
  placeholder tokens (vLLM's encoder cache keeps them across chunked-prefill steps).
* M-RoPE: ``get_mrope_input_positions`` = ``qwen4exp.layers.rope.mrope_positions`` over the prompt's placeholder
  runs (the HF reference's function), so the text after an image continues at its (t, h, w) offset; the QSA
  layers rotate block keys at these positions (``qwen4exp.vllm.qsa``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from vllm.model_executor.models.interfaces import SupportsMultiModal
from vllm.model_executor.models.utils import _merge_multimodal_embeddings
from vllm.multimodal.inputs import MultiModalFieldConfig
from vllm.multimodal.parse import ImageSize
from vllm.multimodal.processing import (BaseDummyInputsBuilder, BaseMultiModalProcessor, BaseProcessingInfo,
                                        PromptReplacement)

from ..hf.processing import Qwen4ExpProcessor
from ..layers.rope import IMAGE, VIDEO, mrope_positions
from ..layers.vision import VisionTower


class Qwen4ExpProcessingInfo(BaseProcessingInfo):
    def get_hf_config(self):
        return self.ctx.get_hf_config()  # (transformers' own qwen4_exp config class)

    def get_hf_processor(self, **kwargs: object) -> Qwen4ExpProcessor:
        return self.ctx.get_hf_processor(Qwen4ExpProcessor, **kwargs)

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"image": None}

    def _unit(self) -> int:
        vc = self.get_hf_config().vision_config
        return vc.patch_size * vc.spatial_merge_size

    def num_image_tokens(self, width: int, height: int) -> int:
        ip = self.get_hf_processor().image_processor
        m = self.get_hf_config().vision_config.spatial_merge_size
        return ip.get_number_of_image_patches(height, width, {}) // (m * m)

    def get_image_size_with_most_features(self) -> ImageSize:
        """The largest square-ish grid of whole merge blocks the image processor's pixel budget allows."""
        ip = self.get_hf_processor().image_processor
        u = self._unit()
        blocks = max(1, ip.size["longest_edge"] // (u * u))
        h = math.isqrt(blocks)
        w = blocks // h
        return ImageSize(width=u * w, height=u * h)

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Mapping[str, int]:
        size = self.get_image_size_with_most_features()
        return {"image": self.num_image_tokens(size.width, size.height)}


class Qwen4ExpDummyInputsBuilder(BaseDummyInputsBuilder[Qwen4ExpProcessingInfo]):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return "<|vision_start|><|image_pad|><|vision_end|>" * mm_counts.get("image", 0)

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int], mm_options=None):
        size = self.info.get_image_size_with_most_features()
        return {"image": self._get_dummy_images(width=size.width, height=size.height,
                                                num_images=mm_counts.get("image", 0),
                                                overrides=(mm_options or {}).get("image"))}


def check_images_fit(mm_inputs, max_model_len: int, max_pixels: int | None = None) -> None:
    """A processed prompt holding images that is longer than ``max_model_len``: a 400 (VLLMValidationError on
    ``image_url``) saying how many of its tokens its images take, instead of the bare length message. Prompts without
    images are left to vLLM's checks."""
    n = len(mm_inputs["prompt_token_ids"])
    sizes = [r.length for r in (mm_inputs.get("mm_placeholders") or {}).get("image", [])]
    if n <= max_model_len or not sizes:
        return
    from vllm.exceptions import VLLMValidationError

    each = f" ({', '.join(map(str, sizes))})" if len(sizes) > 1 else ""
    limit = f" (this server resizes an image to at most {max_pixels} pixels)" if max_pixels else ""
    raise VLLMValidationError(
        f"image_url: too large for max_model_len {max_model_len}: the prompt's {len(sizes)} image(s) take "
        f"{sum(sizes)} tokens{each} of its {n}; send smaller or fewer images{limit}, or serve with a larger "
        f"--max-model-len", parameter="image_url")


class Qwen4ExpMultiModalProcessor(BaseMultiModalProcessor[Qwen4ExpProcessingInfo]):
    _profiling = 0  # inside get_dummy_mm_inputs (start-up profiling: its prompt may exceed max_model_len)

    def get_dummy_mm_inputs(self, *args, **kwargs):
        self._profiling += 1
        try:
            return super().get_dummy_mm_inputs(*args, **kwargs)
        finally:
            self._profiling -= 1

    def apply(self, inputs, timing_ctx):
        out = super().apply(inputs, timing_ctx)
        if not self._profiling:
            ip = self.info.get_hf_processor().image_processor
            check_images_fit(out, self.info.ctx.model_config.max_model_len, (ip.size or {}).get("longest_edge"))
        return out

    def _get_mm_fields_config(self, hf_inputs, hf_processor_mm_kwargs: Mapping[str, object]
                              ) -> Mapping[str, MultiModalFieldConfig]:
        grid = hf_inputs.get("image_grid_thw", torch.empty((0, 3)))
        return dict(pixel_values=MultiModalFieldConfig.flat_from_sizes("image", grid.prod(-1)),
                    image_grid_thw=MultiModalFieldConfig.batched("image", keep_on_cpu=True))

    def _get_prompt_updates(self, mm_items, hf_processor_mm_kwargs: Mapping[str, Any], out_mm_kwargs
                            ) -> Sequence[PromptReplacement]:
        tok = self.info.get_tokenizer()
        pad = tok.get_vocab()[self.info.get_hf_processor(**hf_processor_mm_kwargs).image_token]
        m = self.info.get_hf_config().vision_config.spatial_merge_size

        def replacement(i: int):
            grid = out_mm_kwargs["image"][i]["image_grid_thw"].data
            return [pad] * (int(grid.prod()) // (m * m))

        return [PromptReplacement(modality="image", target=[pad], replacement=replacement)]


PROCESSOR = dict(processor=Qwen4ExpMultiModalProcessor, info=Qwen4ExpProcessingInfo,
                 dummy_inputs=Qwen4ExpDummyInputsBuilder)


class VisionInputs(SupportsMultiModal):
    """The multimodal half of ``Qwen4ExpForConditionalGeneration`` (mixed in before the text model's base)."""

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        if modality.startswith("image"):
            return "<|vision_start|><|image_pad|><|vision_end|>"
        if modality.startswith("video"):
            return "<|vision_start|><|video_pad|><|vision_end|>"
        raise ValueError(f"qwen4exp: unsupported modality {modality!r} (image or video)")

    def init_vision(self, vllm_config) -> None:
        hf = vllm_config.model_config.hf_config
        self.mm_config = hf
        mm = vllm_config.model_config.multimodal_config
        if mm is not None and mm.language_model_only:
            self.visual = None
            return
        self.visual = VisionTower(hf.vision_config).to(vllm_config.model_config.dtype)

    def get_language_model(self) -> nn.Module:
        return self

    def _tower(self) -> VisionTower:
        if self.visual is None:
            raise ValueError("qwen4exp: this engine runs the language model only (no vision tower)")
        return self.visual

    def embed_multimodal(self, **kwargs: object):
        tower = None
        out: list[torch.Tensor] = []
        seen = set()
        for key in kwargs:  # kwargs order: the modalities in prompt order
            for px_key, grid_key in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
                if key != px_key or key in seen or kwargs.get(key) is None:
                    continue
                seen.add(key)
                tower = tower or self._tower()
                if kwargs.get(px_key.replace("pixel_values", "image_embeds") if px_key == "pixel_values"
                              else "video_embeds") is not None:
                    raise ValueError("qwen4exp: precomputed image/video embeddings are not supported")
                px, grid = kwargs[px_key], kwargs[grid_key]
                if isinstance(px, (list, tuple)):
                    px = torch.cat(list(px))
                if isinstance(grid, (list, tuple)):
                    grid = torch.stack([torch.as_tensor(g).reshape(3) for g in grid])
                p = tower.patch_embed.proj.weight
                emb = tower(px.to(p.device, p.dtype), grid.to(p.device))
                out.extend(emb.split(tower.tokens_per_item(grid)))
        return tuple(out)

    def embed_input_ids(self, input_ids: torch.Tensor, multimodal_embeddings=None, *,
                        is_multimodal: torch.Tensor | None = None) -> torch.Tensor:
        emb = self.model.embed_tokens(input_ids)
        if multimodal_embeddings is None or len(multimodal_embeddings) == 0:
            return emb
        if is_multimodal is None:
            raise ValueError("qwen4exp: multimodal embeddings without their placeholder mask")
        return _merge_multimodal_embeddings(emb, multimodal_embeddings, is_multimodal)

    def get_mrope_input_positions(self, input_tokens, mm_features):
        """(t, h, w) positions of a prompt and its delta (``layers.rope.mrope_positions``): types from the
        placeholder token ids, grids from the features in prompt order."""
        c = self.mm_config
        ids = torch.as_tensor(list(input_tokens), dtype=torch.long)
        types = (ids == c.image_token_id).long() * IMAGE + (ids == c.video_token_id).long() * VIDEO
        feats = sorted(mm_features or [], key=lambda f: f.mm_position.offset)
        img = [f.data["image_grid_thw"].data.tolist() for f in feats if f.modality == "image"]
        vid = [f.data["video_grid_thw"].data.tolist() for f in feats if f.modality == "video"]
        return mrope_positions(types, img, vid, c.vision_config.spatial_merge_size)

    def load_vision_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """Split off ``model.visual.*`` (loaded into the tower here); yields every other tensor."""
        params = dict(self.visual.named_parameters()) if self.visual is not None else {}
        self._vision_loaded = set()
        for name, w in weights:
            if name.startswith("model.visual."):
                if self.visual is None:
                    continue
                k = name[len("model.visual."):]
                if k not in params:
                    raise ValueError(f"qwen4exp: checkpoint tensor {name} has no place in the vision tower")
                if tuple(params[k].shape) != tuple(w.shape):
                    raise ValueError(f"qwen4exp: checkpoint tensor {name} has shape {tuple(w.shape)}, the tower "
                                     f"expects {tuple(params[k].shape)}")
                with torch.no_grad():
                    params[k].copy_(w)
                self._vision_loaded.add("visual." + k)
                continue
            yield name, w

    def check_vision_loaded(self) -> set[str]:
        if self.visual is None:
            return set()
        missing = {"visual." + k for k, _ in self.visual.named_parameters()} - self._vision_loaded
        if missing:
            raise ValueError(f"qwen4exp: the checkpoint lacks vision tower tensors: {sorted(missing)[:5]}")
        return set(self._vision_loaded)
