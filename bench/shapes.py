"""Parameter shapes of the paper's models, from the real model definitions built on the meta device
(no memory, no weights)."""
from __future__ import annotations

from pathlib import Path

import torch

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def bert_shapes(size: str = "base", layers: int | None = None) -> list[tuple[int, ...]]:
    """BertForPreTraining (tied decoder) of BERT-Base or -Large, optionally with fewer encoder layers."""
    from transformers import BertConfig, BertForPreTraining

    hidden, depth, heads = {"base": (768, 12, 12), "large": (1024, 24, 16)}[size]
    layers = depth if layers is None else layers
    config = BertConfig(vocab_size=30528, hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, intermediate_size=4 * hidden)
    with torch.device("meta"):
        model = BertForPreTraining(config)
    return [tuple(p.shape) for p in model.parameters()]


def bert_model_config(config: str, **overrides) -> dict:
    """``configs/model/<config>.yaml`` as a dict, with ``overrides`` (another size of the same model)."""
    from omegaconf import OmegaConf

    return {**OmegaConf.to_container(OmegaConf.load(CONFIGS / "model" / f"{config}.yaml"), resolve=True), **overrides}


def bert_named_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of each parameter of the pre-training model of ``cfg`` as ``bert.train`` builds it (the
    tied decoder once, as ``named_parameters`` gives it)."""
    from bert.model import build_model

    with torch.device("meta"):
        model = build_model(cfg)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def bert_config_shapes(name: str) -> list[tuple[int, ...]]:
    """The pre-training model of ``configs/model/<name>.yaml`` (``bert_large``, ``bert_xl``), as
    ``bert.train`` builds it."""
    return [shape for _, shape in bert_named_shapes(bert_model_config(name))]


def resnet110_shapes() -> list[tuple[int, ...]]:
    """CIFAR ResNet-110 (He et al. 2016, option-A shortcuts): 3 stages x 18 basic blocks."""
    shapes = [(16, 3, 3, 3), (16,), (16,)]
    for cin, cout in ((16, 16), (16, 32), (32, 64)):
        for block in range(18):
            first_in = cin if block == 0 else cout
            shapes += [(cout, first_in, 3, 3), (cout,), (cout,), (cout, cout, 3, 3), (cout,), (cout,)]
    return shapes + [(10, 64), (10,)]


MODELS = {"bert_base": lambda: bert_shapes("base"), "bert_large": lambda: bert_shapes("large"),
          "bert_xl": lambda: bert_config_shapes("bert_xl"), "resnet110": resnet110_shapes}
