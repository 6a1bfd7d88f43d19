"""The non-LLM workloads' hot ops (engine/workloads/): the Fourier neural operator's spectral multiply and message
passing's scatter-sum, each plain-torch reference beside its Triton form."""
