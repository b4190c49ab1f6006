"""Faults a run meets and how it comes through them: damaged checkpoints, full disks, torn logs, resumes with
other settings, damaged shards, stale locks, the launcher's leftovers."""
from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

import harness
import slamb
from harness.atomic import atomic_torch_save, atomic_write_bytes
from harness.checkpoint import Checkpointer, run_settings
from harness.lock import RunLock, RunLocked, enlist, gone, process_start, read, this_process
from harness.records import load_runs
from harness.run import RunLogger, read_jsonl
from slamb.checkpoint import _dcp_writer
from tests import distributed
from tests.disk import as_the_other_ranks_learn_it, disk_with_room
from tests.test_bert_pretrain import tiny_data  # noqa: F401 (a fixture)

CPU = torch.device("cpu")


def solo(rank=0, world=1) -> harness.DistEnv:
    return harness.DistEnv(rank, world, rank, world, CPU)


def flip_byte(path, at: float = 0.5) -> None:
    """Flip every bit of one byte ``at`` (a fraction) into the file, as a disk's silent corruption would."""
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------------------------- checkpoints


def test_a_flipped_byte_in_the_newest_checkpoint_falls_back_to_the_older_one_with_one_line(tmp_path, capsys):
    ckpt = Checkpointer(tmp_path, solo())
    for step in (1, 2):
        ckpt.save({"step": step}, {"a": step}, {"b": torch.arange(10_000.0) + step})
    newest = ckpt.dir / "step000000002" / "rank0.pt"
    assert (ckpt.dir / "step000000002" / "rank0.pt.sha256").read_text().endswith("  rank0.pt\n")
    flip_byte(newest)  # the middle of the tensor's data
    # torch.load alone does not see it: the zip's CRCs go unchecked, the values change
    damaged = torch.load(newest, weights_only=False)["b"]
    assert not torch.equal(damaged, torch.arange(10_000.0) + 2)
    progress, shared, (mine,) = ckpt.load()
    assert progress == {"step": 1} and shared == {"a": 1} and torch.equal(mine["b"], torch.arange(10_000.0) + 1)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"checkpoint file {newest} is unreadable (ValueError: its sha256 ")
    assert lines[0].endswith("the file changed on disk); delete that checkpoint folder to resume from an older "
                             "one, or start over with trainer.resume=never: resuming from the previous checkpoint, "
                             "step000000001")


def test_a_checkpoint_without_digests_still_loads_with_a_notice(tmp_path, capsys):
    """Checkpoints written before the digests were: nothing to check them against, they load as before."""
    ckpt = Checkpointer(tmp_path, solo())
    ckpt.save({"step": 1}, {"a": 1}, {"b": 1})
    for digest in ckpt.dir.glob("step*/*.sha256"):
        digest.unlink()
    for record in (ckpt.dir / "latest.json", ckpt.dir / "step000000001" / "complete.json"):
        record.write_text(json.dumps({k: v for k, v in json.loads(record.read_text()).items() if k != "files"}))
    assert ckpt.load() == ({"step": 1}, {"a": 1}, [{"b": 1}])
    assert capsys.readouterr().out == (f"checkpoint {ckpt.dir / 'step000000001'} records no digests (written before "
                                       "they were): its files load unchecked\n")


def test_a_missing_digest_falls_back_naming_it(tmp_path, capsys):
    # before: the file loaded unchecked, with no notice
    ckpt = Checkpointer(tmp_path, solo())
    for step in (1, 2):
        ckpt.save({"step": step}, {"a": step}, {"b": step})
    (ckpt.dir / "step000000002" / "rank0.pt.sha256").unlink()
    assert ckpt.load() == ({"step": 1}, {"a": 1}, [{"b": 1}])
    assert list(json.loads((ckpt.dir / "step000000002" / "complete.json").read_text())["files"]) == ["rank0.pt",
                                                                                                    "shared.pt"]
    assert capsys.readouterr().out == (
        f"checkpoint file {ckpt.dir / 'step000000002' / 'rank0.pt'} is unreadable (FileNotFoundError: its digest "
        "rank0.pt.sha256 is missing, though the checkpoint records one: the file cannot be checked); delete that "
        "checkpoint folder to resume from an older one, or start over with trainer.resume=never: resuming from the "
        "previous checkpoint, step000000001\n")


def test_a_file_of_another_step_copied_in_with_its_digest_is_fallen_back_from_naming_it(tmp_path, capsys):
    """Before: the copy matched the .sha256 copied beside it, and the run resumed at step 12 with step 11's file (a
    final loss of 4.98349 where the run ends at 4.98153)."""
    ckpt = Checkpointer(tmp_path, solo())
    for step in (11, 12):
        ckpt.save({"step": step}, {"a": step}, {"b": torch.full((1000,), float(step))})
    older, newest = ckpt.dir / "step000000011", ckpt.dir / "step000000012"
    for name in ("rank0.pt", "rank0.pt.sha256"):
        shutil.copy(older / name, newest / name)
    recorded = json.loads((newest / "complete.json").read_text())
    assert recorded["step"] == 12 and recorded["files"]["rank0.pt"] != (older / "rank0.pt.sha256").read_text()[:64]
    progress, shared, (mine,) = ckpt.load()
    assert progress == {"step": 11} and shared == {"a": 11} and torch.equal(mine["b"], torch.full((1000,), 11.0))
    copied = (older / "rank0.pt.sha256").read_text()[:16]
    assert capsys.readouterr().out == (
        f"checkpoint file {newest / 'rank0.pt'} is unreadable (ValueError: its sha256 {copied}... differs from the "
        f"{recorded['files']['rank0.pt'][:16]}... that complete.json records for it: it is not the file this "
        "checkpoint wrote (another checkpoint's, copied in with its digest)); delete that checkpoint folder to "
        "resume from an older one, or start over with trainer.resume=never: resuming from the previous checkpoint, "
        "step000000011\n")


def test_no_checkpoint_left_to_fall_back_to_says_so_and_names_the_file(tmp_path):
    # before: "...delete that checkpoint folder to resume from an older one", of which there was none
    ckpt = Checkpointer(tmp_path, solo())
    ckpt.save({"step": 1}, {"a": 1}, {"b": torch.arange(10_000.0)})
    flip_byte(ckpt.dir / "step000000001" / "rank0.pt")
    with pytest.raises(harness.distributed.WILL_RECUR) as raised:
        ckpt.load()
    assert str(raised.value).startswith(f"checkpoint file {ckpt.dir / 'step000000001' / 'rank0.pt'} is unreadable "
                                        "(ValueError: its sha256 ")
    assert str(raised.value).endswith("the file changed on disk); no older checkpoint is left to resume from: restore "
                                      "that file, or start over with trainer.resume=never")


