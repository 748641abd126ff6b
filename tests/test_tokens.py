"""Prompt token ids from the model's own tokenizer: the files, the fleet key, the sources.

A small byte-level BPE tokenizer is trained here with the `tokenizers` library and saved the
way `save_pretrained` lays a model folder out, so these tests need no model hub and no vLLM;
`tests/test_tokens_vllm.py` checks the same machinery against a real vLLM server.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from kvflow.activities.control_plane import ControlPlaneActivities
from kvflow.activities.tokenize import FleetTokenizers, TokenizeUnavailable, VllmTokenize
from kvflow.activities.wire import ChatMessage, PlaceInput, ToolCall, ToolSpec
from kvflow.scheduler.blocks import block_hashes
from kvflow.scheduler.builtin_tokenizer import Tokenizer as BuiltinTokenizer
from kvflow.scheduler.builtin_tokenizer import apply_chat_template
from kvflow.scheduler.core import Scheduler
from kvflow.scheduler.fleet import Fleet
from kvflow.scheduler.placement import PlacementRequest
from kvflow.scheduler.tokens import (
    HfTokenizer,
    InThread,
    Tokenizer,
    check_tokenizer_setting,
    message_text,
)
from kvflow.workers.config import FleetConfigError, load_fleet
from tests.fleets import one_pool_fleet
from tests.servers import ServedModel

ROOT = Path(__file__).resolve().parent.parent
KVFLOW = Path(sys.executable).parent / "kvflow"

# A template in the style of real ones: trim_blocks matters (the newline after a block tag is
# dropped), `raise_exception` and `tojson` are transformers' helpers, `{% generation %}` is its
# extension for assistant masks.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}\n"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ '<|assistant|>\n' + message['content'] + eos_token + '\n' }}{% endgeneration %}"
    "{% else %}{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
    "{% if false %}{{ {'a': '<b>'} | tojson }}{% endif %}"
)
SPECIALS = ["<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You plan tool calls."},
    {"role": "user", "content": [{"type": "text", "text": "Read file a.txt"}, "then b.txt"]},
]

# A template that renders tools the way tool-using models' templates do: the tools' JSON
# (`tojson`), each call's name and its arguments, iterated as an object, and the id a tool
# result answers.
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}\n"
    "{{ '<|system|>\\n# Tools\\n' }}{% for tool in tools %}\n"
    "{{ tool | tojson }}{{ '\\n' }}{% endfor %}\n"
    "{{ eos_token + '\\n' }}{% endif %}\n"
    "{% for message in messages %}\n"
    "{{ '<|' + message['role'] + '|>\\n' }}{% if message['role'] == 'tool' %}\n"
    "{{ '[' + message['tool_call_id'] + '] ' }}{% endif %}\n"
    "{{ message['content'] }}{% for call in message['tool_calls'] or [] %}\n"
    "{{ '<tool_call>' + call['function']['name'] + '(' }}"
    "{% for key, value in call['function']['arguments'].items() %}\n"
    "{{ key + '=' }}{{ value | tojson }}{% if not loop.last %}{{ ', ' }}{% endif %}{% endfor %}\n"
    "{{ ')</tool_call>' }}{% endfor %}\n"
    "{{ eos_token + '\\n' }}{% endfor %}\n"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
TOOL_SPECS = [
    ToolSpec(
        name="read_file",
        description="Read a file.",
        parameters={"type": "object", "properties": {"path": {"type": "string"}}},
    ),
    ToolSpec(name="list_dir"),
]
TOOL_CHAT = [
    ChatMessage(role="system", content="You plan tool calls."),
    ChatMessage(role="user", content="Read file a.txt"),
    ChatMessage(
        role="assistant",
        tool_calls=[
            ToolCall(id="call-1", name="read_file", arguments='{"path": "a.txt", "lines": 2}'),
            ToolCall(id="call-2", name="list_dir", arguments="not json"),
        ],
    ),
    ChatMessage(role="tool", content="plan a step", tool_call_id="call-1"),
]
"""A conversation with an earlier tool call (the second one's arguments malformed) and its
result, as the step API sends it."""


def tool_chat_api() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`TOOL_CHAT` and `TOOL_SPECS` as the API (and the tokenizers) take them."""
    messages = [m.to_api(m.content) for m in TOOL_CHAT if isinstance(m.content, str)]
    return messages, [t.to_api() for t in TOOL_SPECS]


def _corpus() -> list[str]:
    words = [
        "plan",
        "tool",
        "call",
        "file",
        "read",
        "write",
        "the",
        "a",
        "then",
        "answer",
        "step",
        "cache",
        "block",
        "prompt",
    ]
    return [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(300)]


def save_model_folder(folder: Path, *, template: str | None = CHAT_TEMPLATE) -> Path:
    """A byte-level BPE `tokenizer.json`, `tokenizer_config.json` and a chat template."""
    tokenizer = RustTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_corpus(), trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", tokenizer.token_to_id("<|bos|>"))]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config: dict[str, object] = {
        "bos_token": "<|bos|>",
        "eos_token": {"content": "<|eos|>", "special": True},
    }
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model_folder(tmp_path_factory.mktemp("model"))


