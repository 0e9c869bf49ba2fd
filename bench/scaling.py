"""`python -m vlm_caption.bench.scaling`: the model of how a night's wall scales with hosts
(docs/operations.md, "How a night scales with hosts") checked by a simulation on one machine.

Each partition is a thread with an S3 client of its own, as a host has, running the product's own
fan-out on a loopback moto S3 (bench/loopback_s3.py): the done-index load, the shard plan, the claims,
the wait and the retakes, each shard's write and done mark. The engine is a stub: it starts
(`start_s` of sleep) at the partition's first shard, as the pipeline's does, then generates a shard
in len(items) / `rate` s while the next is claimed and the last written. Prefect is not in it (its
load is on paper). Every S3 request is counted through the clients' botocore events."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import queue
import tempfile
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple
from unittest import mock
from urllib.parse import parse_qs, unquote, urlsplit

from vlm_caption.flows.pipeline import RETAKE_POLL_S
from vlm_caption.tasks.claims import ShardClaims, remove_claims
from vlm_caption.tasks.records import ResultRecord
from vlm_caption.tasks.results.done_index import read_done_index
from vlm_caption.tasks.results.layout import partition_parts_id, parts_prefix
from vlm_caption.tasks.results.parquet import read_records
from vlm_caption.tasks.results.writers import write_shard
from vlm_caption.tasks.shard_plan import POLL_S, SharedListing
from vlm_caption.tasks.sources.formats import SourceSpec
from vlm_caption.tasks.sources.items import Shard
from vlm_caption.tasks.sources.s3_client import make_s3_client
from vlm_caption.tasks.sources.storage import S3Storage

FINGERPRINT, QUESTIONS = "scaling-sim", ("Describe the image.",)


@dataclass(frozen=True)
class Scenario:
    items: int = 3072
    shard_size: int = 64
    rate: float = 80.0  # items/s of each stub engine
    start_s: float = 3.0  # each engine's start, paid by every partition
    depth: int = 2  # shards waiting in a partition's feed, claimed before its engine takes them
    end_poll_s: float = RETAKE_POLL_S  # how often a partition out of shards looks at the others' claims
    fails_after: dict[int, int] = field(default_factory=dict)  # partition -> shards its engine generates, then fails


# A run's buckets, the source's and its output's own (moto lists a prefix by walking its bucket's every key).
Store = NamedTuple("Store", [("source", str), ("out", str), ("run_id", str)])


class Requests:
    """The S3 requests one client sends (every attempt) by partition phase (`run`: its own shards, `end`:
    the wait and retakes, `cleanup`), key area and kind; the claims it lost (412); its calls' time."""

    def __init__(self, client, source_bucket: str):
        self.source, self.phase, self.calls, self.waited_s = f"/{source_bucket}/", "run", 0, 0.0
        self.counts, self.lost_claims, self._lock = Counter(), 0, threading.Lock()
        client.meta.events.register("before-send.s3", self._sent)
        client.meta.events.register("before-call.s3", lambda context, **_: context.update(sent_at=time.monotonic()))
        client.meta.events.register("after-call.s3", self._answered)

    def _sent(self, request, **_) -> None:  # returns None: botocore sends the request as it is
        url = urlsplit(request.url)
        where = unquote(url.path) + "/" + "".join(parse_qs(url.query).get("prefix", []))  # path style: /bucket/key
        area = ("listing" if where.startswith(self.source) else "plan" if "/plan/" in where
                else "claims" if "/claims/" in where else "outputs" if "/parquet/" in where else "other")
        kind = {"PUT": "claim" if "If-None-Match" in request.headers else "put",
                "GET": "list" if "list-type" in url.query else "get"}.get(request.method, request.method.lower())
        with self._lock:
            self.counts[(self.phase, area, kind)] += 1

    def _answered(self, http_response, context, **_) -> None:
        with self._lock:
            self.lost_claims += getattr(http_response, "status_code", None) == 412
            self.calls, self.waited_s = self.calls + 1, self.waited_s + time.monotonic() - context["sent_at"]


