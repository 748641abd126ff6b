"""Tenants' spend and retry budgets: the checks a placement passes before any replica is scored.

A tenant's spend is counted per UTC day from the calls observed (and seeded from the ledger at
start-up); its retries are limited to a share of its calls over a sliding window, and a task's
re-placements to a fixed number (`kvflow.scheduler.reliability`).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvflow.scheduler.axes import TenantPriority
from kvflow.scheduler.config import SchedulerConfig
from kvflow.scheduler.fleet import Tenant, format_usd
from kvflow.scheduler.placement import PlacementRequest, Refusal, RefusalReason
from kvflow.scheduler.reasons import tenant_refusal
from kvflow.scheduler.reliability import TenantRetryBudget, task_retry_allowed

SECONDS_PER_DAY = 86_400


class TenantAccounts:
    """Every tenant's spend today, retry window and Temporal priority keys."""

    def __init__(self, tenants: Iterable[Tenant], config: SchedulerConfig) -> None:
        self._retries = config.retries
        self._priority = TenantPriority(config.admission)
        tenants = list(tenants)
        self._keys = {t.name: self._priority.keys(t) for t in tenants}
        self._retry_budgets = {t.name: TenantRetryBudget(config.retries) for t in tenants}
        self._spend: dict[str, tuple[int, int]] = {}
        """Tenant → (UTC day, micro-dollars spent that day)."""

    def keys(self, tenant: str) -> tuple[int, str, float]:
        """Temporal priority key (the tier), fairness key and fairness weight of the tenant."""
        return self._keys[tenant]

    def spend_today(self, tenant: str, now: float) -> int:
        """The tenant's spend seen on `now`'s UTC day, in micro-dollars."""
        day = int(now // SECONDS_PER_DAY)
        spent_day, micros = self._spend.get(tenant, (day, 0))
        return micros if spent_day == day else 0

    def set_spend_today(self, tenant: str, micros: int, now: float) -> None:
        """Seed the tenant's spend for `now`'s UTC day."""
        self._spend[tenant] = (int(now // SECONDS_PER_DAY), micros)

    def add_spend(self, tenant: str, micros: int, now: float) -> None:
        """Count an observed call's price."""
        self.set_spend_today(tenant, self.spend_today(tenant, now) + micros, now)

    def record_call(self, tenant: str, retry: bool, now: float) -> None:
        """Count a placed call (a first attempt) or a re-placement in the retry window."""
        self._retry_budgets[tenant].record(retry, now)

    def refusal(self, request: PlacementRequest, tenant: Tenant, now: float) -> Refusal | None:
        """Why the tenant may not place the call now (retry budgets, daily quota), or None.

        A re-placement after an outage of Temporal (`after_control_plane_fault`) is no retry:
        the tenant's and the task's retry budgets are not asked, the daily quota is.
        """
        retry = request.attempt > 1 and not request.after_control_plane_fault
        if not retry and tenant.daily_budget_usd is None:
            return None  # a first attempt of a tenant without a quota: nothing to check
        retries = self._retries
        if retry and not task_retry_allowed(request.task_retries, request.attempt, retries):
            return tenant_refusal(
                request,
                tenant,
                RefusalReason.RETRY_BUDGET_EXHAUSTED,
                f"the task has used all {retries.max_task_retries} re-placements its retry "
                "budget allows; it fails here instead of spending more",
            )
        budget = self._retry_budgets[tenant.name]
        if retry and not budget.allows_retry(now):
            wait = budget.seconds_until_retry(now)
            return tenant_refusal(
                request,
                tenant,
                RefusalReason.RETRY_BUDGET_EXHAUSTED,
                f"tenant {tenant.name} has retried more than "
                f"{retries.tenant_retry_fraction:.0%} of its calls in the last "
                f"{retries.tenant_window_s:.0f} s; retries resume in {wait:.1f} s",
                retry_after=wait,
            )
        spent_today = self.spend_today(tenant.name, now)
        if self._priority.over_quota(tenant, spent_today):
            day = int(now // SECONDS_PER_DAY)
            return tenant_refusal(
                request,
                tenant,
                RefusalReason.TENANT_OVER_QUOTA,
                f"tenant {tenant.name} has spent ${format_usd(spent_today, 2)} today, its daily "
                f"budget is ${tenant.daily_budget_usd}; calls resume at 00:00 UTC",
                retry_after=(day + 1) * SECONDS_PER_DAY - now,
            )
        return None
