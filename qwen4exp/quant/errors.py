"""The quantization layer's errors: each message names the config field or the tensor at fault."""

from __future__ import annotations


class QuantConfigError(ValueError):
    """A quantization config that cannot be served: the message names the field (``quantization_config.quant_algo``)."""


class QuantTensorError(ValueError):
    """A quantized tensor that does not fit its layer: the message names the tensor (missing, dtype, shape, value)."""
