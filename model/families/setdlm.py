"""SW-SetDLM: sliding-window set diffusion (SETDLM.md). Two-stream training in a sampled generation
order under one static set-causal mask; decoding commits the confident tokens of a window of masked
positions per step and updates the KV cache after every step. Any-order AR is `order: any_order`,
left-to-right AR order `set_size: 1` or `order: left_to_right`."""

from __future__ import annotations

from common.schema import ConfigError

from .spec import FamilySpec, _getter


def _s_max(objective) -> int:
    get = _getter(objective)
    return int(get("s_max", None) or 2 * int(get("set_size", 4) or 4))


class SetDiffusionFamily(FamilySpec):
    name = "setdlm"
    title = "SW-SetDLM"
    description = "sliding-window set diffusion (SW-SetDLM)"
    objective_path = "model.objectives.setdlm:SetDiffusionObjective"
    decoder_path = "model.sampling.setdlm:SetDLMDecoder"
    mask_kind = "set_causal"
    inference_mask = "causal"
    decoding = "set_window"
    two_stream = True
    objective_keys = ("set_size", "s_max", "k", "order", "cache_order")
    cache_orders = ("position", "first_hitting")  # first_hitting: the reference's setdlm_fht_cache_order
    bound = "order-sampled upper bound"
    estimator = "order-sampled upper bound (one order per sequence and draw)"
    order_mixture = True
    reference_step = "setdlm_step"
    reference_names = ("setdlm", "aoarm")

    def validate(self, objective, seq_len: int) -> None:
        if not 1 <= objective.set_size <= seq_len:
            raise ConfigError(f"objective.set_size: D={objective.set_size} must be in [1, seq_len={seq_len}]")
        if _s_max(objective) < objective.set_size:
            raise ConfigError(f"objective.s_max: S_max={_s_max(objective)} must be >= D={objective.set_size}")

    def sampling_defaults(self, objective) -> dict:
        out = {**super().sampling_defaults(objective), "s_max": _s_max(objective)}
        order = _getter(objective)("cache_order", None)
        if order and order != "position":  # the decoding mode the model was released with
            out["cache_order"] = order
        return out

    def infill_window(self, objective) -> int:
        return _s_max(objective)  # the paper infills with w = S_max

    def served_s_max(self, objective) -> int:
        return _s_max(objective)

    def validate_sampling(self, cfg) -> None:
        super().validate_sampling(cfg)
        if cfg.s_max is None:
            return
        for key, value in (("window", cfg.window_size), ("window_max", cfg.max_window if cfg.adaptive_window else 0)):
            if value > cfg.s_max:
                raise ConfigError(f"sampling.{key}: at most the model's S_max = {cfg.s_max} (the most positions one "
                                  f"step was trained on), got {value}")

    def settings_line(self, cfg) -> str:
        return (f"{self.name} sampler, window {cfg.window_size}" + (" (adaptive)" if cfg.adaptive_window else ""))

    def export_window(self, schedule: dict) -> int:
        return int(schedule.get("set_size") or 1)

    def schedule_fields(self, objective, seq_len: int) -> dict:
        from model.schedule import SlidingWindow

        sw = SlidingWindow.build(seq_len, objective.set_size, objective.s_max, objective.k)
        return dict(set_size=sw.set_size, s_max=sw.s_max, k=sw.k, b=sw.b, order=objective.order,
                    cache_order=getattr(objective, "cache_order", "position"),
                    expected_budget=sw.expected_budget, k_explicit=objective.k is not None,
                    s_max_explicit=objective.s_max is not None)

    def objective_from_schedule(self, schedule: dict) -> dict:
        sd = schedule
        out = {"set_size": int(sd.get("set_size", 4)), "order": sd.get("order", "sliding_window")}
        if sd.get("s_max_explicit") or ("s_max" in sd and int(sd["s_max"]) != 2 * out["set_size"]):
            out["s_max"] = int(sd["s_max"])
        if sd.get("k_explicit"):
            out["k"] = float(sd["k"])
        if sd.get("cache_order", "position") != "position":  # the decoding mode a release was evaluated in
            out["cache_order"] = sd["cache_order"]
        return out

    def card_rows(self, schedule: dict) -> list:
        sd = schedule
        return [("set size D", sd.get("set_size")), ("window S_max", sd.get("s_max")), ("k", sd.get("k")),
                ("interval width b", sd.get("b")), ("expected tokens per step", sd.get("expected_budget")),
                ("order", sd.get("order"))]


SPEC = SetDiffusionFamily()
