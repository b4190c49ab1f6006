"""SQuAD v1.1 fine-tuning: files and tokenizer errors, features (doc-stride windows, max context),
post-processing back to the gold text, the official EM/F1 definitions and CLI, an end-to-end
fine-tune of a tiny local BERT with 2 gloo workers, and its row in the results table."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from harness.records import load_runs
from harness.tables import build_tables
from squad_finetune import data as sdata
from squad_finetune.evaluate import evaluate, exact_match_score, f1_score, normalize_answer
from squad_finetune.postprocess import postprocess
from squad_finetune.tiny import write_random_bert
from squad_finetune.train import train
from tests import distributed

ROOT = Path(__file__).resolve().parents[1]
GREEK = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma "
         "tau upsilon phi chi psi omega")
PARAGRAPHS = [
    ("Marie Curie was born in Warsaw in 1867. She moved to Paris, where she studied physics and "
     "chemistry at the Sorbonne. In 1903 she shared the Nobel Prize in Physics with Pierre Curie and "
     "Henri Becquerel, and in 1911 she won the Nobel Prize in Chemistry alone.",
     [("Where was Marie Curie born?", "Warsaw"),
      ("Where did she study physics?", "the Sorbonne"),
      ("Who shared the 1903 prize with her?", "Pierre Curie and Henri Becquerel"),
      ("When did she win the Nobel Prize in Chemistry?", "1911")]),
    ("The Eiffel Tower is a wrought-iron lattice tower in Paris, France. It was designed by the company "
     "of Gustave Eiffel and built from 1887 to 1889 as the entrance to the World's Fair.",
     [("Who designed the Eiffel Tower?", "the company of Gustave Eiffel"),
      ("What is the tower made of?", "wrought-iron"),
      ("When was the tower built?", "from 1887 to 1889")]),
]


def squad_json(paragraphs=PARAGRAPHS, prefix="q") -> dict:
    """A SQuAD v1.1 file of ``(context, [(question, answer), ...])``; answer_start is the first match."""
    paras, n = [], 0
    for context, qas in paragraphs:
        items = []
        for question, answer in qas:
            items.append({"id": f"{prefix}{n}", "question": question,
                          "answers": [{"text": answer, "answer_start": context.index(answer)}]})
            n += 1
        paras.append({"context": context, "qas": items})
    return {"version": "1.1", "data": [{"title": "tiny", "paragraphs": paras}]}


def write_json(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj))
    return path


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    """A tiny random BERT saved with save_pretrained beside a vocab.txt holding every word of the texts."""
    texts = [c + " " + " ".join(q + " " + a for q, a in qas) for c, qas in PARAGRAPHS]
    return write_random_bert(tmp_path_factory.mktemp("bert"), [*texts, GREEK, "what comes after"], hidden=32,
                             max_positions=128)


@pytest.fixture(scope="module")
def tokenizer(bert_dir):
    return sdata.load_tokenizer(bert_dir)


# ------------------------------------------------------------------------------ files and tokenizer


@pytest.mark.parametrize("content, error, match", [
    ("", ValueError, r"is empty"),
    ("{not json", ValueError, r"is not valid JSON"),
    ("[1, 2]", ValueError, r"must be a JSON object with a 'data' list.*got list"),
    ('{"version": "1.1"}', ValueError, r"'data' list.*keys \['version'\]"),
    ('{"data": [{"paragraphs": [{"context": "abc"}]}]}', ValueError, r"data\[0\]\.paragraphs\[0\] has no 'qas'"),
    ('{"data": [{"paragraphs": [{"context": "abc", "qas": [{"id": "x", "question": "q", '
     '"answers": [{"text": "b", "answer_start": 0}]}]}]}]}', ValueError,
     r"1 of 1 answers are not at their answer_start.*'b' is not at answer_start=0"),
    ('{"data": [{"paragraphs": [{"context": 3, "qas": []}]}]}', ValueError, r"context must be str, got int"),
    ('{"data": []}', ValueError, r"holds no question"),
])
def test_empty_or_malformed_squad_file_is_a_clear_error(tmp_path, content, error, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(error, match=match):
        sdata.load_squad(path)


def test_missing_squad_file_names_the_setting(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.json not found.*data\.train_file"):
        sdata.load_squad(tmp_path / "nope.json")


def test_a_few_misplaced_answer_offsets_only_lose_their_label(tmp_path):
    squad = squad_json([(PARAGRAPHS[0][0], PARAGRAPHS[0][1] * 30)])  # 120 questions
    squad["data"][0]["paragraphs"][0]["qas"][1]["answers"][0]["answer_start"] += 1
    with pytest.warns(UserWarning, match=r"1 answer\(s\) not at their answer_start.*qas\[1\]"):
        examples = sdata.load_squad(write_json(tmp_path / "s.json", squad))
    assert examples[1].answer_start is None and examples[1].answers == ("the Sorbonne",)
    assert examples[5].answer_start == PARAGRAPHS[0][0].index("the Sorbonne")


def test_load_squad_reads_every_question(tmp_path):
    examples = sdata.load_squad(write_json(tmp_path / "s.json", squad_json()))
    assert [e.qid for e in examples] == [f"q{i}" for i in range(7)]
    e = examples[2]
    assert e.answers == ("Pierre Curie and Henri Becquerel",)
    assert e.context[e.answer_start:].startswith("Pierre Curie and Henri")


def test_missing_vocabulary_and_five_token_tokenizer_are_clear_errors(tmp_path, bert_dir):
    with pytest.raises(FileNotFoundError, match=r"model directory .* not found.*model\.dir"):
        sdata.load_tokenizer(tmp_path / "absent")
    (tmp_path / "novocab").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no vocabulary in .*novocab: expected vocab\.txt"):
        sdata.load_tokenizer(tmp_path / "novocab")
    five = tmp_path / "five"
    five.mkdir()
    (five / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n")
    with pytest.raises(ValueError, match=r"has 5 tokens: not a BERT WordPiece vocabulary"):
        sdata.load_tokenizer(five)
    from transformers import BertTokenizerFast

    # what offline loading of a hub name gives: a tokenizer without the vocabulary (vocab_file= is ignored)
    empty = BertTokenizerFast(vocab_file=str(bert_dir / "vocab.txt"))
    with pytest.raises(ValueError, match=r"not a BERT WordPiece vocabulary"):
        sdata.check_tokenizer(empty, "hub-name")


# ------------------------------------------------------------------------------ features and post-processing


def gold_logits(features, examples, big=10.0):
    """Logits a perfect model would give: high on the tokens holding the answer's first and last characters."""
    start = torch.zeros(features.input_ids.shape)
    end = torch.zeros(features.input_ids.shape)
    for f in range(len(features)):
        ex = examples[int(features.example_index[f])]
        a0, a1 = ex.answer_start, ex.answer_start + len(ex.answers[0])
        off = features.offsets[f]
        start[f][(off[:, 0] <= a0) & (off[:, 1] > a0)] = big
        end[f][(off[:, 0] < a1) & (off[:, 1] >= a1)] = big
    return start, end


