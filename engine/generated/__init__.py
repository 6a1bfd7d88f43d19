"""Generated kernels: the grammar they are written in, their checking and loading, and the isolated child
processes untrusted work runs in."""
