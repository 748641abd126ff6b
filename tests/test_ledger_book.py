"""The ledger is the book of record: a task's spend is the sum of its attempt rows.

Rows reach the ledger in any order: the GPU worker's exact row before or after the workflow's
estimate, before or after the task row, straight away or from a spool minutes later. Whatever
the order, a task's spend, attempt count and wasted spend follow from the rows it has now, and
a resumed mark, once made, is never undone by a row that comes later. The writer's own view at
the close is kept beside, and a task whose ledger spend moved after it is listed.

Every test runs against SQLite and PostgreSQL (`ledger` fixture).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    rule,
    run_state_machine_as_test,
)

from kvflow.ledger import AttemptOutcome, AttemptRecord, Ledger, LedgerError, ReportQuery
from kvflow.ledger.records import TaskOutcome
from kvflow.ledger.spool import AttemptSpool, SpooledAttemptWriter
from kvflow.ledger.store import AsyncLedger, open_ledger
from tests.fixtures_ledger import attempt_record, task_record


def _estimate(exact: AttemptRecord, completion_tokens: int = 5) -> AttemptRecord:
    """The workflow's provisional row for `exact`'s attempt, from an earlier heartbeat.

    Always `failed`, as the workflow writes it: it only knows it lost the worker."""
    cost = exact.prices.cost_micros(exact.prompt_tokens, exact.cached_tokens, completion_tokens)
    return exact.model_copy(
        update={
            "completion_tokens": completion_tokens,
            "cost_micros": cost,
            "provisional": True,
            "outcome": AttemptOutcome.FAILED,
        }
    )


# ---- the defects each of these reproduced, at the ledger ----------------------------------------


def test_cancelled_attempt_spooled_past_the_close_counts_in_the_task(ledger: Ledger) -> None:
    # The workflow was cancelled mid-call; the GPU worker's row was in its spool, so the
    # workflow billed the attempt 0 and closed. The spool is replayed afterwards.
    ledger.record_task(task_record(outcome=TaskOutcome.CANCELLED, attempts=1, spend_micros=0))
    cancelled = attempt_record(outcome=AttemptOutcome.CANCELLED, completion_tokens=40)
    assert ledger.record_attempt(cancelled) is True

    book = ledger.task("wf-1", "run-1")
    assert book is not None
    assert book.spend_micros == cancelled.cost_micros == book.wasted_micros
    assert (book.spend_at_close_micros, book.moved_micros) == (0, cancelled.cost_micros)
    assert [t.moved_micros for t in ledger.tasks_moved()] == [cancelled.cost_micros]
    report = ledger.report(ReportQuery.parse(""))
    assert report.totals.spend_micros == cancelled.cost_micros
    assert [t.workflow_id for t in report.moved] == ["wf-1"]


def test_exact_row_between_the_bill_read_and_the_task_row_is_counted(ledger: Ledger) -> None:
    exact = attempt_record(outcome=AttemptOutcome.FAILED, completion_tokens=120)
    estimate = _estimate(exact)
    ledger.record_attempt(estimate)
    # The workflow reads the estimate as the attempt's bill ...
    [billed] = ledger.attempts_for("wf-1", "run-1")
    # ... the worker's exact row replaces it ...
    assert ledger.record_attempt(exact) is True
    # ... and only then the task row is written, with the stale figure.
    ledger.record_task(task_record(attempts=1, spend_micros=billed.cost_micros))

    book = ledger.task("wf-1", "run-1")
    assert book is not None and book.spend_micros == exact.cost_micros
    assert book.moved_micros == exact.cost_micros - estimate.cost_micros


def test_exact_row_after_an_estimate_that_was_never_written_is_counted(ledger: Ledger) -> None:
    # The ledger was down for the whole retry window of the provisional write: the task row
    # holds the heartbeat's estimate and the ledger nothing, until the worker's row comes.
    exact = attempt_record(outcome=AttemptOutcome.FAILED, completion_tokens=90)
    ledger.record_task(task_record(attempts=1, spend_micros=_estimate(exact).cost_micros))
    ledger.record_attempt(exact)
    book = ledger.task("wf-1", "run-1")
    assert book is not None and (book.spend_micros, book.attempts) == (exact.cost_micros, 1)


@pytest.mark.parametrize("cut", [AttemptOutcome.FAILED, AttemptOutcome.CANCELLED])
def test_resumed_mark_outlives_the_exact_row_that_replaces_the_estimate(
    ledger: Ledger, cut: AttemptOutcome
) -> None:
    # The workflow lost the GPU worker, wrote its estimate and resumed the output elsewhere;
    # the worker's exact row comes later, `failed`, or `cancelled` for a call Temporal timed
    # out: either way its tokens were carried on, so its spend is no waste.
    exact = attempt_record(outcome=cut, completion_tokens=40)
    ledger.record_attempt(_estimate(exact))
    assert ledger.mark_resumed("wf-1", "run-1", [exact.activity_id]) == 1
    assert ledger.record_attempt(exact) is True
    ledger.record_task(task_record(attempts=1, spend_micros=exact.cost_micros))

    [row] = ledger.attempts_for("wf-1", "run-1")
    assert (row.outcome, row.provisional) == (AttemptOutcome.RESUMED_ELSEWHERE, False)
    book = ledger.task("wf-1", "run-1")
    assert book is not None and book.spend_micros == exact.cost_micros == 2400
    assert book.wasted_micros == 0
    assert ledger.report(ReportQuery.parse("")).totals.wasted_micros == 0


@pytest.mark.parametrize("cut", [AttemptOutcome.FAILED, AttemptOutcome.CANCELLED])
def test_resumed_mark_made_before_the_row_arrives_applies_to_it(
    ledger: Ledger, cut: AttemptOutcome
) -> None:
    # The next attempt continued the cut one's output while the cut one's row was spooled.
    assert ledger.mark_resumed("wf-1", "run-1", ["1"]) == 0
    ledger.record_attempt(attempt_record(outcome=cut))
    [row] = ledger.attempts_for("wf-1", "run-1")
    assert row.outcome is AttemptOutcome.RESUMED_ELSEWHERE


def test_resumed_mark_made_after_a_cancelled_row_turns_it_resumed(ledger: Ledger) -> None:
    ledger.record_attempt(attempt_record(activity_id="1", outcome=AttemptOutcome.CANCELLED))
    ledger.record_attempt(attempt_record(activity_id="2", outcome=AttemptOutcome.CANCELLED))
    assert ledger.mark_resumed("wf-1", "run-1", ["1"]) == 1
    # A cancelled attempt whose output nobody carried on stays cancelled, and wasted.
    assert {r.activity_id: r.outcome for r in ledger.attempts_for("wf-1", "run-1")} == {
        "1": AttemptOutcome.RESUMED_ELSEWHERE,
        "2": AttemptOutcome.CANCELLED,
    }


def test_mark_resumed_marks_only_failed_rows_of_its_own_run(ledger: Ledger) -> None:
    ledger.record_attempt(attempt_record(activity_id="1", outcome=AttemptOutcome.FAILED))
    ledger.record_attempt(attempt_record(activity_id="2", outcome=AttemptOutcome.OK))
    ledger.record_attempt(
        attempt_record(activity_id="1", run_id="run-2", outcome=AttemptOutcome.FAILED)
    )
    assert ledger.mark_resumed("wf-1", "run-1", ["1", "2", "1"]) == 1
    assert ledger.mark_resumed("wf-1", "run-1", ["1"]) == 0  # idempotent
    outcomes = {
        (r.run_id, r.activity_id): r.outcome
        for run in ("run-1", "run-2")
        for r in ledger.attempts_for("wf-1", run)
    }
    assert outcomes == {
        ("run-1", "1"): AttemptOutcome.RESUMED_ELSEWHERE,
        ("run-1", "2"): AttemptOutcome.OK,
        ("run-2", "1"): AttemptOutcome.FAILED,
    }


def test_spend_by_tenant_sums_attempts_started_in_the_range_by_tenant(ledger: Ledger) -> None:
    first = attempt_record(activity_id="1")
    ledger.record_attempt(first)
    ledger.record_attempt(attempt_record(activity_id="2", tenant="globex", completion_tokens=3))
    later = first.started_at.replace(hour=first.started_at.hour + 1)
    ledger.record_attempt(attempt_record(activity_id="3", started_at=later))
    since, until = first.started_at, later
    assert ledger.spend_by_tenant(since, until) == {
        "acme": first.cost_micros,
        "globex": attempt_record(completion_tokens=3).cost_micros,
    }
    assert ledger.spend_by_tenant(until, until.replace(hour=until.hour + 1)) == {
        "acme": first.cost_micros
    }


def test_step_name_with_a_nul_character_is_stored_not_refused(ledger: Ledger) -> None:
    # PostgreSQL's text refuses NUL; a row refused for good would be a bill lost.
    row = attempt_record().model_copy(update={"step": "plan\x00b"})
    row = AttemptRecord.model_validate(row.model_dump())
    assert ledger.record_attempt(row) is True
    [stored] = ledger.attempts_for("wf-1", "run-1")
    assert stored.step == "plan\ufffdb" and stored.cost_micros == row.cost_micros


class RefusesOne:
    """The real ledger, except that it refuses one key for good (a constraint it breaks)."""

    def __init__(self, ledger: AsyncLedger, refused_activity: str) -> None:
        self.ledger = ledger
        self.refused_activity = refused_activity
        self.down = False

    async def record_attempt(self, record: AttemptRecord) -> bool:
        if self.down:
            from kvflow.ledger import LedgerUnavailable

            raise LedgerUnavailable("ledger: connection refused")
        if record.activity_id == self.refused_activity:
            raise LedgerError("ledger: value out of range for this row")
        return await self.ledger.record_attempt(record)


@pytest.mark.timeout(60)
async def test_spool_replay_sets_a_refused_row_aside_and_writes_the_rest(
    ledger_url: str, tmp_path: Path
) -> None:
    async with AsyncLedger(open_ledger(ledger_url, migrate=True)) as ledger:
        target = RefusesOne(ledger, refused_activity="2")
        spool = AttemptSpool(tmp_path / "spool.db")
        writer = SpooledAttemptWriter(target, spool, retries=0, replay_interval_s=3600)
        target.down = True
        rows = [attempt_record(activity_id=str(i)) for i in (1, 2, 3)]
        for row in rows:
            assert await writer.record_attempt(row) is False  # spooled
        target.down = False

        assert await writer.replay() == 2
        written = await ledger.attempts_for("wf-1", "run-1")
        assert [r.activity_id for r in written] == ["1", "3"]
        assert len(spool) == 0 and [r.activity_id for r in spool.refused()] == ["2"]

        # The ledger is fixed; the worker restarts and the refused row is tried again.
        target.refused_activity = ""
        async with writer:
            pass
        assert [r.activity_id for r in await ledger.attempts_for("wf-1", "run-1")] == [
            "1",
            "2",
            "3",
        ]


# ---- any interleaving -----------------------------------------------------------------------------

_ACTIVITIES = ("1", "2", "3")
_WASTED = (AttemptOutcome.FAILED, AttemptOutcome.CANCELLED)


class Interleavings(RuleBasedStateMachine):
    """Random arrivals of one task's rows and its close, against a model of what must hold.

    The model keeps, per attempt, the row the ledger must hold (the first exact row, else the
    first estimate) and the resumed marks; after every step the ledger's book of the task
    (once it has a task row) and its attempt rows must match it to the micro-dollar.
    """

    ledger: Ledger

    def __init__(self) -> None:
        super().__init__()
        self.workflow_id = f"wf-{uuid.uuid4().hex[:12]}"
        self.rows: dict[str, AttemptRecord] = {}
        self.marks: set[str] = set()
        self.closed_with: int | None = None

    spooled = Bundle("spooled")

    def _row(self, activity: str, outcome: AttemptOutcome, tokens: int) -> AttemptRecord:
        return attempt_record(
            self.workflow_id, activity_id=activity, outcome=outcome, completion_tokens=tokens
        )

    def _write(self, row: AttemptRecord) -> None:
        written = self.ledger.record_attempt(row)
        held = self.rows.get(row.activity_id)
        if held is None or (held.provisional and not row.provisional):
            assert written, row
            self.rows[row.activity_id] = row
        else:
            assert not written, (held, row)

    @rule(
        activity=st.sampled_from(_ACTIVITIES),
        outcome=st.sampled_from(list(AttemptOutcome)),
        tokens=st.integers(0, 400),
    )
    def exact_row(self, activity: str, outcome: AttemptOutcome, tokens: int) -> None:
        """The GPU worker's row arrives (at once, or replayed late: the same write)."""
        if outcome is AttemptOutcome.RESUMED_ELSEWHERE:
            outcome = AttemptOutcome.FAILED
        self._write(self._row(activity, outcome, tokens))

    @rule(
        target=spooled,
        activity=st.sampled_from(_ACTIVITIES),
        outcome=st.sampled_from([AttemptOutcome.OK, *_WASTED]),
        tokens=st.integers(0, 400),
    )
    def spool_row(self, activity: str, outcome: AttemptOutcome, tokens: int) -> AttemptRecord:
        """The worker's write fails and its row waits in the spool."""
        return self._row(activity, outcome, tokens)

    @rule(row=consumes(spooled))
    def replay_spooled_row(self, row: AttemptRecord) -> None:
        self._write(row)

    @rule(activity=st.sampled_from(_ACTIVITIES), tokens=st.integers(0, 400))
    def lost_attempt_estimate(self, activity: str, tokens: int) -> None:
        """The workflow lost the worker and writes an estimate from its last heartbeat."""
        self._write(_estimate(self._row(activity, AttemptOutcome.FAILED, 400), tokens))

    @rule(activity=st.sampled_from(_ACTIVITIES))
    def resumed(self, activity: str) -> None:
        self.ledger.mark_resumed(self.workflow_id, "run-1", [activity])
        self.marks.add(activity)

    @rule(outcome=st.sampled_from(list(TaskOutcome)), view=st.integers(0, 10_000))
    def close(self, outcome: TaskOutcome, view: int) -> None:
        """The task row, with whatever figure its writer saw (right or stale)."""
        written = self.ledger.record_task(
            task_record(self.workflow_id, outcome=outcome, spend_micros=view)
        )
        assert written == (self.closed_with is None)
        if written:
            self.closed_with = view

    def _outcome(self, row: AttemptRecord) -> AttemptOutcome:
        if row.outcome in _WASTED and row.activity_id in self.marks:
            return AttemptOutcome.RESUMED_ELSEWHERE
        return row.outcome

    @invariant()
    def rows_are_the_model(self) -> None:
        stored = {r.activity_id: r for r in self.ledger.attempts_for(self.workflow_id, "run-1")}
        assert set(stored) == set(self.rows)
        for activity, row in self.rows.items():
            held = stored[activity]
            assert (held.cost_micros, held.provisional) == (row.cost_micros, row.provisional)
            assert held.outcome is self._outcome(row)

    @invariant()
    def task_spend_is_the_sum_of_its_rows(self) -> None:
        book = self.ledger.task(self.workflow_id, "run-1")
        if self.closed_with is None:
            assert book is None
            return
        assert book is not None
        assert book.spend_micros == sum(r.cost_micros for r in self.rows.values())
        assert book.attempts == len(self.rows)
        assert book.wasted_micros == sum(
            r.cost_micros for r in self.rows.values() if self._outcome(r) in _WASTED
        )
        assert book.spend_at_close_micros == self.closed_with
        moved = {t.workflow_id: t.moved_micros for t in self.ledger.tasks_moved()}
        assert moved.get(self.workflow_id, 0) == book.moved_micros


@pytest.mark.timeout(600)
def test_any_interleaving_of_rows_and_close_keeps_the_books(ledger: Ledger) -> None:
    Interleavings.ledger = ledger
    run_state_machine_as_test(
        Interleavings,
        settings=settings(
            max_examples=40,
            stateful_step_count=12,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        ),
    )
