"""The GPU benchmark's sections (bench/gpu_bench.py runs them): one module each over ``harness``."""
