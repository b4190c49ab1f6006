"""SQuAD v1.1 files, the tokenizer, and model features.

Features follow the original BERT ``run_squad.py``: the question is cut to
``max_query_length`` tokens, the context is split into windows of
``max_length - len(question) - 3`` tokens whose starts are ``doc_stride``
tokens apart, a window that does not hold the whole answer is labelled with
the [CLS] position, and every context token records whether this window gives
it the most context on both sides (only such tokens may start a predicted
span, so an answer near a window's edge is read from the window centred on it).
Offsets come from the fast tokenizer, so answers are cut from the original
context text, not re-assembled from WordPieces.

A run records what its two files hold (:func:`fingerprint`): SQuAD v1.1 only where a file's MD5 is the one
published with it.
"""
from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import numpy as np
import torch

from harness import identity

SPECIAL_TOKENS = ("[CLS]", "[SEP]", "[PAD]", "[UNK]")
MAX_MISPLACED = 0.01  # share of answers whose answer_start may not point at their text
# SQuAD v1.1's files as published (rajpurkar.github.io/SQuAD-explorer), by the MD5s that torchtext and NVIDIA's
# BERT scripts check: 87,599 training and 10,570 dev questions
PUBLISHED_MD5 = {"981b29407e0affa3b1b156f72073b945": "SQuAD v1.1 training set",
                 "3e85deb501d4e538b6bc56f786231552": "SQuAD v1.1 dev set"}


@dataclasses.dataclass(frozen=True)
class Example:
    qid: str
    question: str
    context: str
    answers: tuple[str, ...]        # every ground truth (dev sets hold several)
    answer_start: int | None        # character offset of the first answer (training label), None if unanswered


def load_squad(path) -> list[Example]:
    """Every question of a SQuAD v1.1 JSON file, with clear errors for a missing, empty or malformed file."""
    path = Path(path)
    raw = read_squad_json(path, fix="set data.train_file / data.dev_file to the train-v1.1.json / dev-v1.1.json "
                                    "files (never downloaded at run time)")
    examples, misplaced = [], []
    for a, article in enumerate(raw["data"]):
        for p, para in enumerate(_field(article, "paragraphs", list, path, f"data[{a}]")):
            where = f"data[{a}].paragraphs[{p}]"
            context = _field(para, "context", str, path, where)
            for q, qa in enumerate(_field(para, "qas", list, path, where)):
                at = f"{where}.qas[{q}]"
                answers = _field(qa, "answers", list, path, at)
                texts = tuple(_field(ans, "text", str, path, f"{at}.answers[{i}]") for i, ans in enumerate(answers))
                start = None
                if answers:
                    start = _field(answers[0], "answer_start", int, path, f"{at}.answers[0]")
                    if context[start:start + len(texts[0])] != texts[0]:
                        misplaced.append(f"{at}: answer {texts[0]!r} is not at answer_start={start} of its context")
                        start = None  # still scored against its answers, but no training label
                examples.append(Example(str(_field(qa, "id", (str, int), path, at)),
                                        _field(qa, "question", str, path, at), context, texts, start))
    if not examples:
        raise ValueError(f"SQuAD file {path} holds no question (its 'data' has no paragraphs with 'qas')")
    if len(misplaced) > MAX_MISPLACED * len(examples):  # a few misplaced offsets are tolerated, a broken file is not
        raise ValueError(f"{path}: {len(misplaced)} of {len(examples)} answers are not at their answer_start, e.g. "
                         f"{misplaced[0]}: not a SQuAD v1.1 file (answer_start counts characters of the context)")
    if misplaced:
        warnings.warn(f"{path}: {len(misplaced)} answer(s) not at their answer_start (no span label for those), e.g. "
                      f"{misplaced[0]}", stacklevel=2)
    return examples


def fingerprint(path) -> dict:
    """What the SQuAD-format file at ``path`` holds (:mod:`harness.identity`): its questions and articles and its
    MD5; one of SQuAD v1.1's files where that MD5 is the published one."""
    path = Path(path)

    def make() -> dict:
        raw = read_squad_json(path, fix="set data.train_file / data.dev_file to SQuAD v1.1's JSON files")
        articles = raw["data"]
        questions = sum(len(p.get("qas", ())) for a in articles if isinstance(a, dict)
                        for p in a.get("paragraphs", ()) if isinstance(p, dict))
        md5 = identity.md5_file(path)
        dataset, source = PUBLISHED_MD5.get(md5), raw.get("source")
        size = f"{questions:,} questions in {identity.count(len(articles), 'article')}"
        name = (f"{dataset} ({size}; its MD5 is the published one)" if dataset else
                f"{source} in the SQuAD format ({size}), not SQuAD v1.1's" if source else
                f"a SQuAD-format file ({size}), not SQuAD v1.1's (its MD5 is not a published one)")
        return {"layout": "squad-json", "dataset": dataset, "name": name, "digest": md5,
                "counts": {"questions": questions, "articles": len(articles)}}

    if not path.is_file():
        read_squad_json(path, fix="set data.train_file / data.dev_file to SQuAD v1.1's JSON files")
    return identity.kept(path.parent, "squad-" + path.stem, [path], make)


