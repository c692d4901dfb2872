"""Peak host memory per phase of an export, for export.json.

``ru_maxrss`` only ever grows, so it names the process's peak but not the phase that set it. On
Linux the kernel keeps the same high-water mark as ``VmHWM`` in /proc/self/status and resets it to
the current resident size when "5" is written to /proc/self/clear_refs (Linux >= 4.0): read it at
the end of each phase, reset, and each phase gets its own peak. Where that file cannot be written
(not Linux, a locked-down container) each phase gets the running peak instead, said in "method".

At each phase end the C heap's free pages also go back to the system (glibc ``malloc_trim``): the
CPU tensors of a phase are freed into glibc's per-thread arenas, which otherwise keep them
resident, so the next phase would start several GiB higher than it needs to.
"""

from __future__ import annotations

import resource
from pathlib import Path

_STATUS, _CLEAR = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def _hwm_gib() -> float:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20  # kB
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def release_free_memory() -> None:
    """glibc's malloc_trim(0) where there is glibc; nothing elsewhere."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset() -> bool:
    try:
        _CLEAR.write_text("5")
        return True
    except OSError:
        return False


class PhasePeaks:
    """`mark(phase)` at the end of each phase; `as_dict()` for export.json."""

    def __init__(self):
        self.start_gib = _hwm_gib()
        self.per_phase = _reset()
        self.peaks: dict[str, float] = {}

    def mark(self, phase: str) -> float:
        gib = _hwm_gib()
        self.peaks[phase] = round(max(gib, self.peaks.get(phase, 0.0)), 2)
        release_free_memory()
        if self.per_phase:
            _reset()
        return gib

    def peak_gib(self) -> float:
        return round(max([self.start_gib, *self.peaks.values()]), 2)

    def as_dict(self) -> dict:
        return {"host_peak_gib": self.peak_gib(), "phase_peak_gib": dict(self.peaks),
                "method": "VmHWM per phase (reset through /proc/self/clear_refs)" if self.per_phase
                else "running peak (ru_maxrss); per-phase reset unavailable here"}
