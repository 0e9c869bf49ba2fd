"""The job's command-line options (`vlm-caption run` and `demo`): the arguments, and the
CaptionJob fields they give; `Subcommand`, the parser that adds them once its subcommand is used.
`flows/cli.py` builds the parser with them."""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Callable
from typing import Any


# `vlm-caption run` given neither what to caption nor where the results go.
RUN_NEEDS = ("the following arguments are required: source (s3://bucket/prefix/ or a folder; or --manifest "
             "FILE) and --out (s3://bucket/prefix/ or a folder), e.g. vlm-caption run ./photos --out ./captions")


def entry_point(ref: str | Callable[..., Any]) -> Callable[..., Any]:
    """A function named "module:function", imported now (a callable is itself): how the CLI reaches
    what it imports only when used, and the bench (a tool beside the product, bench/) at all."""
    if callable(ref):
        return ref
    module, _, function = ref.partition(":")
    return getattr(importlib.import_module(module), function)


class Subcommand(argparse.ArgumentParser):
    """A subcommand's parser. `more` ("module:function") adds the options that come from modules slow
    to import (the job's name every source reader; the bench's import the bench): imported and added
    when the subcommand is parsed or its help shown, so that `vlm-caption --help` does not wait for them."""

    more: str | None = None
    needs_source: bool = False  # `run`: a missing --out with no source either is one message for both
    _given: argparse.Namespace | None = None

    def _complete(self) -> None:
        if self.more is not None:
            more, self.more = self.more, None
            entry_point(more)(self)

    def parse_known_args(self, args=None, namespace=None):
        self._complete()
        self._given = argparse.Namespace() if namespace is None else namespace  # what error() finds given
        return super().parse_known_args(args, self._given)

    def format_help(self) -> str:
        self._complete()
        return super().format_help()

    def error(self, message: str):
        given = self._given
        if (self.needs_source and "--out" in message and given is not None
                and getattr(given, "source", None) is None and getattr(given, "manifest", None) is None):
            message = RUN_NEEDS
        super().error(message)


def engine_arg(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE, e.g. max_model_len=4096")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def _choices(text: str) -> list[str]:
    choices = [c.strip() for c in text.split(",") if c.strip()]
    if not choices:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated choices, e.g. cat,dog,other")
    return choices


def json_schema_option(value: str | None) -> dict[str, Any] | str | None:
    """`--json-schema`: a built-in schema's name, or a JSON Schema file (checked by the job)."""
    from vlm_caption.flows.params import BUILTIN_SCHEMAS
    from vlm_caption.tasks.errors import UsageError

    if value is None or value in BUILTIN_SCHEMAS:
        return value
    try:
        with open(value, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"--json-schema {value}: cannot read a JSON Schema from it ({exc}); "
                          f"give a JSON file or one of: {', '.join(BUILTIN_SCHEMAS)}") from None


def add_job_options(parser: argparse.ArgumentParser) -> None:
    # Here, not at the top: the registry imports every source reader, which `vlm-caption --help` need not wait for.
    from vlm_caption.tasks.sources.registry import SOURCE_FORMATS, formats_help

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
    parser.add_argument("--shard-size", type=int, default=None, help="items per results part (default 64)")
    parser.add_argument("--limit", type=int, help="stop after this many items")
    parser.add_argument("--glob", help="only keys matching this glob, e.g. '*.jpg'")
    parser.add_argument("--source-format", choices=SOURCE_FORMATS,
                        help=f"what the source holds: {formats_help()}".replace("`", "").replace("%", "%%"))
    parser.add_argument("--column", help="Parquet: the column of image URLs, s3:// URIs, paths or bytes")
    parser.add_argument("--modified-since", metavar="TIME|DURATION|auto",
                        help="only objects modified after this time (2026-11-20T03:00:00Z), this long before the "
                        "run (26h, 2d), or auto: since the watermark the last completed run left in the output")
    parser.add_argument("--follow-links", action="store_true",
                        help="a local folder source: read its symbolic links that lead outside the folder "
                        "(off: each is a bad_input record, its target never read)")
    parser.add_argument("--gallery-items", type=int,
                        help="items on the run's HTML gallery beside its manifest (default 200; 0: none)")
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--retry-looping", type=float, nargs="?", const=1.3, metavar="PENALTY",
                        help="ask again, with this repetition penalty (1.3 if none given), for each looping or "
                        "empty caption")
    parser.add_argument("--no-dedup", dest="dedup", action="store_false",
                        help="ask for every item, copies of another's bytes too (default: each distinct media once)")
    parser.add_argument("--engine-arg", action="append", type=engine_arg, default=[],
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


def job_fields(args: argparse.Namespace) -> dict[str, Any]:
    fields: dict[str, Any] = {"recipe": args.recipe, "trust_remote_code": args.trust_remote_code}
    if args.skip_model_check:
        fields["skip_model_check"] = True
    if args.follow_links:
        fields["follow_links"] = True
    if not args.dedup:
        fields["dedup"] = False
    for name in ("questions", "model", "shard_size", "limit", "glob", "modality", "method", "num_frames",
                 "max_images", "processor_device", "source_format", "column", "gallery_items",
                 "modified_since", "retry_looping"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    sampling = {k: getattr(args, k) for k in ("temperature", "max_tokens", "seed")
                if getattr(args, k) is not None}
    if sampling:
        fields["sampling"] = sampling
    if args.engine_arg:
        fields["engine_overrides"] = dict(args.engine_arg)
    schema = json_schema_option(args.json_schema)
    for name, value in (("json_schema", schema), ("regex", args.regex), ("choice", args.choice)):
        if value is not None:
            fields[name] = value
    return fields
