"""Prediction: the cost model (roofline step times through the real scheduler) and its calibration."""
