"""Row-wise operations: RMSNorm (with the residual add), SiLU-and-multiply, rotary embedding and the greedy
argmax, each reference beside its Triton form."""
