"""`redact_url`: URLs with their secrets masked, for messages, logs and tables.

In the bottom layer because every layer prints a URL somewhere: the ledger its database URL,
the CLI and the telemetry a replica's endpoint, which may carry credentials.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

# `password=...` (or `sslpassword=...`, `api_key=...`, `token=...`, `secret=...`) in a URL's
# query or a libpq `key=value` string; the value is a single-quoted libpq string or runs to the
# next space, `&` or `;`.
_PASSWORD_PARAM = re.compile(
    r"(?i)(?<![a-z_])((?:ssl)?password|api[_-]?key|(?:access[_-]?)?token|secret)(\s*=\s*)"
    r"('(?:[^'\\]|\\.)*'?|[^\s&;]*)"
)


def redact_url(url: str) -> str:
    """`url` with every password (and API key or token) replaced by `***`, for messages and logs.

    Covers the user-info password (`postgresql://u:secret@h/db`), `password=` query parameters
    (`postgresql://u@h/db?password=secret`), libpq `key=value` strings
    (`host=h password='se cret'`) and the API keys an endpoint URL may carry
    (`https://vllm.example/?api_key=...`).
    """
    parts = urlsplit(url)
    if parts.password is not None:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
        url = urlunsplit(parts._replace(netloc=netloc))
    return _PASSWORD_PARAM.sub(r"\1\2***", url)
