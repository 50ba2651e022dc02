"""This process's resident memory, for the memory benchmarks and the tests that bound a build's peak.

    rss_mib()          resident now (/proc/self/statm)
    reset_peak_rss()   reset the kernel's high-water mark (Linux: "5" to /proc/self/clear_refs);
                       False where the kernel does not allow it
    peak_rss_mib()     the high-water mark since start or the last reset (VmHWM; ru_maxrss where
                       /proc/self/status has no VmHWM)
    anon_rss_mib(pid)  resident anonymous memory now (RssAnon: what cannot be paged out, unlike
                       memory-mapped files); of another process with `pid`; None where not reported

All in MiB. Linux only for the first two (the benchmarks and tests that use them say so).
"""

from __future__ import annotations

import os
import resource


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mib() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def anon_rss_mib(pid: int | str = "self") -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


__all__ = ["rss_mib", "reset_peak_rss", "peak_rss_mib", "anon_rss_mib"]
