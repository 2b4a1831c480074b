"""This host's memory, checked before the ranks start: the host KV tiers (--swap-space,
GiB per worker; pipeline/worker/kv_tiers.py allocates them) must fit the machine."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

GIB = 1 << 30


def host_memory_bytes() -> tuple[int, int]:
    """(MemTotal, MemAvailable) of this machine, from /proc/meminfo (0, 0 if unknown)."""
    values = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                values[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return 0, 0
    return values.get("MemTotal", 0), values.get("MemAvailable", 0)


def check_swap_space(swap_space_gib: float, num_workers: int = 1) -> None:
    """ValueError when the host tiers of every worker would not fit this machine's memory."""
    total, available = host_memory_bytes()
    wanted = int(swap_space_gib * GIB) * num_workers
    if total and wanted > total:
        raise ValueError(
            f"swap_space: {swap_space_gib:g} GiB x {num_workers} worker(s) = "
            f"{wanted / GIB:.1f} GiB of host memory, but this machine has "
            f"{total / GIB:.1f} GiB in all ({available / GIB:.1f} GiB available); lower it"
        )
    if available and wanted > available:
        logger.warning(
            "swap_space: %.1f GiB asked for, %.1f GiB of host memory available now",
            wanted / GIB,
            available / GIB,
        )
