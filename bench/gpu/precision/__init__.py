"""The precision benchmarks on a GPU: quantized weights (int8, FP8) in decode, served steps, the one-byte
tensor-core kernel, and the FP8 KV cache."""