def test_the_model_tokenizer_renders_its_chat_template_and_encodes_it(model_dir: Path) -> None:
    tokenizer = HfTokenizer.from_path(model_dir)
    rendered = tokenizer.render_chat(MESSAGES)
    assert rendered == (
        "<|bos|><|system|>\nYou plan tool calls.<|eos|>\n"
        "<|user|>\nRead file a.txt\nthen b.txt<|eos|>\n<|assistant|>\n"
    )
    ids = tokenizer.encode_chat(MESSAGES)
    raw = RustTokenizer.from_file(str(model_dir / "tokenizer.json"))
    # The template writes <|bos|>: encoding it adds no second one.
    assert ids == raw.encode(rendered, add_special_tokens=False).ids
    assert ids[0] == raw.token_to_id("<|bos|>") and ids.count(ids[0]) == 1
    # A completion prompt gets the special tokens of the tokenizer's post-processor.
    assert tokenizer.encode("plan a step") == raw.encode("plan a step").ids
    assert tokenizer.encode("plan a step")[0] == raw.token_to_id("<|bos|>")


def test_a_continued_final_message_is_cut_right_after_its_text(model_dir: Path) -> None:
    tokenizer = HfTokenizer.from_path(model_dir)
    partial = [*MESSAGES, {"role": "assistant", "content": "First read"}]
    rendered = tokenizer.render_chat(
        partial, add_generation_prompt=False, continue_final_message=True
    )
    prompt = tokenizer.render_chat(MESSAGES)
    # The resumed prompt is the original prompt followed by the partial answer.
    assert rendered == prompt + "First read"
    with pytest.raises(ValueError, match="not compatible"):
        tokenizer.render_chat(partial, continue_final_message=True)


def test_the_template_can_refuse_a_conversation(model_dir: Path) -> None:
    tokenizer = HfTokenizer.from_path(model_dir)
    with pytest.raises(Exception, match="unknown role tool"):
        tokenizer.encode_chat([{"role": "tool", "content": "42"}])


def test_loads_are_remembered_and_a_tokenizer_json_path_works_too(model_dir: Path) -> None:
    assert HfTokenizer.from_path(model_dir) is HfTokenizer.from_path(model_dir / "tokenizer.json")


def test_a_folder_of_links_reads_the_files_beside_the_links(
    model_dir: Path, tmp_path: Path
) -> None:
    # A Hugging Face cache snapshot: each file is a link to a blob named by its hash.
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for number, file in enumerate(sorted(model_dir.iterdir())):
        blob = blobs / f"blob{number}"
        blob.write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(blob)
    tokenizer = HfTokenizer.from_path(snapshot)
    assert tokenizer.render_chat(MESSAGES) == HfTokenizer.from_path(model_dir).render_chat(MESSAGES)
    assert check_tokenizer_setting(str(snapshot)) == str(snapshot)


