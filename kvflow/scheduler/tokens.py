"""Prompt token ids: the one tokenizer abstraction of kvflow, and the model's own tokenizer.

The scheduler matches a prompt's block-hash chain (`kvflow.scheduler.blocks`) against what the
replicas cache, including the blocks vLLM reports in its KV events. Those hashes only agree when
kvflow cuts the prompt into the same token ids as the engine, so the ids must come from the
served model's own tokenizer and chat template, not from an approximation.

Two small protocols, with the same two methods:

- `Tokenizer`: ids computed in this process (`encode` for a completion prompt, `encode_chat`
  for chat messages and the tools the engine renders into the prompt with them). The built-in
  tokenizer of the simulator's models is one (`kvflow.scheduler.builtin_tokenizer.Tokenizer`);
  `HfTokenizer` is another: a model's `tokenizer.json`, read with the `tokenizers` library,
  and its chat template, rendered with jinja2 the way `transformers` renders it for vLLM.
- `AsyncTokenizer`: what the `place` activity awaits. `InThread` runs a `Tokenizer` off the
  event loop; `kvflow.activities.tokenize.VllmTokenize` asks a replica's `POST /tokenize`.

Tokenizing happens in the `place` activity, before the decision: nothing here runs on the
scheduler's decision path, and nothing here touches the network (files are read once, when a
fleet is loaded).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import jinja2
    import tokenizers

ChatMessages = Sequence[Mapping[str, Any]]
"""OpenAI-style chat messages: `{"role": ..., "content": str | [{"type": "text", ...}]}`, an
assistant's with its `tool_calls`, a `tool` message with its `tool_call_id`."""
ChatTools = Sequence[Mapping[str, Any]]
"""OpenAI function tools as the API takes them: `{"type": "function", "function": {...}}`."""


class Tokenizer(Protocol):
    """Token ids of prompts, computed in this process, exactly as the engine computes them."""

    def encode(self, text: str) -> list[int]:
        """Ids of a completion prompt, with the special tokens the engine adds (e.g. BOS)."""
        ...

    def encode_chat(
        self,
        messages: ChatMessages,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: ChatTools | None = None,
    ) -> list[int]:
        """Ids of chat `messages` rendered with the model's chat template.

        With `continue_final_message` the last message is left open, so the model continues it.
        `tools` are rendered into the prompt as the engine renders a request's `tools`; None or
        an empty list: a request without tools.
        """
        ...


class AsyncTokenizer(Protocol):
    """`Tokenizer`'s two methods as coroutines: the form the `place` activity awaits."""

    async def encode(self, text: str) -> list[int]:
        """Ids of a completion prompt (see `Tokenizer.encode`)."""
        ...

    async def encode_chat(
        self,
        messages: ChatMessages,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: ChatTools | None = None,
    ) -> list[int]:
        """Ids of chat `messages` and `tools` (see `Tokenizer.encode_chat`)."""
        ...


class InThread:
    """An `AsyncTokenizer` that runs a local `Tokenizer` in a worker thread.

    Tokenizing a long conversation takes milliseconds: it must not stall the event loop that
    also serves the worker's other activities.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    async def encode(self, text: str) -> list[int]:
        """Ids of a completion prompt (see `Tokenizer.encode`)."""
        return await asyncio.to_thread(self.tokenizer.encode, text)

    async def encode_chat(
        self,
        messages: ChatMessages,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: ChatTools | None = None,
    ) -> list[int]:
        """Ids of chat `messages` and `tools` (see `Tokenizer.encode_chat`)."""
        return await asyncio.to_thread(
            lambda: self.tokenizer.encode_chat(
                messages,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
            )
        )


def message_text(content: Any) -> str:
    """The text of a chat message's `content`: a string, or a list of `{"type": "text"}` parts.

    Parts are joined with newlines, as vLLM's default "string" content format does before it
    renders a chat template.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                texts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                texts.append(part)
            else:
                raise ValueError(
                    "message content parts must be {'type': 'text', 'text': ...}; "
                    "kvflow places text prompts only"
                )
        return "\n".join(texts)
    raise ValueError("message content must be a string or a list of text parts")


