"""BERT data preparation: NVIDIA's HDF5 layout, the masking and next-sentence statistics of Google's
recipe, reproducibility across worker counts, the tokenizer checks, and the per-rank shard stream."""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import yaml

from bert import prepare_data as prep
from bert.data import (IGNORE_INDEX, SHARD_PATTERN, Prefetcher, PretrainingStream, StepStream,
                       find_shards, load_shard, mlm_labels)
from bert.tiny import WORDS, write_corpus
from bert.vocab import check_tokenizer, load_tokenizer, train_vocab
from harness import StepReader

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SEQ, PRED = 64, 10
SETTINGS = prep.Settings(max_seq_length=SEQ, max_predictions_per_seq=PRED, dupe_factor=5, seed=7)
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("bert_corpus")
    files = write_corpus(root / "text")
    vocab = train_vocab(files, root / "vocab", vocab_size=120, min_frequency=1)
    return root, files, vocab


@pytest.fixture(scope="module")
def shards(corpus):
    root, files, vocab = corpus
    stats = prep.prepare(files, vocab, root / "shards", SETTINGS, workers=2, progress=False)
    return root / "shards", stats, load_tokenizer(vocab)


def read(path: Path) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as f:
        return {k: f[k][:] for k in f}


@pytest.mark.multiprocess  # the shards fixture prepares them with a pool of 2 workers
def test_shards_have_nvidia_field_names_shapes_and_dtypes(shards):
    out, stats, _ = shards
    assert [p.name for p in find_shards(out)] == ["part0_training.hdf5", "part1_training.hdf5"]
    for path in find_shards(out):
        a = read(path)
        n = len(a["next_sentence_labels"])
        assert n > 50
        assert sorted(a) == sorted(prep.FIELDS)
        assert {k: (v.shape, v.dtype.str[1:]) for k, v in a.items()} == {
            "input_ids": ((n, SEQ), "i4"), "input_mask": ((n, SEQ), "i1"), "segment_ids": ((n, SEQ), "i1"),
            "masked_lm_positions": ((n, PRED), "i4"), "masked_lm_ids": ((n, PRED), "i4"),
            "next_sentence_labels": ((n,), "i1")}
    assert sum(s["examples"] for s in stats) == sum(len(read(p)["next_sentence_labels"]) for p in find_shards(out))


@pytest.mark.multiprocess  # the shards fixture prepares them with a pool of 2 workers
def test_examples_are_cls_a_sep_b_sep_pairs_zero_padded(shards):
    out, _, tok = shards
    cls, sep = tok.convert_tokens_to_ids(["[CLS]", "[SEP]"])
    for path in find_shards(out):
        a = read(path)
        for ids, mask, seg, pos in zip(a["input_ids"], a["input_mask"], a["segment_ids"], a["masked_lm_positions"]):
            n = int(mask.sum())
            assert (mask[:n] == 1).all() and (mask[n:] == 0).all() and (ids[n:] == 0).all() and (seg[n:] == 0).all()
            assert ids[0] == cls and ids[n - 1] == sep
            first_sep = int((seg[:n] == 0).sum()) - 1  # segment 0: [CLS] A [SEP]; segment 1: B [SEP]
            assert 1 <= first_sep < n - 2  # A and B both non-empty
            assert (seg[first_sep + 1:n] == 1).all()
            assert ids[first_sep] == sep and first_sep not in pos



