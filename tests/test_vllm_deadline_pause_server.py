"""A real vLLM server with kvflow's engine scheduler: a tier-1 call at risk of its deadline pauses
tier 3, judged on the engine's own pace (`make paced`, on a quiet machine).

One real vLLM CPU server runs `kvflow_vllm.scheduler.DeadlinePauseScheduler`
(`VllmServer(deadline_pause=True)`: `--scheduler-cls`, priority scheduling, and a
`PYTHONPATH` that holds only the `kvflow_vllm` package, vLLM's environment having none of
kvflow's dependencies).

Each round runs the same scene twice. Tier-3 calls with long answers (EOS ignored) are
decoding; once all of them run, one tier-1 call arrives. The first time it carries no
deadline: the engine decodes it in the same batch as the tier-3 calls, which get a token on
every step it gets one. The second time it carries a deadline (`vllm_xargs`) well before the
time it took at that pace: the engine then leaves the tier-3 calls out of its steps while the
tier-1 call would miss it, so the tier-3 calls stall while it decodes, and it finishes
sooner.

What happened is read from the engine's own accounts in the server's Prometheus metrics, taken
just before the tier-1 call is sent and once it has finished: how many steps decoded it alone
(`vllm:iteration_tokens_total`, the bucket of one-token steps), how many tokens the tier-3
calls got while it ran (`vllm:generation_tokens_total`, less what they made in the steps
before the API server handed it to the engine), and its decode time as the engine timed it
(`vllm:request_decode_time_seconds`). On two shared cores the arrival of stream chunks in
this process lags the engine by up to seconds, in bursts, so their arrival times cannot tell
which tokens were generated while the tier-1 call decoded.

Both scenes of a round are judged against each other, so neither the machine's pace nor its
changes between rounds can make a round pass. Without the pause no step decodes the tier-1
call alone while tier-3 calls run (vLLM's own scheduler decodes every running call on every
step), so a round can only pass where the pause works; a busy machine can still spoil a round
(the deadline passes before the call gets going, or the machine speeds up between the two
scenes so that the call is never at risk), so up to `ROUNDS` rounds run and one must show the
effects.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvflow.scheduler.engine_http import engine_limits
from kvflow.scheduler.placement import TIER_PRIORITY_SPAN, engine_priority
from tests.fixtures_vllm import (
    SERVED_MODEL_NAME,
    VllmServedModel,
    early_vllm,
    served_model,
    tiny_server,
    vllm_servers,
)
from tests.waiting import eventually

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

TASK_START = 1_765_000_000.0
"""When the calls' tasks began (POSIX seconds)."""
LOW_CALLS = 4
CONTEXT = 2048
"""The server's context: the tiny model's whole (`max_position_embeddings`), so that the tier-3
calls can be long."""
LOW_TOKENS = CONTEXT - 32
"""Long enough to keep decoding through the tier-1 call, however late this process sends it
on a busy machine (their prompts are under 32 tokens)."""
URGENT_TOKENS = 200
DEADLINE_SHARE = 0.6
"""The deadline, as a share of the time the same call took without one in the same round."""
PAUSED_SHARE = 0.5
"""With the deadline, at least this share of the tier-1 call's decode steps decode it alone,
and the tier-3 calls get at most this share of the tokens they got without it."""
ROUNDS = 6
START_TRIES = 15
"""Tries at having every tier-3 call running at once before a scene (`tier3_calls`)."""
FRESH_TOKENS = 150
"""Each tier-3 call has made at most about this many tokens when the tier-1 call is sent..."""
FRESH_TRIES = 3
"""...in the first this many tries; later tries take the calls as they come (a round they
spoil is run again)."""


