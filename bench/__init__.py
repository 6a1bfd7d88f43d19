"""Benchmarks that print figures: ``python -m bench NAME [options]`` runs one (``python -m bench`` lists them).
Figures go to bench/RESULTS.md, history to bench/results/."""