def read_squad_json(path: Path, fix: str) -> dict:
    """The JSON object of a SQuAD file, with clear errors for a missing, empty or non-JSON file or one
    without a ``data`` list; ``fix`` ends the missing-file message."""
    if not path.is_file():
        raise FileNotFoundError(f"SQuAD file {path} not found: {fix}")
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"SQuAD file {path} is empty: expected a SQuAD v1.1 JSON object {{'version', 'data'}}")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"SQuAD file {path} is not valid JSON ({e})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("data"), list):
        raise ValueError(f"SQuAD file {path} must be a JSON object with a 'data' list of articles "
                         f"(SQuAD v1.1 layout), got {type(raw).__name__}"
                         + (f" with keys {sorted(raw)}" if isinstance(raw, dict) else ""))
    return raw


def _field(obj, key: str, kind, path: Path, where: str):
    if not isinstance(obj, dict) or key not in obj:
        raise ValueError(f"{path}: {where} has no {key!r} field: not a SQuAD v1.1 file")
    value = obj[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{path}: {where}.{key} must be {getattr(kind, '__name__', kind)}, "
                         f"got {type(value).__name__}")
    return value


def load_tokenizer(model_dir, do_lower_case: bool = True):
    """The fast WordPiece tokenizer of a local BERT directory: its tokenizer files, else its ``vocab.txt``.

    Never downloads. Rejects what offline loading silently returns instead of an
    error (a tokenizer of only special tokens) and slow tokenizers (no offsets).
    """
    from transformers import AutoTokenizer, BertTokenizerFast

    d = Path(model_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"model directory {d} not found: set model.dir to a local BERT checkpoint "
                                "(the bert/ phase-2 output or a Hugging Face BERT saved with save_pretrained)")
    if (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    elif (d / "vocab.txt").is_file():
        # ``vocab=``: BertTokenizerFast ignores ``vocab_file=`` and would build an empty vocabulary
        tokenizer = BertTokenizerFast(vocab=str(d / "vocab.txt"), do_lower_case=do_lower_case)
    else:
        raise FileNotFoundError(f"no vocabulary in {d}: expected vocab.txt (WordPiece, one token a line) or "
                                "tokenizer.json; copy the vocabulary the model was pre-trained with there")
    check_tokenizer(tokenizer, d)
    return tokenizer


def check_tokenizer(tokenizer, where) -> None:
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"the tokenizer of {where} is not a fast tokenizer: character offsets are needed to "
                         "map predicted spans to text (install tokenizers / provide tokenizer.json or vocab.txt)")
    vocab = tokenizer.get_vocab()
    missing = [t for t in SPECIAL_TOKENS if t not in vocab]
    if missing or len(vocab) <= len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"the tokenizer of {where} has {len(vocab)} tokens"
                         + (f" and lacks {missing}" if missing else "")
                         + ": not a BERT WordPiece vocabulary (an offline hub name loads an empty one); "
                         "point model.dir at a directory holding the model's vocab.txt")


@dataclasses.dataclass
class Features:
    """Model inputs of every window and what post-processing needs to map logits back to text."""
    # compact dtypes (the full train set is ~90k windows per rank); batches are widened to int64
    input_ids: torch.Tensor         # (N, L) int32
    token_type_ids: torch.Tensor    # (N, L) int8
    attention_mask: torch.Tensor    # (N, L) int8
    start_positions: torch.Tensor   # (N,) token of the answer's start in the window, 0 ([CLS]) if not inside
    end_positions: torch.Tensor     # (N,)
    example_index: torch.Tensor     # (N,) which example each window comes from
    offsets: torch.Tensor           # (N, L, 2) int32 character span of each context token, -1 elsewhere
    max_context: torch.Tensor       # (N, L) bool: this window gives the token its most context

    def __len__(self) -> int:
        return len(self.input_ids)


def _windows(n_tokens: int, max_doc: int, doc_stride: int) -> list[tuple[int, int]]:
    spans, start = [], 0
    while True:
        length = min(n_tokens - start, max_doc)
        spans.append((start, length))
        if start + length >= n_tokens:
            return spans
        start += min(length, doc_stride)


