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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=f"Evaluation for SQuAD {EXPECTED_VERSION}")
    parser.add_argument("dataset_file", help="Dataset file")
    parser.add_argument("prediction_file", help="Prediction File")
    args = parser.parse_args(argv)
    from .data import load_squad

    load_squad(args.dataset_file)  # clear errors for a missing, empty or malformed file
    with open(args.dataset_file, encoding="utf-8") as f:
        dataset_json = json.load(f)
    if dataset_json.get("version") != EXPECTED_VERSION:
        print(f"Evaluation expects v-{EXPECTED_VERSION}, but got dataset with v-{dataset_json.get('version')}",
              file=sys.stderr)
    with open(args.prediction_file, encoding="utf-8") as f:
        predictions = json.load(f)
    if not isinstance(predictions, dict):
        raise ValueError(f"{args.prediction_file} must be a JSON object {{question id: answer text}}")
    print(json.dumps(evaluate(dataset_json["data"], predictions)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
