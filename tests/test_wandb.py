"""``logger.wandb=true`` end to end, offline: a CIFAR-10 job from the command line, then the same job
extended by one epoch (a resume from its checkpoint), read back from wandb's own run files."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cifar10.data import write_digits
from tests.test_cifar10 import ROOT, TINY, env, history

pytestmark = pytest.mark.multiprocess

wandb_internal_pb2 = pytest.importorskip("wandb.proto.wandb_internal_pb2")

BLOCK, HEADER = 32768, 7  # wandb's run file: a LevelDB log (32 KiB blocks) behind a 7-byte ":W&B" header
FULL, LAST = 1, 4


def read_records(path: Path) -> list:
    """The protobuf records of a ``run-<id>.wandb`` file, decoded with wandb's own message types."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    records, pos, payload = [], HEADER, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a chunk header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            records.append(record)
            payload = b""
    return records


def _items(updates) -> dict:
    return {".".join(u.nested_key) or u.key: json.loads(u.value_json) for u in updates}


def read_run(run_file: Path) -> dict:
    """run id, config, history rows (user keys only) and the final summary of one offline run."""
    records = read_records(run_file)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    config = _items(run.config.update)
    for r in records:
        if r.WhichOneof("record_type") == "config":
            config.update(_items(r.config.update))
    rows = [_items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update(_items(r.summary.update))
    strip = lambda d: {k: v for k, v in d.items() if not k.startswith("_")}  # noqa: E731
    return {"id": run.run_id, "config": strip(config), "history": [strip(row) for row in rows],
            "summary": strip(summary), "finished": any(r.WhichOneof("record_type") == "exit" for r in records)}


def test_offline_wandb_run_logs_config_history_summary_and_resumes_under_the_same_id(tmp_path):
    data_dir = write_digits(tmp_path / "cifar-10-batches-py", 160, 40)
    run_dir = tmp_path / "run"
    common = [*TINY, "trainer.nproc_per_node=1", "logger.wandb=true", "logger.project=slamb-test",
              f"data.dir={data_dir}", f"hydra.run.dir={run_dir}"]
    for epochs in (1, 2):  # the second command resumes from the first one's checkpoint
        done = subprocess.run([sys.executable, "-m", "cifar10.train", *common, f"epochs={epochs}"], cwd=ROOT,
                              env=env(WANDB_DIR=str(tmp_path / "elsewhere")), capture_output=True, text=True,
                              timeout=600, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stdout

    run_id = (run_dir / "wandb_id").read_text()
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and all(f.name == f"run-{run_id}.wandb" for f in files)
    first, second = (read_run(f) for f in files)
    assert first["id"] == second["id"] == run_id and first["finished"] and second["finished"]

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert second["config"] == cfg and cfg["logger"]["wandb"] is True and cfg["epochs"] == 2
    assert first["config"]["epochs"] == 1

    rows = history(run_dir)  # metrics.jsonl: epoch 1 from the first command, epoch 2 from the second
    assert [r["epoch"] for r in rows] == [1, 2]
    assert first["history"] == [rows[0]] and second["history"] == [rows[1]]

    summary = json.loads((run_dir / "metrics.json").read_text())
    assert summary["resumed_from"] == [1] and summary["epochs"] == 2
    for key, value in summary.items():
        assert second["summary"][key] == value, key
