"""`vlm-caption` command line: run, demo, bench, server, export, recipes list, recipes show.

`recipes ...` import neither torch, vLLM nor Prefect, so they answer at once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from tasks.errors import UsageError, UserError

DESCRIPTION = "Caption, tag or OCR images in a bucket or folder with vision-language models (vLLM + Prefect)."


EMBEDDED_SERVER_HINT = (
    "Prefect's embedded API server did not start in time (a fresh database on a slow or busy "
    "machine). Run the command again, raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS "
    "(now {timeout} s), or start a server once with `vlm-caption server` and point "
    "PREFECT_API_URL at it (http://127.0.0.1:4200/api)."
)


def _engine_arg(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE, e.g. max_model_len=4096")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a port number, 1 to 65535")
    return int(text)


def _choices(text: str) -> list[str]:
    choices = [c.strip() for c in text.split(",") if c.strip()]
    if not choices:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated choices, e.g. cat,dog,other")
    return choices


def _json_schema(value: str | None) -> dict[str, Any] | str | None:
    """`--json-schema`: a built-in schema's name, or a JSON Schema file (checked by the job)."""
    from flows.params import BUILTIN_SCHEMAS

    if value is None or value in BUILTIN_SCHEMAS:
        return value
    try:
        with open(value, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"--json-schema {value}: cannot read a JSON Schema from it ({exc}); "
                          f"give a JSON file or one of: {', '.join(BUILTIN_SCHEMAS)}") from None


def _add_job_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", default="llava", help="recipe name (default: llava)")
    parser.add_argument("--question", action="append", dest="questions", metavar="QUESTION",
                        help="asked about every item, one record each (repeatable)")
    parser.add_argument("--modality", choices=["image", "video", "multi-image"],
                        help="what one item is: an image, a video, or a group of images (one folder, or "
                        "one manifest line) (default: image)")
    parser.add_argument("--method", choices=["generate", "chat"],
                        help="generate (default) or chat: LLM.chat with image parts and the chat template")
    parser.add_argument("--num-frames", type=int, help="frames sampled from each video (default 16)")
    parser.add_argument("--max-images", type=int, help="largest image group accepted (default 8)")
    parser.add_argument("--model", help="model id or local path instead of the recipe's")
    parser.add_argument("--skip-model-check", action="store_true",
                        help="start without checking the model first (that it loads, and that its model_type "
                        "is one the recipe is for)")
    parser.add_argument("--shard-size", type=int, default=None, help="items per task run (default 64)")
    parser.add_argument("--limit", type=int, help="stop after this many items")
    parser.add_argument("--glob", help="only keys matching this glob, e.g. '*.jpg'")
    parser.add_argument("--source-format", choices=["auto", "files", "webdataset", "parquet", "inventory"],
                        help="what the source holds: media files, WebDataset tar shards (a tar, a prefix of tars "
                        "or a brace pattern like shards/{00000..00099}.tar), Parquet, or an S3 Inventory report "
                        "(its manifest.json, or a folder of dated reports: the newest) (default auto: from "
                        ".tar/.parquet/manifest.json/braces, else from the objects listed first)")
    parser.add_argument("--column", help="Parquet: the column of image URLs, s3:// URIs, paths or bytes")
    parser.add_argument("--modified-since", metavar="TIME|DURATION|auto",
                        help="only objects modified after this time (2026-11-20T03:00:00Z), this long before the "
                        "run (26h, 2d), or auto: since the watermark the last completed run left in the output")
    parser.add_argument("--gallery-items", type=int,
                        help="items on the run's HTML gallery beside its manifest (default 200; 0: none)")
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--engine-arg", action="append", type=_engine_arg, default=[],
                        metavar="KEY=VALUE", help="vLLM engine argument override (repeatable)")
    parser.add_argument("--processor-device", choices=["auto", "cuda", "cpu"],
                        help="where the model's processor runs (default auto: the GPU where the recipe's "
                             "processor is checked there)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow recipes that run the model repository's own code")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="every log line on the terminal as it comes (Prefect's, vLLM's, the flow's) instead "
                        "of a progress bar, the rest in the run's log file")
    parser.add_argument("--log-format", choices=["auto", "console", "json"],
                        help="json: the flow's structured log lines and the final summary as JSON, on the "
                        "terminal, for machines (implies -v); console or auto: VLM_CAPTION_LOG_FORMAT's choices")
    structured = parser.add_mutually_exclusive_group()
    structured.add_argument("--json-schema", metavar="FILE|tags",
                            help="answer JSON matching this JSON Schema file (or `tags`: a built-in "
                            '{"tags": [...], "caption": ...} schema); records get it parsed in `structured`')
    structured.add_argument("--regex", help="answer text matching this regular expression")
    structured.add_argument("--choice", type=_choices, metavar="A,B,C", help="answer one of these strings")


