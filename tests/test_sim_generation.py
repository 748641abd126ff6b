"""The simulator's tokenizer, chat template and deterministic output (text and JSON)."""

from __future__ import annotations

import datetime
import json
import uuid
from enum import StrEnum
from typing import Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from kvflow.scheduler.builtin_tokenizer import EOS_ID, Tokenizer, apply_chat_template
from kvflow.simulator.generation import (
    SchemaError,
    TextSampler,
    instance_for_schema,
    json_for_schema,
)

TOKENIZER = Tokenizer()


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_any_text_round_trips_through_the_tokenizer(text: str) -> None:
    ids = TOKENIZER.encode(text, add_special_tokens=False)
    # Text may contain a special token's spelling ("<|end|>"), encoded as that token; decoding
    # keeps it only when asked to, as vLLM's tokenizers do.
    assert TOKENIZER.decode(ids, skip_special_tokens=False) == text
    assert TOKENIZER.encode(text, add_special_tokens=False) == ids


def test_english_costs_about_one_token_per_word() -> None:
    text = "the plan is to review the draft and call a tool for the customer order"
    ids = TOKENIZER.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.split())


def test_chat_template_marks_roles_and_the_generation_prompt() -> None:
    text = apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    )
    assert text == "<|bos|><|system|>\nbe brief<|end|>\n<|user|>\nhi<|end|>\n<|assistant|>\n"
    ids = TOKENIZER.encode(text, add_special_tokens=False)
    assert ids[0] == TOKENIZER.bos_token_id
    assert ids.count(TOKENIZER.bos_token_id) == 1


def generate(prompt_ids: list[int], key: int, count: int, **kwargs: object) -> list[int]:
    sampler = TextSampler(prompt_ids, key, **kwargs)  # type: ignore[arg-type]
    out = []
    for _ in range(count):
        token, eos = sampler.next_token()
        out.append(token)
        if eos:
            break
    return out


def test_same_context_and_key_give_the_same_tokens_and_other_keys_differ() -> None:
    ids = TOKENIZER.encode("write the plan")
    first = generate(ids, 3, 50, ignore_eos=True)
    assert first == generate(ids, 3, 50, ignore_eos=True)
    assert first != generate(ids, 4, 50, ignore_eos=True)


def test_resumed_chat_continues_exactly_as_the_original_would() -> None:
    messages = [{"role": "user", "content": "write the plan"}]
    original_prompt = TOKENIZER.encode(apply_chat_template(messages), add_special_tokens=False)
    full = generate(original_prompt, 0, 40, ignore_eos=True)
    partial_text = TOKENIZER.decode(full[:15])
    resumed_messages = [*messages, {"role": "assistant", "content": partial_text}]
    resumed_prompt = TOKENIZER.encode(
        apply_chat_template(
            resumed_messages, add_generation_prompt=False, continue_final_message=True
        ),
        add_special_tokens=False,
    )
    assert resumed_prompt == original_prompt + full[:15]
    assert generate(resumed_prompt, 0, 25, ignore_eos=True) == full[15:]


def test_output_ends_with_end_of_sequence_unless_ignored() -> None:
    ids = TOKENIZER.encode("answer briefly")
    natural = generate(ids, 1, 5000)
    assert natural[-1] == EOS_ID
    assert EOS_ID not in generate(ids, 1, len(natural) + 50, ignore_eos=True)


class Color(StrEnum):
    RED = "red"
    BLUE = "blue"


class Step(BaseModel):
    title: str = Field(min_length=3, max_length=40)
    priority: int = Field(ge=1, le=5)
    confidence: float = Field(gt=0, lt=1)
    tags: list[str] = Field(min_length=1, max_length=3)
    color: Color
    due: datetime.datetime
    id: uuid.UUID
    kind: Literal["tool", "think"]
    child: Step | None = None


class Plan(BaseModel):
    steps: list[Step]
    note: str | None
    weights: dict[str, int]
    done: bool


@pytest.mark.parametrize("seed", range(25))
def test_structured_output_is_a_valid_instance_of_a_pydantic_schema(seed: int) -> None:
    document = json_for_schema(Plan.model_json_schema(), seed)
    Plan.model_validate_json(document)


def test_schema_instances_are_deterministic_for_a_seed() -> None:
    schema = Plan.model_json_schema()
    assert json_for_schema(schema, 5) == json_for_schema(schema, 5)
    assert json_for_schema(schema, 5) != json_for_schema(schema, 6)


def test_schema_keywords_are_honoured() -> None:
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 10, "maximum": 12, "multipleOf": 2},
            "pair": {"type": "array", "prefixItems": [{"const": 1}, {"enum": ["x"]}]},
            "email": {"type": "string", "format": "email"},
            "either": {"anyOf": [{"type": "null"}, {"type": "boolean"}]},
        },
        "required": ["n", "pair", "email", "either"],
    }
    value = instance_for_schema(schema, 1)
    assert value["n"] in (10, 12)
    assert value["pair"] == [1, "x"]
    assert value["email"].endswith("@example.com")
    assert isinstance(value["either"], bool)


def test_json_object_format_gives_a_json_object() -> None:
    assert isinstance(json.loads(json_for_schema(None, 3)), dict)


def test_unsupported_schema_is_reported() -> None:
    with pytest.raises(SchemaError, match="local"):
        instance_for_schema({"$ref": "https://example.com/schema"}, 0)
