"""The tuning logic, as plain Python testable without Dagster: traces and profiles, replay, the benchmark
tiers, the hardware probe, the model spec, the cost model, the message board and its workers, the agents,
searches, the choice and build, deploy and rollback, load and fault tests. Nothing here is a Dagster op:
the assets (assets/) call into these modules."""
