"""Serving on a GPU: served latency at several rates, tensor parallelism, cold start against a hot swap, offline
throughput and prefill MFU."""