@pytest.mark.parametrize("layout", ["config", "files"])
def test_a_request_with_tools_is_rendered_with_the_models_tool_use_template(
    tmp_path: Path, layout: str
) -> None:
    folder = save_model_folder(tmp_path / "model", template=None)
    if layout == "config":  # named templates in tokenizer_config.json
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = [
            {"name": "default", "template": CHAT_TEMPLATE},
            {"name": "tool_use", "template": TOOLS_TEMPLATE},
        ]
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    else:  # as transformers saves them
        (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
        (folder / "additional_chat_templates").mkdir()
        (folder / "additional_chat_templates" / "tool_use.jinja").write_text(TOOLS_TEMPLATE)
    tokenizer = HfTokenizer.from_path(folder)
    only_tools = HfTokenizer.from_path(
        save_model_folder(tmp_path / "tools-model", template=TOOLS_TEMPLATE)
    )
    messages, tools = tool_chat_api()
    assert tokenizer.render_chat(messages, tools=tools) == only_tools.render_chat(
        messages, tools=tools
    )
    # Without tools: the default template.
    assert tokenizer.render_chat(MESSAGES) == HfTokenizer.from_path(
        save_model_folder(tmp_path / "default-model")
    ).render_chat(MESSAGES)


def test_the_simulator_tokenizer_is_one_implementation_of_the_protocol() -> None:
    builtin: Tokenizer = BuiltinTokenizer()
    messages = [{"role": "user", "content": "hello"}]
    assert builtin.encode_chat(messages) == BuiltinTokenizer().encode(
        apply_chat_template(messages), add_special_tokens=False
    )
    assert message_text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == "a\nb"


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda d: d / "missing" / "tokenizer.json", "does not exist"),
        (lambda d: d, "has no tokenizer.json"),
        (lambda d: _write(d / "tokenizer.json", "{not json"), "not a Hugging Face fast tokenizer"),
        (lambda d: save_model_folder(d, template=None), "has no chat template"),
        (lambda d: save_model_folder(d, template="{% for %}"), "does not compile"),
    ],
    ids=["missing", "folder_without_file", "garbage", "no_template", "bad_template"],
)
def test_a_bad_tokenizer_path_fails_with_what_to_do(
    tmp_path: Path, make: Callable[[Path], Path], words: str
) -> None:
    with pytest.raises(ValidationError, match=words):
        fleet_with_tokenizer(str(make(tmp_path)))


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def fleet_with_tokenizer(tokenizer: str, endpoints: list[str] | None = None) -> Fleet:
    fleet = one_pool_fleet("m", endpoints=endpoints)
    data = fleet.model_dump(mode="json")
    data["models"][0]["tokenizer"] = tokenizer
    return Fleet.model_validate(data)


