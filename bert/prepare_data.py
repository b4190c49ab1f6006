"""Raw text -> BERT pre-training examples in NVIDIA's HDF5 layout, in parallel over input files.

    python -m bert.prepare_data --input corpus/*.txt --vocab vocab.txt --output data/bert/seq128 \
        --max-seq-length 128 --dupe-factor 5 --workers 16
    python -m bert.prepare_data --input corpus/*.txt --train-vocab 30522 --output data/bert/seq512 \
        --max-seq-length 512

Input: one sentence per line, a blank line between documents (the format of
BERT's ``create_pretraining_data.py`` and of NVIDIA's sharded Wikipedia/Books
text). Each input file becomes one output shard ``<stem>_training.hdf5`` (a name
NVIDIA's loader selects: it trains on the files whose names contain
"training") holding

    input_ids [N, L] i4   input_mask [N, L] i1   segment_ids [N, L] i1
    masked_lm_positions [N, P] i4   masked_lm_ids [N, P] i4   next_sentence_labels [N] i1

zero-padded, exactly as NVIDIA's recipe writes them, so shards from either
load in :mod:`bert.data`. Examples follow Google's recipe: sentence pairs
filling ``L - 3`` tokens (10% shorter targets), B the true continuation or, in
50% of pairs (always for a one-segment chunk), text from a random other
document of the same shard (the unused segments return to the pool); 15% of the
tokens (at most ``P``: 20 at L=128, 80 at L=512) are predicted, of which 80%
become [MASK], 10% a random token and 10% stay; ``dupe_factor`` passes over the
data with different masks. A shard's examples depend only on its file, the seed
and its index, so preparation is reproducible with any number of workers.

Held-out split (``--heldout-fraction``, default 0.01 on the command line): that
share of each input file's documents (at least one, never all) is left out of
its training shard and written to ``heldout/<stem>_heldout.hdf5`` with one fixed
masking; ``validation.dir=<output>/heldout`` scores it (``val_mlm_loss``, the
paper's metric). The documents are drawn from the seed and the file's name
alone, so the seq-128 and seq-512 folders of one corpus hold out the same text.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import random
from pathlib import Path

import numpy as np

from .vocab import load_tokenizer, train_vocab

FIELDS = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids", "next_sentence_labels")
# on-disk dtypes of NVIDIA's create_pretraining_data.py
DTYPES = {"input_ids": "i4", "input_mask": "i1", "segment_ids": "i1", "masked_lm_positions": "i4",
          "masked_lm_ids": "i4", "next_sentence_labels": "i1"}
# BERT's recipe: 20 predictions at seq 128, 80 at seq 512 (5/32 of the length)
PREDICTIONS_PER_TOKEN = 20 / 128


def default_max_predictions(max_seq_length: int) -> int:
    return max(1, round(max_seq_length * PREDICTIONS_PER_TOKEN))


@dataclasses.dataclass(frozen=True)
class Settings:
    max_seq_length: int = 128
    max_predictions_per_seq: int = 20
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    dupe_factor: int = 5
    whole_word_mask: bool = False
    seed: int = 12345

    def __post_init__(self):
        if self.max_seq_length < 8:
            raise ValueError(f"invalid max_seq_length={self.max_seq_length}: must be >= 8")
        if not 1 <= self.max_predictions_per_seq <= self.max_seq_length - 3:
            raise ValueError(f"invalid max_predictions_per_seq={self.max_predictions_per_seq}: must be in "
                             f"[1, max_seq_length - 3 = {self.max_seq_length - 3}]")
        if not 0.0 < self.masked_lm_prob < 1.0:
            raise ValueError(f"invalid masked_lm_prob={self.masked_lm_prob}: must be in (0, 1)")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise ValueError(f"invalid short_seq_prob={self.short_seq_prob}: must be in [0, 1]")
        if self.dupe_factor < 1:
            raise ValueError(f"invalid dupe_factor={self.dupe_factor}: must be >= 1")


class Vocab:
    """The token ids the recipe needs, from a checked tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.size = len(tokenizer)
        self.cls, self.sep, self.mask = (tokenizer.convert_tokens_to_ids(t) for t in ("[CLS]", "[SEP]", "[MASK]"))
        tokens = tokenizer.convert_ids_to_tokens(list(range(self.size)))
        self.continuation = np.array([t.startswith("##") for t in tokens])

    def encode_lines(self, lines: list[str]) -> list[list[int]]:
        return self.tokenizer(lines, add_special_tokens=False)["input_ids"] if lines else []


