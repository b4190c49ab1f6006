"""A small SQuAD-format data set made from Python's own documentation, for an offline check in minutes.

    python -m squad_finetune.tiny data/squad_tiny                       # train-v1.1.json, dev-v1.1.json
    python -m squad_finetune.tiny data/squad_tiny --random-bert data/squad_tiny/bert

Every paragraph lists a few functions of the standard library with the first
sentence of their docstrings ("The function math.floor: Return the floor of x
as an Integral. ..."); each function gives two questions: what it does (the
sentence is the answer) and which function does that (the name is the
answer). Paragraphs alternate between the train and dev files, so dev asks
about functions the model never saw. Nothing is downloaded: the text is the
docstrings of the running interpreter.

``--random-bert DIR`` also writes a tiny randomly initialised BERT with a
WordPiece vocabulary of every word of the same text, for checking the fine-tuning
path alone; the end-to-end check fine-tunes the tiny BERT that ``bert/``
pre-trains instead (see the README).
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import re
import sys
from pathlib import Path

MODULES = ("builtins", "math", "os", "os.path", "string", "json", "re", "itertools", "functools", "operator",
           "random", "statistics", "shutil", "textwrap", "collections", "heapq", "bisect", "copy", "glob")
PER_PARAGRAPH = 4
SOURCE = "questions on the docstrings of Python's standard library"


def documented_functions(modules=MODULES) -> list[tuple[str, str]]:
    """(qualified name, first docstring sentence) of the public functions of ``modules``, sorted, unique."""
    seen, out = set(), []
    for module_name in modules:
        module = importlib.import_module(module_name)
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not (inspect.isbuiltin(obj) or inspect.isfunction(obj)):
                continue
            first = (inspect.getdoc(obj) or "").split("\n\n")[0].replace("\n", " ").strip()
            match = re.match(r"^([A-Z][^.]{10,120}\.)(\s|$)", first)
            if not match:  # signature lines, empty or one-word docstrings: no usable sentence
                continue
            sentence = match.group(1)
            qualified = name if module_name == "builtins" else f"{module_name}.{name}"
            if sentence.lower() in seen:
                continue
            seen.add(sentence.lower())
            out.append((qualified, sentence))
    return out


def make_squad(functions: list[tuple[str, str]]) -> tuple[dict, dict]:
    """(train, dev) SQuAD v1.1 objects; paragraphs alternate between them."""
    splits = ([], [])
    for p in range(0, len(functions) - PER_PARAGRAPH + 1, PER_PARAGRAPH):
        context, qas = "", []
        for name, sentence in functions[p:p + PER_PARAGRAPH]:
            lead = f"The function {name}: "
            name_at = len(context) + len("The function ")
            sentence_at = len(context) + len(lead)
            context += lead + sentence + " "
            body = sentence[0].lower() + sentence[1:-1]
            qid = f"pydoc-{name}"
            qas.append({"id": f"{qid}-what", "question": f"What does the function {name} do?",
                        "answers": [{"text": sentence, "answer_start": sentence_at}]})
            qas.append({"id": f"{qid}-which", "question": f"Which function does this: {body}?",
                        "answers": [{"text": name, "answer_start": name_at}]})
        splits[(p // PER_PARAGRAPH) % 2].append({"context": context.strip(), "qas": qas})
    # "source": the mark a run's fingerprint names the set by (squad_finetune.data.fingerprint)
    return tuple({"version": "1.1", "source": SOURCE, "data": [{"title": "python docstrings", "paragraphs": s}]}
                 for s in splits)


def write_vocab(folder, texts) -> Path:
    """``folder/vocab.txt``: a WordPiece vocabulary of every word of ``texts`` (lowercased) and every single
    character, so that nothing is [UNK] and every word is one token."""
    words = sorted({w for t in texts for w in re.findall(r"[a-z0-9]+", t.lower())})
    chars = sorted(set("abcdefghijklmnopqrstuvwxyz0123456789") | {c for t in texts for c in t if not c.isalnum()
                                                                  and not c.isspace()})
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *(f"##{c}" for c in chars if c.isalnum()), *words]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(dict.fromkeys(tokens)) + "\n")
    return folder


def write_random_bert(folder, texts, hidden: int = 64, layers: int = 2, heads: int = 2, max_positions: int = 512,
                      seed: int = 0) -> Path:
    """A tiny randomly initialised ``BertForPreTraining`` (saved as ``save_pretrained`` does, as ``bert.train``
    exports) beside :func:`write_vocab`'s vocabulary of ``texts``, in ``folder``."""
    import torch
    from transformers import BertConfig, BertForPreTraining

    folder = write_vocab(folder, texts)
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len((folder / "vocab.txt").read_text().split()), hidden_size=hidden,
                        num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=2 * hidden,
                        max_position_embeddings=max_positions)
    BertForPreTraining(config).save_pretrained(folder)
    return folder


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="a SQuAD-format data set from Python's docstrings")
    parser.add_argument("out", help="folder for train-v1.1.json and dev-v1.1.json")
    parser.add_argument("--random-bert", metavar="DIR", help="also write a tiny random BERT + vocab.txt here")
    args = parser.parse_args(argv)
    functions = documented_functions()
    train, dev = make_squad(functions)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, obj in (("train-v1.1.json", train), ("dev-v1.1.json", dev)):
        (out / name).write_text(json.dumps(obj, indent=1))
    count = [sum(len(p["qas"]) for p in s["data"][0]["paragraphs"]) for s in (train, dev)]
    print(f"{out}: {count[0]} train and {count[1]} dev questions from {len(functions)} documented functions")
    if args.random_bert:
        texts = [p["context"] + " " + " ".join(q["question"] for q in p["qas"])
                 for s in (train, dev) for p in s["data"][0]["paragraphs"]]
        print(f"random tiny BERT in {write_random_bert(args.random_bert, texts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