def damaged_rank_worker(rank, world, run_dir):
    env = harness.init_distributed("cpu", 1)
    ckpt = Checkpointer(run_dir, env)
    for step in (1, 2):
        ckpt.save({"step": step}, {"a": step}, {"b": torch.full((1000,), float(10 * step + rank))})
    if rank == 1:  # only rank 1's own file is damaged; rank 0 reads all of its files
        flip_byte(ckpt.dir / "step000000002" / "rank1.pt")
    harness.distributed.barrier()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        progress, _, (mine,) = ckpt.load()
    if rank == 1:
        flip_byte(ckpt.dir / "step000000001" / "rank1.pt")
    harness.distributed.barrier()
    try:
        ckpt.load()
        error = None
    except harness.distributed.WILL_RECUR as e:  # a damaged input: not restarted
        error = str(e)
    return {"progress": progress, "b": mine["b"][0].item(), "printed": printed.getvalue(), "error": error}


@pytest.mark.multiprocess  # starts workers
def test_a_damaged_file_on_another_rank_sends_every_rank_back_and_is_named(tmp_path):
    out = distributed.run(damaged_rank_worker, 2, str(tmp_path))
    bad = tmp_path / "ckpt" / "step000000002" / "rank1.pt"
    for rank, r in enumerate(out):
        assert r["progress"] == {"step": 1} and r["b"] == 10 + rank  # both ranks at the older checkpoint
        # no other checkpoint left: the error every rank raises names rank 1's file
        assert r["error"].startswith(f"checkpoint file {tmp_path / 'ckpt' / 'step000000001' / 'rank1.pt'} is "
                                     "unreadable (ValueError: its sha256 ")
    # rank 0 prints the one line, naming the file rank 1 found damaged
    assert out[0]["printed"].startswith(f"checkpoint file {bad} is unreadable (ValueError: its sha256 ")
    assert out[0]["printed"].count("\n") == 1 and out[1]["printed"] == ""


# ------------------------------------------------------------------------------- sharded checkpoints