@pytest.mark.multiprocess  # the shards fixture prepares them with a pool of 2 workers
def test_masking_statistics_follow_the_15_percent_80_10_10_recipe(shards):
    out, _, tok = shards
    mask_id = tok.convert_tokens_to_ids("[MASK]")
    counts = {"masked": 0, "tokens": 0, "mask": 0, "kept": 0, "random": 0}
    for path in find_shards(out):
        a = read(path)
        for ids, mask, pos, lab in zip(a["input_ids"], a["input_mask"], a["masked_lm_positions"], a["masked_lm_ids"]):
            n = int(mask.sum())
            k = int((pos > 0).sum())
            # exactly round(15%) of the tokens (at least 1, at most max_predictions), sorted, never [CLS]/[SEP]
            assert k == min(PRED, max(1, round(n * 0.15)))
            assert (pos[k:] == 0).all() and (lab[k:] == 0).all()
            p = pos[:k]
            assert (np.diff(p) > 0).all() and (p > 0).all() and (p < n).all()
            assert not np.isin(lab[:k], tok.convert_tokens_to_ids(["[CLS]", "[SEP]"])).any()
            shown = ids[p]
            counts["mask"] += int((shown == mask_id).sum())
            counts["kept"] += int((shown == lab[:k]).sum())
            counts["random"] += int(((shown != mask_id) & (shown != lab[:k])).sum())
            counts["masked"] += k
            counts["tokens"] += n
    m = counts["masked"]
    assert m > 2000
    assert counts["masked"] / counts["tokens"] == pytest.approx(0.15, abs=0.01)
    assert counts["mask"] / m == pytest.approx(0.8, abs=0.03)
    # a random replacement may draw the original token (1 in 120 here): it then counts as kept
    assert counts["kept"] / m == pytest.approx(0.1 + 0.1 / 120, abs=0.025)
    assert counts["random"] / m == pytest.approx(0.1 - 0.1 / 120, abs=0.025)


@pytest.mark.multiprocess  # the shards fixture prepares them with a pool of 2 workers
def test_next_sentence_labels_are_about_half_random(shards):
    out, stats, _ = shards
    labels = np.concatenate([read(p)["next_sentence_labels"] for p in find_shards(out)])
    assert set(np.unique(labels)) == {0, 1}
    # 50% by coin, plus the chunks of a single segment, which always take a random B (Google's recipe)
    assert 0.45 <= labels.mean() <= 0.65
    assert sum(s["random_next"] for s in stats) == labels.sum()


@pytest.mark.multiprocess  # the shards fixture prepares them with a pool of 2 workers
def test_continuation_pairs_are_consecutive_text_of_one_document(corpus, shards):
    root, files, vocab = corpus
    out, _, tok = shards
    text = " ".join(line for line in files[0].read_text().splitlines() if line)
    ids, docs = read(out / "part0_training.hdf5"), tok(text, add_special_tokens=False)["input_ids"]
    stream = " ".join(map(str, docs))
    sep = tok.convert_tokens_to_ids("[SEP]")
    checked = 0
    for row, mask, seg, lab, pos, mlm in zip(ids["input_ids"], ids["input_mask"], ids["segment_ids"],
                                             ids["next_sentence_labels"], ids["masked_lm_positions"],
                                             ids["masked_lm_ids"]):
        if lab != 0:
            continue
        original = row.copy()
        original[pos[pos > 0]] = mlm[pos > 0]
        n = int(mask.sum())  # not the non-zero ids: a random replacement may be [PAD] (id 0)
        s = int((seg[:n] == 0).sum()) - 1
        assert original[s] == sep
        a, b = original[1:s], original[s + 1:n - 1]
        if len(a) + len(b) < SEQ - 3:  # untruncated: A then B are the document's tokens in order
            assert " ".join(map(str, np.concatenate([a, b]))) in stream
            checked += 1
    assert checked > 20


@pytest.mark.multiprocess  # the shards fixture prepares them with a pool of 2 workers
def test_preparation_is_reproducible_with_any_number_of_workers(corpus, shards, tmp_path):
    root, files, vocab = corpus
    out, _, _ = shards
    prep.prepare(files, vocab, tmp_path, SETTINGS, workers=1, progress=False)
    for name in ("part0_training.hdf5", "part1_training.hdf5"):
        a, b = read(out / name), read(tmp_path / name)
        assert all(np.array_equal(a[k], b[k]) for k in prep.FIELDS)
    other = prep.Settings(**{**SETTINGS.__dict__, "seed": 8})
    prep.prepare(files[:1], vocab, tmp_path / "seed8", other, progress=False)
    assert not np.array_equal(read(tmp_path / "seed8" / "part0_training.hdf5")["input_ids"],
                              read(out / "part0_training.hdf5")["input_ids"])


