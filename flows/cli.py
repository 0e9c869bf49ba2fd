"""`vlm-caption` command line: run, demo, bench, server, export, recipes list, recipes show.
`--help` and `recipes ...` import neither torch, vLLM nor Prefect, so they answer at once."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from vlm_caption.flows.cli_job import Subcommand, entry_point, job_fields
from vlm_caption.tasks.interrupt import exit_now_if_building, stoppable
from vlm_caption.tasks.prefect_api import embedded_server_defaults, import_prefect, show_prefect_notice_now

if TYPE_CHECKING:
    from vlm_caption.flows.params import CaptionJob

DESCRIPTION = "Caption, tag or OCR images in a bucket or folder with vision-language models (vLLM + Prefect)."
EMBEDDED_SERVER_HINT = (
    "Prefect's embedded API server did not start in time (a fresh database on a slow or busy "
    "machine). Run the command again, raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS "
    "(now {timeout} s), or start a server once with `vlm-caption server` and point "
    "PREFECT_API_URL at it (http://127.0.0.1:4200/api)."
)


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a port number, 1 to 65535")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlm-caption", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Subcommand)

    run = sub.add_parser("run", help="run the vlm-caption flow on a bucket or folder")
    run.add_argument("source", nargs="?", help="s3://bucket/prefix/ or a local folder (of media, tar shards or "
                     "Parquet files), a .tar or .parquet file, or a brace pattern of shards")
    run.add_argument("--manifest", help="instead of a source: a JSON Lines file of items (s3:// or local), "
                     'each line {"id": ..., "media": [...], "question": ...}')
    run.add_argument("--out", required=True, help="s3://bucket/prefix/ or a local folder")
    run.more, run.needs_source = "vlm_caption.flows.cli_job:add_job_options", True

    demo = sub.add_parser("demo", help="caption a few generated images, offline, on CPU or GPU")
    demo.add_argument("--dir", default="vlm-caption-demo", help="working folder (default: ./%(default)s)")
    demo.add_argument("--images", type=int, default=8, help="how many sample images to make")
    demo.more = "vlm_caption.flows.cli_job:add_job_options"

    bench = sub.add_parser("bench", help="the flow against raw vLLM (the example's way) on this machine")
    # The bench is a tool beside the product (bench/), never imported by it: its options and its
    # handler are named here and imported only when `vlm-caption bench` is used.
    bench.more = "vlm_caption.bench.cli:add_bench_arguments"

    server = sub.add_parser("server", help="start Prefect's server with its UI (in its own environment, "
                            "via uv), for deployments, workers and runs to report to")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    server.add_argument("--port", type=_port, default=4200, help="port (default %(default)s)")
    server.add_argument("--background", action="store_true", help="start it in the background, its output in "
                        "--log; return once its API answers")
    server.add_argument("--stop", action="store_true", help="stop the server --background started on --port")
    server.add_argument("--log", default="vlm-caption-server.log", help="--background's log (./%(default)s)")

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
    from vlm_caption.recipes import all_recipes

    if args.markdown:
        from vlm_caption.recipes.table import recipes_markdown

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
    from vlm_caption.flows.params import DEFAULT_QUESTIONS
    from vlm_caption.recipes import get_recipe
    from vlm_caption.recipes.requests import build_requests, load_local_tokenizer

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
        from vlm_caption.tasks.settings import get_settings

        get_settings.cache_clear()


def start_prefect() -> None:
    """Prefect's first import in `run`, `demo` and the bench's flow phase, before the engine's thread
    (two threads importing Prefect at once leave a module half-made: "Failed to initialize plugins"),
    holding what it prints at a terminal (its first-run notice) for the run's terminal to place
    (tasks/prefect_api.py). Then a PREFECT_API_URL nobody answers fails here, before any engine."""
    from vlm_caption.flows.server import check_api_reachable

    import_prefect()
    check_api_reachable()


def cmd_run(args: argparse.Namespace) -> int:
    _log_format(args)
    from vlm_caption.flows.params import CaptionJob

    run_job(CaptionJob(source=args.source, manifest=args.manifest, output=args.out, **job_fields(args)), args)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    _log_format(args)
    from vlm_caption.flows.demo import demo_job, print_samples

    job = demo_job(args, job_fields(args))
    print_samples(run_job(job, args), job.output)
    return 0


def run_job(job: CaptionJob, args: argparse.Namespace) -> dict:
    """`run`'s and `demo`'s path: the job's checks, Prefect, the job's slot, then its flow with the
    engine started first; the run's summary printed, and returned."""
    from vlm_caption.flows.plan import make_plan, start_engine_first

    # Every check that needs no engine, before Prefect starts: each problem one line, all at once.
    # The flow makes the plan again in its own process (a deployment run has had no CLI).
    plan = make_plan(job)
    job = plan.job
    start_prefect()
    from vlm_caption.flows.head_start import begin_head_start, discard_head_start
    from vlm_caption.tasks.concurrency import hold_job_lock
    from vlm_caption.tasks.observability import phase
    from vlm_caption.tasks.terminal import print_run_end, run_terminal

    # Another run of this job on this Prefect home: waited for here, saying so, before any engine or server.
    hold_job_lock(plan.fingerprint, job.output, lambda line: print(f"vlm-caption: {line}", file=sys.stderr))
    with run_terminal(job.output, verbose=args.verbose, log_format=args.log_format) as log_path:
        # vLLM's import, then the engine's start, beside Prefect's start and the flow run's (a fan-out's parent:
        # neither yet); earlier results and no engine yet: the done-index's load and the listing begin now.
        if not start_engine_first(plan):
            begin_head_start(plan)
        from vlm_caption.flows.caption import vlm_caption

        from prefect.settings import PREFECT_API_URL

        phase("starting Prefect", api=PREFECT_API_URL.value() or "embedded")
        try:
            summary = vlm_caption(job)
        finally:
            discard_head_start()  # the flow failed before its listing
    print_run_end(summary, job.output, log_path, args.log_format, source=job.location)
    return summary


