"""What the benchmarks share: rows of figures printed as measured and as one table at the end."""
