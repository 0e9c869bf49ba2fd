"""`vlm-caption bench --history N`: what a nightly run costs over a history of N done results.

It synthesizes a source of N small items and their N done results exactly as a run leaves them
(parts of `--shard-size` records, the run's Parquet view file that the done-index reads, its
manifest), then times `vlm-caption run` over it, each run a process with a fresh Prefect home:

- `nothing_new`: every item done;
- `one_pct_new`: N/100 new items, spread evenly among the done ones (each sorts after a done one),
  or with `--history-new-at end` all after them (a bucket whose keys begin with the day);
- `new_only_empty_output`: the same new items alone, into an empty output (what they cost with
  no history); the ratio line puts `one_pct_new - nothing_new` over it.

Each run's figures: wall, the peak RSS of the run's process (and of its process tree), the task
runs Prefect's server recorded and their states (read from the run's Prefect home's SQLite
database), and how many events Prefect's server dropped (`Subscription queue is full` in the
run's log). With `--history-source inventory` the history is an S3 Inventory report of a bucket
(bench/history_inventory.py), not a folder to walk; `--history-keep DIR` keeps the synthesized
history there and uses it again (what the bench's runs added removed first). Items are hard
links to one small JPEG (a done item's bytes are never read): a million in about a minute.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from vlm_caption.bench.config import BenchConfig
from vlm_caption.bench.processes import output_file, read_all, started

PER_FOLDER = 10_000  # items per source folder (a bucket's keys are flat; a folder's are not)
HISTORY_RUN = "history0-20260101T000000"  # the run that "wrote" the synthesized results
DROPPED = "Subscription queue is full"


def run_history(cfg: BenchConfig) -> dict[str, Any]:
    from vlm_caption.bench.driver import build_checkpoint
    from vlm_caption.bench.harness import loopback_s3, prefect_api, server_home
    from vlm_caption.bench.history_inventory import InventoryLocations, kept_history

    work = Path(cfg.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    model = cfg.model or build_checkpoint(work, "llava", "tiny")
    inventory = cfg.history_source == "inventory"
    name = f"history-{cfg.history}-{cfg.source}" + ("-inventory" if inventory else "")
    base = Path(cfg.history_keep).resolve() if cfg.history_keep else work / name
    report: dict[str, Any] = {"history": cfg.history, "source": cfg.source, "history_source": cfg.history_source,
                              "shard_size": cfg.shard_size, "model": model}
    wanted = {"history": cfg.history, "source": cfg.source, "history_source": cfg.history_source,
              "shard_size": cfg.shard_size, "model": model, "run": HISTORY_RUN}
    with ExitStack() as serving:  # an inventory's items are in a bucket: the loopback one
        env = serving.enter_context(loopback_s3(work)) if cfg.source == "s3" or inventory else {}
        env = {**os.environ, **env}
        # --prefect server: the timed runs against one `prefect server start`, up before them, as a
        # deployment's nightly run meets its server (embedded: each run starts its own, fresh).
        api = serving.enter_context(prefect_api(cfg.prefect, work))
        runs_db = (lambda home: server_home(work) / "prefect.db") if api else (lambda home: home / "prefect.db")
        env_api = {**env, **api}
        where = InventoryLocations(base, cfg.source) if inventory else Locations(base, cfg.source)
        began = time.perf_counter()
        new = new_keys(where, cfg.history, cfg.history_new_at)
        if cfg.history_keep and cfg.source == "folder" and kept_history(base, wanted):
            for key in new:  # a listed history's new items from the last bench
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(where.source, key))
            report["synthesize_s"] = f"kept ({base})"
        else:
            if cfg.history_keep and base.exists() and any(base.iterdir()) and not (base / "synthesized.json").exists():
                raise RuntimeError(f"--history-keep {base}: not empty and not a history this bench kept; "
                                   "name a new folder")
            shutil.rmtree(base, ignore_errors=True)
            synthesize(where, cfg, model, env)
            report["synthesize_s"] = round(time.perf_counter() - began, 1)
            if cfg.history_keep:
                (base / "synthesized.json").write_text(json.dumps({**wanted, "compacted": where.compacted}))
        report["prefect_api"] = api.get("PREFECT_API_URL", "embedded")
        report["nothing_new"] = timed_run(where, where.source, where.out, model, cfg, env_api, base / "prefect-1",
                                          runs_db)
        if cfg.history_new:
            add_new_items(where, new, env)
            report["one_pct_new"] = timed_run(where, where.source, where.out, model, cfg, env_api, base / "prefect-2",
                                              runs_db)
            report["new_only_empty_output"] = timed_run(where, where.new_source, where.new_out, model, cfg, env_api,
                                                        base / "prefect-3", runs_db)
    line = (f"history {cfg.history:,} ({cfg.source}, {cfg.history_source}): nothing new "
            f"{report['nothing_new']['wall_s']} s, {report['nothing_new']['peak_rss_mb']} MB")
    if cfg.history_new:
        extra = report["one_pct_new"]["wall_s"] - report["nothing_new"]["wall_s"]
        report["ratio_new_over_empty"] = round(extra / report["new_only_empty_output"]["wall_s"], 3)
        line += (f"; 1% new minus nothing new {extra:.1f} s over the same new items into an empty output "
                 f"{report['new_only_empty_output']['wall_s']} s: {report['ratio_new_over_empty']}x")
    (work / f"bench-{name}.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    print(line)
    if not cfg.history_keep:
        shutil.rmtree(base, ignore_errors=True)
    return report


class Locations:
    """The bench's folders, or the same names under the loopback bucket."""

    source_format = "auto"
    key_prefix = ""

    def __init__(self, base: Path, source: str):
        self.base = base
        self.folder = base / "src"
        if source == "s3":
            self.source, self.out = "s3://bench/history/src/", "s3://bench/history/out/"
            self.new_source, self.new_out = "s3://bench/history/new/", "s3://bench/history/new-out/"
        else:
            self.source, self.out = str(base / "src"), str(base / "out")
            self.new_source, self.new_out = str(base / "new"), str(base / "new-out")


