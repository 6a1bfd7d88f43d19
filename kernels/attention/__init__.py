"""Attention over the paged KV cache, writing keys and values into it, and the weight prefetch that runs
beside it: each plain-torch reference beside its Triton form."""
