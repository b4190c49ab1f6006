"""``BertForPreTraining`` from a model config, built locally (never from the hub)."""
from __future__ import annotations

import torch

from harness.settings import check_count

# model config keys that are BertConfig settings (the rest, e.g. ``name``, describe the config itself)
BERT_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
             "max_position_embeddings", "type_vocab_size", "hidden_act", "hidden_dropout_prob",
             "attention_probs_dropout_prob", "layer_norm_eps", "initializer_range")


# the model config's sizes: counts of at least 1
SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
         "max_position_embeddings", "type_vocab_size")


def check_model(cfg) -> None:
    """The model config's shape, without importing transformers (a check before any worker starts)."""
    for key in SIZES:
        if cfg.get(key) is not None:
            check_count(f"model.{key}", cfg[key])
    if cfg["hidden_size"] % cfg["num_attention_heads"]:
        raise ValueError(f"invalid model.num_attention_heads={cfg['num_attention_heads']}: hidden_size="
                         f"{cfg['hidden_size']} is not a multiple of num_attention_heads={cfg['num_attention_heads']}")


def bert_config(cfg):
    from transformers import BertConfig

    check_model(cfg)
    return BertConfig(**{k: cfg[k] for k in BERT_KEYS if k in cfg and cfg[k] is not None})


def build_model(cfg) -> torch.nn.Module:
    """A freshly initialised ``BertForPreTraining`` (MLM + NSP heads, decoder tied to the word embeddings)."""
    from transformers import BertForPreTraining

    return BertForPreTraining(bert_config(cfg))


def shard_blocks() -> tuple[type, ...]:
    """The modules sharded as one FSDP2 unit each (``trainer.parallelism=fsdp|hsdp``): the transformer layers;
    the embeddings, the pooler and the heads (the MLM decoder tied to the word embeddings) go with the root."""
    from transformers.models.bert.modeling_bert import BertLayer

    return (BertLayer,)


def load_pretrained(path, cfg) -> torch.nn.Module:
    """The ``BertForPreTraining`` saved in the local directory ``path``, which must have ``cfg``'s shape."""
    from pathlib import Path

    from transformers import BertForPreTraining

    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"init_from={str(path)!r} holds no saved model (config.json): point it at the "
                                "model/ directory a finished pre-training run writes (e.g. phase 1's run_dir/model)")
    model = BertForPreTraining.from_pretrained(str(path), local_files_only=True)
    want = bert_config(cfg)
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "max_position_embeddings"):
        if getattr(model.config, key) != getattr(want, key):
            raise ValueError(f"the model in {path} has {key}={getattr(model.config, key)}, the config model.{key}="
                             f"{getattr(want, key)}: phase 2 must use phase 1's model config")
    return model


def parameter_count(model: torch.nn.Module) -> int:
    """Distinct parameters (the tied MLM decoder weight counted once)."""
    return sum(p.numel() for p in model.parameters())