def cmd_export(args: argparse.Namespace) -> int:
    from vlm_caption.tasks.results.parquet import export_parquet
    from vlm_caption.tasks.results.parquet_view import compact_view, rebuild_view
    from vlm_caption.tasks.sources.storage import open_storage, split_parent

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
    from_shell, argv = argv is None, sys.argv[1:] if argv is None else argv
    runs = argv[:1] in (["run"], ["demo"])
    # A Ctrl-C stops a run within seconds, from its start; Prefect's settings for its embedded server
    # (the bench's flow phases get them from its environment too).
    with stoppable(runs), embedded_server_defaults(runs or argv[:1] == ["bench"]):
        args = build_parser().parse_args(argv)
        handlers = {"run": cmd_run, "demo": cmd_demo, "bench": "vlm_caption.bench.cli:cmd_bench",
                    "export": cmd_export, "server": "vlm_caption.flows.server:server_command"}
        if args.command == "recipes":
            handler = cmd_recipes_list if args.recipes_command == "list" else cmd_recipes_show
        else:
            handler = entry_point(handlers[args.command])
        try:
            return handler(args)
        except Exception as exc:
            code = report_user_error(exc)
            if code is None:
                raise  # a bug: its traceback
            return exit_now_if_building(code) if from_shell else code  # not for an engine it will not use


def report_user_error(exc: Exception) -> int | None:
    """A user's error as one line per problem on stderr (no traceback); its exit code
    (tasks/errors.py; docs/operations.md, "Exit codes"). None for anything else."""
    from pydantic import ValidationError

    from vlm_caption.tasks.errors import UsageError, UserError

    if isinstance(exc, ValidationError):
        from vlm_caption.flows.run_state import validation_lines

        lines, code = validation_lines(exc), UsageError.exit_code
    elif isinstance(exc, UserError):
        lines, code = exc.lines(), exc.exit_code
    elif isinstance(exc, RuntimeError) and "ephemeral Prefect API server" in str(exc):
        timeout = os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS")
        lines, code = [EMBEDDED_SERVER_HINT.format(timeout=timeout)], 3
    else:
        return None
    show_prefect_notice_now(sys.stderr)  # Prefect's, if it has one for this terminal: before our error
    for line in lines:  # a pre-flight's problems, one line each
        print(f"vlm-caption: error: {line}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
