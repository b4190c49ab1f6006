"""Offline BERT pre-training in minutes on a CPU, on text every machine has: Python's own docstrings.

    python -m bert.demo                                   # 2 workers, SLAMB, 300 steps
    python -m bert.demo --optimizer lamb --steps 100 --out runs/bert_demo_lamb

It writes the docstrings of the standard library as a corpus (a sentence per
line, a blank line between documents), trains a WordPiece vocabulary on it,
prepares seq-128 shards with ``bert.prepare_data`` and pre-trains the tiny
BERT of ``configs/model/bert_tiny.yaml`` through the real pipeline
(``bert.train``, gradient accumulation, the optimizer's communication). The
model lands in ``OUT/run/model`` (Hugging Face format with its vocab.txt),
ready for ``squad_finetune``.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import re
from pathlib import Path

from .prepare_data import Settings, default_max_predictions, prepare
from .vocab import train_vocab

MODULES = ("argparse", "ast", "asyncio", "base64", "bisect", "calendar", "collections", "configparser", "contextlib",
           "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum", "fractions", "ftplib",
           "functools", "gettext", "gzip", "heapq", "hmac", "http.client", "imaplib", "inspect", "ipaddress",
           "itertools", "json", "logging", "mailbox", "multiprocessing.pool", "numbers", "operator", "optparse",
           "os", "pathlib", "pickle", "pprint", "queue", "random", "re", "sched", "shlex", "shutil", "smtplib",
           "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap",
           "threading", "tkinter", "turtle", "typing", "unittest.case", "urllib.parse", "urllib.request", "uuid",
           "wave", "xml.dom.minidom", "zipfile")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(`'\"])")


def docstrings() -> list[str]:
    """The docstrings of the modules above and of their public classes, functions and methods."""
    out = []
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # e.g. tkinter on a minimal Python
            continue
        objs = [module] + [v for k, v in vars(module).items() if not k.startswith("_")
                           and (inspect.isclass(v) or inspect.isfunction(v))]
        objs += [m for c in objs if inspect.isclass(c) for k, m in vars(c).items()
                 if not k.startswith("_") and inspect.isfunction(m)]
        out += [d for d in (inspect.getdoc(o) for o in objs) if d and len(d) > 80]
    return list(dict.fromkeys(out))


def write_corpus(out_dir: Path, shards: int = 4) -> list[Path]:
    """Docstrings as documents (one sentence per line), dealt round-robin into ``shards`` files."""
    docs = []
    for doc in docstrings():
        text = " ".join(doc.split())
        sentences = [s for s in SENTENCE_END.split(text) if len(s.split()) >= 3]
        if len(sentences) >= 2:
            docs.append("\n".join(sentences))
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"docstrings{i}.txt" for i in range(shards)]
    for i, path in enumerate(paths):
        path.write_text("\n\n".join(docs[i::shards]) + "\n")
    return paths


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/bert_demo")
    p.add_argument("--optimizer", default="slamb", choices=["lamb", "onebit_lamb", "slamb"])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=4000)
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides of the bert config")
    a = p.parse_args(argv)
    out = Path(a.out).resolve()
    files = write_corpus(out / "text")
    vocab = train_vocab(files, out / "vocab", a.vocab_size)
    seq = 128
    stats = prepare(files, vocab, out / "seq128", Settings(seq, default_max_predictions(seq), dupe_factor=2),
                    workers=a.workers)
    print(f"corpus: {sum(len(f.read_text().split()) for f in files)} words in {len(files)} files; "
          f"{sum(s['examples'] for s in stats)} examples of {seq} tokens", flush=True)

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from harness import check_trainer, launch

    from .train import train

    extra = {"lamb": [], "onebit_lamb": [f"optimizer.freeze_step={max(1, a.steps // 5)}"],
             "slamb": ["optimizer.sync_interval=10", "optimizer.min_compress_numel=2000"]}[a.optimizer]
    overrides = [f"experiment=bert/phase1_{a.optimizer}", "model=bert_tiny",
                 f"model.vocab_size={len(vocab.read_text().splitlines())}", "model.hidden_size=64",
                 "model.intermediate_size=256", f"data.dir={out / 'seq128'}", "data.global_batch=64",
                 "data.micro_batch=16", f"steps={a.steps}", "log_every=25", "schedule.warmup_steps=null",
                 "+schedule.warmup_fraction=0.1", "optimizer.lr=0.01", "trainer.precision=fp32",
                 f"trainer.nproc_per_node={a.workers}", "trainer.progress=false", "trainer.resume=never",
                 f"trainer.checkpoint.every={a.steps}", "paper=null", f"name=bert_demo_{a.optimizer}",
                 *extra, *a.overrides]
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "configs"), version_base="1.3"):
        cfg = OmegaConf.to_container(compose("bert", overrides=overrides), resolve=True)
    check_trainer(cfg["trainer"])
    summary = launch(train, cfg, str(out / "run"), nproc_per_node=a.workers)
    keys = ("final_loss", "final_mlm_acc", "final_nsp_acc", "mean_seqs_per_s", "bytes_total", "params", "model_dir")
    print({k: summary[k] for k in keys}, flush=True)
    return summary


if __name__ == "__main__":
    main()
