"""Issue 67, "Many hosts": the parent and two partitions of a fanned-out run as three separate
hosts, with nothing in common but the bucket (moto's S3 server) and the Prefect API.

Each host is a folder whose name no other host is given: its worker's working folder, HOME,
TMPDIR, caches (HF_HOME, VLLM_CACHE_ROOT, XDG_CACHE_HOME, XDG_CONFIG_HOME), its Prefect home with
a profile of its own that points at the one PREFECT_API_URL, and its worker's log. Each host's
process worker starts in that folder with that environment and nothing of this test process's (no
AWS_, PREFECT_, VLM_CAPTION_, HF_ or XDG_ variable, no HOME or TMPDIR); S3 credentials come from
the AwsCredentials block on the API, as the deployments say. The API (`vlm-caption server`, on
SQLite) has a folder of its own too.

What the hosts do share is what hosts built from one image share: the software, the project's
checkout and virtual environment at the same path on each (VLM_CAPTION_HOME, the pull step's
folder; the Docker image's /opt/vlm-caption). The model is not part of it: the job names it by
hub id (`vlm-caption-tests/tiny-llava`) and each host has it in its own hub cache (its HF_HOME,
HF_HUB_OFFLINE=1), copied there from the tiny checkpoint as a host pre-pulls a model. So every
partition resolves the model as a separate host would. (A job whose `model` is a folder passes
that path to its children as it is: it must exist on every host, as in an image.)

The run: `prefect deployment run vlm-caption/prod` with fan_out=3, picked up by the parent host's
worker (started first, `--limit 1`), whose two children (the `partition` deployment) the two other
hosts' workers pick up. Once a child has captioned a shard and holds another, its host is frozen
(SIGSTOP: what it holds cannot change while the test reads it) and killed (its worker and everything
under it). The others retake its shards when its heartbeat goes stale,
Prefect's zombie automation marks its flow run CRASHED, and the parent completes.

Checked: every item captioned exactly once (none lost, none twice); the killed partition's
unfinished shards captioned by another partition; the run's Parquet view holds every item once;
and no host's processes, environments or log name a folder of another host, of the API or of the
checkpoint the copies came from: the paths each host's processes run in, hold open or map, and
their environments and command lines, sampled every second while they run. Where this test may
make mount namespaces (root, as in CI's container), each host's worker also runs in one where the
other hosts', the API's and pytest's folders are empty, so a read of another's disk fails there
instead of going unseen between two samples.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.images import image_bytes
from tests.postgres import REPO, PrefectStack, _descendants
from tests.result_files import s3_records

pytestmark = pytest.mark.timeout(1500)  # a hung worker must fail the test, not stall CI

BUCKET = "separate-hosts"
MODEL = "vlm-caption-tests/tiny-llava"  # a hub id, in each host's own hub cache
OUT = "captions/"  # the output's prefix in the bucket: results, claims, manifests, the Parquet view
ITEMS, SHARD = 48, 2  # 24 shards: some left for the late partitions to take, some for the kill to leave
POOL = "vlm-caption-gpu"
# What a host takes of this process's environment: what any machine has (PATH, locale,
# certificates, the CPU engine's settings from tests/conftest.py), nothing naming a folder of
# this process's or carrying a credential or a Prefect setting.
NOT_INHERITED = ("AWS_", "PREFECT_", "VLM_CAPTION_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "XDG_", "VLLM_CACHE",
                 "TORCHINDUCTOR_", "TRITON_", "PYTEST", "UV_", "VIRTUAL_ENV", "PYTHONPATH", "TMP", "TEMP", "HOME",
                 "PWD", "OLDPWD")


class Host:
    """A machine of its own: one folder, named so that no other host's path contains its name."""

    def __init__(self, base: Path, role: str, token: str, checkpoint: Path, api: str):
        self.name = f"{role}-host"  # its worker's name
        self.root = base / f"{role}-host-only-{token}"
        for folder in ("work", "home", "tmp", "hf", "vllm-cache", "xdg-cache", "xdg-config", "prefect"):
            (self.root / folder).mkdir(parents=True)
        # The model pre-pulled into this host's hub cache (refs/main -> snapshots/<commit>/).
        commit = "0" * 40
        repo = self.root / "hf" / "hub" / f"models--{MODEL.replace('/', '--')}"
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(commit)
        shutil.copytree(checkpoint, repo / "snapshots" / commit)
        # Its Prefect client settings: a profile of its own in its own Prefect home, at the one API.
        (self.root / "prefect" / "profiles.toml").write_text(
            f'active = "{role}"\n\n[profiles.{role}]\nPREFECT_API_URL = "{api}"\nPREFECT_WORKER_QUERY_SECONDS = "2"\n')
        self.env = {key: value for key, value in os.environ.items() if not key.startswith(NOT_INHERITED)}
        self.env.update({
            "HOME": str(self.root / "home"), "TMPDIR": str(self.root / "tmp"), "HF_HOME": str(self.root / "hf"),
            "HF_HUB_OFFLINE": "1", "VLLM_CACHE_ROOT": str(self.root / "vllm-cache"),
            "XDG_CACHE_HOME": str(self.root / "xdg-cache"), "XDG_CONFIG_HOME": str(self.root / "xdg-config"),
            "PREFECT_HOME": str(self.root / "prefect"), "VLM_CAPTION_HOME": str(REPO),  # the image's code
            # Three CPU engines share two cores here: decode in the fetch threads (no pool of
            # processes per host), and a feed of two shards, so a partition holds few shards at a
            # time and the late ones find shards left to take.
            "VLM_CAPTION_DECODE_PROCESSES": "0", "VLM_CAPTION_FEED_DEPTH": "2", "VLM_CAPTION_PREPARE_AHEAD": "1",
        })

    @property
    def log(self) -> Path:
        return self.root / "worker.log"

    def start_worker(self, stack: PrefectStack, hidden: list[Path]) -> None:
        """Its process worker, in its own folder with its own environment, where it can, in a mount
        namespace of its own with `hidden` (the other machines' folders) empty; ended by the
        stack's close()."""
        command = [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--limit", "1",
                   "--name", self.name, "--type", "process"]
        if can_hide():
            mounts = " && ".join(f"mount -t tmpfs -o size=1m none {shlex.quote(str(path))}" for path in hidden)
            command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", f'{mounts} && exec "$@"', "sh",
                       *command]  # unshare and sh exec: the Popen's pid is the worker's
        log = open(self.log, "ab")
        stack.logs.append(log)
        stack.workers[self.name] = subprocess.Popen(command, cwd=self.root / "work", env=self.env, stdout=log,
                                                    stderr=subprocess.STDOUT, start_new_session=True)