def item_key(i: int) -> str:
    return f"d{i // PER_FOLDER:04d}/{i:08d}.jpg"


def folder_of(key: str) -> str:
    return key.split("/", 1)[0]


def new_keys(where, n: int, at: str = "spread") -> list[str]:
    """The keys of the night's 1% new items. The j-th: at "spread", right after done item 100*j, so
    they are spread evenly; at "end", in a folder that sorts after every done item's (`item_key`)."""
    return [where.key_prefix + (f"new/{j:08d}.jpg" if at == "end" else f"d{100 * j // PER_FOLDER:04d}/{100 * j:08d}n.jpg")
            for j in range(max(1, n // 100))]


def synthesize(where: Locations, cfg: BenchConfig, model: str, env: dict[str, str]) -> list[str]:
    """The source's N items (or the inventory report that lists them) and their N done results;
    returns the keys of the 1% to add later."""
    import numpy as np
    import pyarrow as pa

    from vlm_caption.flows.params import CaptionJob
    from vlm_caption.flows.plan import make_plan
    from vlm_caption.tasks.results.done_rows import content_hash, result_key, signature_hash
    from vlm_caption.tasks.results.layout import manifest_key, run_parquet_key
    from vlm_caption.tasks.results.parquet import results_schema, view_row, write_rows
    from vlm_caption.tasks.records import ResultRecord, sha256_hex
    from vlm_caption.tasks.results.report import RunStats

    photo = small_jpeg()
    n = cfg.history
    keys = [where.key_prefix + item_key(i) for i in range(n)]
    etags = where.write_history(keys, photo) if where.source_format == "inventory" else \
        write_items(where, where.source, keys, photo, env)
    job = CaptionJob(source=where.source, output=where.out, model=model, shard_size=cfg.shard_size,
                     source_format=where.source_format, sampling={"max_tokens": cfg.max_tokens})
    plan = make_plan(job)
    out, question = plan.output, plan.job.questions_to_ask[0]
    template = ResultRecord(key="\x00", size=len(photo), etag="\x01", sha256=sha256_hex(photo), recipe=plan.recipe.name,
                            model=plan.model, question=question, prompt="USER: <image>\nASSISTANT:",
                            text="a small photo", finish_reason="length", prompt_tokens=70, output_tokens=8,
                            timings={"fetch_s": 0.001, "decode_s": 0.001, "generate_s": 0.01},
                            fingerprint=plan.fingerprint, run_id=HISTORY_RUN)
    # The run's view file, as `fold_run` would write it, made column by column (a million rows).
    signed = {folder: signature_hash(((etag, len(photo)),)) for folder, etag in etags.items()}
    same = view_row(template, None)
    columns = {"key": keys, "etag": [etags[folder_of(key)] for key in keys],
               "done_key": np.fromiter((result_key(key, question) for key in keys), np.uint64, n),
               "listed_hash": np.array([signed[folder_of(key)] for key in keys], np.uint64),
               "content_hash": np.full(n, content_hash(sha256_hex(photo)), np.uint64)}
    table = pa.table([pa.array(columns[f.name], f.type) if f.name in columns else
                      pa.array([same.get(f.name)] * n, f.type) for f in results_schema()], schema=results_schema())
    write_rows(out, run_parquet_key(HISTORY_RUN), [table])
    where.compacted = run_parquet_key(HISTORY_RUN).rsplit("/", 1)[1]
    stats = RunStats(listed=n, processed=n, succeeded=n)
    manifest = stats.manifest(run_id=HISTORY_RUN, parameters=plan.job.model_dump(mode="json"),
                              fingerprint=plan.fingerprint, engine=None)
    out.write(manifest_key(HISTORY_RUN), json.dumps(manifest, indent=2).encode())
    return new_keys(where, n, cfg.history_new_at)


def small_jpeg() -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (96, 64), (90, 140, 200)).save(buffer, "JPEG", quality=80)
    return buffer.getvalue()


def write_items(where: Locations, uri: str, keys: list[str], photo: bytes, env: dict[str, str]) -> dict[str, str]:
    """`keys` as items of the source at `uri`; returns the etag the listing gives the items of
    each folder: in a folder source they are hard links to one file per folder (a file takes
    at most 65,000 links on ext4), on S3 they are one body."""
    folders = sorted({folder_of(key) for key in keys})
    if not uri.startswith("s3://"):
        root, etags = Path(uri), {}
        for folder in folders:
            original = where.base / "photos" / f"{folder}.jpg"
            if not original.exists():
                original.parent.mkdir(parents=True, exist_ok=True)
                original.write_bytes(photo)
            os.makedirs(root / folder, exist_ok=True)
            stat = original.stat()
            etags[folder] = f"{stat.st_size:x}-{stat.st_mtime_ns:x}"
        prefix, photos = str(root) + "/", str(where.base / "photos") + "/"
        for key in keys:
            os.link(photos + folder_of(key) + ".jpg", prefix + key)
        return etags
    import hashlib

    from vlm_caption.tasks.sources.storage import open_storage

    store = open_storage(uri, create=True)
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(lambda key: store.write(key, photo), keys))
    return dict.fromkeys(folders, hashlib.md5(photo).hexdigest())


def add_new_items(where: Locations, keys: list[str], env: dict[str, str]) -> None:
    """The night's new items: beside the history, and alone in a source of their own."""
    photo = small_jpeg()
    if where.source_format == "inventory":
        return where.add_new_items(keys, photo)
    write_items(where, where.source, keys, photo, env)
    write_items(where, where.new_source, keys, photo, env)


def timed_run(where, source: str, out: str, model: str, cfg: BenchConfig, env: dict[str, str],
              home: Path, runs_db) -> dict[str, Any]:
    """`vlm-caption run` as a night's run starts it (its own process, a fresh Prefect home; its
    API the embedded server, or the one `env` names). `runs_db(home)`: the database it records in."""
    import psutil

    exe, log_dir = Path(sys.executable).with_name("vlm-caption"), home / "logs"
    command = [str(exe), "run", source, "--model", model, "--out", out, "--shard-size", str(cfg.shard_size),
               "--max-tokens", str(cfg.max_tokens), "--source-format", where.source_format]
    run_env = {**env, "PREFECT_HOME": str(home), "VLM_CAPTION_LOG_DIR": str(log_dir), "HF_HUB_OFFLINE": "1"}
    begun = time.perf_counter()
    # Stopped with all it started (its engine, its Prefect server) however the bench ends.
    with output_file() as printed, started(command, env=run_env, stdout=printed, stderr=printed) as proc:
        watched, peak, tree_peak = psutil.Process(proc.pid), 0, 0
        while proc.poll() is None:
            try:
                peak = max(peak, watched.memory_info().rss)
                tree = [watched, *watched.children(recursive=True)]
                tree_peak = max(tree_peak, sum(p.memory_info().rss for p in tree if p.is_running()))
            except psutil.Error:
                pass  # a child ended between the listing and the read: the next sample has the rest
            time.sleep(0.1)
        wall, output = time.perf_counter() - begun, read_all(printed)
    if proc.returncode != 0:
        raise RuntimeError(f"vlm-caption run failed (exit {proc.returncode}):\n{output[-4000:]}")
    logs = "".join(p.read_text(errors="replace") for p in log_dir.rglob("*.log")) if log_dir.exists() else output
    return {"wall_s": round(wall, 1), "peak_rss_mb": round(peak / 2**20), "tree_peak_rss_mb": round(tree_peak / 2**20),
            "task_runs": task_runs(runs_db(home)), "dropped_events": logs.count(DROPPED),
            "summary": output.strip().splitlines()[-8:]}


def task_runs(db: Path) -> dict[str, Any]:
    """The task runs of the newest flow run the server recorded, by name and by state, and what
    its database holds after the run (rows of the tables runs fill, its size on disk)."""
    if not db.exists():
        return {}
    with sqlite3.connect(db) as conn:
        newest = conn.execute("select id, start_time, end_time from flow_run order by created desc").fetchone()
        if newest is None:
            return {}
        flow_id, *flow = newest
        rows = conn.execute("select name, state_type from task_run where flow_run_id = ?", (flow_id,)).fetchall()
        spans = conn.execute("select name, start_time, end_time from task_run where end_time is not null "
                             "and flow_run_id = ?", (flow_id,)).fetchall()
        tables = {table: conn.execute(f"select count(*) from {table}").fetchone()[0]  # noqa: S608 - our names
                  for table in ("task_run_state", "flow_run", "events", "log", "artifact")}
    names = Counter(name.rsplit("-", 1)[0] for name, _ in rows)  # "prepare-shard-3f2" -> "prepare-shard"
    size = sum(f.stat().st_size for f in db.parent.glob(db.name + "*"))  # with its -wal and -shm
    seconds: Counter = Counter()
    for name, start, end in spans:  # each step's task runs, their seconds summed (they overlap)
        seconds[name.rsplit("-", 1)[0]] += _seconds(start, end)
    # How far into the flow run its engine began: a rerun's starts at the first new item listed.
    engine = [start for name, start, _ in spans if name.rsplit("-", 1)[0] == "start-engine"]
    engine_at = round(_seconds(flow[0], min(engine)), 2) if flow and flow[0] and engine else None
    return {"total": len(rows), "by_state": dict(Counter(state for _, state in rows)), "by_name": dict(names),
            "seconds_by_name": {name: round(s, 2) for name, s in seconds.items()},
            "flow_run_s": round(_seconds(*flow), 2) if flow and all(flow) else None,
            "start_engine_after_flow_start_s": engine_at,
            "rows": tables, "db_mb": round(size / 2**20, 1)}


def _seconds(start: str, end: str) -> float:
    from datetime import datetime

    return (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()
