"""Forward-pass kernels: each Triton kernel sits beside a plain-torch reference with the same signature.

Imports only torch (and triton inside the modules that hold Triton kernels), so the
same code runs on a bare GPU benchmark host.
"""
