"""The model as the forward pass runs it: the transformer, the table of operations it calls (ForwardOps),
rotary tables, weight precision and tensor parallelism."""