SERVERS = early_vllm(
    __name__,
    "vllm-deadline-pause",
    lambda install, log_dir: {
        "server": tiny_server(install, log_dir, deadline_pause=True, max_model_len=CONTEXT)
    },
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServedModel]:
    """A real vLLM server scheduling with `DeadlinePauseScheduler` (priority policy)."""
    with vllm_servers(tmp_path_factory, SERVERS) as started:
        yield served_model(started["server"])


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` in Prometheus text whose labels include `labels`."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


@dataclasses.dataclass(frozen=True)
class EngineCounts:
    """What the engine had counted at one moment (its Prometheus metrics)."""

    finished_by_length: float
    running: float
    steps: float
    steps_of_one_token: float
    generated_tokens: float
    decode_time_s: float

    @staticmethod
    async def read(http: httpx.AsyncClient, server: VllmServedModel) -> EngineCounts:
        answer = await http.get(f"{server.base_url}/metrics")
        answer.raise_for_status()
        text = answer.text
        return EngineCounts(
            finished_by_length=metric(text, "vllm:request_success_total", finished_reason="length"),
            running=metric(text, "vllm:num_requests_running"),
            steps=metric(text, "vllm:iteration_tokens_total_count"),
            steps_of_one_token=metric(text, "vllm:iteration_tokens_total_bucket", le="1.0"),
            generated_tokens=metric(text, "vllm:generation_tokens_total"),
            decode_time_s=metric(text, "vllm:request_decode_time_seconds_sum"),
        )


async def counts_with_call(
    http: httpx.AsyncClient, server: VllmServedModel, before: EngineCounts
) -> EngineCounts:
    """The engine's counts once they include the tier-1 call that just finished.

    The server takes a step's counts in after it has handed out the step's outputs, so they
    may lag the answer a little.
    """
    async with asyncio.timeout(10):
        while True:
            after = await EngineCounts.read(http, server)
            if after.finished_by_length > before.finished_by_length:
                return after
            await asyncio.sleep(0.05)


async def low_call(http: httpx.AsyncClient, server: VllmServedModel, i: int) -> None:
    """A tier-3 call of `LOW_TOKENS` (EOS ignored), not streamed: nothing for this process to
    keep up with while the engine decodes (cancelling it aborts it in vLLM)."""
    body = {
        "model": SERVED_MODEL_NAME,
        "prompt": f"Write the long tier-3 report number {i}.",
        "max_tokens": LOW_TOKENS,
        "ignore_eos": True,
        "priority": engine_priority(3, TASK_START + i),
    }
    answer = await http.post(f"{server.base_url}/v1/completions", json=body)
    assert answer.status_code == 200, answer.text


@contextlib.asynccontextmanager
async def tier3_calls(
    http: httpx.AsyncClient, server: VllmServedModel
) -> AsyncIterator[EngineCounts]:
    """`LOW_CALLS` tier-3 calls, all running in the engine and freshly so; aborted on exit.

    Yields the engine's counts from just before they were sent, so that a scene can tell
    whether one of them ended before the tier-1 call did (`Scene.spoiled`).

    Whether they run, and whether one has ended, is read from the engine's own counts rather
    than from their answers: on two busy cores this process may read an answer seconds after
    the engine made it. Where the API server is slow enough (another server loading beside
    it) that one call ends before the last one runs, they are aborted and sent again, up to
    `START_TRIES` times (about a minute: longer than a server takes to load); in the first
    `FRESH_TRIES`, also when they have made more than `FRESH_TOKENS` each by then, as calls
    that far along may end within the scene.
    """
    for attempt in range(1, START_TRIES + 1):
        # A client of their own: a connection vLLM closed when an earlier call was aborted is
        # never reused for the next one.
        calls = httpx.AsyncClient(timeout=120)
        sent = await EngineCounts.read(http, server)
        tasks = [asyncio.create_task(low_call(calls, server, i)) for i in range(LOW_CALLS)]

        async def running_or_one_ended(sent: EngineCounts = sent) -> bool:
            now = await EngineCounts.read(http, server)
            return _one_ended(sent, now) or now.running >= LOW_CALLS

        async def decoding_or_one_ended(sent: EngineCounts = sent) -> bool:
            # The gauge can run ahead of the steps: wait until they decode, a few tokens each.
            now = await EngineCounts.read(http, server)
            return _one_ended(sent, now) or now.generated_tokens - sent.generated_tokens >= (
                2 * LOW_CALLS
            )

        try:
            await eventually(
                running_or_one_ended, within=60, what="every tier-3 call runs", interval=0.05
            )
            await eventually(
                decoding_or_one_ended, within=30, what="the tier-3 calls decode", interval=0.05
            )
            for task in tasks:
                if task.done():
                    task.result()  # a failed call fails the test with its error
            now = await EngineCounts.read(http, server)
            made = now.generated_tokens - sent.generated_tokens
            if not _one_ended(sent, now) and (
                made <= LOW_CALLS * FRESH_TOKENS or attempt >= FRESH_TRIES
            ):
                yield sent
                return
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await calls.aclose()
            # The next scene starts from an idle engine: vLLM aborts a call whose client left.
            await eventually(idle(http, server), within=30, what="vLLM aborted the tier-3 calls")
    raise AssertionError(
        f"in {START_TRIES} tries one of the {LOW_CALLS} tier-3 calls always ended before the "
        "last one ran: the server admitted them too slowly"
    )


def _one_ended(sent: EngineCounts, now: EngineCounts) -> bool:
    """Whether the engine finished a call since `sent` (the tier-3 calls are the only ones)."""
    return now.finished_by_length > sent.finished_by_length


def idle(http: httpx.AsyncClient, server: VllmServedModel) -> Callable[[], Awaitable[bool]]:
    """A check that the engine runs no call."""

    async def check() -> bool:
        return (await EngineCounts.read(http, server)).running == 0

    return check


@dataclasses.dataclass(frozen=True)
class Scene:
    """What the engine did while it ran the tier-1 call (from its admission to its end)."""

    latency_s: float
    """From sending the tier-1 call to its answer, as this process saw it."""
    decode_time_s: float
    """The tier-1 call's decode time, as the engine timed it."""
    waited: int
    """Steps from its sending to its admission (the API server's delay)."""
    steps_alone: int
    """Steps that decoded one token: the tier-1 call's, the tier-3 calls left out."""
    low_tokens: int
    """Tokens the tier-3 calls got while it ran (all of them together)."""
    spoiled: bool
    """A tier-3 call ended before the tier-1 call did (in the engine, whatever this process
    had read of its answer): the tier-1 call did not decode amid all of them throughout."""


async def scene(
    http: httpx.AsyncClient, server: VllmServedModel, deadline_in_s: float | None
) -> Scene:
    """The tier-1 call amid decoding tier-3 calls, with a deadline `deadline_in_s` from now."""
    async with tier3_calls(http, server) as at_tier3_start:
        before = await EngineCounts.read(http, server)
        xargs: dict[str, Any] = {"kvflow_priority_span": TIER_PRIORITY_SPAN}
        if deadline_in_s is not None:
            xargs["kvflow_deadline"] = time.time() + deadline_in_s
        body = {
            "model": SERVED_MODEL_NAME,
            "prompt": "Write the tier-1 summary.",
            "max_tokens": URGENT_TOKENS,
            "ignore_eos": True,
            "priority": engine_priority(1, TASK_START + 10),
            "vllm_xargs": xargs,
        }
        sent_at = time.monotonic()
        answer = await http.post(f"{server.base_url}/v1/completions", json=body)
        latency_s = time.monotonic() - sent_at
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == URGENT_TOKENS
        after = await counts_with_call(http, server, before)
    # The tier-1 call makes one token a step from its admission on (it is never paused), so
    # the steps before it were the API server's delay in handing it over (a second or more on
    # a busy machine): every tier-3 call decoded in each.
    waited = round(after.steps - before.steps) - URGENT_TOKENS
    return Scene(
        latency_s=latency_s,
        decode_time_s=after.decode_time_s - before.decode_time_s,
        waited=waited,
        steps_alone=round(after.steps_of_one_token - before.steps_of_one_token),
        low_tokens=round(after.generated_tokens - before.generated_tokens)
        - URGENT_TOKENS
        - LOW_CALLS * waited,
        # Compared with the counts from before the tier-3 calls were sent: one that had
        # ended by the time the tier-1 call was sent spoils the scene too.
        spoiled=after.finished_by_length != at_tier3_start.finished_by_length + 1,
    )


def paused_enough(unhurried: Scene, hurried: Scene) -> bool:
    """Whether the round with the deadline shows the pause (see the test's assertions)."""
    return (
        not unhurried.spoiled
        and not hurried.spoiled
        and unhurried.steps_alone == 0
        and hurried.steps_alone >= PAUSED_SHARE * URGENT_TOKENS
        and hurried.low_tokens <= PAUSED_SHARE * unhurried.low_tokens
        and hurried.decode_time_s < unhurried.decode_time_s
    )


@pytest.mark.paced  # `make paced`: a busy machine's delays spoil its rounds (module doc)
async def test_a_call_at_risk_of_its_deadline_pauses_the_lower_tier(
    server: VllmServedModel,
) -> None:
    rounds: list[tuple[Scene, Scene]] = []
    # A busy machine can leave a pooled connection idle for seconds between two reads of
    # `/metrics`; reused just as the server closes it for idling (5 s), it fails with "Server
    # disconnected without sending a response". kvflow's own clients drop it at 2 s.
    async with httpx.AsyncClient(timeout=120, limits=engine_limits()) as http:
        for _ in range(ROUNDS):
            unhurried = await scene(http, server, None)
            hurried = await scene(http, server, DEADLINE_SHARE * unhurried.latency_s)
            rounds.append((unhurried, hurried))
            print(f"without deadline: {unhurried}\nwith deadline:    {hurried}")
            if paused_enough(unhurried, hurried):
                break
    unhurried, hurried = rounds[-1]
    assert not unhurried.spoiled and not hurried.spoiled, rounds
    # Without a deadline no step decoded the tier-1 call alone: the tier-3 calls kept pace.
    assert unhurried.steps_alone == 0, rounds
    # With one, most of its steps left the tier-3 calls out: they stalled...
    assert hurried.steps_alone >= PAUSED_SHARE * URGENT_TOKENS, rounds
    assert hurried.low_tokens <= PAUSED_SHARE * unhurried.low_tokens, rounds
    # ...and it decoded sooner.
    assert hurried.decode_time_s < unhurried.decode_time_s, rounds
    # The server's log says why, as an operator reads it.
    assert (
        f"pausing priority bands above 1 (span {TIER_PRIORITY_SPAN})" in server.log_path.read_text()
    )
