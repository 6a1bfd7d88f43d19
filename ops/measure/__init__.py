"""Measurement: the benchmark tiers, the hardware probe, the served model's spec and the static-best sweep."""