class StubEngine:
    """A partition's engine, stubbed: started at the first shard fed, then a shard at a time, each part (its
    done mark last) written by the product's write beside the next one's generating. `take` claims a shard
    when fewer than `depth` wait, as the pipeline does; a failed engine drops its shards: claimed, not done."""

    def __init__(self, claims: ShardClaims, scenario: Scenario, run_id: str, t0: float):
        self.claims, self.scenario, self.t0 = claims, scenario, t0
        self.parts_id = partition_parts_id(run_id, claims.partition)
        self.fails_after = scenario.fails_after.get(claims.partition)
        self.shards, self.slots = queue.Queue(), threading.Semaphore(scenario.depth)
        self.writer = ThreadPoolExecutor(2, thread_name_prefix="stub-write")
        self.writes, self.generated, self.failed, self.marks = [], [], False, {}
        self._thread: threading.Thread | None = None

    def mark(self, what: str) -> None:
        self.marks[f"{what}_s"] = round(time.monotonic() - self.t0, 3)

    def _run(self) -> None:
        time.sleep(self.scenario.start_s)
        self.mark("engine_ready")
        while (shard := self.shards.get()) is not None:
            self.slots.release()
            self.failed = self.failed or len(self.generated) == self.fails_after
            if not self.failed:
                self._generate(shard)
            self.shards.task_done()
        self.shards.task_done()

    def _generate(self, shard: Shard) -> None:
        time.sleep(len(shard.items) / self.scenario.rate)
        self.generated.append(shard)
        self.mark("last_generated")
        records = [ResultRecord(key=item.id, size=item.members[0].size, etag=item.members[0].etag, sha256=None,
                                recipe="stub", model="stub", question=QUESTIONS[0], prompt=None, text="a caption",
                                finish_reason="stop", timings={}, fingerprint=FINGERPRINT, run_id=self.parts_id)
                   for item in shard.items]
        self.writes.append(self.writer.submit(write_shard, self.claims.out, FINGERPRINT, self.parts_id, shard.index,
                                              records, "stub", self.claims.done_key(shard.index)))

    def take(self, shards) -> None:
        """Each of `shards` fed as the feed has room (claimed then, if `shards` claims); every
        shard fed generated (or dropped) and every part written before it returns."""
        shards = iter(shards)
        while self.slots.acquire() and not self.failed and (shard := next(shards, None)) is not None:
            if not isinstance(shard, Shard):  # items the listing found done: no room taken
                self.slots.release()
                continue
            if self._thread is None:
                self.mark("first_shard")
                self._thread = threading.Thread(target=self._run, name="stub-engine", daemon=True)
                self._thread.start()
            self.shards.put(shard)
        self.slots.release()
        if self._thread is not None:
            self.shards.join()
        for write in self.writes:
            write.result()

    def close(self) -> None:
        self.shards.put(None)  # the engine's thread ends, if it began
        self.writer.shutdown(wait=True)


def _partition(index: int, partitions: int, scenario: Scenario, store: Store, client, requests: Requests,
               go: threading.Event, t0: list[float]) -> dict:
    """A partition as flows/pipeline.py drives one: its shards claimed from the plan as its feed
    has room, then the wait for the others' claimed shards, retaking those of a partition gone."""
    out = S3Storage(store.out, "", client)
    source = SourceSpec(f"s3://{store.source}/", opened=S3Storage(store.source, "", client))
    go.wait()
    with ShardClaims(out, store.run_id, index, partitions=partitions) as claims:  # N: where its share of a chunk is
        engine = StubEngine(claims, scenario, store.run_id, t0[0])
        done = read_done_index(out, FINGERPRINT)

        plan = lambda shards="originals": SharedListing(  # noqa: E731 - the run's plan, read or listed
            out, store.run_id, claims, source, scenario.shard_size, None,
            lambda items: done.pending_mask(items, QUESTIONS), shards=shards).start()
        with contextlib.closing(plan()) as listing:
            engine.take(claims.claimed(listing))
        requests.phase = "end"
        while not engine.failed and (retaken := claims.retake()) is not None:
            if not retaken:
                time.sleep(scenario.end_poll_s)
                continue
            with contextlib.closing(plan("all")) as again:  # read again, as the pipeline reads a gone one's shards
                engine.take(s for s in again if isinstance(s, Shard) and s.index in retaken)
        engine.close()
    engine.mark("end")
    return {"partition": index, "lists": listing.lists, "claimed": claims.taken, "retaken": claims.retaken,
            "generated": sorted(s.index for s in engine.generated), "failed": engine.failed, **engine.marks}