def _xor16(path: Path) -> None:
    """16 bytes inverted in the middle of the file."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 16] = bytes(b ^ 0xFF for b in data[middle:middle + 16])
    path.write_bytes(bytes(data))


def _unrecorded(folder: Path) -> None:
    """The checkpoint in ``folder`` as written before digests were: no ``files`` record."""
    for record in (folder.parent / "latest.json", folder / "complete.json"):
        entry = json.loads(record.read_text())
        if entry.get("dir", folder.name) == folder.name:
            record.write_text(json.dumps({k: v for k, v in entry.items() if k != "files"}))


# each case damages a copy of the run whose newest checkpoint is step 3 (of 1-3)
SHARDED_DAMAGE = {
    "flipped": lambda ckpt: _xor16(ckpt / "step000000003" / "dcp" / "__0_0.distcp"),
    "truncated": lambda ckpt: (lambda p: p.write_bytes(p.read_bytes()[:1000]))(
        ckpt / "step000000003" / "dcp" / "__1_0.distcp"),
    "removed": lambda ckpt: (ckpt / "step000000003" / "dcp" / "__0_0.distcp").unlink(),
    "metadata": lambda ckpt: flip_byte(ckpt / "step000000003" / "dcp" / ".metadata"),
    # a checkpoint without digests: its sharded load, which fails, is inside the fallback too
    "undigested": lambda ckpt: (_unrecorded(ckpt / "step000000003"),
                                flip_byte(ckpt / "step000000003" / "dcp" / ".metadata", at=0.1)),
    "every": lambda ckpt: [_xor16(ckpt / f"step00000000{s}" / "dcp" / "__0_0.distcp") for s in (1, 2, 3)],
}


def sharded_damage_worker(rank, world, cfg, root):
    """The run (checkpoints after steps 1-4), then each case of :data:`SHARDED_DAMAGE` on a copy rolled back
    to step 3: its summary (or the error it ended on) and what rank 0 printed."""
    import shutil

    from bert.train import train

    full = root / "full"
    out = {"full": train(cfg, str(full))}
    for name, damage in SHARDED_DAMAGE.items():
        run = root / name
        if rank == 0:
            shutil.copytree(full, run)
            shutil.rmtree(run / "ckpt" / "step000000004")
            record = json.loads((run / "ckpt" / "step000000003" / "complete.json").read_text())
            (run / "ckpt" / "latest.json").write_text(json.dumps({"dir": "step000000003", **record}))
            damage(run / "ckpt")
        harness.distributed.barrier()
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            try:
                out[name] = train(cfg, str(run))
            except harness.distributed.WILL_RECUR as e:  # not restarted: a restart would meet it again
                out[name] = f"{type(e).__name__}: {e}"
        out[f"{name} printed"] = [line for line in printed.getvalue().splitlines() if "unreadable" in line]
    return out


@pytest.fixture(scope="module")
def sharded_damage(tiny_data, tmp_path_factory):  # noqa: F811 (the imported fixture)
    from tests.test_bert_pretrain import ROWS, tiny_cfg

    root = tmp_path_factory.mktemp("sharded_damage")
    cfg = tiny_cfg(tiny_data, root / "full", *ROWS["lamb"], "trainer.parallelism=fsdp", "steps=4", "log_every=1",
                   "trainer.checkpoint.every=1", "trainer.checkpoint.keep=4")
    return root, distributed.run(sharded_damage_worker, 2, cfg, root)


def _unreadable_line(path, reason: str) -> str:
    return (f"checkpoint {path} is unreadable ({reason}); delete that checkpoint folder to resume from an older one, "
            "or start over with trainer.resume=never")


@pytest.mark.multiprocess  # starts workers
@pytest.mark.parametrize("case, found, reason", [
    ("flipped", "file step000000003/dcp/__0_0.distcp", "ValueError: its sha256 "),
    ("truncated", "file step000000003/dcp/__1_0.distcp", "ValueError: its sha256 "),
    ("removed", "file step000000003/dcp/__0_0.distcp", "FileNotFoundError: [Errno 2] No such file or directory"),
    ("metadata", "file step000000003/dcp/.metadata", "ValueError: its sha256 "),
    ("undigested", "folder step000000003/dcp", ""),
])
def test_a_damaged_sharded_checkpoint_falls_back_on_every_rank_naming_the_file(sharded_damage, case, found,
                                                                               reason):
    """A 2-worker FSDP BERT run's newest checkpoint damaged (before: the flipped bytes loaded silently, a final
    loss far from the run's; the others failed in load_sharded, outside the fallback, naming no file): every rank
    resumes from the one before, and the run ends as the undamaged run ends, bit for bit."""
    root, out = sharded_damage
    kind, _, name = found.partition(" ")
    line, = out[0][f"{case} printed"]
    assert line.startswith(f"checkpoint {kind} {root / case / 'ckpt' / name} is unreadable ({reason}"), line
    assert line.endswith("start over with trainer.resume=never: resuming from the previous checkpoint, "
                         "step000000002"), line
    assert out[0][case]["resumed_from"] == [2]
    full, resumed = (read_jsonl(root / r / "metrics.jsonl") for r in ("full", case))
    assert [h["step"] for h in resumed] == [1, 2, 3, 4]
    keys = ("loss", "mlm_acc", "nsp_acc", "bytes_cum/all")
    assert [{k: h[k] for k in keys} for h in resumed] == [{k: h[k] for k in keys} for h in full]


@pytest.mark.multiprocess  # starts workers
def test_no_readable_sharded_checkpoint_ends_in_one_error_naming_the_file_on_every_rank(sharded_damage):
    root, out = sharded_damage
    oldest = root / "every" / "ckpt" / "step000000001" / "dcp" / "__0_0.distcp"
    for rank in (0, 1):
        assert out[rank]["every"].startswith(f"ValueError: checkpoint file {oldest} is unreadable (ValueError: its "
                                             "sha256 "), out[rank]["every"]
    assert len(out[0]["every printed"]) == 2  # steps 3 and 2, each fallen back from in one line


def test_an_unreadable_latest_json_is_said_once_by_rank_0(tmp_path, capsys):
    # before: by the launcher's look and by every rank (3 lines with 2 workers)
    for rank in (0, 1):
        Checkpointer(tmp_path, solo(rank, 2)).save({"step": 1}, {}, {})
    (tmp_path / "ckpt" / "latest.json").write_text('{"dir": "step0')
    assert [e["dir"] for e in Checkpointer(tmp_path, None).complete()] == ["step000000001"]  # the launcher's
    assert [e["dir"] for e in Checkpointer(tmp_path, solo(1, 2)).complete()] == ["step000000001"]
    assert capsys.readouterr().out == ""
    assert [e["dir"] for e in Checkpointer(tmp_path, solo(0, 2)).complete()] == ["step000000001"]
    assert capsys.readouterr().out == (f"{tmp_path / 'ckpt' / 'latest.json'} is unreadable: looking for complete "
                                       f"checkpoints in {tmp_path / 'ckpt'}\n")


def test_the_next_start_removes_the_folder_of_a_save_that_did_not_finish(tmp_path, capsys):
    """A rank's save failed (its disk full) while the others' files were on disk: the next start frees their
    space, in one line (before: they stayed, keeping the disk full)."""
    from harness.checkpoint import prepare_run
    from tests.test_harness import _cfg

    for rank in (0, 1):
        Checkpointer(tmp_path, solo(rank, 2)).save({"step": 1}, {}, {"b": rank})
    partial = tmp_path / "ckpt" / "step000000002"
    partial.mkdir()
    atomic_torch_save({"b": torch.zeros(1000)}, partial / "rank0.pt")
    assert prepare_run(_cfg(), tmp_path) is None
    assert capsys.readouterr().out == f"removing {partial}: a checkpoint whose save did not finish\n"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest.json", "step000000001"]


def test_a_step_saved_again_leaves_nothing_of_the_earlier_attempt(tmp_path):
    """A save killed mid-write left its temporary file; the run resumed from the step before and saves this step
    again (before: the .tmp file stayed, and the folder kept the earlier attempt's complete.json while written)."""
    ckpt = Checkpointer(tmp_path, solo())
    ckpt.save({"step": 1}, {"a": 1}, {"b": 1})
    again = ckpt.dir / "step000000002"
    again.mkdir()
    (again / ".rank0.pt.tmp4242").write_bytes(b"half a checkpoint")
    (again / "stale.bin").write_bytes(b"an earlier attempt's")
    ckpt.save({"step": 2}, {"a": 2}, {"b": 2})
    assert sorted(p.name for p in again.iterdir()) == ["complete.json", "rank0.pt", "rank0.pt.sha256", "shared.pt",
                                                       "shared.pt.sha256"]
    assert ckpt.load() == ({"step": 2}, {"a": 2}, [{"b": 2}])


def test_a_sharded_run_resumes_on_another_world_size_from_rank_0s_file(tmp_path):
    """load_sharded reshards the model and optimizer; each worker's own file (RNG streams, ledger) is rank 0's,
    as on DDP (before: refused, "each worker's own state ... cannot be redistributed"). A pipeline that cuts
    its data per worker still refuses, with its own reason."""
    def write(folder):
        (folder / "dcp").mkdir()
        (folder / "dcp" / ".metadata").write_bytes(b"DCP's")
        return [folder / "dcp" / ".metadata"]

    for rank in range(4):
        Checkpointer(tmp_path, solo(rank, 4)).save({"step": 1}, {}, {"ledger": rank}, write if rank == 0 else None)
    with pytest.raises(ValueError) as refused:
        Checkpointer(tmp_path, solo(0, 2)).load()
    assert str(refused.value) == (
        f"the checkpoint in {tmp_path / 'ckpt'} was written by 4 workers and this run has 2: this loop cuts its data "
        "stream per worker (it records no micro-batches of its steps), so no other number of workers continues it. Resume "
        "with 4 workers, or use a new run directory (trainer.resume=never starts over)")
    for rank in range(2):
        assert Checkpointer(tmp_path, solo(rank, 2)).load(why_fixed=None) == ({"step": 1}, {}, [{"ledger": 0}])


def test_a_failed_write_removes_its_temporary_file(tmp_path):
    def full_disk(f):
        f.write(b"x" * 1000)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError, match="No space left on device"):
        atomic_write_bytes(tmp_path / "rank0.pt", full_disk)

    class Unpicklable:
        def __reduce__(self):
            raise TypeError("cannot pickle this")

    with pytest.raises(TypeError, match="cannot pickle this"):
        atomic_torch_save({"x": torch.zeros(100), "y": Unpicklable()}, tmp_path / "shared.pt")
    assert list(tmp_path.iterdir()) == []  # neither the files nor their temporary siblings


