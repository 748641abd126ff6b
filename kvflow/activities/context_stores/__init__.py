"""Context stores that many machines share: a PostgreSQL table and an S3-compatible bucket.

Workers, the codec server and the tools that decode history run on different machines; these
stores give them one context store without a shared volume. They keep the directory store's
semantics (`kvflow.activities.context_store`): the same names (`tenants/<tenant>`, `shared`,
`payloads/<scope>`, `payloads`, then the digest), the same refusals, the same errors, and
prune by last use. `SharedContextStore` holds those semantics once; each store only moves
bytes and timestamps (`postgres.PostgresContextStore`, `s3.S3ContextStore`).

Each backend is imported on demand (`open_context_store`), so that its driver stays an
optional extra: `kvflow[postgres]` (psycopg) and `kvflow[s3]` (boto3).
"""

from kvflow.activities.context_stores.base import RENEW_AFTER, SharedContextStore

__all__ = ["RENEW_AFTER", "SharedContextStore"]
