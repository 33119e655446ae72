"""A local Qwen3-style tokenizer directory and a GSM8K-style parquet file, made in a second."""

from __future__ import annotations

import json
from pathlib import Path

# The shape of Qwen3's template (system, user turns, then the assistant's generation prompt).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

QUESTIONS = [
    ("Tom has 3 apples and buys 4 more. How many apples does he have?", "3 + 4 = 7\n#### 7"),
    ("A box holds 12 pens. How many pens are in 2 boxes?", "12 * 2 = 24\n#### 24"),
    ("Sara read 10 pages on Monday and 15 on Tuesday. How many pages?", "10 + 15 = 25\n#### 25"),
    ("There are 9 birds and 4 fly away. How many are left?", "9 - 4 = 5\n#### 5"),
]


def make_tokenizer_dir(directory: Path, vocab_size: int = 300) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [q + " " + a for q, a in QUESTIONS] * 20 + ["system user assistant \\boxed{}"]
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    return directory


def make_gsm8k_parquet(path: Path, *, bad_row: bool = False) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    questions = [q for q, _ in QUESTIONS]
    answers: list = [a for _, a in QUESTIONS]
    if bad_row:
        answers[2] = None
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"question": questions, "answer": answers}), path)
    return path
