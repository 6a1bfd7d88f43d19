"""Launchers for generated Triton kernels: each operation's fixed signature and the bounded views it gets."""