@pytest.mark.parametrize("max_length, doc_stride", [(384, 128), (28, 5), (24, 3)])
def test_features_and_postprocess_recover_the_gold_answers(tokenizer, tmp_path, max_length, doc_stride):
    examples = sdata.load_squad(write_json(tmp_path / "s.json", squad_json()))
    max_query = min(64, max_length - 16)  # long questions are cut to max_query tokens
    feats = sdata.make_features(examples, tokenizer, max_length=max_length, doc_stride=doc_stride,
                                 max_query_length=max_query)
    assert feats.input_ids.shape[1] == max_length and len(feats) >= len(examples)
    for f in range(len(feats)):
        ex = examples[int(feats.example_index[f])]
        ids = feats.input_ids[f][feats.attention_mask[f].bool()].tolist()
        q_len = min(max_query, len(tokenizer(ex.question, add_special_tokens=False)["input_ids"]))
        assert ids[0] == tokenizer.cls_token_id and ids[q_len + 1] == ids[-1] == tokenizer.sep_token_id
        types = feats.token_type_ids[f]
        assert types[:q_len + 2].eq(0).all() and types[q_len + 2:len(ids)].eq(1).all()
        s, e = int(feats.start_positions[f]), int(feats.end_positions[f])
        if s:  # the label spans exactly the answer's tokens, whose offsets cut the answer from the context
            assert ex.context[feats.offsets[f][s, 0]:feats.offsets[f][e, 1]] == ex.answers[0]
        else:  # a window not holding the whole answer points at [CLS]
            assert e == 0
    # every context token is owned (max context) by exactly one window
    for i, ex in enumerate(examples):
        rows = (feats.example_index == i).nonzero().flatten()
        owned = torch.cat([feats.offsets[f][feats.max_context[f], 0] for f in rows])
        n_tokens = len(tokenizer(ex.context, add_special_tokens=False)["input_ids"])
        assert sorted(owned.tolist()) == sorted(set(owned.tolist())) and len(owned) == n_tokens
    predictions, nbest = postprocess(examples, feats, *gold_logits(feats, examples))
    assert predictions == {e.qid: e.answers[0] for e in examples}
    assert all(abs(sum(b["probability"] for b in v) - 1) < 1e-6 and len(v) <= 20 for v in nbest.values())


