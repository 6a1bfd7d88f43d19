"""Linear layers and their quantized forms: matrix-vector and fused kernels, weight quantization, the FP8
activation quantizer and the one-byte tensor-core multiply."""
