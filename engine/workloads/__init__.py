"""Non-LLM workloads (scientific models) served and tuned through the same variant, tier and gate machinery as the
LLM engine: the Workload, its variants and runner, and its static-best form."""
from engine.workloads.static_best import static_best
from engine.workloads.variants import WorkloadRunner, WorkloadVariant, build_runner
from engine.workloads.workload import WORKLOADS, BatchPolicy, Workload, WorkloadRequest, get_workload

__all__ = ["WORKLOADS", "BatchPolicy", "Workload", "WorkloadRequest", "WorkloadRunner", "WorkloadVariant",
           "build_runner", "get_workload", "static_best"]
