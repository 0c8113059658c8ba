"""The machine a benchmark ran on, and how busy the rest of it was meanwhile."""

from __future__ import annotations

import datetime
import os
import platform
import resource
import subprocess
import sys
import time
from typing import Dict, List, Optional


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def describe() -> Dict[str, object]:
    import torch

    info: Dict[str, object] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "torch": torch.__version__,
    }
    try:
        from importlib.metadata import version

        info["executorch"] = version("executorch")
    except Exception:  # noqa: BLE001 - informational only
        info["executorch"] = None
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
        info["isa"] = "avx512" if "avx512f" in flags else ("avx2" if "avx2" in flags else "other")
    except OSError:
        info["isa"] = None
    return info


def read_bandwidth_gbs(mib: int = 256, passes: int = 5) -> float:
    """One thread reading a buffer far larger than the caches, the best of ``passes`` (GB/s): the floor
    under a one-thread decode step, which reads every weight once. torch's reduction runs at the rate
    of a bare AVX-512 load loop here (22-23 GB/s on the AMD EPYC, both measured in one minute)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        buf = torch.ones(mib * 2**20 // 4)
        best = float("inf")
        for _ in range(passes):
            t = time.perf_counter()
            torch.amax(buf)
            best = min(best, time.perf_counter() - t)
        return buf.numel() * 4 / best / 1e9
    finally:
        torch.set_num_threads(before)


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def drop_from_page_cache(path: str) -> None:
    """Make the next read of ``path`` come from the disk (a cold read)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("VmRSS not found in /proc/self/status")


def _busy_seconds() -> Optional[float]:
    """CPU seconds all processes spent busy since boot (all cores)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Contention:
    """Share of the machine's cores other processes kept busy while this one measured.

    Other sessions may run tests on the same cores; a median over many steps
    shrugs off short preemptions, but a busy machine still skews results, so
    every measurement records how busy the rest of the machine was.
    """

    def __init__(self) -> None:
        self.wall0 = time.perf_counter()
        self.busy0 = _busy_seconds()
        self.own0 = _own_seconds()

    def others_fraction(self) -> Optional[float]:
        busy = _busy_seconds()
        if busy is None or self.busy0 is None:
            return None
        wall = time.perf_counter() - self.wall0
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        others = (busy - self.busy0) - (_own_seconds() - self.own0)
        return max(0.0, min(1.0, others / max(wall * cores, 1e-9)))


class Busy:
    """One spinning Python process per core while inside (``n`` of them): the busy-machine case
    of the thread and peer benchmarks, a load every desktop or phone meets."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.procs: List[subprocess.Popen] = []

    def __enter__(self) -> "Busy":
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.n)]
        time.sleep(0.5)  # let them reach the scheduler's steady state
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
