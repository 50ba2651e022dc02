"""First-hitting times of generated positions: the order in which SW-SetDLM tokens committed in one
step enter the KV cache under `SamplingConfig.cache_order = "first_hitting"`.

The paper's GSM8K evaluation (the reference implementation's `setdlm_fht_cache_order: true`) does not
cache a step's accepted tokens in position order: each generated position j of a span of n has a
first-hitting time T_j under the sliding-window schedule of the model's length L,

    T_j = loc_{L-n+j} + b (1 - exp(-E_j / k)),   E_j ~ Exp(1),   loc_i = (1 - b) (L - 1 - i) / (L - 1),

and the tokens one step accepts are cached (and attend causally among themselves) in descending T.
b and k follow the reference's rule for its evaluation-time schedule (`schedule`): S_max = 2 w for
window w, as its GSM8K script sets it, D the model's set size.

The draw is the reference's: n float64 Exp(1) variables, one `exponential_` call on the model's
device, from the generator in use (`SamplingConfig.seed`, a passed generator, or else torch's global
generator, as the reference draws). Every request of one decode draws from the same starting state
(a clone of the generator's state when decoding starts), so a prompt gets the same times whether it is
decoded alone or in a batch, and after `torch.manual_seed(s)` the times are those the reference draws
after the same call. Past L (a span longer than the model's length, where the reference fails with a
shape mismatch) the locations continue below 0 at the same spacing, so the order keeps its meaning.
"""

from __future__ import annotations

import torch

__all__ = ["schedule", "FirstHitting", "record", "cache_order", "for_decode"]


def schedule(length: int, set_size: int, s_max: int, k: float | None = None) -> tuple[float, float]:
    """(b, k) of the reference's staggered schedule over `length` positions with set size D and window
    S_max (D in {1, S_max}: k = 1; an explicit k: b from the budget D / 2)."""
    L, D, S = int(length), int(set_size), int(s_max)
    area = D / (2 * L)
    if k is not None:
        k = float(k)
        return area * (k + 1) / k, k
    if D not in (1, S):
        b = S / (L + S - 1)
        return b, area / (b - area)
    return 2 * area, 1.0


def _locations(length: int, b: float, n: int, device) -> torch.Tensor:
    """loc of the last n of `length` positions (float64 [n]); n > length continues at the same spacing."""
    loc = torch.linspace(0.0, 1.0 - b, length, dtype=torch.float64, device=device).flip(0)
    if n <= length:
        return loc[length - n:]
    step = (1.0 - b) / max(length - 1, 1)
    extra = step * torch.arange(n - 1, length - 1, -1, dtype=torch.float64, device=device)
    return torch.cat((extra, loc))


class FirstHitting:
    """Draws T [n] for each span of one decode (see the module docstring)."""

    def __init__(self, *, length: int, set_size: int, window: int, k: float | None, device,
                 generator: torch.Generator | None):
        self.length = int(length)
        self.b, self.k = schedule(self.length, min(int(set_size), self.length), min(2 * int(window), self.length), k)
        self.device = torch.device(device)
        src = generator
        if src is None:
            src = torch.default_generator if self.device.type == "cpu" else torch.cuda.default_generators[
                self.device.index if self.device.index is not None else torch.cuda.current_device()]
        self.src, self.state = src, src.get_state()
        self.advanced = False

    def times(self, n: int) -> torch.Tensor:
        """T [n] float64 on the device for a span of n generated positions."""
        g = torch.Generator(device=self.device)
        g.set_state(self.state)
        e = torch.empty(1, int(n), dtype=torch.float64, device=self.device).exponential_(generator=g)
        if not self.advanced:  # the generator moves on as the reference's one draw moves it (unless used since)
            self.advanced = True
            if torch.equal(self.src.get_state(), self.state):
                self.src.set_state(g.get_state())
        loc = _locations(self.length, self.b, int(n), self.device)
        return (loc + self.b * -torch.expm1(-e[0] / self.k)).contiguous()


# -- the model's recorded decoding mode ------------------------------------------------------------
ATTR = "sampling_defaults"  # set on a loaded model (pretrain/checkpoint/inference.load_model)


def record(model, objective, seq_len: int) -> None:
    """Attach the run's decoding defaults to a loaded model: its objective's cache order and the
    schedule (L, D, k) the first-hitting times use."""
    setattr(model, ATTR, {"cache_order": getattr(objective, "cache_order", "position") or "position",
                          "length": int(seq_len), "set_size": int(getattr(objective, "set_size", 4) or 4),
                          "k": getattr(objective, "k", None)})


def cache_order(cfg, model) -> str:
    """The cache order a SetDLM decode of `model` under `cfg` uses: the config's, else the model's recorded
    one, else position."""
    if cfg.cache_order is not None:
        return cfg.cache_order
    return (getattr(model, ATTR, None) or {}).get("cache_order") or "position"


def for_decode(cfg, model, generator) -> FirstHitting | None:
    """The first-hitting times of a SetDLM decode of `model` under `cfg` (None: position order)."""
    from .. import families

    if cfg.spec is not families.SETDLM or cache_order(cfg, model) != "first_hitting":
        return None
    rec = getattr(model, ATTR, None) or {}
    length = rec.get("length") or int(getattr(model.cfg, "max_seq_len", 0) or 0) or 1024
    device = next(model.parameters()).device
    return FirstHitting(length=length, set_size=rec.get("set_size") or cfg.window_size, window=cfg.window_size,
                        k=rec.get("k"), device=device, generator=generator)