# ------------------------------------------------------------------------------------- a full disk


def _fill(disk: Path, leave: int) -> None:
    """A file that leaves ``leave`` bytes free on ``disk``."""
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    with open(disk / "filler", "ab") as f:
        f.write(bytes(max(0, free - leave)))


def _full_disk_worker(rank, world, cfg, disk):
    """A 2-worker FSDP BERT run on the small disk: 2 steps; then, the disk filled, 2 more, whose first save
    fails; the launcher's check of the rerun; the rerun once the disk has room."""
    from bert.train import train

    from harness.checkpoint import prepare_run

    run_dir, out = cfg["run_dir"], {}
    train({**cfg, "steps": 2}, run_dir)
    if rank == 0:
        _fill(Path(disk), leave=400_000)  # less than a checkpoint
    harness.distributed.barrier()
    try:
        train(cfg, run_dir)
    except harness.distributed.WILL_RECUR as e:  # not restarted: a restart would find the disk full
        out["error"] = f"{type(e).__name__}: {e}"
    harness.distributed.barrier()
    out["folders"] = sorted(p.name for p in (Path(run_dir) / "ckpt").iterdir())
    if rank == 0:
        try:
            prepare_run(cfg, run_dir)
        except ValueError as e:
            out["refused"] = str(e)
        (Path(disk) / "filler").unlink()
    harness.distributed.barrier()
    out["resumed_from"] = train(cfg, run_dir)["resumed_from"]
    return out


def _full_disk_main(cfg_file: str, disk: str) -> None:
    """In a mount namespace whose ``disk`` is a small tmpfs (see the test): a checkpoint's ``.pt`` on the full
    disk in this process, then :func:`_full_disk_worker` on 2 workers; what they found, as JSON on stdout."""
    from harness.checkpoint import check_writable

    disk, out = Path(disk), {}
    ckpt = Checkpointer(disk / "ddp", solo())
    _fill(disk, leave=100_000)
    try:
        ckpt.save({"step": 1}, {}, {"x": torch.zeros(100_000)})  # 400 kB
    except harness.distributed.WILL_RECUR as e:
        out["ddp_error"] = f"{type(e).__name__}: {e}"
    out["ddp_files"] = sorted(str(p.relative_to(disk)) for p in disk.rglob("*"))
    _fill(disk, leave=0)
    try:
        check_writable(disk / "full" / "ckpt", keep=3)
    except ValueError as e:
        out["full_refused"] = str(e)
    (disk / "filler").unlink()
    cfg = json.loads(Path(cfg_file).read_text())
    out["sharded"] = distributed.run(_full_disk_worker, 2, cfg, str(disk))
    print(json.dumps(out))


def _can_mount_tmpfs() -> bool:
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                           "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True, check=False)
    return done.returncode == 0


