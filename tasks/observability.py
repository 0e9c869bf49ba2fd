"""Structured logs, Prefect artifacts and events: what an operator sees while a job runs.

structlog is configured once per process. Its lines go through the stdlib logger `vlm_caption`,
whose two handlers each render the event their way:
- stderr (a machine sink for a worker's log collector): JSON lines, or a readable console on a
  terminal (`VLM_CAPTION_LOG_FORMAT`: auto, json or console);
- Prefect's API log handler, so the lines show in the flow run's logs in the Prefect UI, where a
  person reads them: always `event key=value key=value` (the UI shows time and level itself).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import threading
import time
from typing import Any

import structlog

from vlm_caption.tasks.settings import get_settings
from vlm_caption.tasks.terminal import TerminalProgress, say_phase

LOGGER_NAME = "vlm_caption"
EVENT_PREFIX = "vlm-caption"
_configured = False
_api_handler_added = False
_CONFIGURING = threading.Lock()


# ---- secrets never reach a log line ---------------------------------------------------------
# botocore at DEBUG logs every request's headers: the access key (in Authorization) and the
# session token (X-Amz-Security-Token). Every log record from the libraries that see
# credentials is scrubbed when it is created, whatever handler (console, Prefect API, a test's)
# later formats it.
_SECRET_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
_SCRUBBED_LOGGERS = ("botocore", "boto3", "s3transfer", "urllib3", "prefect", "httpx", "httpcore",
                     "aiobotocore", LOGGER_NAME)
_secrets: set[str] = set()
REDACTED = "***"


def register_secret(*values: str | None) -> None:
    """Scrub these values (credentials resolved from a block, a profile or a role) from logs."""
    _secrets.update(v for v in values if v and len(v) >= 8)
    _install_redaction()


def redact(text: str) -> str:
    found = {os.environ.get(name) for name in _SECRET_ENV}
    for secret in _secrets | {v for v in found if v and len(v) >= 8}:
        text = text.replace(secret, REDACTED)
    return text


def _redact_values(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {key: _redact_values(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_redact_values(item) for item in value)
    return value


@functools.cache  # installed once
def _install_redaction() -> None:
    original = logging.getLogRecordFactory()

    def scrubbing_factory(*args, **kwargs):
        record = original(*args, **kwargs)
        if isinstance(record.msg, dict):  # a structlog event, rendered later by each handler
            record.msg = _redact_values(record.msg)
        elif isinstance(record.name, str) and record.name.startswith(_SCRUBBED_LOGGERS):  # not in makeLogRecord
            try:
                message = record.getMessage()
            except Exception:  # noqa: BLE001 - a malformed record is left as it is
                return record
            clean = redact(message)
            if clean != message:
                record.msg, record.args = clean, ()
        return record

    logging.setLogRecordFactory(scrubbing_factory)


# Context every line of a run carries; shown after the line's own fields, which say what happened.
_CONTEXT_LAST = ("run_id", "recipe", "fingerprint")


def _plain_value(value: Any) -> str:
    if isinstance(value, str):
        if value and not any(ch.isspace() or ch in '"=' for ch in value):
            return value
        return json.dumps(value, ensure_ascii=False)
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


def render_for_people(_logger: Any, _name: str, event_dict: dict[str, Any]) -> str:
    """`event key=value key=value`, for the Prefect UI's log tab: no timestamp or level (the UI
    shows its own), values quoted only where they need it, a traceback on the lines after."""
    fields = dict(event_dict)
    for key in ("timestamp", "level", "logger"):
        fields.pop(key, None)
    event = str(fields.pop("event", ""))
    exception = fields.pop("exception", None)
    ordered = [key for key in fields if key not in _CONTEXT_LAST] + [k for k in _CONTEXT_LAST if k in fields]
    text = " ".join([event, *(f"{key}={_plain_value(fields[key])}" for key in ordered)])
    return f"{text}\n{exception}" if exception else text


class _Formatter(structlog.stdlib.ProcessorFormatter):
    """A structlog event rendered for one handler, with known secrets scrubbed from the text."""

    def __init__(self, renderer: Any):
        super().__init__(processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer])

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def configure_logging() -> None:
    """Idempotent. The handler to Prefect's UI is added once Prefect is imported: importing Prefect's
    logging on the engine's thread (about a second of GIL-bound imports) would delay the engine."""
    global _configured, _api_handler_added
    _install_redaction()
    if _configured and (_api_handler_added or "prefect" not in sys.modules):
        return
    with _CONFIGURING:  # the engine's thread and the flow's may both log first
        if not _configured:
            structlog.configure(
                processors=[
                    structlog.contextvars.merge_contextvars,
                    structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso"),
                    structlog.processors.format_exc_info,
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter,  # each handler renders
                ],
                logger_factory=structlog.stdlib.LoggerFactory(),
                wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
                cache_logger_on_first_use=True,
            )
            stdlib = logging.getLogger(LOGGER_NAME)
            stdlib.setLevel(logging.INFO)
            stdlib.propagate = False
            # stderr: JSON lines for machines, a plain console on a terminal
            fmt = get_settings().log_format
            console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
            stream = logging.StreamHandler(sys.stderr)
            stream.setFormatter(_Formatter(structlog.dev.ConsoleRenderer(colors=False) if console
                                           else structlog.processors.JSONRenderer()))
            stdlib.addHandler(stream)
            _configured = True
        if not _api_handler_added and "prefect" in sys.modules:
            from prefect.context import FlowRunContext, TaskRunContext
            from prefect.logging.handlers import APILogHandler

            api = APILogHandler()
            api.setFormatter(_Formatter(render_for_people))
            # outside a run there is nowhere to send it
            api.addFilter(lambda record: FlowRunContext.get() is not None or TaskRunContext.get() is not None)
            logging.getLogger(LOGGER_NAME).addHandler(api)
            _api_handler_added = True