def test_whole_word_masking_masks_every_piece_of_a_word(corpus):
    _, _, vocab = corpus
    v = prep.Vocab(load_tokenizer(vocab))
    s = prep.Settings(max_seq_length=SEQ, max_predictions_per_seq=PRED, whole_word_mask=True)
    rng = random.Random(0)
    pieced = 0
    for trial in range(40):  # words glued from two corpus words split into several WordPiece pieces
        words = [random.Random(trial).choice(WORDS) + w for w in random.Random(trial + 1).choices(WORDS, k=8)]
        tokens = [v.cls, *v.encode_lines([" ".join(words)])[0], v.sep]
        _, positions, _ = prep.mask_tokens(tokens, v, s, rng)
        chosen = set(positions)
        for i in range(2, len(tokens) - 1):  # a continuation piece is masked iff the piece before it is
            if v.continuation[tokens[i]]:
                pieced += 1
                assert (i in chosen) == (i - 1 in chosen)
    assert pieced > 100


def test_default_max_predictions_are_the_recipes():
    assert prep.default_max_predictions(128) == 20 and prep.default_max_predictions(512) == 80


def test_tokenizer_checks_reject_missing_and_empty_vocabularies(tmp_path):
    with pytest.raises(FileNotFoundError, match="vocabulary .*not found.*--train-vocab"):
        load_tokenizer(tmp_path / "vocab.txt")
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]) + "\n")
    with pytest.raises(ValueError, match="only 5 tokens"):
        load_tokenizer(tmp_path)
    from transformers import BertTokenizerFast

    empty = BertTokenizerFast()  # what an offline from_pretrained of a hub name gives: 5 special tokens
    assert len(empty) == 5
    with pytest.raises(ValueError, match="only 5 tokens"):
        check_tokenizer(empty, "bert-large-uncased")
    with pytest.raises(FileNotFoundError, match="input text files not found"):
        prep.prepare([tmp_path / "nope.txt"], tmp_path / "vocab.txt", tmp_path / "out", SETTINGS, progress=False)
    with pytest.raises(ValueError, match="max_predictions_per_seq"):
        prep.Settings(max_seq_length=16, max_predictions_per_seq=20)


def test_shards_in_nvidias_own_dtypes_load(tmp_path):
    """NVIDIA's files may store every field as int32/int64: the loader reads any integer dtype."""
    rng = np.random.default_rng(0)
    n = 6
    with h5py.File(tmp_path / "nv.hdf5", "w") as f:
        f["input_ids"] = rng.integers(5, 100, (n, 16)).astype(np.int64)
        f["input_mask"] = np.ones((n, 16), np.int32)
        f["segment_ids"] = np.zeros((n, 16), np.int32)
        f["masked_lm_positions"] = np.array([[3, 7, 0]] * n, np.int32)
        f["masked_lm_ids"] = np.array([[11, 12, 0]] * n, np.int32)
        f["next_sentence_labels"] = np.arange(n) % 2
    batch = next(PretrainingStream([tmp_path / "nv.hdf5"], 3, 0, 1, seed=0, seq_len=16).micro_batches())
    assert batch["input_ids"].dtype == torch.long and batch["input_ids"].shape == (3, 16)
    assert (batch["labels"][:, 3] == 11).all() and (batch["labels"][:, 7] == 12).all()
    assert (batch["labels"] != IGNORE_INDEX).sum() == 6
    with pytest.raises(ValueError, match="data.seq_len=32"):
        load_shard(tmp_path / "nv.hdf5", 32)
    with h5py.File(tmp_path / "bad.hdf5", "w") as f:
        f["input_ids"] = np.zeros((2, 16), np.int32)
    with pytest.raises(ValueError, match="missing fields"):
        PretrainingStream([tmp_path / "bad.hdf5"], 1, 0, 1, seed=0, seq_len=16)
    with pytest.raises(FileNotFoundError, match="bert.prepare_data"):
        find_shards(tmp_path / "empty")


