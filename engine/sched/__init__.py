"""Which tokens run in the next step: sequences, the paged KV cache's block manager, continuous batching and
prompt-lookup speculation."""
