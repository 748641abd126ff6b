"""The secrets in URLs: masked for display, scrubbed from messages, encoded for drivers.

In the bottom layer because every layer prints a URL somewhere: the ledger its database URL,
the CLI and the telemetry a replica's endpoint, which may carry credentials.

Users write passwords as they are (`postgresql://u:S3cr%t!pw@h/db`, `http://u:a/b#c@h`),
not percent-encoded, so the user-info is read the way they meant it (`url_credentials`):
libpq, httpx and `urlsplit` would cut such a password at its first `/`, `#` or `@` and then
quote a piece of it as a host or a port in their errors. `redact_url` masks the password so
read; `scrub_secrets` takes every form of it out of a driver's message; `encode_password`
hands drivers a URL they read the same way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

# `password=...` (or `sslpassword=...`, `api_key=...`, `token=...`, `secret=...`) in a URL's
# query or a libpq `key=value` string; the value is a single-quoted libpq string or runs to the
# next space, `&` or `;`.
_PASSWORD_PARAM = re.compile(
    r"(?i)(?<![a-z_])((?:ssl)?password|api[_-]?key|(?:access[_-]?)?token|secret)(\s*=\s*)"
    r"('(?:[^'\\]|\\.)*'?|[^\s&;]*)"
)
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")
# What RFC 3986 allows in a user-info password as written: unreserved, sub-delims, ":" and
# percent-escapes. A password with anything else was written unencoded.
_ENCODED_PASSWORD = re.compile(r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:]|%[0-9A-Fa-f]{2})*")
_SAFE_IN_PASSWORD = "-._~!$&'()*+,;=:"
_VALID_ESCAPES = re.compile(r"(?:[^%]|%[0-9A-Fa-f]{2})*")

MIN_SCRUBBED_LENGTH = 4
"""Shorter secrets are not searched for in free text (they would mangle the message and hide
little); the URLs that hold them are still masked whole."""

MASK = "***"


@dataclass(frozen=True)
class UrlCredentials:
    """A URL cut around its user-info: `{head}{user}:{password}@{rest}`."""

    head: str
    """The scheme and `://`."""
    user: str
    password: str | None
    """As written (percent-escapes and all); None when the user-info has no `:`."""
    rest: str
    """Host, port, path, query and fragment."""


def url_credentials(url: str) -> UrlCredentials | None:
    """The user-info of `url` as its writer meant it; None when it has none.

    It runs from `://` to the last `@` before the query (or, when there is no `@` before a
    `?`, to the last `@` of all), so a password holding `@`, `/`, `#`, `?` or `:` is taken
    whole. A path or query with an `@` in it may be taken for part of a password: masking
    too much is the safe way to be wrong.
    """
    scheme = _SCHEME.match(url)
    if scheme is None:
        return None
    start = scheme.end()
    if url.startswith("/", start):
        return None  # `sqlite:///path`: no authority at all
    query = url.find("?", start)
    at = url.rfind("@", start, query) if query != -1 else -1
    if at == -1:
        at = url.rfind("@", start)
    if at == -1:
        return None
    user, colon, password = url[start:at].partition(":")
    return UrlCredentials(url[:start], user, password if colon else None, url[at + 1 :])


def redact_url(url: str) -> str:
    """`url` with every password (and API key or token) replaced by `***`, for messages and logs.

    Covers the user-info password (`postgresql://u:secret@h/db`, whatever characters it holds:
    see `url_credentials`), `password=` query parameters
    (`postgresql://u@h/db?password=secret`), libpq `key=value` strings
    (`host=h password='se cret'`) and the API keys an endpoint URL may carry
    (`https://vllm.example/?api_key=...`).
    """
    credentials = url_credentials(url)
    if credentials is not None and credentials.password is not None:
        url = f"{credentials.head}{credentials.user}:{MASK}@{credentials.rest}"
    return _PASSWORD_PARAM.sub(rf"\1\2{MASK}", url)


def encode_password(url: str) -> str:
    """`url` with its user-info password percent-encoded, as libpq and httpx read URLs.

    A password that is already a valid encoding is left as written; otherwise each character
    RFC 3986 does not allow there is encoded (a `%` too, unless it starts an escape), so
    `u:S3cr%t!pw@h` becomes `u:S3cr%25t!pw@h` and `u:a/b#c@h` becomes `u:a%2Fb%23c@h`. A URL
    that `urlsplit` reads as a valid host and port (`http://h:8000/p@th`) is left alone.
    """
    credentials = url_credentials(url)
    if credentials is None or credentials.password is None:
        return url
    password = credentials.password
    if _ENCODED_PASSWORD.fullmatch(password) or _reads_as_host_and_port(url):
        return url
    escapes_valid = _VALID_ESCAPES.fullmatch(password) is not None
    encoded = quote(password, safe=_SAFE_IN_PASSWORD + ("%" if escapes_valid else ""))
    return f"{credentials.head}{credentials.user}:{encoded}@{credentials.rest}"


def url_secrets(url: str) -> set[str]:
    """Every form in which a driver or a message may quote the secrets of `url`.

    The password as written, percent-decoded and percent-encoded (also as `urlsplit` would
    cut it), and the values of `password=`-like parameters; the shorter than
    `MIN_SCRUBBED_LENGTH` left out.
    """
    passwords: set[str] = set()
    credentials = url_credentials(url)
    if credentials is not None and credentials.password is not None:
        passwords.add(credentials.password)
    try:
        split = urlsplit(url).password
    except ValueError:
        split = None
    if split is not None:
        passwords.add(split)
    for match in _PASSWORD_PARAM.finditer(url):
        value = match.group(3)
        passwords.add(value)
        if len(value) >= 2 and value[0] == value[-1] == "'":
            passwords.add(value[1:-1])
    forms: set[str] = set()
    for password in passwords:
        decoded = unquote(password)
        forms |= {password, decoded, quote(decoded, safe=""), quote(password, safe="")}
        forms.add(quote(decoded, safe=_SAFE_IN_PASSWORD))
    return {form for form in forms if len(form) >= MIN_SCRUBBED_LENGTH}


def scrub_secrets(text: str, *urls: str | None) -> str:
    """`text` without the secrets of `urls`: for a driver's or a server's error message.

    Each URL (as given, and as `encode_password` hands it on) is replaced by its
    `redact_url` form, then every form of its secrets (`url_secrets`) still in the text by
    `***`: drivers quote a password they cannot parse (`invalid percent-encoded token:
    "S3cr%t!pw"`), and a URL may reach them in either form.
    """
    secrets: set[str] = set()
    for url in urls:
        if not url:
            continue
        for form in {url, encode_password(url)}:
            text = text.replace(form, redact_url(form))
            secrets |= url_secrets(form)
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text


def _reads_as_host_and_port(url: str) -> bool:
    """Whether `urlsplit` finds no user-info in `url` and a host with a valid port."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        return False
    return "@" not in parts.netloc and parts.hostname is not None