def _dcp_short_write(folder):
    """What a rank learns when another rank's ``torch.save`` streams a tensor onto a full disk: its short-write
    error ("unexpected pos 704 vs 598"), pickled to this rank without the ENOSPC behind it, unless the writer
    raised that."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with disk_with_room(4096):
            dcp.save({"x": torch.zeros(100_000)}, storage_writer=_dcp_writer(str(folder / "dcp")), no_dist=True)
    except CheckpointException as err:
        raise as_the_other_ranks_learn_it(err) from None


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process: DCP's single writer
def test_a_full_disk_behind_torchs_short_write_in_a_sharded_save_is_a_full_disk(tmp_path):
    ckpt = Checkpointer(tmp_path / "run", solo())
    with pytest.raises(harness.distributed.WILL_RECUR) as raised:
        ckpt.save({"step": 3}, {}, {}, write=_dcp_short_write)
    assert str(raised.value) == (f"no space left on the disk of the checkpoint {tmp_path / 'run/ckpt/step000000003'} "
                                 "(writing dcp): free space there (an older checkpoint folder can go), or lower "
                                 "trainer.checkpoint.keep (now 2): a save needs room for one more checkpoint beside "
                                 "those kept")
    assert not (tmp_path / "run/ckpt/step000000003").exists()

    def other_error(folder):  # a short write of another cause stays the error it is
        raise RuntimeError("unexpected pos 704 vs 598")
    with pytest.raises(RuntimeError, match="unexpected pos"):
        ckpt.save({"step": 4}, {}, {}, write=other_error)


@pytest.mark.multiprocess  # starts workers
def test_a_full_disk_ends_the_save_in_one_line_leaves_no_partial_checkpoint_and_is_refused_before_the_rerun(
        tiny_data, tmp_path):  # noqa: F811 (the imported fixture)
    """On a real full disk: an 8 MB tmpfs in a mount namespace of the test's own (gone with it). Before: the
    sharded save left its partial .distcp files, the rerun's check wrote an empty file (which fits) and died at
    start-up on an ENOSPC naming no path; a .pt's save ended on torch's 'unexpected pos 704 vs 598'."""
    from tests.test_bert_pretrain import ROWS, tiny_cfg

    if not shutil.which("unshare") or not _can_mount_tmpfs():
        pytest.skip("no user and mount namespaces here (unshare --user --mount) for a small tmpfs")
    disk = tmp_path / "disk"
    disk.mkdir()
    run_dir = disk / "run"
    cfg = tiny_cfg(tiny_data, run_dir, *ROWS["lamb"], "trainer.parallelism=fsdp", "steps=4", "log_every=1",
                   "trainer.checkpoint.every=1", "trainer.checkpoint.keep=4")
    (tmp_path / "cfg.json").write_text(json.dumps({**cfg, "run_dir": str(run_dir)}))
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                           'mount -t tmpfs -o size=8m tmpfs "$2" && exec "$0" -c "import sys, tests.test_faults as t; '
                           't._full_disk_main(*sys.argv[1:])" "$1" "$2"', sys.executable, str(tmp_path / "cfg.json"),
                           str(disk)], cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                          timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    room = ("free space there (an older checkpoint folder can go), or lower trainer.checkpoint.keep (now {}): a save "
            "needs room for one more checkpoint beside those kept")
    # a .pt: the file's own error, naming the checkpoint and the fix; no partial file, nor folder, stays
    assert out["ddp_error"] == ("DiskFull: no space left on the disk of the checkpoint "
                                f"{disk / 'ddp/ckpt/step000000001'} (writing rank0.pt): {room.format(2)}")
    assert out["ddp_files"] == ["ddp", "ddp/ckpt", "filler"]
    # the check before the workers writes and syncs a block: an empty file would fit
    assert out["full_refused"] == f"checkpoint directory {disk / 'full/ckpt'} has no space left on its disk: " \
                                  f"{room.format(3)}"
    for rank in out["sharded"]:
        # DCP's save on both ranks, in one line; the partial folder of step 3 is gone
        assert rank["error"] == ("DiskFull: no space left on the disk of the checkpoint "
                                 f"{run_dir / 'ckpt' / 'step000000003'} (writing dcp): {room.format(4)}")
        assert rank["folders"] == ["latest.json", "step000000001", "step000000002"]
        assert rank["resumed_from"] == [2]  # once room was made: from step 2
    refused = out["sharded"][0]["refused"]
    assert refused.startswith(f"checkpoint directory {run_dir / 'ckpt'} has 0.4 MB free on its disk and a checkpoint "
                              "of this run takes 1.1 MB (step000000002): "), refused
    assert refused.endswith(room.format(4))


# ---------------------------------------------------------------------------------- metrics.jsonl


def _history(path, epochs, torn: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"epoch": e, "step": 10 * e, "test_top1": 50.0 + e}) + "\n"
                            for e in epochs) + torn)


def test_a_torn_last_metrics_line_is_dropped_with_a_notice_naming_the_file(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    _history(path, (1, 2, 3), torn='{"epoch": 4, "step": 40, "te')  # a full disk during the append
    log = RunLogger(tmp_path, {"name": "t"}, solo(), progress=False, resume_epoch=3)
    assert capsys.readouterr().out == (f"dropping the torn last line of {path} (line 4, 28 characters that are not "
                                       "JSON: an interrupted write)\n")
    assert [h["epoch"] for h in log.history()] == [1, 2, 3] and path.read_text().endswith("}\n")
    # the tables read finished runs the same way, their notice in the tables' log
    _history(path, (1, 2), torn='{"epo')
    (tmp_path / "metrics.json").write_text(json.dumps({"final_test_top1": 52.0, "epochs": 2}))
    messages = []
    assert [h["epoch"] for h in load_runs(tmp_path, log=messages.append)[0]["history"]] == [1, 2]
    assert messages == [f"dropping the torn last line of {path} (line 3, 5 characters that are not JSON: an "
                        "interrupted write)"]


def test_a_damaged_metrics_line_before_the_last_is_refused_naming_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _history(path, (1,), torn='{"epo\n' + json.dumps({"epoch": 2}) + "\n")
    with pytest.raises(ValueError, match=rf"^{path} line 2 is not JSON \(.*\): repair or delete that line$"):
        RunLogger(tmp_path, {"name": "t"}, solo(), progress=False, resume_epoch=2)


def test_truncating_the_metrics_on_resume_is_atomic(tmp_path, monkeypatch):
    log = RunLogger(tmp_path, {"name": "t"}, solo(), progress=False)
    path = tmp_path / "metrics.jsonl"
    _history(path, (1, 2, 3))
    before = path.read_text()

    def full_disk(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left on device"):
        log._truncate_metrics(1)
    # the old lines stand, whole, and no temporary file is left beside them
    assert path.read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == [
        "config.yaml", "meta.json", "metrics.jsonl"]
    monkeypatch.undo()
    log._truncate_metrics(1)
    assert [h["epoch"] for h in log.history()] == [1]


# ------------------------------------------------------------------------------- through a pipeline


@pytest.mark.multiprocess  # reruns a pipeline with its workers
def test_a_rerun_comes_through_a_damaged_checkpoint_and_a_torn_metrics_line(tmp_path):
    """``python -m cifar10.train``: the newest checkpoint's byte flipped and a torn metrics line appended; the
    rerun (one epoch longer, so that it resumes) drops the line, resumes from the older checkpoint, finishes."""
    from cifar10.data import write_digits
    from tests.test_cifar10 import TINY, cli

    data = write_digits(tmp_path / "cifar-10-batches-py", 64, 16)
    run = tmp_path / "run"
    common = [*[a for a in TINY if not a.startswith("trainer.nproc")], "trainer.nproc_per_node=1",
              "experiment=cifar10/lamb", f"data.dir={data}", f"hydra.run.dir={run}"]
    first = cli([*common, "epochs=2"])
    assert first.returncode == 0, first.stderr[-3000:]
    older, newest = sorted((run / "ckpt").glob("step*"))  # epochs 1 and 2
    newest = newest / "rank0.pt"
    flip_byte(newest, at=0.6)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"epoch": 3, "st')
    again = cli([*common, "epochs=3"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"dropping the torn last line of {run / 'metrics.jsonl'} (line 3, " in again.stdout
    assert f"checkpoint file {newest} is unreadable (ValueError: its sha256 " in again.stdout
    assert f"resuming from the previous checkpoint, {older.name}" in again.stdout
    assert f"resumed from {run}/ckpt at epoch 1" in again.stdout
    assert [h["epoch"] for h in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]


# -------------------------------------------------------------------------- resuming with other settings


def _settings(**optimizer):
    return run_settings({"name": "r", "seed": 0, "epochs": 2, "data": {"dir": "/d", "micro_batch": 16},
                         "optimizer": {"name": "slamb", "lr": 0.01, "compress_ratio": 0.1, "betas": [0.9, 0.999],
                                       **optimizer},
                         "trainer": {"nproc_per_node": 2, "progress": False, "checkpoint": {"every": 1}}})


def test_resuming_with_other_settings_is_refused_naming_each_one(tmp_path):
    saved = _settings()
    assert "epochs" not in saved and "data.dir" not in saved and "trainer.nproc_per_node" not in saved
    assert saved["optimizer.betas"] == [0.9, 0.999]  # as JSON holds it: a list compares equal after the round trip
    Checkpointer(tmp_path, solo(), settings=saved).save({"step": 1}, {}, {})
    assert Checkpointer(tmp_path, solo(), settings=_settings()).load()[0] == {"step": 1}
    with pytest.raises(ValueError, match=r"^the run in .*ckpt was trained with optimizer.compress_ratio=0.1, "
                                         r"optimizer.lr=0.01 and this run has optimizer.compress_ratio=0.05, "
                                         r"optimizer.lr=0.05: .* Set optimizer.compress_ratio, optimizer.lr back "
                                         r"to resume, or start this run over with trainer.resume=never"):
        Checkpointer(tmp_path, solo(), settings=_settings(lr=0.05, compress_ratio=0.05)).load()
    with pytest.raises(ValueError, match=r"with optimizer.sync_interval unset and this run has "
                                         r"optimizer.sync_interval=10"):
        Checkpointer(tmp_path, solo(), settings=_settings(sync_interval=10)).load()


@pytest.mark.multiprocess  # runs the pipeline's command line and its workers
def test_a_changed_learning_rate_is_refused_before_any_worker_and_a_longer_run_resumes(tmp_path):
    from cifar10.data import write_digits
    from tests.test_cifar10 import TINY, cli

    data = write_digits(tmp_path / "cifar-10-batches-py", 64, 16)
    run = tmp_path / "run"
    common = [*[a for a in TINY if not a.startswith("trainer.nproc")], "trainer.nproc_per_node=1",
              "experiment=cifar10/lamb", "optimizer.lr=0.01", f"data.dir={data}", f"hydra.run.dir={run}"]
    first = cli([*common, "epochs=1"])
    assert first.returncode == 0, first.stderr[-3000:]
    changed = cli([*common, "epochs=2", "optimizer.lr=0.05"])
    assert changed.returncode == 2 and changed.stderr.count("\n") == 1, changed.stderr[-3000:]
    assert changed.stderr.startswith(f"error: the run in {run / 'ckpt'} was trained with optimizer.lr=0.01 and this "
                                     "run has optimizer.lr=0.05: "), changed.stderr
    assert yaml.safe_load((run / "config.yaml").read_text())["optimizer"]["lr"] == 0.01  # still says what ran
    longer = cli([*common, "epochs=2"])  # only the length changed: resumes
    assert longer.returncode == 0 and f"resumed from {run}/ckpt at epoch 1" in longer.stdout, longer.stderr[-3000:]


@pytest.mark.parametrize("name", ["slamb", "lamb", "dgc", "onebit_lamb", "jointspar", "diloco", "powersgd"])
def test_a_process_group_that_is_not_one_is_refused_by_the_constructor(name):
    # before: slamb.SLAMB(params, process_group="gloo") was built, and failed at its first step's collective
    with pytest.raises(ValueError, match=r"^invalid process_group='gloo': must be a torch.distributed process group "
                                         r"\(dist.new_group\(ranks\)\) or None for the default group"):
        slamb.create_optimizer(name, torch.nn.Linear(4, 4), process_group="gloo")


# ------------------------------------------------------------------------------------- skipped steps


@pytest.mark.parametrize("name", ["lamb", "slamb", "jointspar"])
def test_a_step_the_optimizer_drops_on_nan_gradients_is_counted_and_resumed(name):
    """optimizer.nonfinite=skip: before, skipped_steps counted the loss scale's skips only (0 here, in fp32)."""
    from harness.amp import MixedPrecision

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = slamb.create_optimizer(name, model, nonfinite="skip")
    amp = MixedPrecision("fp32", CPU, optimizer=opt)
    moved = []
    for step in range(3):
        opt.begin_step()
        opt.zero_grad()
        model(torch.ones(2, 4)).square().sum().backward()
        if step == 1:  # JointSpar: on a parameter of this round's layers
            next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
        before = [p.detach().clone() for p in model.parameters()]
        amp.step(opt, model.parameters())
        moved.append(not all(map(torch.equal, before, model.parameters())))
    assert moved == [True, False, True] and amp.skipped_steps == 1
    resumed = MixedPrecision("fp32", CPU)
    resumed.load_state_dict(amp.state_dict())
    assert resumed.skipped_steps == 1