def run_partitions(scenario: Scenario, partitions: int, store: Store) -> dict:
    """A fanned-out run over `partitions` threads, each with its own client, made before the clock starts."""
    clients = [make_s3_client() for _ in range(partitions)]
    requests = [Requests(client, store.source) for client in clients]
    go, t0 = threading.Event(), [0.0]
    # `list-source`, the listing's task run, a thread: a Prefect task is submitted in a flow run.
    on_a_thread = SimpleNamespace(submit=lambda listing: threading.Thread(target=listing.produce, daemon=True).start())
    with mock.patch("vlm_caption.tasks.sources.listing.list_source", on_a_thread), \
            ThreadPoolExecutor(partitions, thread_name_prefix="partition") as pool:
        running = [pool.submit(_partition, i, partitions, scenario, store, clients[i], requests[i], go, t0)
                   for i in range(partitions)]
        t0[0] = time.monotonic()
        go.set()
        results = [partition.result() for partition in running]  # a partition's error raised here
    wall = time.monotonic() - t0[0]
    requests[0].phase = "cleanup"  # the parent's, once its children have ended
    remove_claims(S3Storage(store.out, "", clients[0]), store.run_id)
    return {"wall_s": wall, "partitions": results, "counts": sum((r.counts for r in requests), Counter()),
            "lost_claims": sum(r.lost_claims for r in requests),
            "latency_s": sum(r.waited_s for r in requests) / max(1, sum(r.calls for r in requests))}


def predict(scenario: Scenario, shards: int, n: int, calibration: dict, latency_s: float) -> dict[str, float]:
    """wall(N) = F + P(N) + H(N) + E + ceil(S/N) * s + T + W(N); H, the start's lost claims as
    docs/operations.md has it: all try the plan's first free shard, one wins each round of a PUT, a
    GET and a LIST. (Kept as it was, though partitions now take each chunk from their own share on,
    tasks/claims.py: they still meet at a first chunk cut at one shard, and at their shares' ends.)"""
    return {"F_first_shard": calibration["first_s"], "P_plan_poll": POLL_S / 2 * (n - 1) / n,
            "H_start_lost_claims": (n - 1) / 2 * 3 * latency_s, "E_engine_start": scenario.start_s,
            "G_generate": math.ceil(shards / n) * scenario.shard_size / scenario.rate,
            "T_last_write": calibration["end_s"], "W_wait_for_others": scenario.end_poll_s if n > 1 else 0.0}


def summarize(run: dict, scenario: Scenario, calibration: dict[str, float] | None, store: Store) -> dict:
    """The run beside the model (calibrated on this run without `calibration`) and its parts' keys, read back."""
    firsts = [p["first_shard_s"] for p in run["partitions"] if "first_shard_s" in p]
    last = max(p.get("last_generated_s", 0) for p in run["partitions"])
    measured = {"first_s": min(firsts), "mean_first_s": sum(firsts) / len(firsts), "end_s": run["wall_s"] - last,
                "latency_s": run["latency_s"]}
    calibration = calibration or measured
    out = S3Storage(store.out, "", make_s3_client())
    written = Counter(record.key for ref in out.iter_objects(prefix=parts_prefix(FINGERPRINT))
                      if ref.key.endswith(".parquet") for record in read_records(out, ref.key))
    parts, n, items = run["partitions"], len(run["partitions"]), scenario.items
    shards, total = math.ceil(items / scenario.shard_size), sum(run["counts"].values())
    terms = predict(scenario, shards, n, calibration, calibration["latency_s"])
    with_its_store = sum(predict(scenario, shards, n, calibration, measured["latency_s"]).values())  # its store's H
    by = {name: sum((Counter({key[i]: count}) for key, count in run["counts"].items()), Counter())
          for i, name in enumerate(("phase", "area", "kind"))}
    return {
        "partitions": n, "items": items, "shards": shards, "wall_s": round(run["wall_s"], 3),
        "model_s": round(sum(terms.values()), 3), "ratio": round(run["wall_s"] / sum(terms.values()), 3),
        "model_terms": {k: round(v, 3) for k, v in terms.items()},
        "measured": {k: round(v, 3) for k, v in measured.items()}, "model_at_its_latency_s": round(with_its_store, 3),
        "ratio_at_its_latency": round(run["wall_s"] / with_its_store, 3),
        "items_missing": items - len(written), "items_written_twice": sum(1 for c in written.values() if c > 1),
        "shards_generated_twice": sum(1 for c in Counter(i for p in parts for i in p["generated"]).values() if c > 1),
        "shards_retaken": sum(p["retaken"] for p in parts), "lost_claims": run["lost_claims"],
        "s3_requests": total, "s3_requests_per_item": round(total / items, 3),
        "s3_requests_per_shard": round(total / shards, 2), "s3_requests_per_s": round(total / run["wall_s"], 1),
        **{f"s3_by_{name}": dict(sorted(c.items())) for name, c in by.items()}, "by_partition": parts}


