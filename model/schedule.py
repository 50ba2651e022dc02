"""Generation-order schedules for set diffusion (SETDLM.md section 2).

The sliding-window schedule gives position i an active interval [loc_i, loc_i + b] on the reveal-time
axis, with b = S_max / (L + S_max - 1) and loc_i = (1 - b) (L - 1 - i) / (L - 1). Its masking time is
T_i = loc_i + b (1 - U_i^(1/k)), U_i ~ U(0, 1), and the generation order sorts positions by
descending T_i. k = A / (b - A) with A = D / (2L) makes the expected number of positions predicted
per step D / 2. Everything is vectorised on the device, in float64. `generator` may be a torch.Generator
or a per-sample `model.noise.SampleNoise`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.schema import ConfigError

from . import noise


@dataclass(frozen=True)
class SlidingWindow:
    length: int  # L
    set_size: int  # D
    s_max: int  # window of overlapping intervals
    k: float  # masking-curve exponent
    b: float  # interval width

    @classmethod
    def build(cls, length: int, set_size: int, s_max: int | None = None, k: float | None = None) -> "SlidingWindow":
        L, D = int(length), int(set_size)
        S = int(s_max) if s_max is not None else 2 * D
        if not 1 <= D <= L:
            raise ConfigError(f"objective.set_size: D={D} must be in [1, L={L}]")
        if S < D:
            raise ConfigError(f"objective.s_max: S_max={S} must be >= D={D}")
        b = S / (L + S - 1)
        if k is None:
            if S == D:
                k = 1.0
            else:
                A = D / (2 * L)
                k = A / (b - A)
        return cls(L, D, S, float(k), b)

    @property
    def expected_budget(self) -> float:
        """Expected number of positions predicted per step: L b k / (k + 1)."""
        return self.length * self.b * self.k / (self.k + 1)

    def locations(self, device=None) -> torch.Tensor:
        L = self.length
        i = torch.arange(L, dtype=torch.float64, device=device)
        if L == 1:
            return torch.zeros(1, dtype=torch.float64, device=device)
        return (1 - self.b) * (L - 1 - i) / (L - 1)

    def masking_times(self, batch: int, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
        """T [B, L] float64."""
        u = noise.rand((batch, self.length), generator, device, torch.float64)
        return self.locations(device) + self.b * (1 - u.pow(1.0 / self.k))


def sample_order(batch: int, length: int, *, order: str = "sliding_window", schedule: SlidingWindow | None = None,
                 context: torch.Tensor | None = None, valid: torch.Tensor | None = None,
                 generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """Generation order perm [B, L]: perm[b, r] is the position revealed at rank r.

    Context (prompt) positions come first in natural order, padding (valid == False) last in natural
    order; the rest follow the schedule. D = 1 (or order="left_to_right") is the identity order.
    """
    L = length
    pos = torch.arange(L, dtype=torch.float64, device=device).expand(batch, L)
    if order == "left_to_right" or (order == "sliding_window" and schedule is not None and schedule.set_size == 1):
        key = 1.0 - (pos + 1) / (L + 1)  # in (0, 1), descending in position
    elif order == "sliding_window":
        if schedule is None:
            raise ValueError("sliding_window order needs a schedule")
        key = schedule.masking_times(batch, generator, device)
    elif order == "any_order":
        key = noise.rand((batch, L), generator, device, torch.float64)
    else:
        raise ConfigError(f"objective.order: unknown order {order!r}")
    if context is not None:  # above every schedule key (<= 1), earlier positions higher
        key = torch.where(context.bool(), 2.0 + (L - pos) / L, key)
    if valid is not None:  # below every key, earlier positions higher
        key = torch.where(valid.bool(), key, -1.0 - pos / L)
    return torch.argsort(key, dim=1, descending=True, stable=True)


def ranks_of(perm: torch.Tensor) -> torch.Tensor:
    """Inverse permutation: rank[b, i] is the generation rank of position i."""
    rank = torch.empty_like(perm)
    rank.scatter_(1, perm, torch.arange(perm.shape[1], device=perm.device).expand_as(perm))
    return rank
