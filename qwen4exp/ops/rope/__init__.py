from .._dispatch import pick
from . import reference


def apply_rope(x, cos, sin):
    return pick("apply_rope", x.device, reference.apply_rope)(x, cos, sin)


__all__ = ["apply_rope", "reference"]