def simulate(scenario: Scenario, counts: tuple[int, ...], tag: str | None = None) -> dict:
    """A run over each of `counts` partitions (the first calibrates the model) on the settings' S3 endpoint."""
    tag = tag or time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:4]
    client, source = make_s3_client(), f"scaling-{tag}-source"
    client.create_bucket(Bucket=source)
    with ThreadPoolExecutor(8) as pool:  # each of other bytes: the listing takes the same size and etag for a copy
        list(pool.map(lambda i: client.put_object(Bucket=source, Key=f"img/{i:06d}.jpg", Body=b"%d" % i),
                      range(scenario.items)))
    runs: list[dict] = []
    for n in counts:
        store = Store(source, f"scaling-{tag}-n{n}", f"sim{tag}-n{n}")
        client.create_bucket(Bucket=store.out)
        run = run_partitions(scenario, n, store)
        runs.append(summarize(run, scenario, runs[0]["measured"] if runs else None, store))
    return {"scenario": asdict(scenario), "calibrated_on": counts[0], "runs": runs}


def table(report: dict) -> str:
    rows = ["| partitions | shards | model | measured | measured / model | at its store's latency | S3 requests per "
            "item | per shard | lost claims | retaken | items missing / twice |", "|" + " --- |" * 11]
    return "\n".join(rows + [
        f"| {r['partitions']} | {r['shards']} | {r['model_s']:.2f} s | {r['wall_s']:.2f} s | {r['ratio']:.3f} "
        f"| {r['ratio_at_its_latency']:.3f} ({1000 * r['measured']['latency_s']:.0f} ms) "
        f"| {r['s3_requests_per_item']:.3f} | {r['s3_requests_per_shard']:.1f} | {r['lost_claims']} "
        f"| {r['shards_retaken']} | {r['items_missing']} / {r['items_written_twice']} |" for r in report["runs"]])


def main(argv: list[str] | None = None) -> int:
    from vlm_caption.bench.harness import loopback_s3

    parser = argparse.ArgumentParser(prog="python -m vlm_caption.bench.scaling", description=__doc__.split("\n\n")[0])
    parser.add_argument("--partitions", default="1,4,16", help="partition counts, the first calibrating (1,4,16)")
    for name in ("items", "shard_size", "rate", "start_s", "depth"):  # the Scenario's, its defaults
        parser.add_argument("--" + name.replace("_", "-"), type=type(value := getattr(Scenario, name)), default=value)
    parser.add_argument("--dir", help="where scaling.json and the moto server's log go (default: a new temp folder)")
    args = parser.parse_args(argv)
    scenario = Scenario(args.items, args.shard_size, args.rate, args.start_s, args.depth)
    (work := Path(args.dir or tempfile.mkdtemp(prefix="vlm-caption-scaling-"))).mkdir(parents=True, exist_ok=True)
    with loopback_s3(work):
        report = simulate(scenario, tuple(int(n) for n in args.partitions.split(",")))
    (work / "scaling.json").write_text(json.dumps(report, indent=2))
    print(f"{table(report)}\nreport: {work / 'scaling.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