# ---------------------------------------------------------------------------------------- smaller


def test_a_truncated_hdf5_shard_names_the_file_and_is_not_restarted(tmp_path):
    """A damaged input, a ValueError (before: an OSError, which elastic restarted), found before any worker
    starts (check_shards) where its header is cut."""
    import h5py
    import numpy as np

    from bert.data import check_shards, load_shard, shard_length

    path = tmp_path / "part_training_0.hdf5"
    with h5py.File(path, "w") as f:
        for name in ("input_ids", "input_mask", "segment_ids"):
            f[name] = np.ones((64, 16), np.int32)
        for name in ("masked_lm_positions", "masked_lm_ids"):
            f[name] = np.ones((64, 3), np.int32)
        f["next_sentence_labels"] = np.zeros(64, np.int32)
    assert shard_length(path) == 64
    path.write_bytes(path.read_bytes()[:3000])  # a copy cut short
    for read in (lambda: shard_length(path), lambda: load_shard(path, 16), lambda: check_shards([path], 16, 100)):
        with pytest.raises(harness.distributed.WILL_RECUR, match=rf"^cannot read the pre-training shard {path} \(.*\): "
                                                                 r"the file is truncated or damaged; prepare it again"):
            read()


def test_the_lock_records_its_holders_start_and_waits_for_an_empty_lock_to_be_written(tmp_path, capsys):
    lock = RunLock(tmp_path)
    with lock:
        record = json.loads((tmp_path / "run.lock").read_text())
    assert record["host"] == socket.gethostname() and record["pid"] == os.getpid() and record["since"]
    assert record["started"] == process_start(os.getpid()) is not None
    # a pid whose process started at another time is another process: the holder (pid reused) is gone, which
    # the line says so (before: "process <pid> is gone", of a pid that runs)
    (tmp_path / "run.lock").write_text(json.dumps({**record, "started": "1"}))
    with RunLock(tmp_path):
        assert capsys.readouterr().out == (
            f"removing the stale lock {tmp_path / 'run.lock'} (process {os.getpid()} that wrote it is gone: pid "
            f"{os.getpid()} now names another process, started later)\n")
    # an empty lock file: its holder is between creating and writing it; once written, it is refused
    (tmp_path / "run.lock").write_text("")
    writer = threading.Timer(0.5, lambda: (tmp_path / "run.lock").write_text(json.dumps(record)))
    writer.start()
    with pytest.raises(RuntimeError, match=rf"is being written by process {os.getpid()}"):
        RunLock(tmp_path).acquire()
    writer.join()
    # one that stays empty past the grace is a holder's that died before writing it
    (tmp_path / "run.lock").write_text("")
    old = time.time() - RunLock.EMPTY_GRACE_S - 1
    os.utime(tmp_path / "run.lock", (old, old))
    with RunLock(tmp_path):
        assert "(empty for over 10 s: its holder died before writing it)" in capsys.readouterr().out
    assert not (tmp_path / "run.lock").exists()


