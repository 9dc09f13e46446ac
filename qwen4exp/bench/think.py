"""``--think-time``: the simulated tool execution between a turn's reply and the next turn's send."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class ThinkTime:
    """A pause distribution: ``const`` (seconds), ``lognormal`` (median, sigma, max or None), ``uniform`` (a, b)."""

    kind: str = "const"
    a: float = 0.0
    b: float = 0.0
    cap: float | None = None

    @property
    def zero(self) -> bool:
        return self.kind == "const" and self.a == 0

    def sample(self, rng: random.Random) -> float:
        if self.kind == "const":
            return self.a
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b)
        v = rng.lognormvariate(math.log(self.a), self.b)  # median exp(mu) = a
        return min(v, self.cap) if self.cap is not None else v

    def describe(self) -> str:
        if self.kind == "const":
            return f"{self.a:g}"
        if self.kind == "uniform":
            return f"uniform:{self.a:g},{self.b:g}"
        return f"lognormal:{self.a:g},{self.b:g}" + (f",{self.cap:g}" if self.cap is not None else "")


def parse_think_time(s: str) -> ThinkTime:
    """``0`` | ``S`` | ``lognormal:MEDIAN,SIGMA[,MAX]`` | ``uniform:A,B``; ValueError naming the problem."""
    text = s.strip()
    kind, sep, rest = text.partition(":")
    try:
        if not sep:
            v = float(text)
            if not math.isfinite(v) or v < 0:
                raise ValueError
            return ThinkTime("const", v)
        vals = [float(x) for x in rest.split(",")]
        if not all(math.isfinite(x) for x in vals):
            raise ValueError
    except ValueError:
        raise ValueError(
            f"expected 0, seconds, lognormal:MEDIAN,SIGMA[,MAX] or uniform:A,B, got {s!r}") from None
    kind = kind.strip().lower()
    if kind == "lognormal":
        if len(vals) not in (2, 3):
            raise ValueError(f"lognormal takes MEDIAN,SIGMA[,MAX], got {s!r}")
        median, sigma = vals[0], vals[1]
        cap = vals[2] if len(vals) == 3 else None
        if median <= 0 or sigma < 0 or (cap is not None and cap <= 0):
            raise ValueError(f"lognormal needs MEDIAN > 0, SIGMA >= 0, MAX > 0, got {s!r}")
        return ThinkTime("lognormal", median, sigma, cap)
    if kind == "uniform":
        if len(vals) != 2 or vals[0] < 0 or vals[1] < vals[0]:
            raise ValueError(f"uniform takes A,B with 0 <= A <= B, got {s!r}")
        return ThinkTime("uniform", vals[0], vals[1])
    raise ValueError(f"unknown distribution {kind!r} (lognormal or uniform), got {s!r}")
