"""An engine serving traffic: the threaded async engine, the tensor-parallel rank group, traffic capture and
metrics."""
