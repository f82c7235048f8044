"""Peak memory of this process over a stretch of a test (Linux): how far it rose, not where it ended.

Owns the one way tests measure memory growth in-process: `PeakMemory()` resets the kernel's peak-RSS
counter (VmHWM, through /proc/self/clear_refs) and records the RSS at that moment; `growth_mib` is the peak
since then minus that RSS. Anything allocated and freed in between still counts.
"""

from __future__ import annotations

from pathlib import Path


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


class PeakMemory:
    def __init__(self) -> None:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        self.start_kib = _status_kib("VmRSS")

    @property
    def growth_mib(self) -> float:
        return (_status_kib("VmHWM") - self.start_kib) / 1024
