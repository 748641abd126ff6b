"""Deterministic output: the next token is a function of the whole context and a sampling key.

`TextSampler` keeps a 64-bit rolling hash of every token of the context (prompt, then each
output token) and draws the next token from `splitmix64(hash ^ key)`. Consequences a user can
rely on:

- the same prompt and key give the same output, on any replica;
- a resumed request (the prompt followed by a partial answer, e.g. with chat
  `continue_final_message`) continues exactly as the original would have, because its context
  is the same token sequence;
- greedy requests (`temperature` 0) use key 0; a request `seed` is the key otherwise; without
  either, the server draws a key from its own seeded random generator.

Text is words with a leading space, commas, and full stops; after a full stop the output ends
(end of sequence) one time in five unless `ignore_eos`. A request with a JSON schema
(`response_format`) instead gets `instance_for_schema`'s document, token by token, then end of
sequence; so does a tool call, whose arguments are an instance of the tool's `parameters`.

Tool calls follow one rule (`calls_tool`): `tool_choice` `"required"` or a named function
always calls a tool, `"none"` never does, and `"auto"` calls one when the conversation's last
message is the user's, and answers in text otherwise (after a `tool` message carrying a
result, after an assistant message being continued, after a system message). Which of several
tools `"auto"` and `"required"` call is `pick_tool`'s draw from the request's seed.

Log-probabilities (`TokenLogprobs`) are drawn the same way, from the context and the key: the
generated token is always the most likely one (probability 0.35 to 1), and the other
candidates share the rest in halving, jittered parts.
"""

from __future__ import annotations

import json
import math
import random
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from kvflow.scheduler.builtin_tokenizer import EOS_ID, Tokenizer

_MASK = (1 << 64) - 1
_PRIME = 0x100000001B3
_TOKENIZER = Tokenizer()
_WORDS = _TOKENIZER.word_ids()
_PERIOD = _TOKENIZER.piece_id(".")
_COMMA = _TOKENIZER.piece_id(",")


def splitmix64(value: int) -> int:
    """A well-mixed 64-bit function of `value` (SplitMix64's finalizer)."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
    return value ^ (value >> 31)


def context_hash(token_ids: Sequence[int], start: int = 0xCBF29CE484222325) -> int:
    """The rolling hash of a token sequence (FNV-style, 64 bits)."""
    value = start
    for token in token_ids:
        value = ((value ^ (token + 1)) * _PRIME) & _MASK
    return value


class TextSampler:
    """Deterministic next tokens for one request (see the module docstring).

    With `forced`, those tokens come out first (a structured-output document), then end of
    sequence; with `ignore_eos` the output then goes on as text.
    """

    __slots__ = ("_forced", "_hash", "_key", "_last", "ignore_eos")

    def __init__(
        self,
        prompt_token_ids: Sequence[int],
        key: int = 0,
        *,
        ignore_eos: bool = False,
        forced: Sequence[int] | None = None,
    ) -> None:
        self._hash = context_hash(prompt_token_ids)
        self._key = splitmix64(key & _MASK)
        self._last = prompt_token_ids[-1] if prompt_token_ids else -1
        self._forced = list(reversed(forced)) if forced is not None else None
        self.ignore_eos = ignore_eos

    def next_token(self) -> tuple[int, bool]:
        """The next token id and whether it is the end of sequence."""
        forced = self._forced
        if forced is not None:
            if forced:
                token = forced.pop()
                self._advance(token)
                return token, False
            if not self.ignore_eos:
                return EOS_ID, True
            self._forced = None
        draw = splitmix64(self._hash ^ self._key)
        last = self._last
        if last == _PERIOD and not self.ignore_eos and draw % 5 == 0:
            return EOS_ID, True
        roll = (draw >> 8) % 100
        if last in (_PERIOD, _COMMA) or roll < 80:
            token = _WORDS[(draw >> 16) % len(_WORDS)]
        elif roll < 88:
            token = _COMMA
        else:
            token = _PERIOD
        self._advance(token)
        return token, False

    def _advance(self, token: int) -> None:
        self._hash = ((self._hash ^ (token + 1)) * _PRIME) & _MASK
        self._last = token


ToolChoice = Literal["none", "auto", "required", "named"]
"""How a chat request lets the model call its tools (`"named"`: one function by name)."""


def calls_tool(choice: ToolChoice, last_role: str | None, continue_final_message: bool) -> bool:
    """Whether the simulated model answers with a tool call (the rule in the module docstring)."""
    if choice in ("required", "named"):
        return True
    if choice == "auto":
        return last_role == "user" and not continue_final_message
    return False


def pick_tool(count: int, seed: int) -> int:
    """Which of `count` tools a call that may use any of them uses, drawn from `seed`."""
    return splitmix64(seed ^ _TOOL_SALT) % count


_TOOL_SALT = 0x70BE5EED
_LOGPROB_SALT = 0x1F0B5A17
_WORST_LOGPROB = -9999.0
"""vLLM's floor for a log-probability (the logarithm of a probability that rounds to 0)."""