def read_documents(path: Path, vocab: Vocab) -> list[list[list[int]]]:
    """Documents (lists of tokenised sentences) of a text file; blank lines separate documents."""
    docs, lines, bounds = [], [], []
    with open(path, encoding="utf-8") as f:
        for raw in f:
            line = raw.strip()
            if line:
                lines.append(line)
            elif lines and (not bounds or bounds[-1] != len(lines)):
                bounds.append(len(lines))
    bounds.append(len(lines))
    ids = vocab.encode_lines(lines)
    start = 0
    for end in bounds:
        doc = [s for s in ids[start:end] if s]
        if doc:
            docs.append(doc)
        start = end
    return docs


def truncate_pair(a: list[int], b: list[int], max_tokens: int, rng: random.Random) -> None:
    """Trim the longer segment, at its front or back at random, until the pair fits."""
    while len(a) + len(b) > max_tokens:
        longer = a if len(a) > len(b) else b
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def mask_tokens(tokens: list[int], vocab: Vocab, s: Settings, rng: random.Random):
    """(tokens with the masking applied, sorted masked positions, their original ids)."""
    candidates: list[list[int]] = []
    for i, t in enumerate(tokens):
        if t in (vocab.cls, vocab.sep):
            continue
        if s.whole_word_mask and candidates and vocab.continuation[t]:
            candidates[-1].append(i)
        else:
            candidates.append([i])
    rng.shuffle(candidates)
    num_to_predict = min(s.max_predictions_per_seq, max(1, int(round(len(tokens) * s.masked_lm_prob))))
    output, masked = list(tokens), []
    for group in candidates:
        if len(masked) >= num_to_predict:
            break
        if len(masked) + len(group) > num_to_predict:
            continue
        for i in group:
            if rng.random() < 0.8:
                output[i] = vocab.mask
            elif rng.random() >= 0.5:  # else: keep the original token
                output[i] = rng.randint(0, vocab.size - 1)
            masked.append((i, tokens[i]))
    masked.sort()
    return output, [i for i, _ in masked], [t for _, t in masked]


def instances_from_document(docs, index: int, vocab: Vocab, s: Settings, rng: random.Random) -> list[dict]:
    """Google's ``create_instances_from_document``: sentence pairs from one document (token ids)."""
    document = docs[index]
    max_tokens = s.max_seq_length - 3  # [CLS] A [SEP] B [SEP]
    target = rng.randint(2, max_tokens) if rng.random() < s.short_seq_prob else max_tokens
    out, chunk, length, i = [], [], 0, 0
    while i < len(document):
        chunk.append(document[i])
        length += len(document[i])
        if i == len(document) - 1 or length >= target:
            a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
            a = [t for seg in chunk[:a_end] for t in seg]
            b: list[int] = []
            random_next = len(chunk) == 1 or rng.random() < 0.5
            if random_next:
                for _ in range(10):
                    other = rng.randint(0, len(docs) - 1)
                    if other != index:
                        break
                random_doc = docs[other]
                for seg in random_doc[rng.randint(0, len(random_doc) - 1):]:
                    b.extend(seg)
                    if len(b) >= target - len(a):
                        break
                i -= len(chunk) - a_end  # the unused segments start the next chunk
            else:
                b = [t for seg in chunk[a_end:] for t in seg]
            truncate_pair(a, b, max_tokens, rng)
            if a and b:
                tokens = [vocab.cls, *a, vocab.sep, *b, vocab.sep]
                segments = [0] * (len(a) + 2) + [1] * (len(b) + 1)
                tokens, positions, labels = mask_tokens(tokens, vocab, s, rng)
                out.append({"tokens": tokens, "segments": segments, "positions": positions, "labels": labels,
                            "random_next": random_next})
            chunk, length = [], 0
        i += 1
    return out


# the command line's share of each file's documents held out; the folder of their shards, inside the output
HELDOUT_FRACTION = 0.01
HELDOUT = "heldout"


def split_documents(docs: list, fraction: float, seed: int, name: str) -> tuple[list, list]:
    """(training, held-out) documents of the input file ``name``: ``round(fraction x n)`` of its ``n`` documents,
    at least one where ``fraction > 0``, never all. The draw depends on the seed and the name only: every
    sequence length of a corpus holds out the same documents, so phase 2 validates on text phase 1 never saw."""
    if fraction <= 0 or len(docs) < 2:
        return docs, []
    held = set(random.Random(f"{seed}:heldout:{name}").sample(range(len(docs)),
                                                                 min(len(docs) - 1, max(1, round(fraction * len(docs))))))
    return [d for i, d in enumerate(docs) if i not in held], [d for i, d in enumerate(docs) if i in held]


