"""Which storage failures may pass when tried again, the one rule every reader of a source uses.

A transient failure (a timeout, a cut or refused connection, throttling, a 5xx, a body cut short)
is retried, or recorded as retryable so that a rerun tries again; it never becomes a final record.
Anything else (no such object or bucket, access denied, bytes that do not parse) is what a rerun
would only repeat. The S3 client retries each call itself first (`tasks/sources/s3_client.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from vlm_caption.tasks.observability import get_logger
from vlm_caption.tasks.sources.storage import ShortBodyError, error_code

T = TypeVar("T")

# What S3-compatible stores answer while overloaded or briefly failing (besides any 5xx and 429).
TRANSIENT_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
                             "ServiceUnavailable", "TooManyRequestsException", "RequestLimitExceeded"})
ATTEMPTS = 3
PAUSE_S = 1.0  # before the second attempt; twice that before the third


def is_transient(exc: BaseException) -> bool:
    """Whether the failure of a storage call may pass when the call is made again."""
    from botocore.exceptions import ClientError, ConnectionError as BotoConnectionError, HTTPClientError

    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return status >= 500 or status == 429 or error_code(exc) in TRANSIENT_CODES
    # botocore's timeouts and cut connections (HTTPClientError, ConnectionError), and the builtins
    # a local or HTTP read raises for the same.
    return isinstance(exc, (ShortBodyError, BotoConnectionError, HTTPClientError, ConnectionError, TimeoutError))


def retry_transient(call: Callable[[], T], what: str, attempts: int = ATTEMPTS) -> T:
    """`call()`, made again while it fails transiently past the client's own retries (a page or
    a footer is cheap to ask for again; a run refused or stopped for it is not), each failure
    logged; the last failure, or any other, is raised. `what` names the read in the log."""
    for attempt in range(1, attempts):
        try:
            return call()
        except Exception as exc:
            if not is_transient(exc):
                raise
            get_logger().warning("storage read failed; trying again", read=what, attempt=attempt,
                                 error=f"{type(exc).__name__}: {exc}")
            time.sleep(PAUSE_S * attempt)
    return call()  # the last attempt: its failure is raised
