"""Pre-training shards (NVIDIA's HDF5 layout) as an endless stream of this rank's micro-batches.

A run cuts the data into one stream per worker of its first start (:class:`PretrainingStream`); each
optimizer step takes ``data.global_batch / data.micro_batch`` micro-batches, as many consecutive ones of
each stream (:class:`StepStream`). On another number of workers (a resumed run) each worker takes an
equal run of a step's micro-batches, whichever streams they come from: every step sees the same sequences
in the same micro-batches, masked as their shard masks them.

Within a stream, each pass ("epoch") over the data shuffles the shard list with the run's seed
(the same order on every rank) and deals the shards out to the streams
round-robin; with fewer shards than streams every stream reads every shard and
takes a strided share of its examples instead. Examples are shuffled within a
shard. Training length is counted in optimizer steps, so ranks never wait on
one another for data: each stream is endless, and
``micro_batches(start=n)`` replays it from its n-th micro-batch (exact
resume) from the shards' lengths alone, without reading skipped data.

:class:`Prefetcher` reads the stream ahead in a background thread (shard
reads, batch assembly, and on an accelerator the copy into pinned memory), so
that the training loop only starts an asynchronous copy to the device.

A run records what its shard folders hold (:func:`fingerprint`): the shards, their sequences and a digest of each
shard's length and ends. No digest of the paper's pre-training data is published, so a page names shards by
their size only.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import queue
import threading
from pathlib import Path

import numpy as np
import torch

from harness import identity
from harness.data import step_share

from .prepare_data import FIELDS

IGNORE_INDEX = -100  # the label ``transformers`` skips in the MLM loss


# NVIDIA's run_pretraining.py trains on the files of its input directory whose names contain "training":
# its hdf5 directories also hold <dataset>_test_<i>.hdf5 shards, which must stay out of training.
SHARD_PATTERN = "*training*.hdf5"


def find_shards(data_dir: str | Path, pattern: str = SHARD_PATTERN, setting: str = "data") -> list[Path]:
    """The shard files of ``data_dir`` matching ``pattern`` (default: NVIDIA's rule), sorted by name; ``setting``:
    the config node they come from (``data``, ``validation``), which the error names."""
    files = sorted(p for p in Path(data_dir).glob(pattern) if p.is_file())
    if not files:
        raise FileNotFoundError(
            f"no pre-training shards {pattern!r} in {str(data_dir)!r} ({setting}.dir, {setting}.pattern): prepare "
            "them with "
            "`python -m bert.prepare_data --input TEXT... --vocab vocab.txt --output DIR` (or point data.dir at "
            "NVIDIA's hdf5 directory)"
        )
    return files


def fingerprint(data_dir, pattern: str = SHARD_PATTERN, setting: str = "data") -> dict:
    """What the shards ``pattern`` of ``data_dir`` hold (:mod:`harness.identity`): their number, sequences and
    length, and a digest of each shard's length and ends (a shard is hashed at its ends, never read whole)."""
    files = find_shards(data_dir, pattern, setting)

    def make() -> dict:
        sequences, lengths = 0, set()
        for path in files:
            with open_shard(path) as f:
                sequences += len(f["input_ids"])
                lengths.add(int(f["input_ids"].shape[1]))
        seq = "/".join(map(str, sorted(lengths)))
        digest = identity.digest_of({p.name: identity.ends_digest(p) for p in files})
        name = f"BERT pre-training shards ({identity.count(len(files), 'shard')}, {sequences:,} sequences of {seq})"
        return {"layout": "bert-hdf5", "dataset": None, "name": name, "digest": digest,
                "counts": {"shards": len(files), "sequences": sequences}}

    return identity.kept(Path(data_dir), "bert-" + hashlib.sha256(pattern.encode()).hexdigest()[:8], files, make)


@contextlib.contextmanager
def open_shard(path: Path):
    """``h5py.File(path)``; h5py's errors for a truncated or damaged file (at opening or reading) name no file.
    A ``ValueError`` (a damaged input): a restart would meet it again."""
    import h5py

    try:
        with h5py.File(path, "r") as f:
            yield f
    except OSError as e:
        raise ValueError(f"cannot read the pre-training shard {path} ({e}): the file is truncated or damaged; "
                         "prepare it again (python -m bert.prepare_data) or copy it again") from None


def shard_length(path: Path) -> int:
    with open_shard(path) as f:
        missing = [k for k in FIELDS if k not in f]
        if missing:
            raise ValueError(f"{path} is not a BERT pre-training shard: missing fields {missing} (need {list(FIELDS)})")
        return len(f["next_sentence_labels"])


def _check_length(path: Path, length: int, seq_len: int) -> None:
    if length != seq_len:
        raise ValueError(f"{path} holds sequences of length {length}, the run expects data.seq_len={seq_len}: use "
                         "the shards of this phase")


def load_shard(path: Path, seq_len: int) -> dict[str, np.ndarray]:
    with open_shard(path) as f:
        arrays = {k: np.asarray(f[k][:], dtype=np.int64) for k in FIELDS}
    _check_length(path, arrays["input_ids"].shape[1], seq_len)
    return arrays


def check_shards(files: list[Path], seq_len: int, vocab_size: int) -> None:
    """What the workers would meet only once started: every shard readable (a truncated copy fails to open),
    the first one's sequences of ``seq_len`` and token ids the model embeds (``vocab_size``)."""
    for path in files:
        shard_length(path)
    with open_shard(files[0]) as f:
        _check_length(files[0], f["input_ids"].shape[1], seq_len)
        top = max(int(f[k][:].max()) for k in ("input_ids", "masked_lm_ids"))
    if top >= vocab_size:
        raise ValueError(f"invalid model.vocab_size={vocab_size}: {files[0]} holds token id {top}; set "
                         f"model.vocab_size={top + 1} or more (the size of the shards' vocab.txt)")


def mlm_labels(positions: torch.Tensor, ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[B, L] labels: the original id at each masked position, ``IGNORE_INDEX`` elsewhere.

    Position 0 is always [CLS], never masked, so a 0 in ``masked_lm_positions``
    is padding (NVIDIA's loader reads them the same way).
    """
    labels = torch.full((positions.shape[0], seq_len), IGNORE_INDEX, dtype=torch.long)
    valid = positions > 0
    rows = torch.arange(positions.shape[0]).unsqueeze(1).expand_as(positions)
    labels[rows[valid], positions[valid]] = ids[valid]
    return labels


def to_batch(arrays: dict[str, np.ndarray], rows: np.ndarray) -> dict[str, torch.Tensor]:
    """The keyword arguments of ``BertForPreTraining`` for some examples of a shard."""
    get = {k: torch.from_numpy(arrays[k][rows]) for k in FIELDS}
    seq_len = get["input_ids"].shape[1]
    return {
        "input_ids": get["input_ids"], "token_type_ids": get["segment_ids"], "attention_mask": get["input_mask"],
        "labels": mlm_labels(get["masked_lm_positions"], get["masked_lm_ids"], seq_len),
        "next_sentence_label": get["next_sentence_labels"],
    }


class PretrainingStream:
    """This rank's endless micro-batches of ``files`` (see the module docstring for the order)."""

    def __init__(self, files, micro_batch: int, rank: int, world_size: int, *, seed: int, seq_len: int):
        self.files = [Path(f) for f in files]
        self.lengths = [shard_length(f) for f in self.files]
        self.micro_batch, self.rank, self.world, self.seed, self.seq_len = micro_batch, rank, world_size, seed, seq_len
        if self.epoch_batches(0) == 0:
            raise ValueError(f"{sum(self.lengths)} examples in {len(self.files)} shards cannot give each of "
                             f"{world_size} workers a micro-batch of {micro_batch}: lower data.micro_batch")

    def _plan(self, epoch: int) -> list[tuple[int, np.ndarray]]:
        """(shard, its example rows) this rank reads in ``epoch``, in order."""
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(len(self.files))
        dealt = len(self.files) >= self.world
        mine = order[self.rank::self.world] if dealt else order
        plan = []
        for f in mine:
            rows = np.random.default_rng([self.seed, epoch, int(f)]).permutation(self.lengths[f])
            plan.append((int(f), rows if dealt else rows[self.rank::self.world]))
        return plan

    def epoch_batches(self, epoch: int) -> int:
        return sum(len(rows) for _, rows in self._plan(epoch)) // self.micro_batch

    def micro_batches(self, start: int = 0):
        """Endless micro-batches (dicts of CPU tensors), from the ``start``-th of the stream on."""
        epoch = 0
        while start >= (n := self.epoch_batches(epoch)):
            start -= n
            epoch += 1
        while True:
            yield from self._epoch(epoch, skip=start)
            start, epoch = 0, epoch + 1

    def _epoch(self, epoch: int, skip: int):
        """The micro-batches of one pass after the first ``skip``; a batch may span two shards, the tail is dropped."""
        to_skip = skip * self.micro_batch
        parts, pending = [], 0
        for f, rows in self._plan(epoch):
            if to_skip >= len(rows):
                to_skip -= len(rows)
                continue
            rows, to_skip = rows[to_skip:], 0
            arrays = load_shard(self.files[f], self.seq_len)  # one shard in memory at a time
            while len(rows):
                take, rows = rows[:self.micro_batch - pending], rows[self.micro_batch - pending:]
                parts.append(to_batch(arrays, take))
                pending += len(take)
                if pending == self.micro_batch:
                    yield {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
                    parts, pending = [], 0


class StepStream:
    """This rank's micro-batches of each optimizer step, from the streams of the run's first start.

    A step takes ``per_stream`` consecutive micro-batches of each of the ``stream.world`` streams (one per
    worker the run started on, each accumulating ``per_stream`` of them), numbered stream by stream; rank
    ``rank`` of ``world_size`` takes an equal run of them (:attr:`shards`), from as many streams as the run
    spans. With the first start's workers, each takes its own stream.
    """

    def __init__(self, stream: PretrainingStream, per_stream: int, rank: int, world_size: int):
        self.shards = step_share(stream.world * per_stream, rank, world_size)  # the step's micro-batches it takes
        self.stream, self.per_stream = stream, per_stream

    def micro_batches(self, start: int = 0):
        """Endless micro-batches, ``len(shards)`` per step, from step ``start`` on."""
        first, last = self.shards[0] // self.per_stream, self.shards[-1] // self.per_stream
        readers = {}
        for s in range(first, last + 1):
            reader = copy.copy(self.stream)  # the same shards' lengths: read once
            reader.rank = s
            readers[s] = reader.micro_batches(start=start * self.per_stream)
        while True:
            for s, batches in readers.items():
                for i in range(s * self.per_stream, (s + 1) * self.per_stream):
                    batch = next(batches)
                    if i in self.shards:
                        yield batch


class Prefetcher:
    """The batches of ``batches`` (dicts of CPU tensors) on ``device``, read ``depth`` batches ahead.

    A background thread pulls from ``batches`` while the loop trains and, when ``device`` is an
    accelerator, copies each batch into pinned (page-locked) memory, from which the loop's copy to the
    device is asynchronous (``non_blocking``): the host does not wait for it, nor for the device's queue
    (a copy from pageable memory may). On the CPU nothing is pinned or copied. ``depth=0`` reads in the
    loop. The batches and their order are those of ``batches``; an error in the thread is raised by the
    ``next()`` that would have returned its batch. :meth:`close` (or leaving a ``with`` block) stops it.
    """

    def __init__(self, batches, device, depth: int = 2):
        if not (isinstance(depth, int) and depth >= 0):
            raise ValueError(f"invalid data.prefetch={depth!r}: must be an integer >= 0 (batches read ahead)")
        self.device = torch.device(device)
        self.pin = self.device.type != "cpu"
        self._batches = iter(batches)
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        if depth:
            self._queue = queue.Queue(maxsize=depth)
            self._thread = threading.Thread(target=self._read, name="bert-prefetch", daemon=True)
            self._thread.start()

    def _prepare(self, batch: dict) -> dict:
        return {k: v.pin_memory() for k, v in batch.items()} if self.pin else batch

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def _read(self) -> None:
        if self.pin and self.device.index is not None:
            # pinning in a thread of its own would otherwise make a context on device 0 (as DataLoader's
            # pin-memory thread, it takes the loop's device)
            torch.accelerator.set_device_index(self.device.index)
        try:
            for batch in self._batches:
                if not self._put((self._prepare(batch), None)):
                    return
            self._put((None, StopIteration()))
        except BaseException as e:  # handed to the consumer, whose next() raises it
            self._put((None, e))

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self._queue is None:
            batch = self._prepare(next(self._batches))
        else:
            batch, error = self._queue.get()
            if error is not None:
                self.close()
                raise error
        return {k: v.to(self.device, non_blocking=self.pin) for k, v in batch.items()}

    def close(self) -> None:
        self._stop.set()
        if self._queue is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
