"""Getting a model into memory: finding its source, reading GGUF or safetensors, assembling the fused
parameters, the tokenizer, and the on-disk cache between processes."""