def nvidia_selection(data_dir: Path) -> list[str]:
    """The file list of NVIDIA's run_pretraining.py: the directory's files whose names contain "training"."""
    return sorted(f for f in os.listdir(data_dir) if os.path.isfile(data_dir / f) and "training" in f)


@pytest.mark.multiprocess  # the shards fixture prepares them with a pool of 2 workers
def test_default_pattern_follows_nvidia_rule_and_selects_our_shards(shards, tmp_path):
    out, _, _ = shards
    assert nvidia_selection(out) == [p.name for p in find_shards(out)] == ["part0_training.hdf5", "part1_training.hdf5"]
    nvidia = tmp_path / "nvidia"
    nvidia.mkdir()
    for name in ("books_wiki_en_corpus_training_0.hdf5", "books_wiki_en_corpus_training_1.hdf5",
                 "books_wiki_en_corpus_test_0.hdf5", "books_wiki_en_corpus_test_1.hdf5"):
        shutil.copy(out / "part0_training.hdf5", nvidia / name)
    (nvidia / "old_training.hdf5").mkdir()  # a directory is not a shard, whatever its name
    assert [p.name for p in find_shards(nvidia)] == nvidia_selection(nvidia) == \
        ["books_wiki_en_corpus_training_0.hdf5", "books_wiki_en_corpus_training_1.hdf5"]
    for phase in ("bert_phase1", "bert_phase2"):
        assert yaml.safe_load((CONFIGS / "data" / f"{phase}.yaml").read_text())["pattern"] == SHARD_PATTERN
    with pytest.raises(FileNotFoundError,
                       match=r"no pre-training shards '\*test\*.hdf5' .* \(data.dir, data.pattern\)"):
        find_shards(out, "*test*.hdf5")


def test_mlm_labels_place_ids_at_positions_and_ignore_padding():
    labels = mlm_labels(torch.tensor([[2, 5, 0], [1, 0, 0]]), torch.tensor([[40, 41, 0], [42, 0, 0]]), 6)
    want = torch.full((2, 6), IGNORE_INDEX)
    want[0, 2], want[0, 5], want[1, 1] = 40, 41, 42
    assert torch.equal(labels, want)


def example_ids(batch) -> list[tuple]:
    return [tuple(r.tolist()) for r in batch["input_ids"]]


@pytest.mark.multiprocess  # the shards fixture prepares them with a pool of 2 workers
@pytest.mark.parametrize("world", [2, 3])  # 2: shards dealt to ranks; 3 > 2 shards: strided examples
def test_stream_splits_each_pass_between_ranks_and_resumes_exactly(shards, world):
    out, _, _ = shards
    files = find_shards(out)
    streams = [PretrainingStream(files, 8, r, world, seed=1, seq_len=SEQ) for r in range(world)]
    total = sum(len(read(p)["next_sentence_labels"]) for p in files)
    seen = []
    for s in streams:
        it = s.micro_batches()
        for _ in range(s.epoch_batches(0)):
            seen += example_ids(next(it))
    # one pass: no example twice (rows are distinct up to rare collisions), at most a micro-batch left per rank
    rows = [tuple(r.tolist()) for p in files for r in read(p)["input_ids"]]
    assert len(seen) > total - 8 * world * (1 + (world <= len(files)))
    from collections import Counter

    have = Counter(rows)
    assert all(n <= have[r] for r, n in Counter(seen).items())
    # resume: the stream from micro-batch n is the uninterrupted stream after n batches, across pass ends
    s = streams[0]
    n = s.epoch_batches(0) + 1
    full = s.micro_batches()
    for _ in range(n):
        next(full)
    resumed = s.micro_batches(start=n)
    for _ in range(3):
        a, b = next(full), next(resumed)
        assert all(torch.equal(a[k], b[k]) for k in a)
    # another pass reshuffles
    assert example_ids(next(streams[0].micro_batches(start=s.epoch_batches(0)))) != example_ids(next(streams[0].micro_batches()))


