"""A partition of a fanned-out run keeps to its GPU's share of the host's cores
(tasks/engine/host_share.py); a run that is not fanned out keeps every core."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vlm_caption.tasks.engine import host_share
from vlm_caption.tasks.engine.host_share import format_cpu_list, gpu_core_share, parse_cpu_list

REPO = Path(__file__).resolve().parent.parent


def two_socket_host() -> dict[int, tuple[int, int]]:
    """64 logical CPUs as Linux numbers them on a 2-socket host: 0-15 socket 0's cores, 16-31
    socket 1's, then 32-63 their hyperthread siblings in the same order."""
    return {cpu: ((cpu % 32) // 16, cpu % 16) for cpu in range(64)}


def test_each_gpu_gets_whole_physical_cores_and_the_shares_cover_the_host():
    topology = two_socket_host()
    shares = [gpu_core_share(topology, gpu, 4) for gpu in range(4)]
    assert shares[0] == [*range(0, 8), *range(32, 40)]  # GPU 0: socket 0's first 8 cores, both threads each
    assert sorted(cpu for share in shares for cpu in share) == list(range(64))  # disjoint, and every CPU
    for share in shares:  # a core's two hyperthreads never split between GPUs
        assert len({topology[cpu] for cpu in share}) * 2 == len(share)
    assert {topology[cpu][0] for cpu in shares[1]} == {0} and {topology[cpu][0] for cpu in shares[2]} == {1}
    # More GPUs than physical cores: logical CPUs are dealt out, every GPU gets at least one.
    assert [gpu_core_share({0: (0, 0), 1: (0, 0)}, gpu, 3) for gpu in range(3)] == [[0], [0], [1]]


def test_cpu_lists_round_trip_and_bad_ones_are_refused():
    assert parse_cpu_list("0-3, 8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpu_list([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    with pytest.raises(ValueError, match="0-15,32-47"):
        parse_cpu_list("0-x")


@pytest.mark.parametrize("visible, host_gpus, expected", [
    ("1", 2, "GPU 1's share"), ("0,1", 2, None), ("", 2, None), ("GPU-8c1f", 2, None), ("0", 1, None), ("0", 0, None)])
def test_auto_takes_a_share_only_for_one_gpu_of_a_host_with_several(monkeypatch, visible, host_gpus, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(host_share, "host_gpu_count", lambda: host_gpus)
    cpus, why = host_share.cores_for_partition("auto")
    if expected is None:
        assert cpus is None and why
    else:
        assert expected in why and cpus and set(cpus) <= os.sched_getaffinity(0)
    assert host_share.cores_for_partition("all")[0] is None


PROBE = """
import json, os, sys, threading
from vlm_caption.flows.plan import take_partition_cores
from vlm_caption.flows.params import CaptionJob, Partition
from vlm_caption.tasks.media.pool import usable_cores

job = CaptionJob(source="./in", output="./out", recipe="llava", fan_out=int(sys.argv[1]))
idle = threading.Event()
before = threading.Thread(target=idle.wait, daemon=True)  # a thread started before: pinned too
before.start()
cpus, why = take_partition_cores(job)
status = open(f"/proc/self/task/{before.native_id}/status").read()
allowed = [line.split()[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list")][0]
print(json.dumps({"cpus": cpus, "why": why, "process": sorted(os.sched_getaffinity(0)),
                  "thread": allowed, "decode_processes": usable_cores()}))
"""


def probe(fan_out: int, share: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, str(fan_out)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "VLM_CAPTION_CPU_SHARE": share}, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's")
def test_a_partition_keeps_to_its_cores_with_its_threads_and_pools_and_a_single_run_keeps_all():
    everything = sorted(os.sched_getaffinity(0))
    mine = probe(fan_out=2, share=str(everything[0]))
    assert mine["cpus"] == mine["process"] == [everything[0]]
    assert mine["thread"] == str(everything[0])  # a thread that ran before the share was taken
    assert mine["decode_processes"] == 1  # the decode pool is sized to the share
    single = probe(fan_out=1, share=str(everything[0]))
    assert single["cpus"] is None and single["process"] == everything and single["decode_processes"] == len(everything)
