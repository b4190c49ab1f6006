"""WordPiece tokenizers from local files only, with the checks that catch an empty one.

transformers 5 builds a ``BertTokenizerFast`` from ``vocab=PATH`` (``vocab_file=``
is silently ignored) and, offline, ``from_pretrained`` of a hub name returns a
tokenizer that knows only its 5 special tokens instead of raising: every
tokenizer here goes through :func:`check_tokenizer`.
"""
from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# a real WordPiece vocabulary has its special tokens plus at least the characters of its corpus
MIN_VOCAB = 32


def check_tokenizer(tokenizer, source: str = "the tokenizer"):
    """``tokenizer`` when it is a usable BERT WordPiece tokenizer; a ValueError naming ``source`` otherwise."""
    size = len(tokenizer)
    if size < MIN_VOCAB:
        raise ValueError(
            f"{source} has only {size} tokens (a real WordPiece vocabulary has thousands): the vocabulary was not "
            "loaded. Pass the path of a vocab.txt (one token per line), or train one with "
            "`python -m bert.prepare_data --train-vocab SIZE ...`"
        )
    vocab = tokenizer.get_vocab()
    missing = [t for t in SPECIAL_TOKENS if t not in vocab]
    if missing:
        raise ValueError(f"{source} lacks the BERT special tokens {missing}: use a BERT WordPiece vocab.txt")
    return tokenizer


def load_tokenizer(vocab: str | Path, lowercase: bool = True):
    """A checked ``BertTokenizerFast`` from a ``vocab.txt`` file or a local directory holding one."""
    from transformers import BertTokenizerFast

    path = Path(vocab)
    if path.is_dir():
        path = path / "vocab.txt"
    if not path.is_file():
        raise FileNotFoundError(
            f"vocabulary {str(path)!r} not found: pass the vocab.txt of the BERT model (e.g. from NVIDIA's recipe "
            "or a local Hugging Face BERT directory), or train one locally with `--train-vocab SIZE`"
        )
    tokenizer = BertTokenizerFast(vocab=str(path), do_lower_case=lowercase)
    return check_tokenizer(tokenizer, f"the tokenizer from {str(path)!r}")


def train_vocab(files, out_dir: str | Path, vocab_size: int, lowercase: bool = True, min_frequency: int = 2) -> Path:
    """Train a WordPiece vocabulary on local text files with ``tokenizers``; returns the ``vocab.txt`` path."""
    from tokenizers import BertWordPieceTokenizer

    if vocab_size < MIN_VOCAB:
        raise ValueError(f"invalid vocab_size={vocab_size}: must be >= {MIN_VOCAB}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    wp = BertWordPieceTokenizer(lowercase=lowercase)
    wp.train([str(f) for f in files], vocab_size=vocab_size, min_frequency=min_frequency,
             special_tokens=list(SPECIAL_TOKENS), show_progress=False)
    wp.save_model(str(out))
    return out / "vocab.txt"
