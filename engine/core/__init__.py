"""The engine loop (requests in, tokens out, one step at a time) and the swap of its variant between steps."""