def test_a_lock_is_stale_only_once_neither_its_launcher_nor_a_worker_it_records_lives(tmp_path, capsys, monkeypatch):
    """Before: the lock named the launcher only, and a rerun took it the moment the launcher was gone, beside its
    workers, which still wrote checkpoints there (a rerun resumed at step 23 while they wrote steps 24-26)."""
    with RunLock(tmp_path) as lock:  # a worker enlists in its launcher's lock, and in no other job's
        enlist(tmp_path, this_process())
        assert read(lock.path)[1] == [{"pid": os.getpid(), "started": process_start(os.getpid())}]
        other = {**this_process(), "pid": os.getppid(), "started": process_start(os.getppid())}
        with pytest.raises(RunLocked, match=rf"^run directory {tmp_path} is no longer held by process "
                                            rf"{os.getppid()}, which started this worker: the worker ends without "
                                            "writing there$"):
            enlist(tmp_path, other)
    launcher, worker = subprocess.Popen(["sleep", "60"]), subprocess.Popen(["sleep", "60"])
    try:
        lines = [{"host": socket.gethostname(), "pid": launcher.pid, "started": process_start(launcher.pid),
                  "since": "then"}, {"pid": worker.pid, "started": process_start(worker.pid)}]
        (tmp_path / "run.lock").write_text("".join(json.dumps(line) + "\n" for line in lines))
        launcher.kill()
        launcher.wait()
        monkeypatch.setattr(RunLock, "WORKERS_GRACE_S", 0.5)  # the wait for workers that end with their launcher
        with pytest.raises(RunLocked) as refused:
            RunLock(tmp_path).acquire()
        assert str(refused.value) == (
            f"run directory {tmp_path} is being written by the workers of process {launcher.pid} (since then), which "
            f"is gone: 1 of them still run (pids {worker.pid}); end them (kill {worker.pid}) or use another run "
            "directory")
    finally:
        worker.kill()
        worker.wait()
    with RunLock(tmp_path):
        assert capsys.readouterr().out == (f"removing the stale lock {tmp_path / 'run.lock'} (process {launcher.pid} "
                                           "is gone)\n")


