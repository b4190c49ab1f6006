"""Tiny BERT pre-training data in seconds, for smoke runs and tests: made-up text, its WordPiece vocabulary and
shards in NVIDIA's layout.

    python -m bert.tiny data/bert_tiny                  # vocab/vocab.txt, seq128/ and seq512/ (phases 1 and 2),
                                                        # each with heldout/ (validation.dir)
    python -m bert.tiny data/bert_tiny --seq-len 32 64

The text is documents of 3 to 9 sentences of 4 to 12 words drawn from 40 made-up words, so that a vocabulary
of about 120 WordPieces covers it and ``model=bert_tiny`` (vocabulary 1000) trains on it as it is. The shards
are those of ``bert.prepare_data`` (15% masking, random next sentences); their ``stats.json`` names the
vocabulary, which the pre-training run copies beside its exported model. For real text offline, ``bert.demo``
uses Python's docstrings.
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from . import prepare_data as prep
from .vocab import train_vocab

# a smoke run's held-out share: a few documents of the tiny corpus, enough for a validation loss
HELDOUT_FRACTION = 0.2
WORDS = [f"{a}{b}" for a in ("ka", "lo", "mi", "ne", "su", "ta", "vo", "ri") for b in ("p", "rn", "st", "x", "dge")]


def write_corpus(folder, files: int = 2, docs: int = 30, seed: int = 0) -> list[Path]:
    """Text files in BERT's input format (a sentence per line, a blank line between documents) of :data:`WORDS`."""
    rng = random.Random(seed)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for f in range(files):
        lines = []
        for _ in range(docs):
            lines += [" ".join(rng.choices(WORDS, k=rng.randint(4, 12))) + "." for _ in range(rng.randint(3, 9))]
            lines.append("")
        paths.append(folder / f"part{f}.txt")
        paths[-1].write_text("\n".join(lines) + "\n")
    return paths


def write_tiny(out, seq_lens=(128, 512), *, files: int = 1, docs: int = 20, vocab_size: int = 120,
               seed: int = 3, heldout: float = 0.0) -> dict:
    """The corpus (``text/``), its vocabulary (``vocab/vocab.txt``) and one shard folder per sequence length
    (``seq<n>/``) under ``out``; returns ``{"vocab": path, <n>: folder, ...}``. ``heldout``: the share of the
    documents held out into ``seq<n>/heldout/``, as ``bert.prepare_data`` writes them."""
    out = Path(out)
    corpus = write_corpus(out / "text", files, docs)
    written = {"vocab": train_vocab(corpus, out / "vocab", vocab_size, min_frequency=1)}
    for seq in seq_lens:
        settings = prep.Settings(max_seq_length=seq, max_predictions_per_seq=prep.default_max_predictions(seq),
                                 dupe_factor=1, seed=seed)
        prep.prepare(corpus, written["vocab"], out / f"seq{seq}", settings, progress=False, heldout=heldout)
        written[seq] = out / f"seq{seq}"
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="folder for text/, vocab/ and the seq<n>/ shard folders")
    parser.add_argument("--seq-len", type=int, nargs="+", default=[128, 512], help="one shard folder per length")
    parser.add_argument("--heldout-fraction", type=float, default=HELDOUT_FRACTION,
                        help=f"share of the documents held out into seq<n>/heldout/ (default {HELDOUT_FRACTION})")
    args = parser.parse_args(argv)
    if not 0.0 <= args.heldout_fraction < 1.0:
        parser.error(f"--heldout-fraction {args.heldout_fraction}: must be in [0, 1) (0: no held-out split)")
    written = write_tiny(args.out, args.seq_len, heldout=args.heldout_fraction)
    tokens = len(written["vocab"].read_text().splitlines())
    print(f"{args.out}: a vocabulary of {tokens} tokens ({written['vocab']}); shards in "
          + ", ".join(str(written[seq]) for seq in args.seq_len)
          + (f", each with {prep.HELDOUT}/" if args.heldout_fraction > 0 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