def create_instances(docs, vocab: Vocab, s: Settings, rng: random.Random) -> list[dict]:
    docs = list(docs)
    rng.shuffle(docs)
    instances = [inst for _ in range(s.dupe_factor) for d in range(len(docs))
                 for inst in instances_from_document(docs, d, vocab, s, rng)]
    rng.shuffle(instances)
    return instances


def to_arrays(instances: list[dict], s: Settings) -> dict[str, np.ndarray]:
    """The zero-padded feature arrays of NVIDIA's layout."""
    n, L, P = len(instances), s.max_seq_length, s.max_predictions_per_seq
    f = {k: np.zeros((n, L if k in ("input_ids", "input_mask", "segment_ids") else P), dtype=np.int32)
         for k in FIELDS[:-1]}
    f["next_sentence_labels"] = np.zeros(n, dtype=np.int32)
    for r, inst in enumerate(instances):
        t, m = len(inst["tokens"]), len(inst["positions"])
        f["input_ids"][r, :t] = inst["tokens"]
        f["input_mask"][r, :t] = 1
        f["segment_ids"][r, :t] = inst["segments"]
        f["masked_lm_positions"][r, :m] = inst["positions"]
        f["masked_lm_ids"][r, :m] = inst["labels"]
        f["next_sentence_labels"][r] = int(inst["random_next"])  # 1: B is a random sentence (HF's label too)
    return f


def write_shard(path: Path, features: dict[str, np.ndarray]) -> None:
    import h5py

    tmp = path.with_name(f".{path.name}.tmp")
    with h5py.File(tmp, "w") as h5:
        for name in FIELDS:
            h5.create_dataset(name, data=features[name], dtype=DTYPES[name], compression="gzip")
    tmp.replace(path)


# per-process state of the preparation pool (the tokenizer is built once per worker, not pickled per task)
_VOCAB: Vocab | None = None


def _init_worker(vocab_path: str, lowercase: bool) -> None:
    global _VOCAB
    _VOCAB = Vocab(load_tokenizer(vocab_path, lowercase))


def shard_name(path) -> str:
    return f"{Path(path).stem}_training.hdf5"


def prepare_file(task) -> dict:
    """One input file -> one shard, and its held-out documents' shard where some are held out; returns their
    statistics."""
    index, path, out_dir, s, heldout = task
    docs, held = split_documents(read_documents(Path(path), _VOCAB), heldout, s.seed, Path(path).stem)
    stats = {"input": str(path), **write_instances(docs, Path(out_dir) / shard_name(path), s,
                                                   random.Random(f"{s.seed}:{index}"))}
    if held:  # one fixed masking, drawn apart from the training shard's
        stats["heldout"] = write_instances(held, Path(out_dir) / HELDOUT / f"{Path(path).stem}_heldout.hdf5",
                                           dataclasses.replace(s, dupe_factor=1),
                                           random.Random(f"{s.seed}:heldout:{index}"))
    return stats


def write_instances(docs, out: Path, s: Settings, rng: random.Random) -> dict:
    """The examples of ``docs`` written to the shard ``out``; its statistics."""
    instances = create_instances(docs, _VOCAB, s, rng)
    features = to_arrays(instances, s)
    write_shard(out, features)
    return {"shard": str(out), "examples": len(instances), "tokens": int(features["input_mask"].sum()),
            "masked": int((features["masked_lm_positions"] > 0).sum()),
            "random_next": int(features["next_sentence_labels"].sum())}


