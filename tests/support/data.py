"""Test data: a sentencepiece tokenizer trained in a second."""

from __future__ import annotations


def train_sentencepiece(d):
    """A 48-piece sentencepiece model of arithmetic questions, trained in a second."""
    import sentencepiece as spm

    corpus = d / "corpus.txt"
    corpus.write_text(
        "\n".join(f"what is {a} plus {b} ? {a + b}" for a in range(30) for b in range(30))
    )
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(d / "tok"), vocab_size=48, minloglevel=2
    )
    return d / "tok.model"
