"""The job's command-line options (`vlm-caption run` and `demo`) and the CaptionJob fields they give;
`Subcommand`, the parser that adds them once its subcommand is used (flows/cli.py)."""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Callable
from types import UnionType
from typing import TYPE_CHECKING, Any, Literal, get_args, get_origin

if TYPE_CHECKING:  # pydantic is imported with the job's model, only once a subcommand is used
    from pydantic import BaseModel


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


# The job's options that are a CaptionJob field (or a `sampling` one) as it is: their type, choices, default
# and help come from the field (flows/params.py); not given, an option is None: the field's own.
FIELD_OPTIONS = ("recipe", "modality", "method", "num_frames", "max_images", "model", "skip_model_check",
                 "shard_size", "limit", "glob", "source_format", "column", "modified_since", "follow_links",
                 "gallery_items", "processor_device", "trust_remote_code")
SAMPLING_OPTIONS = ("temperature", "max_tokens", "seed")
STRUCTURED_OPTIONS = ("json_schema", "regex", "choice")  # at most one
METAVARS = {"modified_since": "TIME|DURATION|auto", "choice": "A,B,C", "json_schema": "FILE|tags"}


def add_field_options(parser: argparse._ActionsContainer, model: type[BaseModel], names: tuple[str, ...]) -> None:
    """`--name` for each of these fields of the pydantic `model`: a bool a flag, a Literal its choices, a
    list comma-separated (the job refuses an empty one), a number its type, else text; its description the
    help, with its default unless None or a bool."""
    for name in names:
        field = model.model_fields[name]
        kind = field.annotation
        if get_origin(kind) is UnionType:  # `X | None`
            kind = next(arg for arg in get_args(kind) if arg is not type(None))
        if kind is bool:
            option: dict[str, Any] = {"action": "store_true", "default": None}
        elif get_origin(kind) is Literal:
            option = {"choices": list(get_args(kind))}
        elif get_origin(kind) is list:
            option = {"type": lambda text: [c.strip() for c in text.split(",") if c.strip()],
                      "metavar": METAVARS[name]}
        else:
            option = {"type": kind if kind in (int, float) else None, "metavar": METAVARS.get(name)}
        text = (field.description or "").replace("`", "").replace("%", "%%")
        if field.default is not None and kind is not bool:
            text += f" (default: {field.default})"
        parser.add_argument("--" + name.replace("_", "-"), help=text, **option)


def add_job_options(parser: argparse.ArgumentParser) -> None:
    # Here, not at the top: the job's model imports every source reader; `vlm-caption --help` need not wait for it.
    from vlm_caption.flows.params import CaptionJob, SamplingSettings

    add_field_options(parser, CaptionJob, FIELD_OPTIONS)
    add_field_options(parser, SamplingSettings, SAMPLING_OPTIONS)
    parser.set_defaults(recipe=CaptionJob.model_fields["recipe"].default)  # args.recipe always names one
    parser.add_argument("--question", action="append", dest="questions", metavar="QUESTION",
                        help="Asked about every item, one record each (repeatable).")
    parser.add_argument("--retry-looping", type=float, nargs="?", const=1.3, metavar="PENALTY",
                        help="Ask again, with this repetition penalty (1.3 if none given), for each looping or "
                        "empty caption.")
    parser.add_argument("--no-dedup", dest="dedup", action="store_false", default=None,
                        help="Ask for every item, copies of another's bytes too (default: each distinct media once).")
    parser.add_argument("--engine-arg", action="append", type=engine_arg, default=[],
                        metavar="KEY=VALUE", help="A vLLM engine argument over the recipe's (repeatable).")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="Every log line on the terminal as it comes (Prefect's, vLLM's, the flow's) instead "
                        "of a progress bar, the rest in the run's log file.")
    parser.add_argument("--log-format", choices=["auto", "console", "json"],
                        help="json: the flow's structured log lines and the final summary as JSON, on the "
                        "terminal, for machines (implies -v); console or auto: VLM_CAPTION_LOG_FORMAT's choices.")
    add_field_options(parser.add_mutually_exclusive_group(), CaptionJob, STRUCTURED_OPTIONS)


def job_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The CaptionJob fields the options give: only those given; the rest are the job's defaults."""
    names = (*FIELD_OPTIONS, *SAMPLING_OPTIONS, *STRUCTURED_OPTIONS, "questions", "retry_looping", "dedup")
    fields = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    sampling = {name: fields.pop(name) for name in SAMPLING_OPTIONS if name in fields}
    if sampling:
        fields["sampling"] = sampling
    if args.engine_arg:
        fields["engine_overrides"] = dict(args.engine_arg)
    if "json_schema" in fields:
        fields["json_schema"] = json_schema_option(fields["json_schema"])
    return fields
