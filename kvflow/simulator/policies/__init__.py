"""Placement policies for the discrete-event fleet: kvflow's scheduler and the anchors.

Each policy is one small module whose docstring gives its source formula, its defaults and
where they come from (project and file). All implement `PlacementPolicy`
(`kvflow.simulator.policies.base`) and are built by name from one `PolicySetup`:

    random, round-robin, least-loaded        baselines
    llm-d, llm-d-precise                     llm-d's endpoint picker, approximate and precise
    sglang                                   SGLang model gateway, cache_aware
    dynamo                                   NVIDIA Dynamo's KV router
    aibrix                                   AIBrix's prefix-cache strategy
    <anchor>-tuned                           each anchor as its docs configure it for agents
    kvflow                                   kvflow's production Scheduler
    greedy-reference                         reads every engine's cache and load (a reference,
                                             not a bound: the bound is the zero-miss floor)
"""

from __future__ import annotations

from collections.abc import Callable

from kvflow.simulator.policies.aibrix import AibrixKvSyncPolicy, AibrixPrefixCachePolicy
from kvflow.simulator.policies.base import (
    AttemptEnd,
    PlacementPolicy,
    PolicySetup,
    TaskContext,
)
from kvflow.simulator.policies.dynamo import DynamoAgentPolicy, DynamoKvPolicy
from kvflow.simulator.policies.kvflow_scheduler import KvflowPolicy
from kvflow.simulator.policies.least_loaded import LeastLoadedPolicy
from kvflow.simulator.policies.llm_d import LlmDPolicy, LlmDPrecisePolicy, LlmDTunedPolicy
from kvflow.simulator.policies.oracle import GREEDY_REFERENCE, GreedyReferencePolicy
from kvflow.simulator.policies.random_choice import RandomPolicy
from kvflow.simulator.policies.round_robin import RoundRobinPolicy
from kvflow.simulator.policies.sglang import SglangCacheAwarePolicy, SglangManualPolicy

POLICIES: dict[str, Callable[[PolicySetup], PlacementPolicy]] = {
    "kvflow": KvflowPolicy,
    "random": RandomPolicy,
    "round-robin": RoundRobinPolicy,
    "least-loaded": LeastLoadedPolicy,
    "llm-d": LlmDPolicy,
    "llm-d-precise": LlmDPrecisePolicy,
    "llm-d-tuned": LlmDTunedPolicy,
    "sglang": SglangCacheAwarePolicy,
    "sglang-tuned": SglangManualPolicy,
    "dynamo": DynamoKvPolicy,
    "dynamo-tuned": DynamoAgentPolicy,
    "aibrix": AibrixPrefixCachePolicy,
    "aibrix-tuned": AibrixKvSyncPolicy,
}
"""The compared policies by name, kvflow first."""

ALL_POLICIES: dict[str, Callable[[PolicySetup], PlacementPolicy]] = {
    **POLICIES,
    GREEDY_REFERENCE: GreedyReferencePolicy,
}

__all__ = [
    "ALL_POLICIES",
    "GREEDY_REFERENCE",
    "POLICIES",
    "AttemptEnd",
    "PlacementPolicy",
    "PolicySetup",
    "TaskContext",
]
