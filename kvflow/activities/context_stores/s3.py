"""The context store in an S3-compatible bucket (AWS S3, SeaweedFS, MinIO, Ceph, ...), via boto3.

Each content is an object under the store's prefix, named as the directory store names its
file, so that a directory store copied into the bucket as it is (`aws s3 sync`) reads back:

    <prefix>/tenants/<tenant>/ab/<digest>, <prefix>/shared/ab/<digest>,
    <prefix>/payloads/<scope>/ab/<digest>, <prefix>/payloads/ab/<digest>

**Last use.** Each object carries its last use in user metadata, `x-amz-meta-kvflow-used`
(seconds since the epoch, from the writer's clock, as the other stores record theirs). A store
writes it with the object, and a read whose recorded use is older than `renew_after` records a
new one by copying the object onto itself with `MetadataDirective=REPLACE`: S3 changes an
object's metadata only by a write, and a server-side copy moves no bytes through the worker.
`LastModified` alone is not the record because it is the server's clock: no test could set it
(`clock=`), and each S3 server keeps it its own way. The copy moves `LastModified` as well, so
a bucket lifecycle rule that expires objects some days after their last modification prunes
as `kvflow context prune` does, for buckets too large to list. Objects without the metadata
(copied in from a directory store) fall back to `LastModified`.

**Prune** lists the prefix (one request per thousand objects), reads each object's metadata
(a HEAD each, several at once) and deletes those unused since the cutoff in batches of a
thousand. A read that renews an object between prune's HEAD and its delete loses to the
delete, as a read does in the directory store between prune's `stat` and `unlink`.

Credentials are boto3's: `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`, `AWS_PROFILE`, an
instance or task role. The URL carries no secret.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Literal, cast
from urllib.parse import parse_qsl, urlsplit

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
)

from kvflow.activities.context_store import Clock, ContextStoreUnavailable, ContextStoreUrlError
from kvflow.activities.context_stores.base import RENEW_AFTER, SharedContextStore
from kvflow.scheduler.redact import redact_url, scrub_secrets

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

USED_METADATA = "kvflow-used"
"""The user metadata key (`x-amz-meta-kvflow-used`) of an object's last use."""
URL_PARAMETERS = ("endpoint_url", "region", "addressing_style")
DELETE_BATCH = 1000
"""The most keys one `DeleteObjects` request takes."""
HEAD_THREADS = 16
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_LAYOUT = re.compile(
    r"(tenants/[A-Za-z0-9_.-]{1,64}|shared|payloads(/[0-9a-f]{32})?)/[0-9a-f]{2}/[0-9a-f]{64}"
)
_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
_NO_BUCKET = {"NoSuchBucket"}
_DENIED = {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "Forbidden"}