def test_answer_crossing_a_doc_stride_boundary(tokenizer):
    context = GREEK  # whole words of the vocabulary: one token each
    answer = "kappa lambda mu nu"
    ex = sdata.Example("x", "what comes after iota?", context, (answer,), context.index(answer))
    feats = sdata.make_features([ex], tokenizer, max_length=20, doc_stride=4, max_query_length=12)
    q_len = len(tokenizer(ex.question, add_special_tokens=False)["input_ids"])
    assert q_len == 5
    max_doc = 20 - q_len - 3
    assert len(feats) > 2
    starts = [int(feats.offsets[f][q_len + 2, 0]) for f in range(len(feats))]
    token_starts = [o[0] for o in tokenizer(context, add_special_tokens=False, return_offsets_mapping=True)
                    ["offset_mapping"]]
    assert [token_starts.index(s) for s in starts][:3] == [0, 4, 8]  # window starts doc_stride tokens apart
    a0, a1 = ex.answer_start, ex.answer_start + len(answer)
    holds = []
    for f in range(len(feats)):
        ctx = feats.offsets[f][feats.offsets[f][:, 0] >= 0]
        has_start, has_end = bool((ctx[:, 0] == a0).any()), bool((ctx[:, 1] == a1).any())
        holds.append((has_start, has_end))
        assert (int(feats.start_positions[f]) > 0) == (has_start and has_end)
    assert (True, False) in holds or (False, True) in holds  # some window cuts the answer at its edge
    assert (True, True) in holds and max_doc < len(token_starts)
    # a confident but wrong span in the window that cuts the answer must not win over the whole answer
    start, end = gold_logits(feats, [ex])
    predictions, _ = postprocess([ex], feats, start, end)
    assert predictions == {"x": answer}
    long_answer = postprocess([ex], feats, start, end, max_answer_length=3)[0]["x"]
    assert long_answer != answer and len(long_answer.split()) <= 3  # 4 tokens exceed max_answer_length=3


def test_invalid_feature_settings_are_clear_errors(tokenizer):
    ex = sdata.Example("x", "q", "some context", ("context",), 5)
    with pytest.raises(ValueError, match=r"data\.max_length=8 with data\.max_query_length=64"):
        sdata.make_features([ex], tokenizer, max_length=8)
    with pytest.raises(ValueError, match=r"data\.doc_stride=0"):
        sdata.make_features([ex], tokenizer, doc_stride=0)


# ------------------------------------------------------------------------------ official EM / F1


