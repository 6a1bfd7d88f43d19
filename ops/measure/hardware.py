"""Hardware probe: measured memory bandwidth, matmul FLOP/s per dtype, launch overhead."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch


@dataclass(frozen=True)
class HardwareProfile:
    device: str
    device_count: int
    memory_bytes: int
    memory_bandwidth: float  # bytes/s, copy (read + write)
    matmul_flops: dict[str, float] = field(default_factory=dict)  # dtype -> FLOP/s
    launch_overhead_s: float = 0.0
    interconnect_bandwidth: float | None = None
    compute_capability: str | None = None  # "9.0" on a Hopper GPU; None on a CPU

    def to_json(self) -> dict:
        return asdict(self)


def _time(fn, device: torch.device, iters: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters


def probe(device: str = "cpu", size_mb: int = 256, matmul_n: int = 1024) -> HardwareProfile:
    dev = torch.device(device)
    n = size_mb * 1024 * 1024
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    bw = 2 * n / _time(lambda: b.copy_(a), dev, 5)
    a = b = None  # free the buffers before the matmul probe
    dtypes = [torch.float32] if dev.type == "cpu" else [torch.float32, torch.bfloat16, torch.float16]
    flops = {}
    for dt in dtypes:
        x = torch.randn(matmul_n, matmul_n, device=dev, dtype=dt)
        flops[str(dt).replace("torch.", "")] = 2 * matmul_n**3 / _time(lambda: x @ x, dev, 5)
    tiny = torch.zeros(1, device=dev)
    launch = _time(lambda: tiny.add_(1), dev, 200)
    interconnect = None
    if dev.type == "cuda":
        name, count = torch.cuda.get_device_name(dev), torch.cuda.device_count()
        mem = torch.cuda.get_device_properties(dev).total_memory
        capability = "%d.%d" % torch.cuda.get_device_capability(dev)
        if count > 1:  # device-to-device copy to the next device (NVLink or PCIe, whichever links them)
            other = torch.device("cuda", (dev.index or 0) + 1 if (dev.index or 0) + 1 < count else 0)
            src = torch.empty(n // 4, dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src, device=other)
            t = _time(lambda: (dst.copy_(src), torch.cuda.synchronize(other)), dev, 5)
            interconnect = src.numel() / t
            src = dst = None
    else:
        import os

        name, count, capability = f"cpu x{torch.get_num_threads()}", 1, None
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return HardwareProfile(device=name, device_count=count, memory_bytes=mem, memory_bandwidth=bw,
                           matmul_flops=flops, launch_overhead_s=launch, interconnect_bandwidth=interconnect,
                           compute_capability=capability)