def prepare(inputs, vocab: str | Path, out_dir: str | Path, settings: Settings, *, workers: int = 1,
            lowercase: bool = True, progress: bool = True, heldout: float = 0.0) -> list[dict]:
    """Prepare every input file (in ``workers`` processes); writes ``stats.json`` beside the shards.
    ``heldout``: the share of each file's documents held out (:func:`split_documents`) into ``<out_dir>/heldout/``."""
    if not 0.0 <= heldout < 1.0:
        raise ValueError(f"invalid --heldout-fraction {heldout}: must be in [0, 1) (the share of each file's documents "
                         "held out for validation)")
    inputs = [Path(p) for p in inputs]
    missing = [str(p) for p in inputs if not p.is_file()]
    if not inputs or missing:
        raise FileNotFoundError(f"input text files not found: {missing or 'none given'} (--input FILE ...)")
    stems = [p.stem for p in inputs]
    if len(set(stems)) != len(stems):
        raise ValueError("input files must have distinct names: each becomes the shard <name>_training.hdf5")
    load_tokenizer(vocab, lowercase)  # a missing or empty vocabulary fails here, before any worker starts
    out = Path(out_dir)
    (out / HELDOUT if heldout > 0 else out).mkdir(parents=True, exist_ok=True)
    tasks = [(i, str(p), str(out), settings, heldout) for i, p in enumerate(inputs)]
    # forked from a fresh server, not from this process: a fork inherits its threads' locks (the tokenizer's
    # pool, torch's) and its signal handlers, and a pool worker forked from a busy process hung at its exit
    pool = multiprocessing.get_context("forkserver").Pool(max(1, min(workers, len(tasks))), initializer=_init_worker,
                                                          initargs=(str(vocab), lowercase))
    with pool:
        results = pool.imap_unordered(prepare_file, tasks)
        if progress:
            from tqdm.auto import tqdm

            results = tqdm(results, total=len(tasks), desc="shards", dynamic_ncols=True)
        stats = sorted(results, key=lambda r: r["shard"])
    summary = {"settings": dataclasses.asdict(settings), "vocab": str(vocab), "lowercase": lowercase,
               "examples": sum(r["examples"] for r in stats), "shards": stats}
    if heldout > 0:
        summary.update(heldout_fraction=heldout, heldout_examples=sum(r.get("heldout", {}).get("examples", 0)
                                                                      for r in stats))
    (out / "stats.json").write_text(json.dumps(summary, indent=1))
    return stats


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="text files: a sentence per line, blank line between documents")
    p.add_argument("--output", required=True, help="directory for the <input stem>_training.hdf5 shards and stats.json")
    vocab = p.add_mutually_exclusive_group(required=True)
    vocab.add_argument("--vocab", help="WordPiece vocab.txt (or a directory holding one)")
    vocab.add_argument("--train-vocab", type=int, metavar="SIZE",
                       help="train a WordPiece vocabulary of SIZE tokens on the inputs (written to OUTPUT/vocab.txt)")
    p.add_argument("--cased", action="store_true", help="keep case (default: lower-case, as BERT-Large uncased)")
    p.add_argument("--max-seq-length", type=int, default=128)
    p.add_argument("--max-predictions", type=int, default=None, help="default: 20 at 128, 80 at 512 (5/32 of L)")
    p.add_argument("--masked-lm-prob", type=float, default=0.15)
    p.add_argument("--short-seq-prob", type=float, default=0.1)
    p.add_argument("--dupe-factor", type=int, default=5)
    p.add_argument("--whole-word-mask", action="store_true")
    p.add_argument("--seed", type=int, default=12345)
    p.add_argument("--heldout-fraction", type=float, default=HELDOUT_FRACTION,
                   help=f"share of each file's documents held out into OUTPUT/{HELDOUT}/ for validation.dir (default "
                        f"{HELDOUT_FRACTION}; 0: none)")
    p.add_argument("--workers", type=int, default=1, help="parallel processes (one input file each at a time)")
    a = p.parse_args(argv)
    if not 0.0 <= a.heldout_fraction < 1.0:
        p.error(f"--heldout-fraction {a.heldout_fraction}: must be in [0, 1) (0: no held-out split)")
    settings = Settings(a.max_seq_length, a.max_predictions or default_max_predictions(a.max_seq_length),
                        a.masked_lm_prob, a.short_seq_prob, a.dupe_factor, a.whole_word_mask, a.seed)
    vocab_path = a.vocab or train_vocab(a.input, a.output, a.train_vocab, lowercase=not a.cased)
    stats = prepare(a.input, vocab_path, a.output, settings, workers=a.workers, lowercase=not a.cased,
                    heldout=a.heldout_fraction)
    held = [r["heldout"] for r in stats if "heldout" in r]
    print(f"{sum(r['examples'] for r in stats)} examples in {len(stats)} shards under {a.output}"
          + (f"; {sum(r['examples'] for r in held)} held-out examples in {Path(a.output) / HELDOUT}" if held else ""))


if __name__ == "__main__":
    main()