def test_normalisation_and_scores_match_hand_computed_values():
    assert normalize_answer("  The Eiffel-Tower!  ") == "eiffeltower"  # punctuation deleted, not spaced
    assert normalize_answer("An apple a day, theatre") == "apple day theatre"  # whole-word articles only
    assert exact_match_score("the Eiffel Tower", "Eiffel Tower.")
    assert not exact_match_score("Eiffel", "Eiffel Tower")
    assert f1_score("Eiffel Tower in Paris", "the Eiffel Tower") == pytest.approx(2 / 3)  # P 1/2, R 1
    assert f1_score("dog dog cat", "dog cat cat") == pytest.approx(2 / 3)  # counts clip: 2 common of 3 and 3
    assert f1_score("1867", "in 1867 in Warsaw") == pytest.approx(2 * 1 * 0.25 / 1.25)  # P 1, R 1/4
    assert exact_match_score("the", "a") and f1_score("the", "a") == 0.0  # both empty: EM 1 but F1 0 (v1.1)


def test_evaluate_takes_the_max_over_ground_truths_and_scores_unanswered_as_zero():
    dataset = [{"paragraphs": [{"qas": [
        {"id": "1", "answers": [{"text": "Paris, France"}, {"text": "France"}]},
        {"id": "2", "answers": [{"text": "Henri Becquerel"}, {"text": "Pierre Curie and Henri Becquerel"}]},
        {"id": "3", "answers": [{"text": "1911"}]},
        {"id": "4", "answers": [{"text": "the Sorbonne"}]},
    ]}]}]
    predictions = {"1": "paris france", "2": "Becquerel", "3": "in 1911"}  # question 4 unanswered
    f1_2 = max(2 * 1 * 0.5 / 1.5, 2 * 1 * 0.2 / 1.2)  # vs "henri becquerel": P 1, R 1/2
    f1_3 = 2 * 0.5 * 1 / 1.5
    assert evaluate(dataset, predictions) == pytest.approx(
        {"exact_match": 100 * 1 / 4, "f1": 100 * (1 + f1_2 + f1_3 + 0) / 4})


