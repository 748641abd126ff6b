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
# A URL's host (a name, an IPv4 or a bracketed IPv6 address) and optional port.
_HOST_AND_PORT = re.compile(r"(?:[^\[\]:/?#@\s]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]*)?")
# One `key=value` of a URL's query, as drivers read them (`sslmode=require`, `options=-c x`).
_QUERY_PAIR = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*=[^&]*")
# A fragment a driver quotes from the URL it refused (libpq: `invalid port number: "1x"`).
_QUOTED = re.compile(r"\"([^\"]+)\"|'([^']+)'")

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


def url_credentials(url: str, *, widest: bool = False) -> UrlCredentials | None:
    """The user-info of `url` as its writer meant it; None when it has none.

    It runs from `://` to the last `@` before the host: the last `@` of all, so a password
    holding `@`, `/`, `#`, `?` or `:` is taken whole (`u:secret@part?more@h/db` has the
    password `secret@part?more`). The one exception is a URL whose text after the last `@`
    before its `?` reads as a host and a query of `key=value` pairs (`u:p@h/db?options=a@b`):
    that `@` is taken for the query's, unless `widest` (for masking: the password may hold
    `@part?k=v`, and masking too much is the safe way to be wrong).
    """
    scheme = _SCHEME.match(url)
    if scheme is None:
        return None
    start = scheme.end()
    if url.startswith("/", start):
        return None  # `sqlite:///path`: no authority at all
    at = url.rfind("@", start)
    if at == -1:
        return None
    query = url.find("?", start)
    before_query = url.rfind("@", start, query) if query != -1 else -1
    if (
        not widest
        and before_query not in (-1, at)
        and _reads_as_host_and_query(url[before_query + 1 :])
    ):
        at = before_query
    user, colon, password = url[start:at].partition(":")
    return UrlCredentials(url[:start], user, password if colon else None, url[at + 1 :])


def _reads_as_host_and_query(rest: str) -> bool:
    """Whether `rest` (what follows a user-info) is `host[:port][/path]?key=value&...`."""
    authority_and_path, _, query = rest.partition("?")
    authority = authority_and_path.split("/", 1)[0]
    if "@" in authority_and_path or _HOST_AND_PORT.fullmatch(authority) is None:
        return False
    query = query.split("#", 1)[0]
    return all(_QUERY_PAIR.fullmatch(pair) for pair in query.split("&"))


def redact_url(url: str) -> str:
    """`url` with every password (and API key or token) replaced by `***`, for messages and logs.

    Covers the user-info password (`postgresql://u:secret@h/db`, whatever characters it holds:
    see `url_credentials`), `password=` query parameters
    (`postgresql://u@h/db?password=secret`), libpq `key=value` strings
    (`host=h password='se cret'`) and the API keys an endpoint URL may carry
    (`https://vllm.example/?api_key=...`).
    """
    credentials = url_credentials(url, widest=True)
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
    for credentials in (url_credentials(url), url_credentials(url, widest=True)):
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
    "S3cr%t!pw"`), and a URL may reach them in either form. Last, a quoted fragment of a
    URL that overlaps its password (`invalid URI query parameter: "more@h:1/db"`, from a
    driver that cut the URL at an `@` or `?` of the password) is masked whole.
    """
    secrets: set[str] = set()
    forms: set[str] = set()
    for url in urls:
        if not url:
            continue
        forms |= {url, encode_password(url)}
    for form in forms:
        text = text.replace(form, redact_url(form))
        secrets |= url_secrets(form)
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, MASK)
    # Last: a password holding a quote would otherwise be cut in two by its own quote.
    return _QUOTED.sub(lambda quoted: _scrubbed_quote(quoted, forms), text)


def _scrubbed_quote(quoted: re.Match[str], urls: set[str]) -> str:
    """`quoted` (a fragment in quotes), or `***` in its quotes if it holds part of a password.

    A driver that cut a URL in the wrong place quotes a piece of it (libpq: `invalid URI query
    parameter: "more@h:1/db"`), which may be any slice of the password, however short.
    """
    fragment = quoted.group(1) or quoted.group(2)
    for url in urls:
        span = _password_span(url)
        if span is None:
            continue
        at = url.find(fragment)
        while at != -1:
            if at < span[1] and at + len(fragment) > span[0]:
                mark = quoted.group(0)[0]
                return f"{mark}{MASK}{mark}"
            at = url.find(fragment, at + 1)
    return quoted.group(0)


def _password_span(url: str) -> tuple[int, int] | None:
    """Where in `url` a password may be: its widest reading (`url_credentials`)."""
    credentials = url_credentials(url, widest=True)
    if credentials is None or credentials.password is None:
        return None
    start = len(credentials.head) + len(credentials.user) + 1
    return start, start + len(credentials.password)


def _reads_as_host_and_port(url: str) -> bool:
    """Whether `urlsplit` finds no user-info in `url` and a host with a valid port."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        return False
    return "@" not in parts.netloc and parts.hostname is not None