def _descendants(pid: int) -> list[int]:
    """The processes ``pid`` started, and those they started, ..."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:  # ended meanwhile
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        started = children.get(todo.pop(), [])
        found += started
        todo += started
    return found


def kill_the_launcher(module: str, args: list[str], run_dir: Path, step: int) -> tuple[float, float]:
    """``python -m module args`` whose rank 0 hangs before ``step`` (as a worker that trains on, printing nothing,
    would be there): SIGKILL its launcher then, and return the seconds until its workers have ended, and every
    process it started (their fork server and resource tracker too); the test fails where one outlives 20 s."""
    from tests.test_cifar10 import ROOT, env

    launcher = subprocess.Popen([sys.executable, "-m", module, *args, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                                env=env(**{harness.distributed.FAULT_ENV: str(step),
                                           harness.distributed.FAULT_KIND_ENV: "hang"}),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    started = []
    try:
        said = []
        while not said or "hangs before step" not in said[-1]:
            said.append(launcher.stdout.readline())
            assert said[-1] or launcher.poll() is None, "".join(said)[-3000:]
        started = _descendants(launcher.pid)
        workers = [w["pid"] for w in read(run_dir / "run.lock")[1]]  # they enlisted in its lock
        assert len(workers) >= 2 and set(workers) <= set(started)
        launcher.kill()
        tic, ended = time.monotonic(), {}
        while len(ended) < len(started) and time.monotonic() < tic + 20:
            ended.update({p: time.monotonic() - tic for p in started if p not in ended and gone({"pid": p})})
            time.sleep(0.05)
        assert len(ended) == len(started), f"{set(started) - set(ended)} outlived their launcher by 20 s"
        return max(ended[w] for w in workers), max(ended.values())
    finally:
        launcher.kill()
        launcher.communicate()
        for pid in started:  # what outlived the test's bound
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)


@pytest.mark.multiprocess  # runs the pipeline's command line and its workers
@pytest.mark.parametrize("parallelism", ["ddp", "hsdp"])
def test_a_killed_launcher_takes_its_workers_with_it_and_a_rerun_resumes_exactly(
        tmp_path, tiny_data, parallelism):  # noqa: F811 (the imported fixture)
    """Before: the workers of a launcher killed with SIGKILL trained on until they next printed (BERT HSDP: from
    step 8 to 59, 35 s), and a rerun took the lock at once and resumed beside them. Now they end with it, the rerun
    takes over the lock once they are gone and ends where the uninterrupted run ends. DDP: CIFAR-10 on 2 workers,
    the launcher killed in epoch 2 of 3; HSDP: BERT on 2 x 2 workers, killed at step 3 of 4 (one line, at the end)."""
    from tests.test_cifar10 import ROOT, TINY, assert_same_run, env, history

    if parallelism == "ddp":
        from cifar10.data import write_digits

        data = write_digits(tmp_path / "cifar-10-batches-py", 64, 16)  # 2 steps an epoch
        module, args, at = "cifar10.train", [*TINY, "experiment=cifar10/lamb", "epochs=3", f"data.dir={data}"], 5
    else:
        module, at = "bert.train", 3
        args = ["experiment=bert/phase1_lamb", "optimizer.lr=0.02", "model=bert_tiny",
                f"model.vocab_size={tiny_data['vocab_size']}", f"data.dir={tiny_data[32]}", "data.seq_len=32",
                f"validation.dir={tiny_data[32]}", "data.global_batch=16", "data.micro_batch=4", "steps=4",
                "log_every=4", "trainer.checkpoint.every=2", "schedule.warmup_steps=1", "schedule.power=0.0",
                "trainer.progress=false", "trainer.threads_per_worker=1", "trainer.device=cpu",
                "trainer.precision=fp32", "trainer.nproc_per_node=4", "trainer.parallelism=hsdp",
                "trainer.shard_size=2"]
    run, plain = tmp_path / "run", tmp_path / "plain"
    # the uninterrupted run beside the killed one
    uninterrupted = subprocess.Popen([sys.executable, "-m", module, *args, f"hydra.run.dir={plain}"], cwd=ROOT,
                                     env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    workers, everything = kill_the_launcher(module, args, run, at)
    print(f"the workers ended {workers:.2f} s after their launcher was killed, all it started {everything:.2f} s")
    assert workers < 10
    launcher = read(run / "run.lock")[0]["pid"]
    rerun = subprocess.run([sys.executable, "-m", module, *args, f"hydra.run.dir={run}"], cwd=ROOT, env=env(),
                           capture_output=True, text=True, timeout=600, check=False)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"removing the stale lock {run / 'run.lock'} (process {launcher} is gone)" in rerun.stdout
    assert uninterrupted.wait(timeout=600) == 0, uninterrupted.stderr.read()[-3000:]
    uninterrupted.stderr.close()
    summary, whole = (json.loads((d / "metrics.json").read_text()) for d in (run, plain))
    if parallelism == "ddp":
        assert summary["resumed_from"] == [2]
        assert_same_run(history(run), history(plain))
    else:
        assert summary["resumed_from"] == [2]
        assert summary["final_val_mlm_loss"] == pytest.approx(whole["final_val_mlm_loss"], rel=1e-6)
        assert summary["final_val_mlm_acc"] == whole["final_val_mlm_acc"]
        assert summary["bytes_total"] == whole["bytes_total"]
    assert not list(run.glob("error.rank*.txt"))


@pytest.mark.multiprocess  # runs the pipeline's command line
def test_a_second_writer_is_refused_in_one_line_and_writes_nothing_into_the_run_directory(tmp_path):
    """Before: Hydra had written its .hydra/ files (the first run's overrides.yaml rewritten) and its log there,
    and the refusal was a 14-line traceback with exit status 1."""
    from tests.test_cifar10 import TINY, cli

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("- epochs=1\n")  # the first run's, as Hydra wrote it
    with RunLock(run):  # the first run, writing
        before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
        done = cli([*TINY, "experiment=cifar10/lamb", "epochs=2", f"data.dir={tmp_path}", f"hydra.run.dir={run}"])
        assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
        since = json.loads((run / "run.lock").read_text())["since"]
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr == (f"error: run directory {run} is being written by process {os.getpid()} on "
                           f"{socket.gethostname()} (since {since}): wait for it to finish or use another run "
                           f"directory; if that process is gone, delete {run / 'run.lock'}\n")


def _world_and_timeout(cfg, run_dir):
    import torch.distributed as dist

    env = harness.init_distributed("cpu", 1, cfg["timeout_s"])
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    return env.world_size, backend.options._timeout.total_seconds()


@pytest.mark.multiprocess  # starts workers
def test_a_launch_takes_the_configured_timeout_and_leaves_no_launcher_folder_behind(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    code = ("from harness.distributed import launch; print(launch('tests.test_faults:_world_and_timeout', "
            f"{{'timeout_s': 77}}, {str(tmp_path)!r}, nproc_per_node=2))")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=300, check=False, env={**os.environ, "TMPDIR": str(tmp)})
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "(2, 77.0)", done.stderr[-3000:]
    assert list(tmp.glob("torchelastic_*")) == []  # the launcher's folder went with the launch


def _count_the_start_and_fail(cfg, run_dir):
    start = os.environ['TORCHELASTIC_RESTART_COUNT']
    with open(Path(run_dir) / f"starts.rank{os.environ['RANK']}", "a") as f:
        f.write(f"{start}\n")
    # the first rank to fail tears the group down: under load the other rank may not have recorded its start yet,
    # so each rank fails only once every rank's start of this round is on disk (what the tests assert)
    deadline = time.monotonic() + 120
    while sum(p.read_text().split().count(start) for p in Path(run_dir).glob("starts.rank*")) < int(
            os.environ["WORLD_SIZE"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    raise {"missing": FileNotFoundError, "setting": ValueError, "fault": RuntimeError}[cfg["error"]](
        f"{cfg['error']} on this rank\nsecond line")


def _starts(run_dir: Path) -> list[str]:
    return sorted(line for p in run_dir.glob("starts.rank*") for line in p.read_text().split())


@pytest.mark.multiprocess  # starts workers
@pytest.mark.parametrize("error", ["missing", "setting"])
def test_an_error_that_would_recur_is_not_restarted_and_ends_in_one_line(tmp_path, error):
    # before: the launcher started both workers 3 times over (2 restarts) and ended on elastic's ChildFailedError
    with pytest.raises(harness.distributed.WorkerError) as raised:
        harness.launch("tests.test_faults:_count_the_start_and_fail", {"error": error}, str(tmp_path),
                       nproc_per_node=2, max_restarts=2)
    assert _starts(tmp_path) == ["0", "0"]  # each worker started once
    assert raised.value.status == harness.distributed.WILL_RECUR_EXIT
    name = {"missing": "FileNotFoundError", "setting": "ValueError"}[error]
    # the first rank to fail names it; the launcher stops the other
    assert str(raised.value) in [f"error: {name} on rank {r}: {error} on this rank second line (not restarted: a "
                                 "restart from the last checkpoint would fail the same way; its traceback: "
                                 f"{tmp_path / f'error.rank{r}.txt'})" for r in (0, 1)]
    rank = str(raised.value).split(" on rank ")[1][0]
    assert "in _count_the_start_and_fail" in (tmp_path / f"error.rank{rank}.txt").read_text()


@pytest.mark.multiprocess  # starts workers
def test_a_fault_that_may_pass_is_still_restarted_and_ends_in_one_line(tmp_path):
    # before: elastic's ChildFailedError, its log of each worker's traceback at every attempt (90 lines)
    with pytest.raises(harness.distributed.WorkerError) as raised:
        harness.launch("tests.test_faults:_count_the_start_and_fail", {"error": "fault"}, str(tmp_path),
                       nproc_per_node=2, max_restarts=1)
    assert _starts(tmp_path) == ["0", "0", "1", "1"]
    assert raised.value.status == 1 and str(raised.value) in [
        f"error: RuntimeError on rank {r}: fault on this rank second line (its traceback: "
        f"{tmp_path / f'error.rank{r}.txt'})" for r in (0, 1)]


@pytest.mark.multiprocess  # runs the pipeline's command line and its workers
def test_a_killed_worker_ends_the_command_in_one_line(tmp_path):
    """Before: elastic's report of the failure and Hydra's traceback, 40 lines and more."""
    from cifar10.data import write_digits
    from tests.test_cifar10 import TINY, cli

    data = write_digits(tmp_path / "cifar-10-batches-py", 64, 16)
    done = cli([*TINY, "experiment=cifar10/lamb", "epochs=1", f"data.dir={data}", f"hydra.run.dir={tmp_path / 'run'}"],
               extra_env={harness.distributed.FAULT_ENV: "2"})
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr == ("error: the worker of rank 0 ended on exit status 17, without an error of its own "
                           "(killed, or out of memory: see the system's log)\n")
