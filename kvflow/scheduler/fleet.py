"""The fleet as data: models, GPU pools with their prices, and tenants.

These pydantic models are the validated form of the `[[models]]`, `[[pools]]` and `[[tenants]]`
tables of `fleet.toml` and of its `[cache]` table. They are pure data so that the scheduler, the
simulator, the GPU worker and the ledger all read the same prices and the same replica names.

Money is `Decimal` in configuration and integer micro-dollars once computed, never float.
"""

from __future__ import annotations

import re
from collections import Counter
from decimal import ROUND_HALF_UP, Decimal
from typing import Annotated, Literal, NamedTuple, Self

from pydantic import (
    AnyHttpUrl,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from kvflow.scheduler.gpus import GpuGeneration
from kvflow.scheduler.tokens import BUILTIN, VLLM, check_tokenizer_setting

Name = Annotated[
    str,
    Field(
        pattern=r"^[a-z0-9][a-z0-9-]*$",
        max_length=40,
        description="lower-case letters, digits and dashes (it becomes part of task queue names)",
    ),
]
MAX_USD = Decimal(1_000_000)
"""The largest price a fleet file may give: a million dollars (per GPU-hour or per million
tokens) is far beyond any real price, and bounds what a typo can cost the scheduler."""
Usd = Annotated[
    Decimal,
    Field(
        ge=0,
        le=MAX_USD,
        decimal_places=9,
        description=(
            'US dollars, at most 1,000,000, to the nano-dollar; write it as a string, e.g. "0.15"'
        ),
    ),
]

MICROS_PER_USD = 1_000_000

EndpointKind = Literal["vllm", "dynamo", "llm-d"]
"""What a pool's endpoints are: vLLM itself, an NVIDIA Dynamo frontend, or an llm-d gateway
(Gateway API Inference Extension) in front of vLLM. It decides how a call carries its priority
(see `kvflow.activities.inference.engine_hints`)."""

TIERS = 5
"""Tenant tiers run from 1 (first) to `TIERS` (last)."""

ObjectiveName = Annotated[
    str,
    Field(
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
        max_length=253,
        description="the name of an InferenceObjective (a Kubernetes object name)",
    ),
]


def default_objectives() -> list[str]:
    """`kvflow-tier-1` to `kvflow-tier-5`: one InferenceObjective name per tier."""
    return [f"kvflow-tier-{tier}" for tier in range(1, TIERS + 1)]


def usd_to_micros(amount: Decimal) -> int:
    """Convert dollars to integer micro-dollars, rounding half up."""
    return int((amount * MICROS_PER_USD).quantize(Decimal(1), rounding=ROUND_HALF_UP))


def micros_to_usd(micros: int) -> Decimal:
    """Convert integer micro-dollars to an exact `Decimal` dollar amount."""
    return Decimal(micros) / MICROS_PER_USD


def format_usd(micros: int, places: int = 6) -> str:
    """Micro-dollars as a dollar amount with `places` decimals, e.g. `"0.004213"`.

    Rounded half away from zero, in integer arithmetic (no float, and fast enough for every
    placement's reason line).
    """
    if places < 0:
        raise ValueError(f"places must be at least 0, got {places}")
    shown = min(places, 6)
    scale = _POWERS_OF_TEN[6 - shown]
    units = (abs(micros) + scale // 2) // scale
    sign = "-" if micros < 0 else ""
    if not places:
        return f"{sign}{units}"
    whole, fraction = divmod(units, _POWERS_OF_TEN[shown])
    return f"{sign}{whole}.{str(fraction).zfill(shown)}{'0' * (places - shown)}"


_POWERS_OF_TEN = tuple(10**k for k in range(7))


def replica_name(pool: str, index: int) -> str:
    """The human name of a replica, `pool/index`."""
    return f"{pool}/{index}"


def task_queue_for(pool: str, index: int) -> str:
    """The Temporal task queue that the GPU worker of replica `pool/index` polls."""
    return f"kvflow.gpu.{pool}.{index}"


class _Strict(BaseModel):
    # Unknown keys are typos in a hand-written file; refuse them instead of ignoring them.
    model_config = ConfigDict(extra="forbid", frozen=True)


class ExactPrices(NamedTuple):
    """Token prices as integers: micro-dollars per token times `scale`.

    A price per million tokens in dollars is a price per token in micro-dollars; `scale` is
    the power of ten that makes all three whole, so a cost is an exact integer sum with one
    rounding at the end, cheap enough for every placement decision.
    """

    input: int
    cached_input: int
    output: int
    scale: int

    def cost_micros(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> int:
        """The cost in micro-dollars, rounded half up.

        (prompt − cached) · input + cached · cached input + completion · output.
        """
        total = (
            (prompt_tokens - cached_tokens) * self.input
            + cached_tokens * self.cached_input
            + completion_tokens * self.output
        )
        units, rest = divmod(total, self.scale)
        return units + 1 if 2 * rest >= self.scale else units


class TokenPrices(_Strict):
    """Per-million-token prices of one pool, in dollars."""

    input_per_mtok_usd: Usd
    cached_input_per_mtok_usd: Usd
    output_per_mtok_usd: Usd

    @classmethod
    def per_mtok(cls, input_usd: str, cached_input_usd: str, output_usd: str) -> TokenPrices:
        """Prices from decimal strings as fleet.toml writes them, e.g. ("0.20", "0.02", "0.60")."""
        return cls(
            input_per_mtok_usd=Decimal(input_usd),
            cached_input_per_mtok_usd=Decimal(cached_input_usd),
            output_per_mtok_usd=Decimal(output_usd),
        )

    def exact(self) -> ExactPrices:
        """The prices as scaled integers (see `ExactPrices`)."""
        prices = (self.input_per_mtok_usd, self.cached_input_per_mtok_usd, self.output_per_mtok_usd)
        places = max(max(0, -int(price.as_tuple().exponent)) for price in prices)
        inp, cached, out = (int(price.scaleb(places)) for price in prices)
        return ExactPrices(inp, cached, out, 10**places)

    def cost_micros(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> int:
        """Cost of one attempt in micro-dollars.

        `cached_tokens` are part of `prompt_tokens` and billed at the cached price.
        """
        if not 0 <= cached_tokens <= prompt_tokens:
            raise ValueError(
                f"cached_tokens ({cached_tokens}) must be between 0 and prompt_tokens "
                f"({prompt_tokens})"
            )
        return self.exact().cost_micros(prompt_tokens, cached_tokens, completion_tokens)


class ModelSpec(_Strict):
    """A model the fleet serves: its shape (for speed and KV estimates) and its fallback."""

    name: str = Field(min_length=1, description="the name vLLM serves it under")
    parameters_b: float = Field(gt=0, description="parameters, in billions")
    layers: int = Field(gt=0)
    kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    context_length: int = Field(gt=0, description="longest prompt + output, in tokens")
    fallback: str | None = Field(
        default=None, description="a cheaper model to degrade to when this one cannot fit"
    )
    tokenizer: str = Field(
        default=BUILTIN,
        min_length=1,
        description=(
            "where prompt token ids come from (they must equal vLLM's for prefix matching): "
            "the path of the model's folder or its tokenizer.json, "
            f'"{VLLM}" to ask a replica\'s /tokenize, or "{BUILTIN}" (the simulator\'s)'
        ),
    )

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_loads(cls, value: str) -> str:
        # A wrong path must fail `kvflow fleet check`, not the first placement.
        return check_tokenizer_setting(value)

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes of KV cache one token occupies: keys and values in every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


class Pool(_Strict):
    """A set of identical vLLM replicas on one GPU generation, with one price list."""

    name: Name
    gpu: GpuGeneration
    replicas: int = Field(ge=1, le=1024)
    gpus_per_replica: int = Field(default=1, ge=1, le=64)
    endpoints: Literal["simulated"] | list[AnyHttpUrl] = Field(
        default="simulated",
        description='"simulated", or one vLLM base URL per replica',
    )
    price_per_gpu_hour_usd: Usd
    token_prices: TokenPrices
    warm_models: list[str] = Field(min_length=1)
    max_concurrency: int = Field(default=32, ge=1, le=4096, description="calls per GPU worker")
    kv_events: list[str] | None = Field(
        default=None,
        description=(
            "one ZMQ endpoint of vLLM's KV-cache events per replica (its --kv-events-config "
            "endpoint, e.g. ipc:///run/vllm/kv.sock); makes the prefix index precise"
        ),
    )
    kv_events_topic: str = Field(default="", description="the topic vLLM publishes on")
    endpoint_kind: EndpointKind = Field(
        default="vllm",
        description=(
            '"vllm" (the engine itself), "dynamo" (an NVIDIA Dynamo frontend: the priority '
            'travels as nvext.agent_hints) or "llm-d" (a Gateway API Inference Extension '
            "gateway: the tier travels as an InferenceObjective header)"
        ),
    )
    priority_scheduling: bool = Field(
        default=False,
        description=(
            "the vLLM engines run `--scheduling-policy priority`, so each call carries its "
            "engine priority in the body's `priority` (for vllm and llm-d endpoints: an llm-d "
            "gateway passes the body on to vLLM); vLLM's default fcfs policy has no use for it"
        ),
    )
    deadline_pause: bool = Field(
        default=False,
        description=(
            "the vLLM engines run kvflow's engine scheduler (`--scheduler-cls "
            "kvflow_vllm.scheduler.DeadlinePauseScheduler`, with priority_scheduling): each "
            "call of a task with a step objective (`TaskSpec.step_slo_s`) carries its step's "
            "deadline in the body's `vllm_xargs`, and while a call would miss it the engine "
            "pauses the calls of lower tiers"
        ),
    )
    task_end_release: bool = Field(
        default=False,
        description=(
            "the vLLM engines run kvflow's engine scheduler (`--scheduler-cls "
            "kvflow_vllm.scheduler.TaskEndScheduler`, or DeadlinePauseScheduler): each call "
            "names its task in the body's `vllm_xargs`, and when the task ends the control "
            "plane sends the engine that served its last call a one-token release request, "
            "after which the engine reuses that task's own KV blocks before any other cached "
            "block"
        ),
    )
    inference_objectives: list[ObjectiveName] = Field(
        default_factory=default_objectives,
        min_length=TIERS,
        max_length=TIERS,
        description=(
            '"llm-d" only: the InferenceObjective each tier names in the '
            "x-gateway-inference-objective header, tier 1 first"
        ),
    )

    @model_validator(mode="after")
    def _endpoint_kind_settings(self) -> Self:
        # A setting the pool's kind does not use is a mistake in the file, not a no-op.
        if self.priority_scheduling and self.endpoint_kind == "dynamo":
            raise ValueError(
                "priority_scheduling is for vLLM endpoints: Dynamo takes the priority in "
                "nvext.agent_hints and passes it to its engines itself; remove it"
            )
        if self.deadline_pause and not (
            self.priority_scheduling and self.endpoint_kind in ("vllm", "llm-d")
        ):
            raise ValueError(
                "deadline_pause needs vLLM engines scheduling by priority behind a vllm or "
                "llm-d endpoint: set priority_scheduling = true (and run the engines with "
                "--scheduling-policy priority --scheduler-cls "
                "kvflow_vllm.scheduler.DeadlinePauseScheduler), or remove it"
            )
        if self.task_end_release and self.endpoint_kind != "vllm":
            raise ValueError(
                "task_end_release needs each replica's own vLLM server as its endpoint "
                '(endpoint_kind = "vllm"): the release must reach the engine that holds the '
                "task's KV, which a gateway or frontend would route anywhere; remove it"
            )
        # Compared with the default rather than asked whether it was given, so that a dumped
        # pool (which writes the default out) validates again.
        if self.inference_objectives != default_objectives() and self.endpoint_kind != "llm-d":
            raise ValueError(
                'inference_objectives are sent only to an llm-d gateway (endpoint_kind = "llm-d")'
            )
        return self

    @model_validator(mode="after")
    def _one_endpoint_per_replica(self) -> Self:
        if isinstance(self.endpoints, list) and len(self.endpoints) != self.replicas:
            raise ValueError(
                f"endpoints lists {len(self.endpoints)} URL(s) but replicas is {self.replicas}; "
                'give one URL per replica, or "simulated"'
            )
        if self.kv_events is not None and len(self.kv_events) != self.replicas:
            raise ValueError(
                f"kv_events lists {len(self.kv_events)} endpoint(s) but replicas is "
                f"{self.replicas}; give one per replica"
            )
        if self.kv_events is not None and len(self.warm_models) != 1:
            raise ValueError(
                "kv_events needs exactly one warm model per pool: vLLM's events do not say "
                "which model a block belongs to"
            )
        return self

    def replica_names(self) -> list[str]:
        """Names of this pool's replicas, `pool/0` to `pool/N-1`."""
        return [replica_name(self.name, i) for i in range(self.replicas)]


class Tenant(_Strict):
    """A customer of the fleet: how urgent its work is and how much of the fleet it may use."""

    name: Name
    tier: int = Field(ge=1, le=5, description="1 runs first, 5 last (Temporal priority_key)")
    fairness_weight: float = Field(default=1.0, gt=0, le=1000)
    daily_budget_usd: Usd | None = Field(default=None, description="spend cap per UTC day")


_CONTENT_HASH = re.compile(r"^sha256:[0-9a-f]{64}$")


class CacheConfig(_Strict):
    """`[cache]`: which prompts tenants share a prefix cache on.

    Each tenant's calls carry their own vLLM `cache_salt` (`kvflow.scheduler.blocks`), so
    identical prompts of two tenants share no cached block: no discount and no timing side
    channel between tenants. A prompt listed here is shared on purpose: a chat call whose first
    message is one of them is sent without a salt, and the prefix index matches it across
    tenants.
    """

    shared_prefixes: frozenset[str] = Field(
        default=frozenset(),
        description=(
            '"sha256:" and the hex sha256 of a first message\'s text '
            '(`printf %s "$PROMPT" | sha256sum`)'
        ),
    )

    @field_validator("shared_prefixes", mode="before")
    @classmethod
    def _content_hashes(cls, value: object) -> object:
        if not isinstance(value, list | tuple | set | frozenset):
            raise ValueError('give a list of "sha256:<64 hex digits>" strings')
        for entry in value:
            if not isinstance(entry, str) or not _CONTENT_HASH.match(entry):
                raise ValueError(
                    f'{entry!r} is not a content hash: write "sha256:" and the 64 lower-case '
                    'hex digits of the prompt\'s sha256 (`printf %s "$PROMPT" | sha256sum`)'
                )
        return frozenset(value)


class Fleet(_Strict):
    """Models, pools and tenants, checked against each other; how tenants share the cache."""

    models: list[ModelSpec] = Field(min_length=1)
    pools: list[Pool] = Field(min_length=1)
    tenants: list[Tenant] = Field(min_length=1)
    cache: CacheConfig = CacheConfig()

    @model_validator(mode="after")
    def _cross_references(self) -> Self:
        problems: list[InitErrorDetails] = []

        def problem(loc: tuple[str | int, ...], value: object, message: str) -> None:
            problems.append(
                InitErrorDetails(
                    type=PydanticCustomError("fleet_reference", message),
                    loc=loc,
                    input=value,
                )
            )

        tables: dict[str, list[str]] = {
            "models": [m.name for m in self.models],
            "pools": [p.name for p in self.pools],
            "tenants": [t.name for t in self.tenants],
        }
        for table, names in tables.items():
            counts = Counter(names)
            for index, name in enumerate(names):
                if counts[name] > 1:
                    problem(
                        (table, index, "name"),
                        name,
                        f"duplicate name {name!r}: each entry of {table} needs its own",
                    )

        known = {m.name for m in self.models}
        known_list = ", ".join(sorted(known))
        for index, model in enumerate(self.models):
            if model.fallback is None:
                continue
            if model.fallback == model.name:
                problem(
                    ("models", index, "fallback"),
                    model.fallback,
                    "a model cannot be its own fallback",
                )
            elif model.fallback not in known:
                problem(
                    ("models", index, "fallback"),
                    model.fallback,
                    f"unknown model {model.fallback!r}; known models: {known_list}",
                )
        fallback_of = {m.name: m.fallback for m in self.models}
        for index, model in enumerate(self.models):
            seen, current = [model.name], model.fallback
            while current in fallback_of and current not in seen:
                seen.append(current)
                current = fallback_of[current]
            if current == model.name and len(seen) > 1:
                problem(
                    ("models", index, "fallback"),
                    model.fallback,
                    "fallback chain loops: " + " -> ".join([*seen, model.name]),
                )
        for index, pool in enumerate(self.pools):
            for j, warm in enumerate(pool.warm_models):
                if warm not in known:
                    problem(
                        ("pools", index, "warm_models", j),
                        warm,
                        f"unknown model {warm!r}; known models: {known_list}",
                    )
        if problems:
            raise ValidationError.from_exception_data("Fleet", problems)
        return self

    def model(self, name: str) -> ModelSpec:
        """The model called `name`; `KeyError` if the fleet does not serve it."""
        for model in self.models:
            if model.name == name:
                return model
        raise KeyError(name)

    def pool(self, name: str) -> Pool:
        """The pool called `name`; `KeyError` if there is none."""
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise KeyError(name)

    def tenant(self, name: str) -> Tenant:
        """The tenant called `name`; `KeyError` if there is none."""
        for tenant in self.tenants:
            if tenant.name == name:
                return tenant
        raise KeyError(name)
