"""Swin models from timm, built from a model config, never with downloaded weights.

``arch`` names a timm model (``swin_base_patch4_window7_224``: Swin-B, 88M
parameters); every other key of the config except ``name`` is a keyword of
timm's ``SwinTransformer`` (``drop_path_rate``, ``img_size``, ``embed_dim``,
``depths``, ``num_heads``, ``window_size``, ...), so a tiny Swin for tests
is the same code path as Swin-B.
"""
from __future__ import annotations

import timm
import torch

# 2-D tensors that are positions, not weights: no weight decay (Swin's recipe; timm's no_weight_decay*)
NO_DECAY = ("absolute_pos_embed", "relative_position_bias_table")


def build_model(cfg) -> torch.nn.Module:
    cfg = dict(cfg)
    arch = cfg.pop("arch", None)
    cfg.pop("name", None)
    if not isinstance(arch, str) or not arch.startswith("swin") or not timm.is_model(arch):
        raise ValueError(f"invalid model.arch={arch!r}: must name a timm Swin model, e.g. swin_base_patch4_window7_224")
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items()}
    if "depths" in kwargs and "num_heads" in kwargs and len(kwargs["depths"]) != len(kwargs["num_heads"]):
        raise ValueError(f"invalid model.depths={list(kwargs['depths'])} with model.num_heads="
                         f"{list(kwargs['num_heads'])}: one number of heads per stage")
    try:
        return timm.create_model(arch, pretrained=False, **kwargs)
    except (TypeError, IndexError) as e:  # an unknown key, stages that do not match: name the config
        raise ValueError(f"invalid model config for {arch}: {e}") from None


def shard_blocks() -> tuple[type, ...]:
    """The modules sharded as one FSDP2 unit each (``trainer.parallelism=fsdp|hsdp``): the Swin blocks (window
    attention and MLP); the patch embedding, the patch merging layers and the head go with the root."""
    from timm.models.swin_transformer import SwinTransformerBlock

    return (SwinTransformerBlock,)


def image_size(model: torch.nn.Module) -> int:
    """The square input size the model was built for (``model.patch_embed.img_size``)."""
    size = model.patch_embed.img_size
    return int(size[0] if isinstance(size, (tuple, list)) else size)
