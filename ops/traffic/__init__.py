"""Traffic: trace import and profiling, offline text corpora, replay against an endpoint, and load tests."""
