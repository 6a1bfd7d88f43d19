"""Mixture-of-experts: routing and the experts' MLPs, the reference beside the Triton prefill and decode
paths, and their tunable parameters."""