def get_logger(**context: Any):
    configure_logging()
    return structlog.get_logger(LOGGER_NAME).bind(**context)


def phase(what: str, **fields: Any) -> None:
    """A step of a run beginning (starting Prefect, loading vLLM, building the engine, loading what
    is done, listing): a log line (the UI's too, inside a flow run), and a line at the terminal of
    `vlm-caption run`, so slow can be told from hung from the first second."""
    get_logger().info(what, phase=True, **fields)
    say_phase(what)


def emit(event: str, run_id: str, **payload: Any) -> None:
    """A Prefect event (`vlm-caption.shard.completed`, ...) that automations can react to."""
    from prefect.events import emit_event

    emit_event(
        event=f"{EVENT_PREFIX}.{event}",
        resource={"prefect.resource.id": f"{EVENT_PREFIX}.run.{run_id}",
                  "prefect.resource.name": f"vlm-caption run {run_id}"},
        payload=payload,
    )


class Progress(TerminalProgress):
    """A Prefect progress artifact beside the terminal's progress, counted in items. The total
    grows as the streamed listing hands over shards."""

    # The artifact is updated at most this often (each update is a request to the API, made
    # by the pipeline's loop between shards), and always at the end.
    ARTIFACT_INTERVAL_S = 1.0
    # After a failed update (the API away: a server restart) the next try waits this long, so
    # the pipeline's loop does not sit in the client's retries after every shard.
    API_AWAY_BACKOFF_S = 30.0

    def __init__(self, description: str):
        from prefect.artifacts import create_progress_artifact

        self.artifact_id = create_progress_artifact(
            progress=0.0, key="vlm-caption-progress", description=description
        )
        self.published_percent, self.published_at = 0.0, time.monotonic()
        self.skipped = 0
        super().__init__(0, description)

    def skip(self, items: int) -> None:
        """Items the listing found already done: listed and done for the artifact (published with the
        next shard's progress), not for the terminal, whose items/s and ETA are about what is new."""
        self.skipped += items

    @property
    def percent(self) -> float:
        return round(100.0 * (self.done + self.skipped) / max(self.total + self.skipped, 1), 1)

    def advance(self, items: int = 0, errors: int = 0) -> float:
        super().advance(items, errors)
        if time.monotonic() - self.published_at >= self.ARTIFACT_INTERVAL_S:
            self._publish()
        return self.percent

    def close(self) -> None:
        if self.percent != self.published_percent:
            self._publish()
        super().close()

    def _publish(self) -> None:
        """Best effort: a progress bar the API cannot take must not stop the captioning."""
        from prefect.artifacts import update_progress_artifact

        try:
            update_progress_artifact(artifact_id=self.artifact_id, progress=self.percent)
        except Exception as exc:  # noqa: BLE001 - the run's results do not depend on it
            get_logger().warning("progress artifact not updated; captioning goes on", error=str(exc))
            self.published_at = time.monotonic() + self.API_AWAY_BACKOFF_S
            return
        self.published_percent, self.published_at = self.percent, time.monotonic()


def publish_summary(summary: dict[str, Any], samples: list[dict[str, str]]) -> None:
    """The run's closing table artifact: counts, throughput, failures, sample captions."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    rows = [{"metric": key, "value": str(value)} for key, value in summary.items()]
    create_table_artifact(table=rows, key="vlm-caption-summary",
                          description="vlm-caption run summary")
    if samples:
        lines = ["| key | caption |", "| --- | --- |"]
        for sample in samples:
            caption = sample["text"].replace("|", "\\|").replace("\n", " ")[:300]
            lines.append(f"| `{sample['key']}` | {caption} |")
        create_markdown_artifact(markdown="\n".join(lines), key="vlm-caption-samples",
                                 description="A few captions from this run")