class TokenLogprobs:
    """Deterministic log-probabilities of one answer's tokens and their top alternatives.

    Feed it the output tokens in order (`entries`); each entry is vLLM's chat logprobs entry
    (`token`, `logprob`, `bytes`, `top_logprobs`) with `top` alternatives, the generated token
    first. Each token's numbers are a function of the context before it and the sampling key,
    like the token itself, so the same request gets the same logprobs on any replica.
    """

    __slots__ = ("_hash", "_key", "top")

    def __init__(self, prompt_token_ids: Sequence[int], key: int, top: int) -> None:
        self._hash = context_hash(prompt_token_ids)
        self._key = splitmix64((key ^ _LOGPROB_SALT) & _MASK)
        self.top = top

    def entries(self, token_ids: Sequence[int]) -> list[dict[str, Any]]:
        """The entries of the next `token_ids` of the answer (the context moves past them)."""
        result = []
        for token in token_ids:
            draw = splitmix64(self._hash ^ self._key)
            chosen = 0.35 + 0.65 * _unit(draw)
            rest = 1.0 - chosen
            alternatives: list[dict[str, Any]] = [_logprob_entry(token, chosen)]
            seen = {token}
            share = 0.5
            while len(alternatives) < self.top:
                draw = splitmix64(draw)
                candidate = _WORDS[draw % len(_WORDS)]
                if candidate in seen:
                    continue
                seen.add(candidate)
                # Jitter within (0.6, 1] of a halving share keeps the list strictly decreasing.
                probability = rest * share * (0.6 + 0.4 * _unit(splitmix64(draw)))
                alternatives.append(_logprob_entry(candidate, probability))
                share /= 2
            entry = {**alternatives[0], "top_logprobs": alternatives if self.top else []}
            result.append(entry)
            self._hash = ((self._hash ^ (token + 1)) * _PRIME) & _MASK
        return result


def _unit(value: int) -> float:
    """A 64-bit value as a number in [0, 1)."""
    return (value >> 11) / float(1 << 53)


def _logprob_entry(token: int, probability: float) -> dict[str, Any]:
    # vLLM reports the token's text and that text's UTF-8 bytes (not the raw token bytes).
    text = _TOKENIZER.token_str(token)
    logprob = max(math.log(probability), _WORST_LOGPROB) if probability > 0 else _WORST_LOGPROB
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


class SchemaError(ValueError):
    """The JSON schema uses something the simulator cannot produce an instance of."""


_WORD_TEXT = [_TOKENIZER.decode([t]).strip() for t in _WORDS]


def instance_for_schema(schema: Mapping[str, Any], seed: int) -> Any:
    """A deterministic instance of a JSON schema (draft 2020-12 subset) for `seed`.

    Supports `type` (one or a list), `properties`/`required`, `items`/`prefixItems`,
    `minItems`/`maxItems`, `enum`, `const`, `anyOf`/`oneOf`/`allOf`, `$ref` into `$defs` or
    `definitions` (what pydantic emits), `minimum`/`maximum` (and exclusive ones),
    `multipleOf`, `minLength`/`maxLength` and the common string `format`s. Every property is
    filled in, so the document validates against the schema and the pydantic model it came
    from. `pattern` is not interpreted: such strings are plain words.
    """
    return _Generator(schema, random.Random(seed)).value(schema, 0)


