"""Build a tiny random Llama model that real vLLM can serve on the CPU, without a model hub.

The tokenizer is a byte-level BPE trained on generated text (so any UTF-8 input tokenizes),
with `<|bos|>`, `<|eos|>`, `<|pad|>` and role markers, and a chat template. The model is a
two-layer `LlamaForCausalLM` with random weights from a fixed seed: its output is gibberish,
which is all the tests need (they check the serving machinery, not the text). Everything is
deterministic for a given seed.

Runs in the vLLM virtual environment (it needs `tokenizers`, `transformers` and `torch`):

    ~/.cache/kvflow/vllm/venv/bin/python scripts/build_tiny_model.py --out DIR
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

# Never reach for a model hub: everything here is built from nothing.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # type: ignore[import-not-found,unused-ignore]
from tokenizers import (  # type: ignore[import-not-found,unused-ignore]
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import (  # type: ignore[import-not-found,unused-ignore]
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

BOS = "<|bos|>"
EOS = "<|eos|>"
PAD = "<|pad|>"
ROLE_MARKERS = ["<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
REQUESTED_VOCAB = 2048
SERVED_CONTEXT = 2048

# Each message is `<|role|>\ncontent<|eos|>\n`; the generation prompt opens a new assistant
# turn. With `continue_final_message` the last message is left open, without its end marker,
# so the model continues it. transformers does that itself (it cuts the rendering right after
# the final message's content); the template's own check serves renderers that pass the flag.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] }}"
    "{% if not (loop.last and continue_final_message is defined and continue_final_message) %}"
    "{{ eos_token + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

_WORD_TEXT = (
    "the a an of to in and or is are was be it that this for on with as by at from "
    "agent tool call step plan task model token cache block prefix prompt reply answer "
    "workflow activity worker replica pool tenant cost budget retry resume stream usage "
    "search read write file code test error result value list map key json schema name "
    "user system assistant message content role function argument return output input "
    "python rust go java sql http https api url path query data time date number text "
    "hello world please thank you yes no maybe first second third last next previous "
    "run stop start wait send receive open close load save build check fix update"
)
_WORDS = _WORD_TEXT.split()
_PUNCTUATION = [".", ",", ":", ";", "!", "?", "(", ")", "[", "]", "{", "}", '"', "'", "-", "_"]


def training_corpus(seed: int, lines: int = 4000) -> list[str]:
    """Generated text in the shape of agent prompts: words, numbers, punctuation, JSON."""
    rng = random.Random(seed)
    corpus: list[str] = []
    for _ in range(lines):
        parts: list[str] = []
        for _ in range(rng.randint(5, 30)):
            roll = rng.random()
            if roll < 0.75:
                word = rng.choice(_WORDS)
                parts.append(word.capitalize() if rng.random() < 0.1 else word)
            elif roll < 0.87:
                parts.append(str(rng.randint(0, 10_000)))
            else:
                parts.append(rng.choice(_PUNCTUATION))
        if rng.random() < 0.2:
            parts.append(f'{{"{rng.choice(_WORDS)}": {rng.randint(0, 99)}}}')
        corpus.append(" ".join(parts))
    return corpus


def build_tokenizer(seed: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on generated text and wrap it with special tokens and a template."""
    special = [BOS, EOS, PAD, *ROLE_MARKERS]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=REQUESTED_VOCAB,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(seed), trainer=trainer)
    # Plain prompts (the completions API) start with BOS; chat prompts get it from the
    # template and are tokenized without special tokens, so BOS is never doubled.
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=ROLE_MARKERS,
        chat_template=CHAT_TEMPLATE,
        model_max_length=SERVED_CONTEXT,
        clean_up_tokenization_spaces=False,
    )


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> LlamaForCausalLM:
    """A two-layer Llama with random weights sized to the tokenizer's real vocabulary."""
    # The trainer stops early on a small corpus (asking for 2048 gives about 1000).
    vocab_size = len(tokenizer)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SERVED_CONTEXT,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    # vLLM runs bfloat16 on the CPU: store that, so it loads the weights without casting.
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


def main(argv: list[str] | None = None) -> int:
    """Build the tokenizer and the model into `--out`; return the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True, help="directory to write the model")
    parser.add_argument("--seed", type=int, default=0, help="seed for the corpus and weights")
    args = parser.parse_args(argv)
    out: Path = args.out
    # Build next to the target and rename, so an interrupted build never looks finished.
    partial = out.with_name(out.name + ".partial")
    if partial.exists():
        for child in partial.iterdir():
            child.unlink()
        partial.rmdir()
    partial.mkdir(parents=True)
    tokenizer = build_tokenizer(args.seed)
    tokenizer.save_pretrained(partial)
    model = build_model(tokenizer, args.seed)
    model.save_pretrained(partial, safe_serialization=True)
    if out.exists():
        for child in out.iterdir():
            child.unlink()
        out.rmdir()
    partial.rename(out)
    params = sum(p.numel() for p in model.parameters())
    print(f"tiny model: vocab {len(tokenizer)}, {params} parameters -> {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
