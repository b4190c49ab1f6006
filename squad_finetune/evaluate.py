"""The official SQuAD v1.1 exact match and F1, with the official script's interface.

    python -m squad_finetune.evaluate dev-v1.1.json predictions.json
    {"exact_match": 81.2, "f1": 88.5}

Answers are normalised (lower case, punctuation removed, the articles a/an/the
removed, whitespace collapsed) before comparing; each question scores the max
over its ground truths; unanswered questions count 0 (a message on stderr);
both metrics are percentages over all questions of the dataset.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import string
import sys
from pathlib import Path

from .data import _field, read_squad_json

EXPECTED_VERSION = "1.1"
_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


def f1_score(prediction: str, ground_truth: str) -> float:
    pred, gold = normalize_answer(prediction).split(), normalize_answer(ground_truth).split()
    common = collections.Counter(pred) & collections.Counter(gold)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def exact_match_score(prediction: str, ground_truth: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(ground_truth)


def metric_max_over_ground_truths(metric, prediction: str, ground_truths) -> float:
    return max(metric(prediction, gt) for gt in ground_truths)


def evaluate(dataset: list, predictions: dict) -> dict[str, float]:
    """``dataset``: the ``data`` list of a SQuAD v1.1 file; ``predictions``: {question id: answer text}."""
    f1 = exact_match = total = 0
    for article in dataset:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                total += 1
                if qa["id"] not in predictions:
                    print(f"Unanswered question {qa['id']} will receive score 0.", file=sys.stderr)
                    continue
                truths = [a["text"] for a in qa["answers"]]
                exact_match += metric_max_over_ground_truths(exact_match_score, predictions[qa["id"]], truths)
                f1 += metric_max_over_ground_truths(f1_score, predictions[qa["id"]], truths)
    if total == 0:
        raise ValueError("the dataset holds no question: nothing to evaluate")
    return {"exact_match": 100.0 * exact_match / total, "f1": 100.0 * f1 / total}


def evaluate_examples(examples, predictions: dict) -> dict[str, float]:
    """:func:`evaluate` over loaded :class:`~squad_finetune.data.Example` objects."""
    dataset = [{"paragraphs": [{"qas": [{"id": e.qid, "answers": [{"text": t} for t in e.answers]}
                                        for e in examples]}]}]
    return evaluate(dataset, predictions)


def read_dataset(path) -> dict:
    """A SQuAD v1.1 dataset file, checked only for what scoring reads: question ids and answer texts.

    As the official script, nothing else is needed: no ``answer_start`` (nor
    one that points elsewhere in the context), no ``question``, no ``context``.
    """
    path = Path(path)
    raw = read_squad_json(path, fix="pass the SQuAD v1.1 dev file (dev-v1.1.json) as the first argument")
    questions = 0
    for a, article in enumerate(raw["data"]):
        for p, para in enumerate(_field(article, "paragraphs", list, path, f"data[{a}]")):
            for q, qa in enumerate(_field(para, "qas", list, path, f"data[{a}].paragraphs[{p}]")):
                at = f"data[{a}].paragraphs[{p}].qas[{q}]"
                _field(qa, "id", (str, int), path, at)
                answers = _field(qa, "answers", list, path, at)
                if not answers:
                    raise ValueError(f"{path}: {at}.answers is empty: every question needs a ground truth to score")
                for i, answer in enumerate(answers):
                    _field(answer, "text", str, path, f"{at}.answers[{i}]")
                questions += 1
    if not questions:
        raise ValueError(f"SQuAD file {path} holds no question: nothing to evaluate")
    return raw


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=f"Evaluation for SQuAD {EXPECTED_VERSION}")
    parser.add_argument("dataset_file", help="Dataset file")
    parser.add_argument("prediction_file", help="Prediction File")
    args = parser.parse_args(argv)
    try:
        dataset_json = read_dataset(args.dataset_file)
        with open(args.prediction_file, encoding="utf-8") as f:
            predictions = json.load(f)
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        parser.error(str(e))
    if not isinstance(predictions, dict):
        parser.error(f"{args.prediction_file} must be a JSON object {{question id: answer text}}")
    if dataset_json.get("version") != EXPECTED_VERSION:
        print(f"Evaluation expects v-{EXPECTED_VERSION}, but got dataset with v-{dataset_json.get('version')}",
              file=sys.stderr)
    print(json.dumps(evaluate(dataset_json["data"], predictions)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