def _job_fields(args: argparse.Namespace) -> dict[str, Any]:
    fields: dict[str, Any] = {"recipe": args.recipe, "trust_remote_code": args.trust_remote_code}
    if args.skip_model_check:
        fields["skip_model_check"] = True
    for name in ("questions", "model", "shard_size", "limit", "glob", "modality", "method", "num_frames",
                 "max_images", "processor_device", "source_format", "column", "gallery_items",
                 "modified_since"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    sampling = {k: getattr(args, k) for k in ("temperature", "max_tokens", "seed")
                if getattr(args, k) is not None}
    if sampling:
        fields["sampling"] = sampling
    if args.engine_arg:
        fields["engine_overrides"] = dict(args.engine_arg)
    schema = _json_schema(args.json_schema)
    for name, value in (("json_schema", schema), ("regex", args.regex), ("choice", args.choice)):
        if value is not None:
            fields[name] = value
    return fields


def build_parser() -> argparse.ArgumentParser:
    from flows.bench.cli import add_bench_arguments

    parser = argparse.ArgumentParser(prog="vlm-caption", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the vlm-caption flow on a bucket or folder")
    run.add_argument("source", nargs="?", help="s3://bucket/prefix/ or a local folder (of media, tar shards or "
                     "Parquet files), a .tar or .parquet file, or a brace pattern of shards")
    run.add_argument("--manifest", help="instead of a source: a JSON Lines file of items (s3:// or local), "
                     'each line {"id": ..., "media": [...], "question": ...}')
    run.add_argument("--out", required=True, help="s3://bucket/prefix/ or a local folder")
    _add_job_options(run)

    demo = sub.add_parser("demo", help="caption a few generated images, offline, on CPU or GPU")
    demo.add_argument("--dir", default="vlm-caption-demo", help="working folder (default: ./vlm-caption-demo)")
    demo.add_argument("--images", type=int, default=8, help="how many sample images to make")
    _add_job_options(demo)

    bench = sub.add_parser("bench", help="the flow against raw vLLM (the example's way) on this machine")
    add_bench_arguments(bench)

    server = sub.add_parser("server", help="start Prefect's server with its UI (in its own environment, "
                            "via uv), for deployments, workers and runs to report to")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    server.add_argument("--port", type=_port, default=4200, help="port (default 4200)")

    export = sub.add_parser("export", help="make an output's Parquet view (OUTPUT/parquet/, read as one dataset "
                            "by datasets, pandas, DuckDB) again from every part, as one file; exits 1 when a "
                            "part was cut short or unreadable (the file holds the rest, the report names it)")
    export.add_argument("output", help="the run's --out: s3://bucket/prefix/ or a local folder")
    how = export.add_mutually_exclusive_group()
    how.add_argument("--to", help="write every final result as one Parquet file there instead, s3:// or local "
                     "(the view is left as it is)")
    how.add_argument("--compact", action="store_true", help="merge the view's files (one per run) into one, "
                     "from the files alone (no part is read); run it while no run of the output is ending")

    recipes = sub.add_parser("recipes", help="list or inspect recipes")
    rsub = recipes.add_subparsers(dest="recipes_command", required=True)
    rlist = rsub.add_parser("list", help="all recipes")
    rlist.add_argument("--json", action="store_true")
    rlist.add_argument("--markdown", action="store_true", help="a Markdown page (docs/recipes.md)")
    show = rsub.add_parser("show", help="what a recipe builds, without loading a model")
    show.add_argument("name")
    show.add_argument("--modality", default="image", choices=["image", "video", "multi-image"])
    show.add_argument("--question", action="append", help="repeatable")
    show.add_argument("--images", type=int, default=2, help="images for multi-image")
    show.add_argument("--model", help="model id or local path (a local tokenizer renders chat templates)")
    show.add_argument("--json", action="store_true")
    return parser


def cmd_recipes_list(args: argparse.Namespace) -> int:
    from recipes import all_recipes

    if args.markdown:
        from recipes.table import recipes_markdown

        print(recipes_markdown(), end="")
        return 0
    rows = [
        {"name": r.name, "model": r.model, "modalities": list(r.modalities),
         "multi_image": r.multi_image is not None, "needs_remote_code": r.needs_remote_code,
         "gpus": r.gpus_needed}
        for r in all_recipes()
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    headers = ("name", "default model", "modalities", "multi-image", "remote code", "GPUs")
    table = [(r["name"], r["model"], ",".join(m for m in r["modalities"] if m != "multi-image"),
              "yes" if r["multi_image"] else "-", "yes" if r["needs_remote_code"] else "-",
              str(r["gpus"])) for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(headers)]
    for row in (headers, *table):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    print(f"\n{len(rows)} recipes")
    return 0


def cmd_recipes_show(args: argparse.Namespace) -> int:
    from flows.params import DEFAULT_QUESTIONS
    from recipes import get_recipe
    from recipes.requests import build_requests, load_local_tokenizer

    recipe = get_recipe(args.name)
    model = recipe.model_for(args.modality, args.model) if recipe.prompting_or_none(args.modality) else None
    tokenizer = None
    if model and recipe.uses_chat_template(args.modality):
        tokenizer = load_local_tokenizer(model, trust_remote_code=recipe.needs_remote_code)
    built = build_requests(recipe, args.modality, args.question or [DEFAULT_QUESTIONS[args.modality]],
                           images=args.images, model=args.model, tokenizer=tokenizer)
    print(json.dumps(built.to_json_dict(), indent=2, ensure_ascii=False))
    return 0


def _log_format(args: argparse.Namespace) -> None:
    """--log-format before anything reads the settings (structlog's stderr renderer follows it)."""
    if args.log_format:
        os.environ["VLM_CAPTION_LOG_FORMAT"] = args.log_format
        from tasks.settings import get_settings

        get_settings.cache_clear()


def cmd_run(args: argparse.Namespace) -> int:
    _log_format(args)
    from flows.params import CaptionJob
    from flows.plan import make_plan

    job = CaptionJob(source=args.source, manifest=args.manifest, output=args.out, **_job_fields(args))
    # Every check that needs no engine, before Prefect starts: each problem one line, all at once.
    # The flow makes the plan again in its own process (a deployment run has had no CLI).
    plan = make_plan(job)
    job = plan.job
    from flows.server import check_api_reachable

    check_api_reachable()  # a PREFECT_API_URL nobody answers fails here, before any engine starts
    from flows.plan import start_engine_first, take_partition_cores
    from tasks.terminal import print_run_end, run_terminal

    take_partition_cores(job)  # before torch is imported: its threads are sized to the cores it may use
    with run_terminal(job.output, verbose=args.verbose, log_format=args.log_format) as log_path:
        # vLLM's import, then the engine's start, which overlaps Prefect's start and the flow run's.
        start_engine_first(plan, import_now=True)
        from flows.caption import vlm_caption

        summary = vlm_caption(job)
    print_run_end(summary, job.output, log_path, args.log_format, source=job.location)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    _log_format(args)
    from flows.demo import run_demo
    from flows.server import check_api_reachable

    check_api_reachable()
    return run_demo(args, _job_fields(args))


def cmd_bench(args: argparse.Namespace) -> int:
    from flows.bench import BenchConfig, run_bench
    from flows.params import resolve_json_schema

    width, _, height = args.size.partition("x")
    if not (width.isdigit() and height.isdigit()):
        raise UsageError(f"--size {args.size}: expected WIDTHxHEIGHT in pixels, e.g. 640x480")
    try:  # checked as a job checks it, before any phase runs
        schema = resolve_json_schema(_json_schema(args.json_schema))
    except ValueError as exc:
        raise UsageError(f"--json-schema: {exc}") from None
    run_bench(BenchConfig(workdir=args.dir, model=args.model, recipe=args.recipe, images=args.images,
                          width=int(width), height=int(height), shard_size=args.shard_size,
                          source=args.source, max_tokens=args.max_tokens, shape=args.shape,
                          modality=args.modality, frames=args.frames, flow_env=tuple(args.flow_env),
                          fan_out_env=tuple(args.fan_out_env),
                          profile=args.profile, prefect=args.prefect, gpus=args.gpus, skip_raw=args.skip_raw,
                          processor_device=args.processor_device, warm_up=args.warm_up, history=args.history,
                          json_schema=json.dumps(schema) if schema is not None else None))
    return 0


def cmd_server(args: argparse.Namespace) -> int:
    from flows.server import serve

    return serve(args.host, args.port)


def cmd_export(args: argparse.Namespace) -> int:
    from tasks.results.parquet import export_parquet
    from tasks.results.parquet_compact import compact_view, rebuild_view
    from tasks.sources.storage import open_storage, split_parent

    out = open_storage(args.output)  # an output that is not there is an error, not made
    if args.compact:
        report = compact_view(out)
    elif args.to:
        parent, key = split_parent(args.to)
        report = export_parquet(out, open_storage(parent, create=True), key)
    else:
        report = rebuild_view(out)
    print(json.dumps(report, indent=2))
    return 0 if report.get("complete", True) else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {"run": cmd_run, "demo": cmd_demo, "bench": cmd_bench, "server": cmd_server, "export": cmd_export}
    if args.command == "recipes":
        handler = cmd_recipes_list if args.recipes_command == "list" else cmd_recipes_show
    else:
        handler = handlers[args.command]
    try:
        return handler(args)
    except Exception as exc:
        code = report_user_error(exc)
        if code is None:
            raise  # a bug: its traceback
        return code


def report_user_error(exc: Exception) -> int | None:
    """A user's error as one line per problem on stderr (no traceback); its exit code
    (tasks/errors.py; docs/operations.md, "Exit codes"). None for anything else."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        from flows.run_state import validation_lines

        lines, code = validation_lines(exc), UsageError.exit_code
    elif isinstance(exc, UserError):
        lines, code = exc.lines(), exc.exit_code
    elif isinstance(exc, RuntimeError) and "ephemeral Prefect API server" in str(exc):
        timeout = os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS")
        lines, code = [EMBEDDED_SERVER_HINT.format(timeout=timeout)], 3
    else:
        return None
    from tasks.prefect_notice import show_prefect_notice_now

    show_prefect_notice_now(sys.stderr)  # Prefect's, if it has one for this terminal: before our error
    for line in lines:  # a pre-flight's problems, one line each
        print(f"vlm-caption: error: {line}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
