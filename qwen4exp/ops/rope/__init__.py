from .._dispatch import pick
from . import reference


def apply_rope(x, cos, sin):
    return pick("apply_rope", x.device, reference.apply_rope)(x, cos, sin)


def norm_rope(x, weight, eps, cos, sin):
    return pick("norm_rope", x.device, reference.norm_rope)(x, weight, eps, cos, sin)


__all__ = ["apply_rope", "norm_rope", "reference"]