class S3ContextStore(SharedContextStore):
    """Contents as objects in one bucket under a prefix; see the module docstring."""

    def __init__(
        self,
        url: str,
        *,
        clock: Clock = time.time,
        renew_after: timedelta = RENEW_AFTER,
    ) -> None:
        """Open the store at `url`: `s3://bucket[/prefix][?endpoint_url=...&region=...]`.

        `addressing_style` (`path` or `virtual`) defaults to `path` with an `endpoint_url`
        (S3-compatible servers rarely have a DNS name per bucket), else to boto3's choice.
        The bucket must exist: `ContextStoreUnavailable` says how to create it, or why the
        endpoint cannot be reached; `ContextStoreUrlError` if the URL is malformed.
        """
        super().__init__(clock=clock, renew_after=renew_after)
        self._url = url
        parts = urlsplit(url)
        shown = redact_url(url)
        if "@" in parts.netloc:
            raise ContextStoreUrlError(
                f"{shown}: an S3 URL carries no credentials; set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) instead"
            )
        self.bucket = parts.netloc
        if not _BUCKET.fullmatch(self.bucket):
            raise ContextStoreUrlError(
                f"{shown}: {self.bucket!r} is not an S3 bucket name (3 to 63 lower-case "
                "letters, digits, dots and hyphens); write s3://bucket/prefix"
            )
        prefix = parts.path.strip("/")
        self.prefix = f"{prefix}/" if prefix else ""
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        unknown = sorted(set(query) - set(URL_PARAMETERS))
        if unknown:
            raise ContextStoreUrlError(
                f"{shown}: unknown parameter {', '.join(unknown)}; an S3 context store takes "
                f"{', '.join(URL_PARAMETERS)}"
            )
        endpoint = query.get("endpoint_url") or None
        style = query.get("addressing_style") or ("path" if endpoint else "auto")
        if style not in ("path", "virtual", "auto"):
            raise ContextStoreUrlError(f"{shown}: addressing_style is path or virtual")
        config = Config(
            s3={"addressing_style": cast(Literal["auto", "virtual", "path"], style)},
            connect_timeout=5,
            read_timeout=60,
            retries={"mode": "standard", "max_attempts": 3},
            max_pool_connections=HEAD_THREADS + 8,
        )
        try:
            # A session of its own: boto3's default one is shared and not thread-safe.
            self._client: S3Client = boto3.session.Session().client(
                "s3", endpoint_url=endpoint, region_name=query.get("region") or None, config=config
            )
        except (BotoCoreError, ValueError) as exc:
            raise ContextStoreUrlError(f"{shown}: {self._scrubbed(exc)}") from None
        self.endpoint = redact_url(self._client.meta.endpoint_url)
        """The endpoint requests go to (from the URL, `$AWS_ENDPOINT_URL`, or AWS's)."""
        self._location = f"s3://{self.bucket}/{self.prefix} at {self.endpoint}"
        with self._s3_errors("open"):
            self._client.head_bucket(Bucket=self.bucket)

    @property
    def location(self) -> str:
        """The bucket, the prefix and the endpoint."""
        return self._location

    def _key(self, space: str, digest: str) -> str:
        return f"{self.prefix}{space}/{digest[:2]}/{digest}"

    def _scrubbed(self, exc: BaseException) -> str:
        return scrub_secrets(str(exc).strip() or type(exc).__name__, self._url)

    @contextmanager
    def _s3_errors(self, doing: str) -> Iterator[None]:
        """Every S3 or connection failure as `ContextStoreUnavailable`, saying how to fix it."""
        try:
            yield
        except NoCredentialsError:
            raise ContextStoreUnavailable(
                f"no S3 credentials for the context store {self._location}: set "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
            ) from None
        except (EndpointConnectionError, ConnectTimeoutError) as exc:
            raise ContextStoreUnavailable(
                f"cannot reach the S3 endpoint {self.endpoint} of the context store: "
                f"{self._scrubbed(exc)}; check endpoint_url (or AWS_ENDPOINT_URL) and that the "
                "server is running"
            ) from None
        except ClientError as exc:
            code = _code(exc)
            if code in _NO_BUCKET or (doing == "open" and code in _NOT_FOUND):
                raise ContextStoreUnavailable(
                    f"the S3 bucket {self.bucket!r} does not exist at {self.endpoint}; create it "
                    f"(aws s3 mb s3://{self.bucket}) or name another in the context store URL"
                ) from None
            if code in _DENIED:
                raise ContextStoreUnavailable(
                    f"S3 refused {doing} on the context store {self._location} ({code}): check "
                    "the credentials (AWS_ACCESS_KEY_ID, AWS_PROFILE) and the bucket's policy"
                ) from None
            raise ContextStoreUnavailable(
                f"S3 {doing} on the context store {self._location} failed: {self._scrubbed(exc)}"
            ) from None
        except BotoCoreError as exc:
            raise ContextStoreUnavailable(
                f"S3 {doing} on the context store {self._location} failed: {self._scrubbed(exc)}"
            ) from None

    def _store(self, space: str, digest: str, data: bytes, now: float) -> None:
        # A PUT of the same bytes is idempotent and atomic, and renews the object.
        with self._s3_errors("a write"):
            self._client.put_object(
                Bucket=self.bucket,
                Key=self._key(space, digest),
                Body=data,
                Metadata={USED_METADATA: _stamp(now)},
            )

    def _load(self, space: str, digest: str, now: float) -> bytes | None:
        key = self._key(space, digest)
        with self._s3_errors("a read"):
            try:
                response = self._client.get_object(Bucket=self.bucket, Key=key)
            except ClientError as exc:
                if _code(exc) in _NOT_FOUND:
                    return None
                raise
            data = response["Body"].read()
            if self._stale(_used_at(response["Metadata"], response["LastModified"]), now):
                self._renew(key, now)
        return data

    def _renew(self, key: str, now: float) -> None:
        """Record a use of `key` at `now`: copy the object onto itself with new metadata."""
        try:
            self._client.copy_object(
                Bucket=self.bucket,
                Key=key,
                CopySource={"Bucket": self.bucket, "Key": key},
                MetadataDirective="REPLACE",
                Metadata={USED_METADATA: _stamp(now)},
            )
        except ClientError as exc:
            if _code(exc) not in _NOT_FOUND:  # pruned meanwhile: the read has its bytes
                raise

    def _head_used(self, key: str) -> float | None:
        """The recorded use of `key`; None when it is gone."""
        try:
            head = self._client.head_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if _code(exc) in _NOT_FOUND:
                return None
            raise
        return _used_at(head["Metadata"], head["LastModified"])

    def _delete_unused_since(self, cutoff: float) -> int:
        removed = 0
        with self._s3_errors("prune"), ThreadPoolExecutor(HEAD_THREADS) as pool:
            for keys in self._key_pages():
                used = pool.map(self._head_used, keys)
                unused = [
                    key
                    for key, at in zip(keys, used, strict=True)
                    if at is not None and at < cutoff
                ]
                if not unused:
                    continue
                response = self._client.delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": key} for key in unused], "Quiet": True},
                )
                removed += len(unused) - len(response.get("Errors", []))
        return removed

    def _key_pages(self) -> Iterator[list[str]]:
        """The store's keys, a page (at most `DELETE_BATCH`) at a time.

        Only keys the store names: a bucket may hold other things beside it.
        """
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix, PaginationConfig={"PageSize": DELETE_BATCH}
        )
        for page in pages:
            yield [
                item["Key"]
                for item in page.get("Contents", [])
                if _LAYOUT.fullmatch(item["Key"][len(self.prefix) :])
            ]

    def close(self) -> None:
        """Close the client's connections; the store is not used after."""
        self._client.close()


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _stamp(seconds: float) -> str:
    return f"{seconds:.3f}"


def _used_at(metadata: Mapping[str, str], last_modified: datetime) -> float:
    """An object's recorded use: its `kvflow-used` metadata, else its `LastModified`."""
    try:
        return float(metadata[USED_METADATA])
    except (KeyError, ValueError):
        return last_modified.timestamp()