@pytest.mark.multiprocess
def test_evaluate_cli_prints_exact_match_and_f1(tmp_path):
    dataset = write_json(tmp_path / "dev.json", squad_json())
    preds = write_json(tmp_path / "pred.json", {"q0": "Warsaw", "q1": "Sorbonne", "q2": "Pierre Curie",
                                                 "q3": "1911", "q4": "Gustave Eiffel", "q5": "iron",
                                                 "q6": "1887 to 1889"})
    out = subprocess.run([sys.executable, "-m", "squad_finetune.evaluate", str(dataset), str(preds)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout)
    f1 = [1, 1, 2 * 1 * 0.4 / 1.4, 1, 2 * 1 * 0.5 / 1.5, 0, 2 * 1 * 0.75 / 1.75]  # P 1 where partial
    assert got == pytest.approx({"exact_match": 100 * 3 / 7, "f1": 100 * sum(f1) / 7})
    (tmp_path / "empty.json").write_text("")
    bad = subprocess.run([sys.executable, "-m", "squad_finetune.evaluate", str(tmp_path / "empty.json"),
                          str(preds)], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode != 0 and "is empty" in bad.stderr


@pytest.mark.multiprocess
def test_evaluate_cli_scores_what_the_official_script_scores(tmp_path):
    """evaluate-v1.1.py reads only ids and answer texts: a dev file without answer_start, question or
    context, or with every answer_start wrong, is scored, and the line printed is the official JSON."""
    squad = squad_json()
    for p, para in enumerate(squad["data"][0]["paragraphs"]):
        if p == 0:
            del para["context"]
        for qa in para["qas"]:
            for answer in qa["answers"]:
                if p == 0:
                    del answer["answer_start"]
                else:
                    answer["answer_start"] += 3  # every offset misaligned: the training loader refuses this
            del qa["question"]
        para["qas"][0]["answers"].append({"text": "Paris"})  # a second ground truth, no offset either
    dataset = write_json(tmp_path / "dev.json", squad)
    with pytest.raises(ValueError):
        sdata.load_squad(dataset)  # training stays strict
    preds = write_json(tmp_path / "pred.json", {"q0": "Warsaw", "q1": "Sorbonne", "q4": "Paris", "q6": "1887 to 1889"})
    out = subprocess.run([sys.executable, "-m", "squad_finetune.evaluate", str(dataset), str(preds)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True)
    f1 = 1 + 1 + 1 + 2 * 1 * 0.75 / 1.75  # q4 matches its second ground truth; q2, q3, q5 unanswered
    assert out.stdout == json.dumps({"exact_match": 100.0 * 3 / 7, "f1": 100.0 * f1 / 7}) + "\n"
    assert out.stderr.count("will receive score 0") == 3
    del squad["data"][0]["paragraphs"][1]["qas"][2]["answers"][0]["text"]
    bad = subprocess.run([sys.executable, "-m", "squad_finetune.evaluate", str(write_json(dataset, squad)),
                          str(preds)], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 2 and "qas[2].answers[0] has no 'text' field" in bad.stderr
    assert "Traceback" not in bad.stderr


# ------------------------------------------------------------------------------ end to end, 2 workers


def compose_squad(*overrides) -> dict:
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("squad", overrides=list(overrides))
    return OmegaConf.to_container(cfg, resolve=True)


def test_default_config_is_the_standard_recipe():
    cfg = compose_squad("model.dir=/some/bert")
    assert (cfg["epochs"], cfg["optimizer"]["name"], cfg["optimizer"]["lr"], cfg["data"]["global_batch"]) == \
        (2, "adamw", 3e-5, 32)
    assert cfg["schedule"] == {"name": "warmup_poly", "warmup_fraction": 0.1, "power": 1.0}
    assert (cfg["data"]["max_length"], cfg["data"]["doc_stride"], cfg["eval"]["n_best"],
            cfg["eval"]["max_answer_length"]) == (384, 128, 20, 30)
    rows = {r: compose_squad(f"experiment=squad/{r}") for r in ("lamb", "onebit_lamb", "slamb")}
    assert {c["paper"]["row"] for c in rows.values()} == {"LAMB", "1-bit LAMB", "SLAMB"}
    assert rows["lamb"]["paper"]["f1"] == pytest.approx(90.584)  # the LAMB paper's at 64k/32k
    assert {c["model"]["dir"] for c in rows.values()} == {f"runs/bert_phase2_{r}/model" for r in rows}
    tiny = compose_squad("experiment=squad/tiny")
    assert tiny["data"]["name"] == "squad_tiny" and tiny["trainer"]["nproc_per_node"] == 2


@pytest.mark.e2e
def test_tiny_docstring_set_is_valid_squad(tmp_path):
    from squad_finetune import tiny

    functions = tiny.documented_functions()
    assert len(functions) > 100 and ("len", "Return the number of items in a container.") in functions
    assert tiny.main([str(tmp_path)]) == 0
    train_ex, dev_ex = (sdata.load_squad(tmp_path / f) for f in ("train-v1.1.json", "dev-v1.1.json"))
    assert len(train_ex) >= 100 and len(dev_ex) >= 100  # load_squad checks every answer_start
    assert not {e.qid for e in train_ex} & {e.qid for e in dev_ex}  # dev asks about unseen functions
    which = {e.qid: e.answers[0] for e in train_ex + dev_ex if e.qid.endswith("-which")}
    assert which["pydoc-len-which"] == "len" and len(which) == (len(train_ex) + len(dev_ex)) // 2


def e2e_worker(rank, world, cfg, run_dir):
    return train(cfg, run_dir)


@pytest.mark.multiprocess
def test_two_worker_fine_tune_writes_em_f1_and_the_table(bert_dir, tmp_path, capfd):
    train_file = write_json(tmp_path / "train.json", squad_json())
    dev_file = write_json(tmp_path / "dev.json", squad_json())
    cfg = compose_squad(f"model.dir={bert_dir}", f"data.train_file={train_file}", f"data.dev_file={dev_file}",
                        "data.max_length=48", "data.doc_stride=16", "data.max_query_length=16",
                        "data.global_batch=4",
                        "data.eval_batch=5", "epochs=3", "optimizer.lr=3e-3", "schedule.warmup_fraction=0",
                        "trainer.progress=false", "trainer.threads_per_worker=1", "trainer.device=cpu",
                        "trainer.deterministic=true",
                        "paper={table: squad_tiny, row: LAMB, f1: 91.345, exact_match: null}")
    run_dir = tmp_path / "run"
    results = distributed.run(e2e_worker, 2, cfg, str(run_dir))
    assert "".join(capfd.readouterr()).count("LOAD REPORT") == 1  # transformers' load report: rank 0 only
    summary = json.loads((run_dir / "metrics.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    examples = sdata.load_squad(dev_file)
    windows = len(sdata.make_features(examples, sdata.load_tokenizer(bert_dir), max_length=48, doc_stride=16,
                                          max_query_length=16))
    steps = windows // 4
    assert summary["train_windows"] == windows and [r["step"] for r in rows] == [steps, 2 * steps, 3 * steps]
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]  # the tiny model learns the spans it sees
    # averaged gradients: every parameter's fp32 bytes once per step, the same on both ranks
    params = summary["params"]
    assert rows[-1]["bytes_cum/grads"] == 3 * steps * 4 * params == summary["bytes_total"]["all"]
    assert results[0]["bytes_total"] == results[1]["bytes_total"]
    # the metrics are the official script's numbers on the written predictions
    predictions = json.loads((run_dir / "predictions.json").read_text())
    assert sorted(predictions) == sorted(e.qid for e in examples)
    official = subprocess.run([sys.executable, "-m", "squad_finetune.evaluate", str(dev_file),
                               str(run_dir / "predictions.json")], cwd=ROOT, capture_output=True, text=True,
                              timeout=120, check=True)
    assert json.loads(official.stdout) == pytest.approx({k: summary[k] for k in ("exact_match", "f1")})
    assert 0 <= summary["f1"] <= 100 and summary["exact_match"] <= summary["f1"] + 1e-9
    assert (run_dir / "ckpt" / "latest.json").is_file() and (run_dir / "nbest_predictions.json").is_file()

    # the run stopped after epoch 2 and resumed on 1 worker, which accumulates both micro-batches of each step
    # (dropout drawn per micro-batch): epoch 3 as the 2 workers trained and scored it
    one_dir = tmp_path / "on_1"
    shutil.copytree(run_dir, one_dir)
    kept = sorted((one_dir / "ckpt").glob("step*"))
    shutil.rmtree(kept[-1])
    (one_dir / "ckpt" / "latest.json").write_text(json.dumps({"dir": kept[-2].name,
                                                             **json.loads((kept[-2] / "complete.json").read_text())}))
    (one_dir / "metrics.json").unlink()
    (one_dir / "metrics.jsonl").write_text("".join((one_dir / "metrics.jsonl").read_text().splitlines(True)[:2]))
    on_1 = distributed.run(e2e_worker, 1, {**cfg, "trainer": {**cfg["trainer"], "nproc_per_node": 1}},
                           str(one_dir))[0]
    assert on_1["world_size"] == 1 and on_1["resumed_from"] == [2]
    last = json.loads((one_dir / "metrics.jsonl").read_text().splitlines()[-1])
    for key in ("train_loss", "f1", "exact_match", "lr"):
        assert last[key] == pytest.approx(rows[-1][key], rel=1e-5), key

    files = build_tables(load_runs(tmp_path), tmp_path / "tables")
    table = files["squad_tiny"][0].read_text()
    # a tiny BERT on a tiny set: ours in the table, the published number apart
    assert f"| LAMB | {summary['f1']:.2f} | {summary['exact_match']:.2f} |" in table
    assert "| Pre-training optimizer | published F1 | published EM |\n|---|---|---|\n| LAMB | 91.345 | - |" in table
