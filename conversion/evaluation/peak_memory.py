"""Peak memory of a block of work: the process's resident size sampled in a thread (`PeakRSS`), or on CUDA the
allocator's peak (`peak_memory`, what `evaluate` reports per task)."""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time

import torch

from delta_attention.modeling.delta_prefill import release_freed_memory


class PeakRSS:
    """Samples the process's resident set size in a thread; `peak` is the highest seen (bytes)."""

    def __init__(self, interval: float = 0.005):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()

    @staticmethod
    def current() -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:  # not Linux: psutil if there
            import psutil

            return psutil.Process().memory_info().rss

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.current())
            time.sleep(self.interval)

    def __enter__(self):
        gc.collect()
        self.baseline = self.current()
        self.peak = self.baseline
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.current())


@contextlib.contextmanager
def peak_memory(device: torch.device):
    """Yields a dict that holds, after the block, the peak memory the block added (`bytes`) and how (`measure`).

    CUDA: the caching allocator's peak over the block minus what was allocated at its start (exact for tensors).
    CPU: the process's resident size sampled every 5 ms by a thread (`PeakRSS`), peak minus the size at the start,
    after freed heap pages went back to the OS. It counts everything the process touches (allocator slack and
    Python objects included) and can miss a spike shorter than the sampling interval; `getrusage`'s maxrss is
    not used, as it only ever grows over the process's life (and survives fork/exec)."""
    figures = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        figures["measure"] = "CUDA allocator peak over the task"
        yield figures
        torch.cuda.synchronize(device)
        figures["bytes"] = torch.cuda.max_memory_allocated(device) - start
        return
    gc.collect()
    release_freed_memory()  # so that the task's allocations show as growth, not as reuse of freed pages
    figures["measure"] = "peak resident-size growth over the task (sampled every 5 ms)"
    with PeakRSS() as rss:
        yield figures
    figures["bytes"] = rss.peak - rss.baseline


@contextlib.contextmanager
def task_peak_memory(result: dict, task: str, device: torch.device):
    """`peak_memory` of the block, stored as `result["peak_memory"][task]` (`bytes`, `measure`)."""
    with peak_memory(device) as figures:
        yield
    result.setdefault("peak_memory", {})[task] = figures


__all__ = ["PeakRSS", "peak_memory", "task_peak_memory"]
