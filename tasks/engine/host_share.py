"""Each GPU's share of its host's cores, for the partitions of a fanned-out run.

Measured (2x H200, 32 cores, LLaVA-7B shape, 2026-11-26): one GPU alone did 41 img/s at 90%
busy, but two GPUs of the same host, whether two partitions of the flow or two raw vLLM scripts,
did 36 img/s each at 78% busy. Every process there sizes its pools to the whole host: torch's
OpenMP threads (the model's HF processor runs in the engine's front end), the decode pool, vLLM's
engine core; N engines on one host run N times as many threads as there are cores. A partition
that sees one GPU of a host with several therefore keeps to that GPU's share of the cores: whole
physical cores (never one core's two hyperthreads split between GPUs), dealt out evenly in GPU
order. Every pool sized from `os.sched_getaffinity` (the decode pool, libgomp's default thread
count) then follows. `VLM_CAPTION_CPU_SHARE` turns it off (`all`) or names the cores.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

SYSFS_CPUS = Path("/sys/devices/system/cpu")
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one folder per GPU of the host, whatever CUDA_VISIBLE_DEVICES says


def parse_cpu_list(text: str) -> list[int]:
    """`0-3,8,10-11` (the kernel's and taskset's cpulist syntax) -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"VLM_CAPTION_CPU_SHARE={text!r}: expected 'auto', 'all' or a core list like 0-15,32-47")
        cpus.update(range(int(low), int(high or low) + 1))
    return sorted(cpus)


def format_cpu_list(cpus: list[int]) -> str:
    """The inverse of `parse_cpu_list`: [0, 1, 2, 3, 8] -> `0-3,8`."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def gpu_core_share(cores: dict[int, tuple[int, int]], gpu: int, gpus: int) -> list[int]:
    """The logical CPUs of GPU `gpu` of `gpus`: `cores` maps each usable logical CPU to its
    (package, core) pair; the physical cores, in (package, core) order, are dealt out in
    contiguous runs, so GPU 0 gets the first package's first cores. With fewer physical cores than
    GPUs, the logical CPUs are dealt out instead."""
    physical = sorted(set(cores.values()))
    if len(physical) >= gpus:
        mine = set(physical[gpu * len(physical) // gpus:(gpu + 1) * len(physical) // gpus])
        return sorted(cpu for cpu, core in cores.items() if core in mine)
    logical = sorted(cores)
    return logical[gpu * len(logical) // gpus:(gpu + 1) * len(logical) // gpus] or logical[:1]


def host_topology(cpus: set[int]) -> dict[int, tuple[int, int]]:
    """(package, core) of each of `cpus` from sysfs; a CPU sysfs does not describe is a core of its own."""
    topology = {}
    for cpu in cpus:
        folder = SYSFS_CPUS / f"cpu{cpu}" / "topology"
        try:
            topology[cpu] = (int((folder / "physical_package_id").read_text()), int((folder / "core_id").read_text()))
        except (OSError, ValueError):
            topology[cpu] = (-1, cpu)
    return topology


def host_gpu_count() -> int:
    """GPUs of this host (not only those CUDA_VISIBLE_DEVICES shows this process); 0 without NVIDIA's driver."""
    if NVIDIA_GPUS.is_dir():
        return len(list(NVIDIA_GPUS.iterdir()))
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in listed.stdout.splitlines())


def cores_for_partition(setting: str) -> tuple[list[int] | None, str]:
    """The cores a partition should keep to, and why (for the log): `setting` is
    VLM_CAPTION_CPU_SHARE. None: leave the process as it is."""
    setting = setting.strip().lower()
    if setting == "all":
        return None, "VLM_CAPTION_CPU_SHARE=all"
    if setting != "auto":
        return parse_cpu_list(setting), "VLM_CAPTION_CPU_SHARE"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not visible.isdigit():  # unset, several GPUs, or a UUID: no one GPU's share to take
        return None, f"CUDA_VISIBLE_DEVICES={visible or '(unset)'} names no single GPU by index"
    gpus = host_gpu_count()
    if gpus < 2 or int(visible) >= gpus:
        return None, f"the host has {gpus} GPU(s)"
    usable = os.sched_getaffinity(0)
    share = gpu_core_share(host_topology(usable), int(visible), gpus)
    return share, f"GPU {visible}'s share of the host's {gpus} GPUs"


def keep_to_cores(cpus: list[int]) -> None:
    """Pin every thread of this process (new threads and child processes inherit it) to `cpus`."""
    for task in os.listdir("/proc/self/task"):
        # Only a thread that ended since the listing is passed over: it has nothing left to pin.
        # Any other refusal (a core outside the cpuset) reaches take_cpu_share's message.
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(task), cpus)
    os.sched_setaffinity(0, cpus)


def current_cpus() -> str | None:
    """The cores this process may run on, as a cpulist (the manifest's `cpus`); None on macOS."""
    return format_cpu_list(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else None


def take_cpu_share(setting: str) -> tuple[list[int] | None, str]:
    """Keep this partition's process to its GPU's share of the host's cores (see the module's
    doc); call before vLLM (torch) is imported, so OpenMP sizes its threads to the share.
    Returns the cores (None: unchanged) and why."""
    if not hasattr(os, "sched_setaffinity"):  # macOS
        return None, "this platform has no CPU affinity"
    cpus, why = cores_for_partition(setting)
    if cpus is None:
        return None, why
    usable = os.sched_getaffinity(0)
    if set(cpus) == usable:
        return cpus, why
    try:
        keep_to_cores(cpus)
    except OSError as exc:  # a core outside the container's cpuset
        raise ValueError(f"cannot keep to cores {format_cpu_list(cpus)} ({exc}); set VLM_CAPTION_CPU_SHARE to "
                         f"cores of {format_cpu_list(sorted(usable))}, or to all") from None
    if "torch" in sys.modules:  # imported before: its OpenMP pool was sized to every core
        import torch

        torch.set_num_threads(len(cpus))
    return cpus, why