@functools.cache
def can_hide() -> bool:
    """Whether this test may make mount namespaces (root with CAP_SYS_ADMIN, as in a CI container)."""
    try:
        return subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class ProcessWatch:
    """Every second while the run goes, what each host's processes (its worker and everything
    under it) run in, hold open and map, and their environments and command lines: a read of
    another host's folder shows up as a path of it."""

    def __init__(self, workers: dict[str, subprocess.Popen]):
        self.workers = workers  # the stack's, live: a killed worker leaves it
        self.seen: dict[str, set[str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="process-watch", daemon=True)

    def __enter__(self) -> ProcessWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            for name, worker in list(self.workers.items()):
                for pid in _descendants(worker.pid):
                    self.seen.setdefault(name, set()).update(_held(Path(f"/proc/{pid}")))


def _held(proc: Path) -> set[str]:
    found = set()
    with contextlib.suppress(OSError):
        if (proc / "cmdline").read_bytes().startswith((b"unshare\0", b"sh\0-c\0mount ")):
            return found  # the harness hiding the others' folders (it names them), before the worker's exec
        found.add(os.readlink(proc / "ns" / "mnt"))  # "mnt:[...]": which mount namespace it runs in
        found.add(os.readlink(proc / "cwd"))
        for fd in (proc / "fd").iterdir():
            with contextlib.suppress(OSError):
                found.add(os.readlink(fd))
        found.update(line.split(maxsplit=5)[5] for line in (proc / "maps").read_text().splitlines()
                     if len(line.split(maxsplit=5)) == 6)
        for name in ("environ", "cmdline"):  # read each time: a pid read between fork and exec changes
            found.update(value.decode(errors="replace") for value in (proc / name).read_bytes().split(b"\0"))
    return found


@pytest.fixture
def machines():
    """Where the hosts' and the API's folders go: a short path, as /tmp is on a real host. vLLM
    binds a Unix socket in TMPDIR, whose path may hold 107 characters; under pytest's tmp_path a
    host's TMPDIR left no room for it."""
    folder = Path(tempfile.mkdtemp(prefix="vlm-hosts-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def api(machines, s3_endpoint):
    """The one Prefect API of the three hosts (`vlm-caption server` on SQLite, in a folder of its
    own) as an operator sets it up: the work pool, the S3 block, `prefect deploy --all`, the zombie
    automation. No worker yet: each host starts its own."""
    token = secrets.token_hex(4)
    root = machines / f"prefect-api-only-{token}"
    root.mkdir()
    stack = PrefectStack(root, SimpleNamespace(url=f"sqlite+aiosqlite:///{root / 'prefect.db'}"))
    stack.token = token
    try:
        stack.start_server()
        stack.cli("work-pool", "create", POOL, "--type", "process",
                  "--base-job-template", "deployments/base-job-templates/process-gpu.json")
        stack.python(
            "from prefect_aws import AwsCredentials\n"
            "AwsCredentials(aws_access_key_id='testing', aws_secret_access_key='testing', region_name='us-east-1',"
            f" aws_client_parameters={{'endpoint_url': '{s3_endpoint}'}}).save('vlm-caption-s3')")
        stack.cli("deploy", "--all", "--prefect-file", "deployments/prefect.yaml")
        stack.cli("automation", "create", "--from-file", "deployments/automations.yaml")
        yield stack
    finally:
        stack.close()  # the server and every host's worker, with everything under them


# -- the bucket -----------------------------------------------------------------------------------
def keys_under(s3_client, prefix: str) -> list[str]:
    pages = s3_client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return [obj["Key"] for page in pages for obj in page.get("Contents", [])]


def body(s3_client, key: str) -> bytes:
    return s3_client.get_object(Bucket=BUCKET, Key=key)["Body"].read()


def run_id_of(s3_client, flow_run_id: str) -> str | None:
    """The fanned-out run's id (its flow run's first 8 characters and a stamp), once it has claims."""
    found = {key.split("/")[2] for key in keys_under(s3_client, f"{OUT}claims/{flow_run_id[:8]}-")}
    return found.pop() if found else None


def unfinished_claims(s3_client, run_id: str) -> dict[int, str]:
    """Shards claimed and not done (none retaken yet): index -> the partition holding it (p1, ...)."""
    names = {key.rsplit("/", 1)[1] for key in keys_under(s3_client, f"{OUT}claims/{run_id}/")}
    held = {}
    for name in names:
        if re.fullmatch(r"\d{6}", name) and f"{name}.done" not in names:
            with contextlib.suppress(Exception):  # being written: seen next time
                held[int(name)] = json.loads(body(s3_client, f"{OUT}claims/{run_id}/{name}"))["owner"]
    return held


def shards_by_partition(parts: list[str], run_id: str) -> dict[int, set[int]]:
    """Which shards each partition wrote a results part of, from the parts' keys or URIs."""
    found: dict[int, set[int]] = {}
    for part in parts:
        if match := re.search(rf"/part-{re.escape(run_id)}-p(\d+)-(\d{{5}})\.parquet$", part):
            found.setdefault(int(match[1]), set()).add(int(match[2]))
    return found


def parts_by_partition(s3_client, run_id: str) -> dict[int, set[int]]:
    """Which shards each partition wrote a results part of, as the output holds them while the run
    runs (at its end they are folded into its view file and deleted: the manifest lists them)."""
    return shards_by_partition(keys_under(s3_client, f"{OUT}parquet/"), run_id)


def child_hosts(stack: PrefectStack, hosts: list[Host]) -> dict[int, Host]:
    """Which of `hosts` runs each child partition started so far (index -> host), from the child
    flow runs' process ids."""
    found = {}
    for run in stack.runs_of("vlm-caption/partition"):
        if run.get("infrastructure_pid"):
            pid = int(run["infrastructure_pid"].rsplit(":", 1)[-1])  # "pid" or "host:pid"
            found.update({run["parameters"]["job"]["partition"]["index"]: host for host in hosts
                          if host.name in stack.workers and pid in _descendants(stack.workers[host.name].pid)})
    return found


def tails(stack: PrefectStack, hosts: dict[str, Host], chars: int = 3000) -> str:
    return stack.log_tail("server", chars=chars) + "".join(
        f"\n--- {host.name}\n" + host.log.read_text(errors="replace")[-chars:] for host in hosts.values()
        if host.log.exists())


# -- the test ---------------------------------------------------------------------------------------
def test_parent_and_partitions_on_separate_hosts_share_only_the_bucket_and_the_api(api, machines, s3_client,
                                                                                  tiny_llava, tmp_path_factory):
    stack = api
    s3_client.create_bucket(Bucket=BUCKET)
    keys = set()
    for i in range(ITEMS):  # distinct bytes: each item is captioned, none a copy of another (dedup)
        s3_client.put_object(Bucket=BUCKET, Key=f"media/{i:03d}.jpg",
                             Body=image_bytes(size=(48 + i, 40 + i % 5), color=(i * 7 % 255, 90, 200 - i)))
        keys.add(f"{i:03d}.jpg")
    hosts = {role: Host(machines, role, stack.token, tiny_llava, stack.api) for role in ("parent", "a", "b")}
    # What a host must not see: the other hosts', the API's and pytest's folders (the checkpoint's among them).
    hidden = {host.name: [other.root for other in hosts.values() if other is not host]
              + [stack.root, tmp_path_factory.getbasetemp()] for host in hosts.values()}
    job = {"source": f"s3://{BUCKET}/media/", "output": f"s3://{BUCKET}/{OUT}", "recipe": "llava",
           "model": MODEL, "fan_out": 3, "shard_size": SHARD,
           # 48 tokens an item, two at a time: a shard takes a few seconds, so the run is still
           # going when the late partitions' engines are up
           "sampling": {"max_tokens": 48, "ignore_eos": True},
           "engine_overrides": {"kv_cache_memory_bytes": 512 * 1024**2, "max_num_seqs": 2}}

    with ProcessWatch(stack.workers) as watch:
        # The parent's host alone first, so that its worker (one run at a time) takes the parent run.
        hosts["parent"].start_worker(stack, hidden[hosts["parent"].name])
        parent_id = stack.run_deployment("vlm-caption/prod", job)
        deadline = time.time() + 300
        while stack.flow_run(parent_id)["state_type"] == "SCHEDULED":
            assert time.time() < deadline, "the parent host's worker did not take the run\n" + tails(stack, hosts)
            time.sleep(1)
        hosts["a"].start_worker(stack, hidden[hosts["a"].name])
        hosts["b"].start_worker(stack, hidden[hosts["b"].name])

        # The run's end is watched beside the loop below, which reads only the bucket: under load the
        # API can take a minute to answer (SQLite locked), longer than a child holds its last shards.
        ended: dict[str, dict] = {}  # "run": the parent's flow run once final

        def wait_for_parent() -> None:
            with contextlib.suppress(TimeoutError):  # not final by then: the wait below says so
                ended["run"] = stack.wait_for(parent_id, timeout=1400)

        waiting = threading.Thread(target=wait_for_parent, name="parent-run", daemon=True)
        waiting.start()
        # Once a child has captioned a shard and holds another, its host dies. The host is frozen
        # (SIGSTOP) before its claims are read again, so that what it holds cannot change between that
        # read and the kill; a host that turns out to hold nothing unfinished is let go on (SIGCONT).
        run_id, victim, on_host, deadline = None, None, {}, time.time() + 900
        while victim is None:
            assert "run" not in ended, (f"the run ended ({ended['run']['state_type']}) before a partition was "
                                        "killed\n" + tails(stack, hosts))
            assert time.time() < deadline, "no child partition got to work\n" + tails(stack, hosts)
            run_id = run_id or run_id_of(s3_client, parent_id)
            if run_id:
                held, parts = unfinished_claims(s3_client, run_id), parts_by_partition(s3_client, run_id)
                for p in [p for p in (1, 2) if parts.get(p) and f"p{p}" in held.values()]:
                    on_host = on_host if p in on_host else child_hosts(stack, [hosts["a"], hosts["b"]])
                    if p not in on_host:
                        continue
                    stack.signal_worker(on_host[p].name, signal.SIGSTOP)
                    held = {index for index, owner in unfinished_claims(s3_client, run_id).items()
                            if owner == f"p{p}"}
                    if held - parts_by_partition(s3_client, run_id).get(p, set()):
                        victim, killed = p, on_host[p]
                        break
                    stack.signal_worker(on_host[p].name, signal.SIGCONT)
            time.sleep(0.5)
        stack.kill_worker(killed.name)
        children = {run["parameters"]["job"]["partition"]["index"]: run
                    for run in stack.runs_of("vlm-caption/partition")}
        waiting.join(timeout=600)
        assert "run" in ended, "the run did not end after the kill\n" + tails(stack, hosts)
        parent = ended["run"]
    assert parent["state_type"] == "COMPLETED", f"{parent['state']}\n" + tails(stack, hosts)

    # Every item captioned once: none lost with the killed host, none captioned twice.
    found = s3_records(s3_client, BUCKET, OUT)
    assert Counter(r["key"] for r in found) == Counter(keys)
    assert all(r["error"] is None for r in found), [r["error"] for r in found if r["error"]]

    # The killed partition's unfinished shards were captioned by another partition, which says so.
    (manifest,) = [json.loads(body(s3_client, key)) for key in keys_under(s3_client, f"{OUT}manifests/{run_id}")
                   if key.endswith(".json")]
    parts = shards_by_partition(manifest["parts"], run_id)  # the run's parts, folded and deleted at its end
    left = held - parts.get(victim, set())
    assert left, f"partition {victim} had finished every shard it held when its host was killed"
    assert all(any(shard in done for p, done in parts.items() if p != victim) for shard in left), (left, parts)
    partitions = {p["index"]: p for p in manifest["partitions"]}
    assert sorted(partitions) == [0, 1, 2]
    assert sum(p["retaken"] for i, p in partitions.items() if i != victim) >= len(left), partitions
    assert "no report" in partitions[victim]["state"], partitions[victim]
    # What the killed host wrote is counted from its parts: the manifest says every item captioned once.
    assert manifest["counts"]["processed"] == ITEMS, (manifest["counts"], partitions[victim])
    print(f"separate hosts: p{victim} killed on {killed.name} holding shards {sorted(held)}, of which "
          f"{sorted(left)} unfinished; retaken: {[(i, p['retaken']) for i, p in sorted(partitions.items())]}; "
          f"manifest counts {manifest['counts']['processed']} processed of {ITEMS}; folders hidden: {can_hide()}")
    survivor = next(h for h in (hosts["a"], hosts["b"]) if h is not killed)
    assert partitions[0]["worker"] == hosts["parent"].name  # the parent captioned partition 0 on its host
    assert partitions[3 - victim]["worker"] == survivor.name and partitions[3 - victim]["state"] == "COMPLETED"

    # The run's Parquet view holds every item once.
    view = [key for key in keys_under(s3_client, f"{OUT}parquet/") if key.endswith(".parquet")]
    assert manifest["parquet"]["path"] in {f"s3://{BUCKET}/{key}" for key in view}, manifest["parquet"]
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.concat_tables(pq.read_table(io.BytesIO(body(s3_client, key))) for key in view)
    assert Counter(table.column("key").to_pylist()) == Counter(keys)

    # Nothing of one host reached another: no path of another host's folder, the API's or the
    # checkpoint's in what each host's processes held, in their environments, or in its log.
    # Each host's flow run was watched, and vLLM filled that host's own cache.
    folders = {host.name: host.root.name for host in hosts.values()}
    ran = {hosts["parent"].name: parent_id, killed.name: children[victim]["id"],
           survivor.name: children[3 - victim]["id"]}
    for host in hosts.values():
        seen = watch.seen.get(host.name, set())
        foreign = {stack.root.name: "the API's folder", str(tiny_llava): "the checkpoint",
                   **{folder: f"{name}'s folder" for name, folder in folders.items() if name != host.name}}
        reached = {what: sorted(s for s in seen if folder in s)[:5] for folder, what in foreign.items()
                   if any(folder in s for s in seen)}
        assert not reached, f"{host.name}'s processes reached another's: {reached}"
        log = host.log.read_text(errors="replace")
        assert not [what for folder, what in foreign.items() if folder in log], f"{host.name}'s log names another's"
        assert f"PREFECT__FLOW_RUN_ID={ran[host.name]}" in seen, f"{host.name}'s flow run process was not seen"
        assert any((host.root / "vllm-cache").iterdir()), f"{host.name}'s engine used no cache of its own"
        if can_hide():  # its processes ran where the others' folders were empty
            assert os.readlink("/proc/self/ns/mnt") not in seen, f"{host.name} ran in this test's mount namespace"