@pytest.mark.multiprocess  # the shards fixture prepares them with a pool of 2 workers
@pytest.mark.parametrize("start", [0, 5])
def test_each_step_takes_the_same_micro_batches_on_any_divisor_of_its_micro_batches(shards, start):
    """A run started on 4 workers x 2 micro-batches (8 a step): on 1, 2, 4 or 8 workers the ranks' micro-batches
    of each step, in rank order, are the 4 workers' (stream 0's 2, stream 1's 2, ...), across a pass's end and
    from a resumed step."""
    out, _, _ = shards
    stream = PretrainingStream(find_shards(out), 2, 0, 4, seed=1, seq_len=SEQ)
    steps = stream.epoch_batches(0) // 2 + 2  # into the second pass

    def taken(world):
        ranks = [StepStream(stream, 2, r, world).micro_batches(start=start) for r in range(world)]
        return [[example_ids(next(ranks[r])) for r in range(world) for _ in range(8 // world)] for _ in range(steps)]

    first = taken(4)
    own = [PretrainingStream(find_shards(out), 2, r, 4, seed=1, seq_len=SEQ).micro_batches(start=2 * start)
           for r in range(4)]
    assert first == [[example_ids(next(own[r])) for r in range(4) for _ in range(2)] for _ in range(steps)]
    for world in (1, 2, 8):
        assert taken(world) == first, world
    with pytest.raises(ValueError, match="3 workers cannot take an equal share of a step's 8 micro-batches"):
        StepStream(stream, 2, 0, 3)


@pytest.mark.multiprocess  # the shards fixture prepares them with a pool of 2 workers
def test_prefetched_stream_is_the_stream_and_resumes_exactly(shards):
    """Read ahead by the thread or in the loop: the same batches in the same order, across a pass's end,
    and from a resumed position."""
    out, _, _ = shards
    stream = PretrainingStream(find_shards(out), 8, 0, 2, seed=1, seq_len=SEQ)
    n = stream.epoch_batches(0) + 3
    for start in (0, stream.epoch_batches(0) - 1):
        plain = stream.micro_batches(start=start)
        with Prefetcher(stream.micro_batches(start=start), "cpu", 3) as ahead:
            for _ in range(n):
                a, b = next(plain), next(ahead)
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        with Prefetcher(stream.micro_batches(start=start), "cpu", 0) as inline:
            assert all(torch.equal(a, b) for a, b in zip(next(inline).values(),
                                                          next(stream.micro_batches(start=start)).values()))


@pytest.mark.multiprocess  # the shards fixture prepares them with a pool of 2 workers
def test_step_reader_gives_each_steps_micro_batches_whatever_order_the_steps_come_in(shards):
    """harness.StepReader over BERT's prefetched stream: steps in order, a step taken again (a torchft step that did not commit), a step ahead and one behind (a group
    that took a peer's state): each time the micro-batches the stream has for that step."""
    out, _, _ = shards
    steps = StepStream(PretrainingStream(find_shards(out), 2, 0, 4, seed=1, seq_len=SEQ), 2, 1, 2)
    stream = steps.micro_batches()
    expected = [[example_ids(next(stream)) for _ in steps.shards] for _ in range(12)]
    opened = []

    def open_at(step):
        opened.append(step)
        return Prefetcher(steps.micro_batches(start=step), "cpu", 2)

    with StepReader(open_at, len(steps.shards)) as batches:
        for step in (0, 1, 2, 2, 3, 7, 8, 4, 5, 5, 11):
            assert [example_ids(b) for b in batches(step)] == expected[step], step
        left = batches(6)
        next(left)  # a step left part way (a failed collective) is read again whole
        assert [example_ids(b) for b in batches(6)] == expected[6]
    # read on while the steps come in order; a step taken again whole is not read again, one left part way is
    assert opened == [0, 7, 4, 11, 6, 6]


def test_prefetcher_reads_ahead_of_the_loop_and_no_further():
    import time

    made = []

    def batches():
        for i in range(100):
            made.append(i)
            yield {"x": torch.full((2,), i)}

    def wait_for(count):
        deadline = time.monotonic() + 10
        while len(made) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return len(made)

    with Prefetcher(batches(), "cpu", 2) as ahead:
        # before any request: two batches queued and a third made, waiting for room
        assert wait_for(3) == 3
        time.sleep(0.2)
        assert len(made) == 3
        assert next(ahead)["x"].tolist() == [0, 0]
        assert wait_for(4) == 4  # the next batch is made before it is asked for
        assert [next(ahead)["x"][0].item() for _ in range(3)] == [1, 2, 3]


def test_prefetcher_raises_the_readers_error_at_the_batch_it_failed_on():
    def batches():
        yield {"x": torch.zeros(1)}
        raise OSError("shard unreadable")

    ahead = Prefetcher(batches(), "cpu", 2)
    assert next(ahead)["x"].tolist() == [0.0]
    with pytest.raises(OSError, match="shard unreadable"):
        next(ahead)
    with pytest.raises(ValueError, match=r"data.prefetch=-1: must be an integer >= 0"):
        Prefetcher(batches(), "cpu", -1)


def segments_a(shard: Path) -> list[str]:
    """The first segment of every example of a shard, its tokens as before the masking, as text of ids."""
    ids = read(shard)
    out = []
    for row, mask, seg, pos, mlm in zip(ids["input_ids"], ids["input_mask"], ids["segment_ids"],
                                        ids["masked_lm_positions"], ids["masked_lm_ids"]):
        original = row.copy()
        original[pos[pos > 0]] = mlm[pos > 0]
        end = int((seg[:int(mask.sum())] == 0).sum()) - 1
        out.append(" ".join(map(str, original[1:end])))
    return out


@pytest.mark.multiprocess  # bert.prepare_data's pool of workers
def test_the_command_holds_out_whole_documents_for_validation(corpus, tmp_path):
    """python -m bert.prepare_data writes held-out shards (a share of each file's documents, the same documents at
    every sequence length) into heldout/, which validation.dir reads and training's pattern never picks."""
    root, files, vocab = corpus
    for seq in (32, 64):
        prep.main(["--input", *map(str, files), "--vocab", str(vocab), "--output", str(tmp_path / f"seq{seq}"),
                   "--max-seq-length", str(seq), "--heldout-fraction", "0.1"])
    tok = prep.Vocab(load_tokenizer(vocab))
    docs = prep.read_documents(files[0], tok)
    train, held = prep.split_documents(docs, 0.1, 12345, files[0].stem)
    assert len(held) == round(0.1 * len(docs)) and len(train) + len(held) == len(docs)
    stream = {name: " ".join(str(t) for d in part for s in d for t in s) for name, part in (("train", train),
                                                                                            ("held", held))}
    for seq in (32, 64):
        out = tmp_path / f"seq{seq}"
        assert [p.name for p in find_shards(out)] == ["part0_training.hdf5", "part1_training.hdf5"]
        assert [p.name for p in find_shards(out / "heldout", "*.hdf5", "validation")] == [
            "part0_heldout.hdf5", "part1_heldout.hdf5"]
        stats = yaml.safe_load((out / "stats.json").read_text())
        assert stats["heldout_fraction"] == 0.1 and stats["heldout_examples"] > 0
        for name, shard in (("held", out / "heldout" / "part0_heldout.hdf5"), ("train", out / "part0_training.hdf5")):
            other = stream["train" if name == "held" else "held"]
            long = [a for a in segments_a(shard) if len(a.split()) >= 8]
            assert long and all(a not in other for a in long), name  # whole documents, on one side only
    held_a = [a for a in segments_a(tmp_path / "seq32" / "heldout" / "part0_heldout.hdf5") if len(a.split()) >= 8]
    assert all(a in stream["held"] for a in held_a)  # the documents the draw of the seed and the name gives


def test_a_held_out_share_outside_0_1_is_refused(corpus, tmp_path, capsys):
    root, files, vocab = corpus
    with pytest.raises(SystemExit) as exit_:
        prep.main(["--input", str(files[0]), "--vocab", str(vocab), "--output", str(tmp_path / "out"),
                   "--heldout-fraction", "1"])
    assert exit_.value.code == 2 and "--heldout-fraction 1.0: must be in [0, 1)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
