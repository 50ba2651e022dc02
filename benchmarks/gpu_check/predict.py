"""The train part's prediction: the dry run's step time (pretrain/steptime.py) for the case just measured,
on the hardware preset of the GPU it ran on (pretrain/hardware.py), next to the measured step.

One GPU has no communication, so this checks the compute and memory-bound terms: the matmul and
attention efficiencies and the HBM traffic the model assumes. A measured / predicted ratio near 1 says
they hold for that shape; small models also pay kernel-launch and Python time the model leaves out.
Imports the stack (the part does)."""

from __future__ import annotations


def predicted(cfg, device_name: str | None, precision: str, *, cuda: bool) -> dict:
    """{predicted_ms, predicted_compute_ms, predicted_memory_ms, hardware} for `cfg` on one GPU; on an
    unknown device or the CPU the H200 preset, and a note saying the prediction is not for this device."""
    from pretrain.hardware import preset_of_device, resolve_hardware
    from pretrain.steptime import step_time

    key = preset_of_device(device_name or "") if cuda else None
    hw = resolve_hardware(key or "h200")
    st = step_time(cfg, 1, hw, precision=precision, device="cuda")
    out = {"predicted_ms": round(1000 * st.total, 1), "predicted_compute_ms": round(1000 * st.compute, 1),
           "predicted_memory_ms": round(1000 * st.memory, 1), "hardware": hw.name}
    if key is None:
        out["prediction_note"] = f"no preset for {device_name or 'this device'}: {hw.name}'s rates"
    return out


def ratio(measured_ms: float | None, predicted_ms: float | None) -> float | None:
    if not measured_ms or not predicted_ms:
        return None
    return round(measured_ms / predicted_ms, 2)


__all__ = ["predicted", "ratio"]