def _owners(spans, n_tokens: int):
    """Window owning each context token (original BERT rule): the one maximising
    min(left, right) context + 0.01 * its length, the first on ties."""
    pos = np.arange(n_tokens)
    score = np.full((len(spans), n_tokens), -np.inf)
    for i, (start, length) in enumerate(spans):
        inside = slice(start, start + length)
        score[i, inside] = np.minimum(pos[inside] - start, start + length - 1 - pos[inside]) + 0.01 * length
    return score.argmax(0)


def check_windows(max_length: int, doc_stride: int, max_query_length: int) -> None:
    """The window settings: room for a context token beside the longest question, and a stride a window can
    take (a longer one never applies: the windows just would not overlap)."""
    if not (max_query_length >= 1 and max_length >= max_query_length + 4):
        raise ValueError(f"invalid data.max_length={max_length} with data.max_query_length={max_query_length}: "
                         "need max_length >= max_query_length + 4 ([CLS], two [SEP] and a context token)")
    if not 1 <= doc_stride <= max_length - 4:
        raise ValueError(f"invalid data.doc_stride={doc_stride}: tokens between window starts, from 1 to "
                         f"data.max_length - 4 = {max_length - 4} (the most context a window holds); a longer "
                         "stride would never apply")


def make_features(examples: list[Example], tokenizer, *, max_length: int = 384, doc_stride: int = 128,
                  max_query_length: int = 64) -> Features:
    """Windows of every example (see the module docstring)."""
    check_windows(max_length, doc_stride, max_query_length)
    cls, sep, pad = (tokenizer.convert_tokens_to_ids(t) for t in ("[CLS]", "[SEP]", "[PAD]"))
    questions = tokenizer([e.question for e in examples], add_special_tokens=False)["input_ids"]
    contexts = tokenizer([e.context for e in examples], add_special_tokens=False, return_offsets_mapping=True)
    rows = {k: [] for k in ("input_ids", "token_type_ids", "mask", "offsets", "max_context")}
    starts, ends, example_index = [], [], []
    for i, ex in enumerate(examples):
        q = questions[i][:max_query_length]
        ctx_ids = np.asarray(contexts["input_ids"][i], dtype=np.int64)
        ctx_off = np.asarray(contexts["offset_mapping"][i], dtype=np.int64).reshape(-1, 2)
        answer_tokens = None
        if ex.answer_start is not None:
            a0, a1 = ex.answer_start, ex.answer_start + len(ex.answers[0])
            covered = np.flatnonzero((ctx_off[:, 0] < a1) & (ctx_off[:, 1] > a0))
            if len(covered):  # an answer of only whitespace/control characters has no token: no span label
                answer_tokens = (int(covered[0]), int(covered[-1]))
        spans = _windows(len(ctx_ids), max_length - len(q) - 3, doc_stride)
        owner = _owners(spans, len(ctx_ids))
        head = len(q) + 2  # [CLS] question [SEP]
        for w, (start, length) in enumerate(spans):
            n = head + length + 1
            ids = np.full(max_length, pad, dtype=np.int32)
            ids[0], ids[1:head - 1], ids[head - 1] = cls, q, sep
            ids[head:head + length], ids[n - 1] = ctx_ids[start:start + length], sep
            types = np.zeros(max_length, dtype=np.int8)
            types[head:n] = 1
            mask = np.zeros(max_length, dtype=np.int8)
            mask[:n] = 1
            offsets = np.full((max_length, 2), -1, dtype=np.int32)
            offsets[head:head + length] = ctx_off[start:start + length]
            owned = np.zeros(max_length, dtype=bool)
            owned[head:head + length] = owner[start:start + length] == w
            s = e = 0
            if answer_tokens is not None and start <= answer_tokens[0] and answer_tokens[1] < start + length:
                s, e = (t - start + head for t in answer_tokens)
            for key, value in zip(rows, (ids, types, mask, offsets, owned)):
                rows[key].append(value)
            starts.append(s)
            ends.append(e)
            example_index.append(i)
    stacked = {k: torch.from_numpy(np.stack(v)) for k, v in rows.items()}
    return Features(
        input_ids=stacked["input_ids"], token_type_ids=stacked["token_type_ids"], attention_mask=stacked["mask"],
        start_positions=torch.tensor(starts, dtype=torch.long), end_positions=torch.tensor(ends, dtype=torch.long),
        example_index=torch.tensor(example_index, dtype=torch.long), offsets=stacked["offsets"],
        max_context=stacked["max_context"],
    )
