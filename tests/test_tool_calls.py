"""Tool calls through `Agent.infer`: asked for, streamed back, billed and re-placed after a cut.

A real Temporal dev server, simulated vLLM replicas that answer function calling as vLLM does
(`tests/test_sim_tools.py`), GPU workers and a SQLite ledger.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from temporalio.client import Client, WorkflowFailureError

from kvflow.simulator.faults import FaultSpec
from kvflow.workflows.agent import SPEND_QUERY, SpendBreakdown
from tests import agent_workflows as wf
from tests.stacks import MODEL, PoolPlan, assert_replays, fleet_stack, task_spec


@pytest.mark.timeout(120)
async def test_required_tool_call_returns_schema_valid_arguments_and_bills_each_call(
    temporal_client: Client, tmp_path: Path
) -> None:
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("gpu", replicas=2)]) as s:
        handle = await s.start(wf.ToolLoop.run, wf.ToolLoopInput(spec=task_spec(), model=MODEL))
        out = await handle.result()
        (call,) = out.calls
        assert call["name"] == "get_weather" and call["id"]
        arguments = json.loads(call["arguments"])
        assert isinstance(arguments["city"], str) and arguments["unit"] in ("C", "F")
        # A named or required choice finishes as vLLM's does: "stop"; then a text answer.
        assert out.finish_reasons[1] in ("stop", "length") and out.answer
        # The second call carries the tools, the call and its result: the same conversation
        # costs what the ledger says, one row per call, and the task's spend is their sum.
        _, attempts = await s.rows(handle)
        assert [a.step for a in attempts] == ["decide", "answer"]
        assert all(a.outcome == "ok" and a.cost_micros > 0 for a in attempts)
        assert attempts[1].prompt_tokens > attempts[0].prompt_tokens
        breakdown = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
        assert breakdown.spend_micros == sum(a.cost_micros for a in attempts)
        await assert_replays(handle)


@pytest.mark.timeout(120)
async def test_tool_call_cut_mid_stream_starts_over_elsewhere_and_both_attempts_are_billed(
    temporal_client: Client, tmp_path: Path
) -> None:
    pools = [
        PoolPlan(
            "cheap", gpu="H200", prices=("0.05", "0.005", "0.15"), faults=FaultSpec(crash_after=4)
        ),
        PoolPlan("backup", gpu="H100", prices=("0.40", "0.04", "1.20")),
    ]
    async with fleet_stack(temporal_client, tmp_path, pools) as s:
        handle = await s.start(wf.ToolLoop.run, wf.ToolLoopInput(spec=task_spec(), model=MODEL))
        out = await handle.result()
        assert json.loads(out.calls[0]["arguments"])["city"]
        _, attempts = await s.rows(handle)
        decide = [a for a in attempts if a.step == "decide"]
        assert [a.replica for a in decide] == ["cheap/0", "backup/0"]
        cut, whole = decide
        assert cut.outcome != "ok" and cut.completion_tokens > 0 and cut.cost_micros > 0
        # Half a tool call cannot be continued: the backup decoded the whole call again.
        assert whole.outcome == "ok" and whole.reused_tokens == 0
        breakdown = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
        assert breakdown.spend_micros == sum(a.cost_micros for a in attempts)


@pytest.mark.timeout(60)
async def test_tool_choice_naming_no_given_tool_fails_the_task_with_the_fix(
    temporal_client: Client, tmp_path: Path
) -> None:
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("gpu")]) as s:
        handle = await s.start(
            wf.ToolLoop.run,
            wf.ToolLoopInput(spec=task_spec(), model=MODEL, first_choice="get_wether"),
        )
        with pytest.raises(WorkflowFailureError) as failed:
            await handle.result()
        cause = failed.value.cause
        assert "InvalidTask" in str(getattr(cause, "type", "")) or "InvalidTask" in repr(cause)
        assert "get_wether" in str(cause) and "get_weather" in str(cause)
        assert (await s.rows(handle))[1] == []
