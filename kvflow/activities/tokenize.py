"""Prompt token ids for the `place` activity, per model, as the fleet's `tokenizer` key says.

A model's `tokenizer` setting (`kvflow.scheduler.fleet.ModelSpec`) picks one of:

- a path: the model's own `tokenizer.json` and chat template, in this process
  (`kvflow.scheduler.tokens.HfTokenizer`): no network on the way to a placement;
- `"vllm"`: `VllmTokenize` asks a replica that serves the model (`POST /tokenize`), the exact
  ids vLLM sees, at the price of one HTTP round trip per new prompt;
- `"builtin"` (the default): the simulator's tokenizer, right for the simulator's models and
  an estimate for any other (prefix affinity still works, since every workflow worker computes
  the same ids, but the hashes do not match vLLM's KV events).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from kvflow.scheduler.builtin_tokenizer import Tokenizer as BuiltinTokenizer
from kvflow.scheduler.engine_http import engine_limits
from kvflow.scheduler.fleet import Fleet
from kvflow.scheduler.tokens import (
    BUILTIN,
    VLLM,
    AsyncTokenizer,
    ChatMessages,
    ChatTools,
    HfTokenizer,
    InThread,
    message_text,
)

log = logging.getLogger(__name__)


class TokenizeUnavailable(RuntimeError):
    """No replica serving the model answered `POST /tokenize`."""


class VllmTokenize:
    """An `AsyncTokenizer` that asks vLLM's `POST /tokenize` for the ids of a prompt.

    Replicas are asked in turn, starting one further each call, until one answers; a 4xx answer
    (a request vLLM refuses) is final. Answers are remembered in a small LRU cache keyed by a
    hash of the request, so a call that is placed again (a retry, a re-placement after a
    failure) costs no second round trip.
    """

    def __init__(
        self,
        base_urls: Sequence[str],
        model: str,
        *,
        cache_size: int = 256,
        timeout_s: float = 5.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        if not base_urls:
            raise ValueError("VllmTokenize needs at least one replica URL")
        self.base_urls = [str(url).rstrip("/") for url in base_urls]
        self.model = model
        self.cache_size = cache_size
        self.timeout_s = timeout_s
        self.requests = 0
        """Round trips made (cache misses), for tests and metrics."""
        self._client = client
        self._owns_client = client is None
        self._cache: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._next = 0

    async def encode(self, text: str) -> list[int]:
        """Ids of a completion prompt (vLLM adds the tokenizer's special tokens)."""
        return await self._tokenize({"model": self.model, "prompt": text})

    async def encode_chat(
        self,
        messages: ChatMessages,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: ChatTools | None = None,
    ) -> list[int]:
        """Ids of chat `messages` and `tools`, rendered by vLLM with the model's chat template.

        vLLM's `/tokenize` takes a chat request's `tools` and the messages' tool fields, and
        renders them as its chat completions do.
        """
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [_tokenize_message(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            # The chat template writes the special tokens; vLLM's chat default too.
            "add_special_tokens": False,
        }
        if tools:  # a call without tools is sent to the engine without the key
            body["tools"] = [dict(tool) for tool in tools]
        return await self._tokenize(body)

    async def aclose(self) -> None:
        """Close the HTTP client if this object made it."""
        if self._client is not None and self._owns_client:
            await self._client.aclose()
            self._client = None

    async def _tokenize(self, body: dict[str, Any]) -> list[int]:
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        key = hashlib.blake2b(canonical.encode("utf-8"), digest_size=16).digest()
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return list(cached)
        ids = await self._ask(body)
        self._cache[key] = tuple(ids)
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return ids

    async def _ask(self, body: dict[str, Any]) -> list[int]:
        if self._client is None:
            # Made on first use, inside the event loop that uses it.
            self._client = httpx.AsyncClient(timeout=self.timeout_s, limits=engine_limits())
        start, self._next = self._next, self._next + 1
        failures: list[str] = []
        for step in range(len(self.base_urls)):
            url = self.base_urls[(start + step) % len(self.base_urls)]
            self.requests += 1
            try:
                response = await self._client.post(f"{url}/tokenize", json=body)
            except httpx.HTTPError as exc:
                failures.append(f"{url}: {type(exc).__name__}: {exc}")
                continue
            if 400 <= response.status_code < 500:
                raise ValueError(
                    f"{url}/tokenize refused the prompt ({response.status_code}): "
                    f"{response.text[:300]}"
                )
            if response.status_code != 200:
                failures.append(f"{url}: HTTP {response.status_code}")
                continue
            tokens = response.json().get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                failures.append(f"{url}: the answer has no list of token ids")
                continue
            return tokens
        raise TokenizeUnavailable(
            f"no replica serving {self.model} answered /tokenize: {'; '.join(failures)}"
        )


_TOOL_FIELDS = ("tool_calls", "tool_call_id", "name")


def _tokenize_message(message: Mapping[str, Any]) -> dict[str, Any]:
    # The text of the content (kvflow places text prompts only) and the fields a chat template
    # renders tools with; vLLM validates them as its chat completions do.
    body: dict[str, Any] = {
        "role": str(message.get("role", "user")),
        "content": message_text(message.get("content")),
    }
    for key in _TOOL_FIELDS:
        if message.get(key) is not None:
            body[key] = message[key]
    return body


class FleetTokenizers:
    """The `AsyncTokenizer` of each model of a fleet, from its `tokenizer` setting.

    Models the fleet does not know (the scheduler refuses them) are sized with the built-in
    tokenizer. Raises `ValueError` naming the key and the fix when `"vllm"` is set for a model
    that no pool with real endpoints serves.
    """

    def __init__(self, fleet: Fleet, *, client: httpx.AsyncClient | None = None) -> None:
        self.builtin: AsyncTokenizer = InThread(BuiltinTokenizer())
        self._vllm: list[VllmTokenize] = []
        self._by_model: dict[str, AsyncTokenizer] = {}
        for index, model in enumerate(fleet.models):
            if model.tokenizer == BUILTIN:
                self._by_model[model.name] = self.builtin
            elif model.tokenizer == VLLM:
                urls = [
                    str(url)
                    for pool in fleet.pools
                    if isinstance(pool.endpoints, list) and model.name in pool.warm_models
                    for url in pool.endpoints
                ]
                if not urls:
                    raise ValueError(
                        f'models[{index}].tokenizer: "vllm" asks a replica serving '
                        f"{model.name} for token ids, but no pool with endpoints has it in "
                        "warm_models; list the vLLM URLs in a pool's endpoints, or give the "
                        "path of the model's tokenizer.json"
                    )
                tokenize = VllmTokenize(urls, model.name, client=client)
                self._vllm.append(tokenize)
                self._by_model[model.name] = tokenize
            else:
                # The fleet's validation loaded it already; this is the remembered load.
                self._by_model[model.name] = InThread(HfTokenizer.from_path(model.tokenizer))
        builtin_on_vllm = sorted(
            model
            for pool in fleet.pools
            if pool.kv_events is not None
            for model in pool.warm_models
            if self._by_model.get(model) is self.builtin
        )
        if builtin_on_vllm:
            log.warning(
                "models %s use the built-in tokenizer on pools with vLLM KV events: their block "
                "hashes will not match vLLM's; set each model's tokenizer in fleet.toml",
                ", ".join(builtin_on_vllm),
            )

    def for_model(self, model: str) -> AsyncTokenizer:
        """The tokenizer of `model` (the built-in one for a model the fleet does not list)."""
        return self._by_model.get(model, self.builtin)

    async def aclose(self) -> None:
        """Close the HTTP clients of the `"vllm"` tokenizers."""
        for tokenize in self._vllm:
            await tokenize.aclose()
