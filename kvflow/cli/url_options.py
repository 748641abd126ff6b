"""The URL options of `kvflow` commands: passwords encoded on the way in, kept out of output.

A user pastes a ledger or endpoint URL with its password as it is (`S3cr%t!pw`, `my secret`,
`a/b#c`). `url_option` encodes it as drivers read URLs, so libpq and httpx connect where the
user meant instead of refusing the URL with the password quoted. Whatever the error, the
commands print it through `fail_without_secrets`, which scrubs every form of the password.
"""

from __future__ import annotations

from typing import NoReturn

import httpx

from kvflow.scheduler.redact import encode_password, redact_url, scrub_secrets
from kvflow.workers.console import fail


def url_option(value: str | None) -> str | None:
    """A typer callback: the URL with its user-info password percent-encoded (or None)."""
    return None if value is None else encode_password(value.strip())


def url_list_option(value: str | None) -> str | None:
    """A typer callback: `URL[,URL...]` with each URL's password percent-encoded (or None)."""
    if value is None:
        return None
    return ",".join(encode_password(part.strip()) for part in value.split(","))


def fail_without_secrets(message: str, *urls: str | None, code: int = 2) -> NoReturn:
    """`fail` with `message`, every URL in `urls` and their passwords (any form) scrubbed."""
    fail(scrub_secrets(message, *urls), code=code)


def http_url_or_exit(option: str, url: str) -> str:
    """`url` if httpx can send requests to it; else exit 2 naming the option, password masked.

    httpx refuses some URLs only when a request is made (a port that is not a number), with
    an error that would end a worker in a traceback.
    """
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        fail_without_secrets(f"{option} {redact_url(url)}: not a valid URL ({exc})", url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        fail_without_secrets(
            f"{option} {redact_url(url)}: give an http:// or https:// URL, "
            "e.g. http://10.0.0.5:8000",
            url,
        )
    return url
