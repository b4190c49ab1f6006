"""From start/end logits of every window to one answer text per question.

For each question, over all of its windows: the ``n_best`` highest start and
end logits form candidate spans; a span is kept when both ends are context
tokens, the start token is owned by this window (max context), ``start <= end``
and it is at most ``max_answer_length`` tokens long. The answer is the kept
span of highest ``start + end`` logit, cut from the context by character
offsets. Vectorised over a window's n_best x n_best pairs.
"""
from __future__ import annotations

import math

import torch

from harness.settings import check_count

from .data import Example, Features


def check_answers(n_best: int, max_answer_length: int) -> None:
    check_count("eval.n_best", n_best, " (candidate starts and ends per window)")
    check_count("eval.max_answer_length", max_answer_length, " (tokens)")


def postprocess(examples: list[Example], features: Features, start_logits: torch.Tensor, end_logits: torch.Tensor,
                *, n_best: int = 20, max_answer_length: int = 30) -> tuple[dict[str, str], dict[str, list[dict]]]:
    """(predictions {id: text}, n-best lists {id: [{text, probability, start_logit, end_logit}]})."""
    check_answers(n_best, max_answer_length)
    if start_logits.shape != features.input_ids.shape or end_logits.shape != features.input_ids.shape:
        raise ValueError(f"logits of shape {tuple(start_logits.shape)} / {tuple(end_logits.shape)} do not match "
                         f"the {tuple(features.input_ids.shape)} features")
    start_logits, end_logits = start_logits.float().cpu(), end_logits.float().cpu()
    k = min(n_best, start_logits.shape[1])
    candidates: dict[int, list[tuple[float, float, float, int, int]]] = {}
    for f in range(len(features)):
        s_val, s_idx = start_logits[f].topk(k)
        e_val, e_idx = end_logits[f].topk(k)
        s_ok = features.max_context[f][s_idx]           # context token owned by this window
        e_ok = features.offsets[f][e_idx, 0] >= 0        # context token
        length = e_idx[None, :] - s_idx[:, None]
        ok = s_ok[:, None] & e_ok[None, :] & (length >= 0) & (length < max_answer_length)
        score = s_val[:, None] + e_val[None, :]
        ex = int(features.example_index[f])
        for i, j in ok.nonzero().tolist():
            c0 = int(features.offsets[f][s_idx[i], 0])
            c1 = int(features.offsets[f][e_idx[j], 1])
            candidates.setdefault(ex, []).append((float(score[i, j]), float(s_val[i]), float(e_val[j]), c0, c1))
    predictions, nbest = {}, {}
    for ex, example in enumerate(examples):
        spans = sorted(candidates.get(ex, []), key=lambda c: -c[0])
        best, seen = [], set()
        for score, s, e, c0, c1 in spans:
            text = example.context[c0:c1]
            if text in seen:  # the same text from two overlapping windows: keep the better score
                continue
            seen.add(text)
            best.append({"text": text, "score": score, "start_logit": s, "end_logit": e})
            if len(best) == n_best:
                break
        if not best:  # no valid span in any window (original BERT: the empty answer)
            best = [{"text": "", "score": 0.0, "start_logit": 0.0, "end_logit": 0.0}]
        top = best[0]["score"]
        norm = sum(math.exp(b["score"] - top) for b in best)
        for b in best:
            b["probability"] = math.exp(b.pop("score") - top) / norm
        predictions[example.qid] = best[0]["text"]
        nbest[example.qid] = best
    return predictions, nbest
