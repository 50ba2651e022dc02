"""model package: transformer, masks, schedules, objectives, samplers, conversion (torch alone)."""