def json_for_schema(schema: Mapping[str, Any] | None, seed: int) -> str:
    """The document as JSON text; without a schema (`json_object`) a small object."""
    if schema is None:
        rng = random.Random(seed)
        return json.dumps({"answer": " ".join(rng.choice(_WORD_TEXT) for _ in range(6))})
    return json.dumps(instance_for_schema(schema, seed), ensure_ascii=False)


class _Generator:
    _MAX_DEPTH = 8
    _NULL_DEPTH = 3
    """Below this depth a nullable value is null, so recursive models stay small."""

    def __init__(self, root: Mapping[str, Any], rng: random.Random) -> None:
        self.root = root
        self.rng = rng

    def resolve(self, schema: Mapping[str, Any]) -> Mapping[str, Any]:
        seen = 0
        while "$ref" in schema:
            ref = schema["$ref"]
            if not isinstance(ref, str) or not ref.startswith("#"):
                raise SchemaError(f"only local $ref values are supported, got {ref!r}")
            target: Any = self.root
            for part in ref.lstrip("#").split("/"):
                if part:
                    part = part.replace("~1", "/").replace("~0", "~")
                    if not isinstance(target, Mapping) or part not in target:
                        raise SchemaError(f"$ref {ref!r} does not point into the schema")
                    target = target[part]
            extra = {k: v for k, v in schema.items() if k != "$ref"}
            schema = {**target, **extra} if extra else target
            seen += 1
            if seen > 32:
                raise SchemaError(f"$ref {ref!r} loops")
        return schema

    def value(self, schema: Any, depth: int) -> Any:
        if schema is True or schema is None or schema == {}:
            return self.words(1, 3)
        if schema is False:
            raise SchemaError("a schema of `false` has no instance")
        if not isinstance(schema, Mapping):
            raise SchemaError(f"a schema must be an object, got {type(schema).__name__}")
        schema = self.resolve(schema)
        if "const" in schema:
            return schema["const"]
        if "enum" in schema:
            options = list(schema["enum"])
            if not options:
                raise SchemaError("enum is empty")
            return options[self.rng.randrange(len(options))]
        if "allOf" in schema:
            merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
            for part in schema["allOf"]:
                part = self.resolve(part)
                for key, val in part.items():
                    if key == "properties":
                        merged["properties"] = {**merged.get("properties", {}), **val}
                    elif key == "required":
                        merged["required"] = [*merged.get("required", []), *val]
                    else:
                        merged.setdefault(key, val)
            return self.value(merged, depth)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                options = [self.resolve(o) for o in schema[key]]
                non_null = [o for o in options if o.get("type") != "null"]
                if depth >= self._NULL_DEPTH and len(non_null) < len(options):
                    return None
                choice = non_null[0] if non_null else options[0]
                base = {k: v for k, v in schema.items() if k != key}
                return self.value({**base, **choice}, depth)
        kind = schema.get("type")
        if isinstance(kind, list):
            kinds = [k for k in kind if k != "null"]
            if not kinds or (depth >= self._NULL_DEPTH and "null" in kind):
                return None
            kind = kinds[0]
        if kind is None:
            if "properties" in schema or "required" in schema:
                kind = "object"
            elif "items" in schema or "prefixItems" in schema:
                kind = "array"
            else:
                kind = "string"
        if kind == "object":
            return self.obj(schema, depth)
        if kind == "array":
            return self.array(schema, depth)
        if kind == "string":
            return self.string(schema)
        if kind == "integer":
            return self.integer(schema)
        if kind == "number":
            return self.number(schema)
        if kind == "boolean":
            return self.rng.random() < 0.5
        if kind == "null":
            return None
        raise SchemaError(f"unknown JSON schema type {kind!r}")

    def obj(self, schema: Mapping[str, Any], depth: int) -> dict[str, Any]:
        properties = schema.get("properties", {})
        required = list(schema.get("required", []))
        result: dict[str, Any] = {}
        for name, sub in properties.items():
            if depth >= self._MAX_DEPTH and name not in required:
                continue
            result[name] = self.value(sub, depth + 1)
        for name in required:
            if name not in result:
                result[name] = self.words(1, 2)
        minimum = schema.get("minProperties", 0)
        extra = schema.get("additionalProperties", True)
        index = 0
        while len(result) < minimum and extra is not False:
            result[f"field_{index}"] = self.value(
                extra if isinstance(extra, Mapping) else {}, depth
            )
            index += 1
        return result

    def array(self, schema: Mapping[str, Any], depth: int) -> list[Any]:
        prefix = list(schema.get("prefixItems", []))
        minimum = int(schema.get("minItems", 0))
        maximum = schema.get("maxItems")
        count = max(minimum, len(prefix), 0 if depth >= self._MAX_DEPTH else 2)
        if maximum is not None:
            count = min(count, int(maximum))
        items = schema.get("items", {})
        result: list[Any] = []
        for index in range(count):
            sub = prefix[index] if index < len(prefix) else items
            if sub is False:
                break
            value = self.value(sub, depth + 1)
            if schema.get("uniqueItems"):
                tries = 0
                while value in result and tries < 20:
                    value = self.value(sub, depth + 1)
                    tries += 1
            result.append(value)
        return result

    def string(self, schema: Mapping[str, Any]) -> str:
        fmt = schema.get("format")
        rng = self.rng
        if fmt == "date-time":
            text = f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T12:00:00Z"
        elif fmt == "date":
            text = f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        elif fmt == "time":
            text = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:00"
        elif fmt == "email":
            text = f"{rng.choice(_WORD_TEXT)}@example.com"
        elif fmt in ("uri", "url"):
            text = f"https://example.com/{rng.choice(_WORD_TEXT)}"
        elif fmt == "uuid":
            text = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        elif fmt == "ipv4":
            text = f"10.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}"
        else:
            text = self.words(2, 6)
        min_length = int(schema.get("minLength", 0))
        max_length = schema.get("maxLength")
        while len(text) < min_length:
            text = f"{text} {rng.choice(_WORD_TEXT)}"
        if max_length is not None and len(text) > int(max_length):
            text = text[: int(max_length)]
        return text

    def _bounds(self, schema: Mapping[str, Any], step: float) -> tuple[float, float]:
        low = float(schema.get("minimum", -1e18))
        high = float(schema.get("maximum", 1e18))
        if "exclusiveMinimum" in schema:
            low = max(low, float(schema["exclusiveMinimum"]) + step)
        if "exclusiveMaximum" in schema:
            high = min(high, float(schema["exclusiveMaximum"]) - step)
        if low > high:
            raise SchemaError("the schema's minimum is above its maximum")
        return low, high

    def integer(self, schema: Mapping[str, Any]) -> int:
        low, high = self._bounds(schema, 1)
        lo = max(int(-(-low // 1)), -(10**15))
        hi = min(int(high // 1), 10**15)
        if lo > hi:
            raise SchemaError("no integer lies between the schema's bounds")
        base_lo, base_hi = max(lo, 0 if hi >= 0 else lo), min(hi, max(lo, 0) + 100)
        value = self.rng.randint(base_lo, max(base_lo, base_hi))
        multiple = schema.get("multipleOf")
        if multiple:
            step = int(multiple)
            value = -(-value // step) * step
            if value > hi:
                value -= step
        return value

    def number(self, schema: Mapping[str, Any]) -> float:
        low, high = self._bounds(schema, 1e-6)
        lo, hi = max(low, 0.0 if high >= 0 else low), min(high, max(low, 0.0) + 100.0)
        value = round(self.rng.uniform(lo, max(lo, hi)), 2)
        value = min(max(value, low), high)
        multiple = schema.get("multipleOf")
        if multiple:
            value = round(value / float(multiple)) * float(multiple)
        return value

    def words(self, low: int, high: int) -> str:
        count = self.rng.randint(low, high)
        return " ".join(self.rng.choice(_WORD_TEXT) for _ in range(count))
