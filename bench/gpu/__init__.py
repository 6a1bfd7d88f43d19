"""The GPU benchmark's sections (bench/gpu/suite.py runs them): one module each over ``harness``."""
