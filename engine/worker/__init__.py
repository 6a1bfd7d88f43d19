"""One step on the device: the model runner and its KV cache, CUDA graphs, sampling and structured output."""
