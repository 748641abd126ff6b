r"""kvflow's built-in tokenizer: a deterministic, lossless tokenizer and chat template.

It is the tokenizer of the simulator's models, and the default of a fleet model's `tokenizer`
key, so it lives at the bottom layer: the simulator and the control plane (which must not
import the simulator) share it. It implements `kvflow.scheduler.tokens.Tokenizer`.

Text is cut into pieces the way GPT-2-style tokenizers pre-tokenize (a word with its leading
space, up to three digits, a run of punctuation, whitespace), then each piece becomes:

- one token if it is a known word (`kvflow.scheduler.vocab.WORDS`, with or without a leading
  space) or a known punctuation piece;
- otherwise byte-pair tokens: two UTF-8 bytes per token, one byte for an odd last byte.

So ordinary English costs about one token per word, any text round-trips exactly through
`encode` and `decode`, and the same text always gives the same ids. Special tokens
(`<|bos|>`, `<|eos|>`, the role markers and `<|end|>`) are recognised in text as single tokens,
as vLLM's tokenizers do for chat templates.

Chat template (fixed; one line per part)::

    <|bos|>
    <|ROLE|>\n{content}<|end|>\n        for every message
    <|assistant|>\n                      when add_generation_prompt

With `continue_final_message` the last message is left open (no `<|end|>\n`) so the model
continues it: the prompt of a resumed answer is the prompt of the original request followed
by the partial answer, token for token.

Tools and tool calls are written into the messages first, as text
(`kvflow.scheduler.tokens.render_tools`): the simulated server renders a request's `tools`
this way, so the placement counts and hashes the prompt the simulated engine caches.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from functools import lru_cache

from kvflow.scheduler.tokens import ChatMessages, ChatTools, message_text, render_tools
from kvflow.scheduler.vocab import PUNCTUATION, WORDS

BOS = "<|bos|>"
EOS = "<|eos|>"
END = "<|end|>"
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool", "developer")
SPECIAL_TOKENS: tuple[str, ...] = (BOS, EOS, END, *(f"<|{role}|>" for role in ROLES))

_SPECIAL_BASE = 256
_WORD_BASE = 512
PAIR_BASE = 4096
"""Ids from here on are byte pairs: `PAIR_BASE + first_byte * 256 + second_byte`."""
VOCAB_SIZE = PAIR_BASE + 256 * 256

_SPECIAL_IDS: dict[str, int] = {tok: _SPECIAL_BASE + i for i, tok in enumerate(SPECIAL_TOKENS)}
BOS_ID = _SPECIAL_IDS[BOS]
EOS_ID = _SPECIAL_IDS[EOS]


def _piece_table() -> tuple[dict[str, int], list[str]]:
    pieces: list[str] = []
    for word in dict.fromkeys(WORDS):
        pieces.append(word)
        pieces.append(" " + word)
    pieces.extend(p for p in PUNCTUATION if p not in pieces)
    pieces.extend(" " + p for p in PUNCTUATION if p.strip() and " " + p not in pieces)
    if _WORD_BASE + len(pieces) > PAIR_BASE:
        raise RuntimeError("the simulator's word list is too long for its id layout")
    return {piece: _WORD_BASE + i for i, piece in enumerate(pieces)}, pieces


_PIECE_IDS, _PIECES = _piece_table()
_SPACED_WORD_IDS: tuple[int, ...] = tuple(
    _PIECE_IDS[" " + w] for w in dict.fromkeys(WORDS) if len(w) > 1 or w in {"a"}
)
"""Ids of `" word"` tokens: what the output generator says."""

_SPECIAL_RE = re.compile("(" + "|".join(re.escape(tok) for tok in SPECIAL_TOKENS) + ")")
# Letters, digits (at most three), punctuation runs (underscore included), and whitespace
# where a run of spaces leaves its last space to the word that follows, as GPT-2 does.
_PIECE_RE = re.compile(r" ?[^\W\d_]+| ?\d{1,3}| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+")


@lru_cache(maxsize=65536)
def _encode_piece(piece: str) -> tuple[int, ...]:
    known = _PIECE_IDS.get(piece)
    if known is not None:
        return (known,)
    raw = piece.encode("utf-8")
    ids = [PAIR_BASE + raw[i] * 256 + raw[i + 1] for i in range(0, len(raw) - 1, 2)]
    if len(raw) % 2:
        ids.append(raw[-1])
    return tuple(ids)


CACHED_SEGMENT_CHARS = 1024
"""Text between special tokens at least this long is tokenized once and remembered: a chat
template puts each message between special tokens, so a long shared context (a system prompt,
a document) is tokenized once per process, not once per request."""


def _encode_segment(text: str) -> tuple[int, ...] | list[int]:
    if len(text) < CACHED_SEGMENT_CHARS:
        return Tokenizer._encode_ordinary(text)
    return _encode_long_segment(text)


@lru_cache(maxsize=128)
def _encode_long_segment(text: str) -> tuple[int, ...]:
    return tuple(Tokenizer._encode_ordinary(text))


class Tokenizer:
    """The simulator's tokenizer: `encode`, `decode`, token strings and the chat template.

    It is the `kvflow.scheduler.tokens.Tokenizer` of the simulator's built-in models, the
    fleet's default (`tokenizer = "builtin"`).
    """

    vocab_size = VOCAB_SIZE
    bos_token_id = BOS_ID
    eos_token_id = EOS_ID

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens` the ids start with `<|bos|>`.

        A text that already starts with `<|bos|>` (a rendered chat template) gets no second one.
        """
        ids: list[int] = []
        for segment in _SPECIAL_RE.split(text):
            if not segment:
                continue
            special = _SPECIAL_IDS.get(segment)
            if special is not None:
                ids.append(special)
                continue
            ids.extend(_encode_segment(segment))
        if add_special_tokens and (not ids or ids[0] != BOS_ID):
            ids.insert(0, BOS_ID)
        return ids

    def encode_chat(
        self,
        messages: ChatMessages,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: ChatTools | None = None,
    ) -> list[int]:
        """Ids of `messages` and `tools` rendered with the simulator's chat template.

        The text is `apply_chat_template`'s; a malformed `tool_calls` entry raises `ValueError`.
        """
        text = apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
        )
        return self.encode(text, add_special_tokens=False)

    @staticmethod
    def _encode_ordinary(text: str) -> list[int]:
        ids: list[int] = []
        position = 0
        for match in _PIECE_RE.finditer(text):
            if match.start() != position:  # cannot happen with this pattern; stay lossless anyway
                ids.extend(_encode_piece(text[position : match.start()]))
            ids.extend(_encode_piece(match.group()))
            position = match.end()
        if position != len(text):
            ids.extend(_encode_piece(text[position:]))
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (special tokens as their text)."""
        if 0 <= token_id < _SPECIAL_BASE:
            return bytes((token_id,))
        if token_id >= PAIR_BASE:
            if token_id >= VOCAB_SIZE:
                raise ValueError(f"token id {token_id} is outside the vocabulary (< {VOCAB_SIZE})")
            pair = token_id - PAIR_BASE
            return bytes((pair >> 8, pair & 0xFF))
        if token_id >= _WORD_BASE:
            index = token_id - _WORD_BASE
            if index < len(_PIECES):
                return _PIECES[index].encode("utf-8")
        elif _SPECIAL_BASE <= token_id < _SPECIAL_BASE + len(SPECIAL_TOKENS):
            return SPECIAL_TOKENS[token_id - _SPECIAL_BASE].encode("utf-8")
        raise ValueError(f"token id {token_id} is not used by the simulator's tokenizer")

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of `token_ids` (invalid UTF-8 from a cut multi-byte character is replaced)."""
        chunks: list[bytes] = []
        for token_id in token_ids:
            if skip_special_tokens and _SPECIAL_BASE <= token_id < _WORD_BASE:
                continue
            chunks.append(self.token_bytes(token_id))
        return b"".join(chunks).decode("utf-8", errors="replace")

    def token_str(self, token_id: int) -> str:
        """A printable form of one token (as `/tokenize` returns in `token_strs`)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    @staticmethod
    def is_special(token_id: int) -> bool:
        """Whether `token_id` is one of the special tokens (never shown in output text)."""
        return _SPECIAL_BASE <= token_id < _WORD_BASE

    @staticmethod
    def word_ids() -> Sequence[int]:
        """Ids of the `" word"` tokens the output generator draws from."""
        return _SPACED_WORD_IDS

    @staticmethod
    def piece_id(piece: str) -> int:
        """The id of a known piece (a word, `" word"` or punctuation); `KeyError` otherwise."""
        return _PIECE_IDS[piece]


def apply_chat_template(
    messages: ChatMessages,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: ChatTools | None = None,
) -> str:
    """Render `messages` with the simulator's fixed chat template (see the module docstring).

    `tools`, and the messages' `tool_calls`, are written in as text first (`render_tools`).
    """
    rendered = render_tools(messages, tools or ())
    parts = [BOS]
    for index, message in enumerate(rendered):
        role = str(message.get("role", "user"))
        text = message_text(message.get("content"))
        if continue_final_message and index == len(rendered) - 1:
            parts.append(f"<|{role}|>\n{text}")
        else:
            parts.append(f"<|{role}|>\n{text}{END}\n")
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)
