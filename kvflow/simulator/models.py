"""Model shapes the simulator knows without a fleet file (public model cards' figures)."""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.scheduler.fleet import ModelSpec

BUILTIN_MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="llama-3.2-1b", parameters_b=1.2, layers=16, kv_heads=8, head_dim=64,
            context_length=32768,
        ),
        ModelSpec(
            name="llama-3.2-3b", parameters_b=3.2, layers=28, kv_heads=8, head_dim=128,
            context_length=32768,
        ),
        ModelSpec(
            name="llama-3.1-8b", parameters_b=8.0, layers=32, kv_heads=8, head_dim=128,
            context_length=32768, fallback="llama-3.2-1b",
        ),
        ModelSpec(
            name="qwen2.5-7b", parameters_b=7.6, layers=28, kv_heads=4, head_dim=128,
            context_length=32768,
        ),
        ModelSpec(
            name="llama-3.1-70b", parameters_b=70.6, layers=80, kv_heads=8, head_dim=128,
            context_length=32768, fallback="llama-3.1-8b",
        ),
    )
}  # fmt: skip
"""Built-in model specs by name (`kvflow sim serve --model NAME` without `--fleet`)."""


def resolve_models(names: Sequence[str], known: Sequence[ModelSpec] = ()) -> list[ModelSpec]:
    """The specs of `names`, from `known` (a fleet's models) first, then the built-ins.

    `ValueError` names every unknown model and the ones that exist.
    """
    table = {**BUILTIN_MODELS, **{m.name: m for m in known}}
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(
            f"unknown model{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
            f"known models: {', '.join(sorted(table))} (or describe it in a fleet file)"
        )
    return [table[n] for n in names]