class TokenizerFileError(ValueError):
    """A tokenizer path that is missing, unreadable, or has no chat template."""


TOKENIZER_FILE = "tokenizer.json"
_CONFIG_FILE = "tokenizer_config.json"
_SPECIAL_TOKENS_FILE = "special_tokens_map.json"
_TEMPLATE_FILE = "chat_template.jinja"
_TEMPLATES_DIR = "additional_chat_templates"
# The special tokens transformers passes to every chat template by name (its
# SPECIAL_TOKENS_ATTRIBUTES); templates write `{{ bos_token }}`, `{{ eos_token }}`.
_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# transformers marks the end of the final message with this tag to cut the rendered chat there
# when the message is continued; rendering the same way gives the same text.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class HfTokenizer:
    """A model's own tokenizer: its `tokenizer.json` and its chat template.

    Ids equal those vLLM computes for the same request (checked against a real vLLM server in
    `tests/test_tokens_vllm.py`): a completion prompt is encoded with the tokenizer's special
    tokens (its post-processor adds BOS where the model wants it); chat messages are rendered
    with the model's chat template in jinja2's sandbox with `transformers`' settings
    (`trim_blocks`, `lstrip_blocks`, the `tojson`, `raise_exception` and `strftime_now`
    helpers, the special tokens as variables), then encoded without special tokens, since the
    template writes them. `transformers` itself is not needed: it is a large dependency for a
    control plane, and rendering its way takes a page of code.

    Tools reach the template as vLLM 0.32 hands them over: `tools` as its request model writes
    them back (`description` and `parameters` always present, null when not given), an
    assistant's `tool_calls` with each call's JSON `arguments` parsed into an object (an empty
    object for empty, malformed or non-object arguments, as vLLM does), a tool message's
    `tool_call_id`, and any message's `name`.

    A request with tools is rendered with the model's `tool_use` template when it has one (a
    template of that name in `tokenizer_config.json` or `additional_chat_templates/`), as
    `transformers` picks it for vLLM.

    Not covered: multimodal content, templates that take content as a list of parts (vLLM's
    "openai" content format), vLLM's rewriting of a `developer` role to `system` for
    templates that do not know it, a server's own `--chat-template`, and a server started with
    `--exclude-tools-when-tool-choice-none` (it drops the tools of a `tool_choice: "none"`
    request; these ids keep them).
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        chat_template: str | None,
        special_tokens: Mapping[str, str] | None = None,
        *,
        source: str = "",
        tool_template: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.tool_template = tool_template
        """The template of requests with tools, if the model has its own for them."""
        self.special_tokens = dict(special_tokens or {})
        self.source = source
        self._template = _compile_template(chat_template) if chat_template is not None else None
        self._tool_template = (
            _compile_template(tool_template) if tool_template is not None else self._template
        )

    @classmethod
    def from_path(cls, path: Path | str) -> HfTokenizer:
        """Load a model folder (with `tokenizer.json`) or a `tokenizer.json` file.

        The chat templates and the special tokens are read from the same folder, as
        `transformers` reads them: `chat_template.jinja` and `additional_chat_templates/*.jinja`,
        else `tokenizer_config.json`'s `chat_template` (one, or named ones). Loads are
        remembered per file and modification time. Raises `TokenizerFileError` saying what is
        missing and what to point at instead.
        """
        file = _tokenizer_file(Path(path))
        # Not `resolve()`: the folder's files may be links into another folder (a Hugging Face
        # cache snapshot links each file to a blob), and the template beside the link counts.
        return _load(os.path.abspath(file), file.stat().st_mtime_ns)

    def encode(self, text: str) -> list[int]:
        """Ids of a completion prompt, with the special tokens the tokenizer adds."""
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=True).ids
        return ids

    def encode_chat(
        self,
        messages: ChatMessages,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: ChatTools | None = None,
    ) -> list[int]:
        """Ids of chat `messages` and `tools` rendered with the model's chat template."""
        text = self.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
        )
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    def render_chat(
        self,
        messages: ChatMessages,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: ChatTools | None = None,
    ) -> str:
        """The chat template's text for `messages` and `tools` (what `encode_chat` encodes).

        A malformed `tools` or `tool_calls` entry raises `ValueError` naming it.
        """
        template = self._tool_template if tools else self._template
        if template is None:
            raise TokenizerFileError(
                f"{self.source or 'this tokenizer'} has no chat template: add "
                f"{_TEMPLATE_FILE} beside it, or a chat_template in {_CONFIG_FILE}"
            )
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible")
        chat = [_engine_message(index, m) for index, m in enumerate(messages)]
        if continue_final_message:
            if not chat:
                raise ValueError("continue_final_message needs a final message to continue")
            chat[-1]["content"] += _CONTINUE_TAG
        rendered = template.render(
            messages=chat,
            # A call without tools is sent to the engine without the key: None, not [].
            tools=[_engine_tool(index, t) for index, t in enumerate(tools)] if tools else None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
        )
        if continue_final_message:
            # Cut after the final message, as transformers does: the text a template writes
            # after a message (its end token) must not be in a prompt the model continues.
            cut = rendered.rindex(_CONTINUE_TAG.strip())
            if rendered[cut : cut + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
                rendered = rendered[:cut]
            else:  # the template stripped the message's trailing space
                rendered = rendered[:cut].rstrip()
        return rendered


def _engine_message(index: int, message: Mapping[str, Any]) -> dict[str, Any]:
    # The fields vLLM's chat parsing keeps of a message, in its order; text parts are joined
    # as its default "string" content format does.
    role = str(message.get("role", "user"))
    chat: dict[str, Any] = {"role": role, "content": message_text(message.get("content"))}
    if role == "assistant":
        calls = message.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise ValueError(f"messages[{index}].tool_calls must be a list")
        if calls:  # vLLM drops an empty list, so templates take the plain assistant path
            chat["tool_calls"] = [
                _engine_tool_call(f"messages[{index}].tool_calls[{number}]", call)
                for number, call in enumerate(calls)
            ]
    elif role == "tool" and "tool_call_id" in message:
        chat["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str):
        chat["name"] = message["name"]
    return chat


def _engine_tool_call(where: str, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if (
        not isinstance(call, Mapping)
        or call.get("type", "function") != "function"
        or not isinstance(function, Mapping)
        or not isinstance(function.get("name"), str)
    ):
        raise ValueError(
            f"{where} must be a function call: "
            '{"id": ..., "type": "function", "function": {"name": ..., "arguments": ...}}'
        )
    # vLLM's request model gives a call's known fields in this order, then any others; a
    # template that writes `tool_call | tojson` shows the order.
    parsed: dict[str, Any] = {
        "arguments": _call_arguments(function.get("arguments")),
        "name": function["name"],
        **{k: v for k, v in function.items() if k not in ("arguments", "name")},
    }
    entry: dict[str, Any] = {"id": call["id"]} if "id" in call else {}
    entry["function"] = parsed
    entry["type"] = "function"
    entry.update((k, v) for k, v in call.items() if k not in ("id", "function", "type"))
    return entry


def _call_arguments(arguments: Any) -> Any:
    # Templates iterate over a call's arguments, so vLLM parses the JSON text into an object
    # and makes anything else (empty, malformed, not an object) an empty one rather than
    # fail every later turn of the conversation.
    if not arguments:
        return {}
    if isinstance(arguments, Mapping):
        return dict(arguments)
    parsed = arguments
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            return {}
    return parsed if isinstance(parsed, dict) else {}


def _engine_tool(index: int, tool: Mapping[str, Any]) -> dict[str, Any]:
    function = tool.get("function")
    if (
        tool.get("type", "function") != "function"
        or not isinstance(function, Mapping)
        or not isinstance(function.get("name"), str)
    ):
        raise ValueError(
            f'tools[{index}] must be {{"type": "function", "function": {{"name": ...}}}}'
        )
    # What vLLM's request model writes back (`model_dump()`): description and parameters
    # always, null when absent; strict and defer_loading only when set; nothing unknown.
    deferred = function.get("defer_loading")
    if deferred is None:
        deferred = tool.get("defer_loading")
    written: dict[str, Any] = {
        "name": function["name"],
        "description": function.get("description"),
        "parameters": function.get("parameters"),
    }
    if function.get("strict") is not None:
        written["strict"] = function["strict"]
    if deferred is not None:
        written["defer_loading"] = deferred
    entry: dict[str, Any] = {"type": "function", "function": written}
    if tool.get("defer_loading") is not None:
        entry["defer_loading"] = tool["defer_loading"]
    return entry


def _tokenizer_file(path: Path) -> Path:
    try:
        return _existing_tokenizer_file(path)
    except OSError as exc:
        # A name the filesystem cannot even look up (too long, a loop of links, no access).
        shown = str(path) if len(str(path)) <= 80 else f"{str(path)[:77]}..."
        raise TokenizerFileError(
            f"{shown} cannot be read ({exc.strerror or exc}): give the path of the model's "
            f'folder or of its {TOKENIZER_FILE}, "vllm" or "builtin"'
        ) from None


def _existing_tokenizer_file(path: Path) -> Path:
    if path.is_dir():
        file = path / TOKENIZER_FILE
        if not file.is_file():
            raise TokenizerFileError(
                f"{path} has no {TOKENIZER_FILE}: point at the model's folder (the one vLLM "
                f"serves, which holds {TOKENIZER_FILE}) or at its {TOKENIZER_FILE}"
            )
        return file
    if not path.exists():
        raise TokenizerFileError(
            f"{path} does not exist (relative paths start in the working directory): give the "
            f"path of the model's folder or of its {TOKENIZER_FILE}, "
            '"vllm" to ask a replica\'s /tokenize, or "builtin"'
        )
    return path


@lru_cache(maxsize=16)
def _load(file: str, mtime_ns: int) -> HfTokenizer:
    # mtime_ns is part of the key so that a replaced file is read again.
    del mtime_ns
    from tokenizers import Tokenizer as RustTokenizer

    path = Path(file)
    try:
        tokenizer = RustTokenizer.from_file(file)
    except Exception as exc:  # the library raises a bare Exception for a malformed file
        raise TokenizerFileError(
            f"{path} is not a Hugging Face fast tokenizer file ({exc}); give the model's "
            f"{TOKENIZER_FILE}, as saved by `save_pretrained`"
        ) from None
    config = _read_json(path.parent / _CONFIG_FILE)
    special = {**_read_json(path.parent / _SPECIAL_TOKENS_FILE), **config}
    special_tokens = {
        key: text for key in _SPECIAL_TOKEN_KEYS if (text := _token_text(special.get(key)))
    }
    templates = _chat_templates(path.parent, config.get("chat_template"))
    return HfTokenizer(
        tokenizer,
        templates.get("default"),
        special_tokens,
        source=str(path),
        tool_template=templates.get("tool_use"),
    )


def _chat_templates(folder: Path, configured: Any) -> dict[str, str]:
    # transformers' order: template files, if there are any, replace the config's templates.
    # It renders a request with tools with the "tool_use" template, any other with
    # "default" (a single template is the default).
    templates: dict[str, str] = {}
    default = folder / _TEMPLATE_FILE
    if default.is_file():
        templates["default"] = default.read_text(encoding="utf-8")
    for file in sorted((folder / _TEMPLATES_DIR).glob("*.jinja")):
        templates[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    if templates:
        return templates
    if isinstance(configured, str):
        return {"default": configured}
    if isinstance(configured, list):
        return {
            str(entry["name"]): str(entry["template"])
            for entry in configured
            if isinstance(entry, Mapping) and "name" in entry and "template" in entry
        }
    return {}


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerFileError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise TokenizerFileError(f"{path} must hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    # A special token is written as its text or as an AddedToken object {"content": ...}.
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for training masks in
        # some templates; for a prompt it renders its body unchanged.
        tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a plain attribute)

        def parse(self, parser: Any) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        # jinja2's own tojson escapes HTML characters, which a prompt must keep as written.
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
            sort_keys=sort_keys,
        )  # fmt: skip

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizerFileError(f"the chat template does not compile: {exc}") from None


BUILTIN = "builtin"
"""`ModelSpec.tokenizer` value: the simulator's built-in tokenizer (the default)."""
VLLM = "vllm"
"""`ModelSpec.tokenizer` value: ask a replica serving the model for ids (`POST /tokenize`)."""


def check_tokenizer_setting(value: str) -> str:
    """Validate a fleet model's `tokenizer` setting; a path must load and have a chat template.

    Returns the value unchanged; raises `TokenizerFileError` naming the fix.
    """
    if value in (BUILTIN, VLLM):
        return value
    tokenizer = HfTokenizer.from_path(value)
    if tokenizer.chat_template is None:
        raise TokenizerFileError(
            f"{tokenizer.source} has no chat template: add {_TEMPLATE_FILE} beside it or a "
            f'chat_template in {_CONFIG_FILE}, or use tokenizer = "vllm"'
        )
    return value


def render_tools(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = ()
) -> list[dict[str, Any]]:
    r"""A conversation as the simulator's chat template renders it, tools written in as text.

    vLLM renders tools into the chat template; the simulator's built-in tokenizer
    (`kvflow.scheduler.builtin_tokenizer`) writes them with this, the way Hermes-style
    templates do, so that they count as prompt tokens and share a cached prefix:

    - the tools' JSON, one per line between `<tools>` and `</tools>` after a `# Tools` heading,
      ends the first system message (a system message is put first if there is none),
      whatever `tool_choice` says, as vLLM keeps tools in the prompt for `"none"`;
    - an assistant message's `tool_calls` follow its content, each as
      `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`;
    - a `tool` message stays a message of role `tool` whose content is the result.

    Real models' templates write tools their own way (vLLM passes them to the template, and
    so does `HfTokenizer`); for them this is an approximation. `tools` are the API's entries
    (`{"type": "function", "function": {...}}`). A malformed `tool_calls` entry raises
    `ValueError`.
    """
    rendered = [_template_message(index, m) for index, m in enumerate(messages)]
    if not tools:
        return rendered
    lines = [json.dumps(tool, ensure_ascii=False) for tool in tools]
    block = "# Tools\n<tools>\n" + "\n".join(lines) + "\n</tools>"
    if rendered and rendered[0].get("role") == "system":
        text = message_text(rendered[0].get("content"))
        rendered[0] = {**rendered[0], "content": f"{text}\n\n{block}" if text else block}
    else:
        rendered.insert(0, {"role": "system", "content": block})
    return rendered


def _template_message(index: int, message: Mapping[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return dict(message)
    if not isinstance(calls, list):
        raise ValueError(f"messages[{index}].tool_calls must be a list")
    parts = [message_text(message.get("content"))] if message.get("content") else []
    for number, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        arguments = function.get("arguments", "{}") if isinstance(function, Mapping) else None
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise ValueError(
                f"messages[{index}].tool_calls[{number}] needs a function with a `name` "
                "string and an `arguments` JSON string"
            )
        try:
            parsed: Any = json.loads(arguments)
        except json.JSONDecodeError:
            parsed = arguments  # a model's malformed arguments go back as they came
        call_text = json.dumps({"name": name, "arguments": parsed}, ensure_ascii=False)
        parts.append(f"<tool_call>\n{call_text}\n</tool_call>")
    return {**message, "content": "\n".join(parts)}