def test_fleet_check_names_the_key_of_a_bad_tokenizer_path(tmp_path: Path) -> None:
    text = (ROOT / "fleet.toml").read_text()
    old = 'fallback = "llama-3.2-1b"'
    assert old in text
    fleet_file = tmp_path / "fleet.toml"
    fleet_file.write_text(text.replace(old, old + '\ntokenizer = "models/nope"', 1))
    with pytest.raises(FleetConfigError) as caught:
        load_fleet(fleet_file)
    (problem,) = caught.value.problems
    assert problem.key_path == "models[0].tokenizer"
    assert "models/nope does not exist" in problem.message and '"vllm"' in problem.message

    result = subprocess.run(
        [str(KVFLOW), "fleet", "check", str(fleet_file)], capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "models[0].tokenizer" in result.stdout + result.stderr


def test_the_fleet_key_picks_each_models_tokenizer(model_dir: Path) -> None:
    default = FleetTokenizers(one_pool_fleet("m"))
    assert default.for_model("m") is default.builtin
    assert default.for_model("not-in-the-fleet") is default.builtin

    local = FleetTokenizers(fleet_with_tokenizer(str(model_dir)))
    source = local.for_model("m")
    assert isinstance(source, InThread) and isinstance(source.tokenizer, HfTokenizer)

    remote = FleetTokenizers(fleet_with_tokenizer("vllm", endpoints=["http://127.0.0.1:9/"]))
    asked = remote.for_model("m")
    assert isinstance(asked, VllmTokenize) and asked.base_urls == ["http://127.0.0.1:9"]

    with pytest.raises(ValueError, match=r'models\[0\]\.tokenizer: "vllm".*endpoints'):
        FleetTokenizers(fleet_with_tokenizer("vllm"))


async def test_place_sizes_the_prompt_with_the_configured_tokenizer(model_dir: Path) -> None:
    fleet = fleet_with_tokenizer(str(model_dir))
    activities = ControlPlaneActivities(Scheduler(fleet), fleet=fleet, block_size=16)
    request = PlacementRequest(
        model="m", prompt_tokens=0, max_output_tokens=8, tenant="acme", workflow_id="wf"
    )
    chat = PlaceInput.model_validate(
        {"request": request, "messages": [{"role": "user", "content": "plan a step"}]}
    )
    expected = HfTokenizer.from_path(model_dir).encode_chat(
        [{"role": "user", "content": "plan a step"}]
    )
    assert await activities.prompt_tokens(chat) == expected
    answer = await activities.place(chat)
    assert answer.prompt_tokens == len(expected)

    resumed = chat.model_copy(update={"checkpoint_text": "First"})
    continued = HfTokenizer.from_path(model_dir).encode_chat(
        [{"role": "user", "content": "plan a step"}, {"role": "assistant", "content": "First"}],
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert await activities.prompt_tokens(resumed) == continued

    completion = PlaceInput(request=request, prompt="plan a step")
    assert await activities.prompt_tokens(completion) == HfTokenizer.from_path(model_dir).encode(
        "plan a step"
    )


async def test_vllm_tokenize_asks_a_replica_and_remembers_the_answer(
    sim_server: ServedModel,
) -> None:
    # The simulator serves /tokenize as vLLM does; the first URL is down (nothing listens).
    source = VllmTokenize(["http://127.0.0.1:9", sim_server.base_url], sim_server.model)
    try:
        messages = [{"role": "user", "content": "hello there"}]
        ids = await source.encode_chat(messages)
        assert ids == BuiltinTokenizer().encode_chat(messages)
        asked = source.requests
        assert await source.encode_chat(messages) == ids
        assert source.requests == asked  # from the cache
        assert await source.encode("hello") == BuiltinTokenizer().encode("hello")
        resumed = [*messages, {"role": "assistant", "content": "Hi"}]
        assert await source.encode_chat(
            resumed, add_generation_prompt=False, continue_final_message=True
        ) == BuiltinTokenizer().encode_chat(
            resumed, add_generation_prompt=False, continue_final_message=True
        )
        with pytest.raises(ValueError, match="refused"):
            await VllmTokenize([sim_server.base_url], "no-such-model").encode("x")
    finally:
        await source.aclose()


async def test_vllm_tokenize_says_which_replicas_failed() -> None:
    def down(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, text="overloaded")

    async with httpx.AsyncClient(transport=httpx.MockTransport(down)) as client:
        source = VllmTokenize(["http://a:1", "http://b:2"], "m", client=client)
        with pytest.raises(TokenizeUnavailable, match=r"http://a:1: HTTP 503; http://b:2"):
            await source.encode("x")


async def test_the_model_tokenizer_renders_tools_and_tool_calls_as_vllm_hands_them_over(
    tmp_path: Path,
) -> None:
    folder = save_model_folder(tmp_path / "model", template=TOOLS_TEMPLATE)
    tokenizer = HfTokenizer.from_path(folder)
    messages, tools = tool_chat_api()
    rendered = tokenizer.render_chat(messages, tools=tools)
    # Tools as vLLM's request model writes them back (description and parameters always);
    # each call's arguments parsed into an object, malformed ones an empty object.
    assert rendered == (
        "<|bos|><|system|>\n# Tools\n"
        '{"type": "function", "function": {"name": "read_file", "description": "Read a file.", '
        '"parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}\n'
        '{"type": "function", "function": {"name": "list_dir", "description": null, '
        '"parameters": {"type": "object", "properties": {}}}}\n'
        "<|eos|>\n"
        "<|system|>\nYou plan tool calls.<|eos|>\n"
        "<|user|>\nRead file a.txt<|eos|>\n"
        '<|assistant|>\n<tool_call>read_file(path="a.txt", lines=2)</tool_call>'
        "<tool_call>list_dir()</tool_call><|eos|>\n"
        "<|tool|>\n[call-1] plan a step<|eos|>\n"
        "<|assistant|>\n"
    )
    raw = RustTokenizer.from_file(str(folder / "tokenizer.json"))
    expected = raw.encode(rendered, add_special_tokens=False).ids
    assert tokenizer.encode_chat(messages, tools=tools) == expected
    # No tools: the template's tools block is left out, as for a request without `tools`.
    assert tokenizer.render_chat(messages, tools=[]) == tokenizer.render_chat(messages)
    assert "# Tools" not in tokenizer.render_chat(messages)

    # The place activity sizes the call with the same ids.
    fleet = fleet_with_tokenizer(str(folder))
    activities = ControlPlaneActivities(Scheduler(fleet), fleet=fleet, block_size=16)
    request = PlacementRequest(
        model="m", prompt_tokens=0, max_output_tokens=8, tenant="acme", workflow_id="wf"
    )
    place = PlaceInput(request=request, messages=TOOL_CHAT, tools=TOOL_SPECS)
    assert await activities.prompt_tokens(place) == expected

    with pytest.raises(ValueError, match=r"messages\[0\]\.tool_calls\[0\] must be a function"):
        tokenizer.render_chat(
            [{"role": "assistant", "content": "", "tool_calls": [{"type": "custom"}]}]
        )
    with pytest.raises(ValueError, match=r"tools\[0\] must be"):
        tokenizer.render_chat(messages, tools=[{"type": "function"}])


@pytest.mark.parametrize("tokenizer", ["builtin", "vllm"])
async def test_place_counts_a_tool_using_chat_as_the_simulated_engine_does(
    sim_server: ServedModel, tokenizer: str
) -> None:
    fleet = one_pool_fleet(
        sim_server.model, endpoints=[sim_server.base_url], context_length=sim_server.max_model_len
    )
    data = fleet.model_dump(mode="json")
    data["models"][0]["tokenizer"] = tokenizer  # "vllm": ask the simulator's /tokenize
    fleet = Fleet.model_validate(data)
    activities = ControlPlaneActivities(
        Scheduler(fleet), fleet=fleet, block_size=sim_server.block_size
    )
    request = PlacementRequest(
        model=sim_server.model,
        prompt_tokens=0,
        max_output_tokens=4,
        tenant="acme",
        workflow_id="wf",
    )
    place = PlaceInput(request=request, messages=TOOL_CHAT, tools=TOOL_SPECS)
    messages, tools = tool_chat_api()
    try:
        async with httpx.AsyncClient(base_url=sim_server.base_url, timeout=30) as http:
            # What the GPU worker sends for the same call.
            response = await http.post(
                "/v1/chat/completions",
                json={
                    "model": sim_server.model,
                    "messages": messages,
                    "tools": tools,
                    "max_tokens": 1,
                },
            )
            assert response.status_code == 200, response.text
            engine_count = response.json()["usage"]["prompt_tokens"]
            response = await http.post(
                "/tokenize",
                json={"model": sim_server.model, "messages": messages, "tools": tools},
            )
            engine_ids = response.json()["tokens"]
            assert len(engine_ids) == engine_count
            # Each tokenizer renders the tools itself, once.
            assert BuiltinTokenizer().encode_chat(messages, tools=tools) == engine_ids
            remote = VllmTokenize([sim_server.base_url], sim_server.model)
            try:
                assert await remote.encode_chat(messages, tools=tools) == engine_ids
            finally:
                await remote.aclose()
            answer = await activities.place(place)
            assert answer.prompt_tokens == engine_count
            ids = await activities.prompt_tokens(place)
            assert block_hashes(ids, sim_server.block_size) == block_hashes(
                engine_ids, sim_server.block_size
            )

            # A resume continues the same prompt: the partial answer follows it.
            resumed = place.model_copy(update={"checkpoint_text": "First read"})
            response = await http.post(
                "/tokenize",
                json={
                    "model": sim_server.model,
                    "messages": [*messages, {"role": "assistant", "content": "First read"}],
                    "tools": tools,
                    "add_generation_prompt": False,
                    "continue_final_message": True,
                },
            )
            assert await activities.prompt_tokens(resumed) == response.json()["tokens"]
    finally:
        await activities.tokenizers.aclose()
