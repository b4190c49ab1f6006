"""ResNet for CIFAR (He et al., 2016, section 4.2) with option-A shortcuts.

depth = 6n + 2: a 3x3 stem, three stages of n basic blocks at widths w, 2w,
4w (w = 16) on 32, 16, 8 pixels, global average pooling, a linear classifier.
Option A: when a block halves the resolution and doubles the width, the
shortcut subsamples the input by 2 and zero-pads the new channels, so the
shortcut has no parameters. ResNet-110 (n = 18) has 1.73M parameters,
ResNet-20 0.27M, ResNet-8 0.08M.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.stride = stride
        self.pad = cout - cin

    def shortcut(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride == 1 and self.pad == 0:
            return x
        x = x[:, :, ::self.stride, ::self.stride]
        return F.pad(x, (0, 0, 0, 0, self.pad // 2, self.pad - self.pad // 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNetCifar(nn.Module):
    def __init__(self, depth: int = 110, width: int = 16, num_classes: int = 10):
        super().__init__()
        if not (isinstance(depth, int) and depth >= 8 and (depth - 2) % 6 == 0):
            raise ValueError(f"invalid model.depth={depth!r}: must be 6n+2 with n >= 1 (8, 20, 32, 44, 56, 110)")
        if not (isinstance(width, int) and width >= 1):
            raise ValueError(f"invalid model.width={width!r}: must be a positive integer (16 in the paper)")
        n = (depth - 2) // 6
        self.conv = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        blocks, cin = [], width
        for stage, cout in enumerate((width, 2 * width, 4 * width)):
            for b in range(n):
                blocks.append(BasicBlock(cin, cout, 2 if stage > 0 and b == 0 else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(m.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.bn(self.conv(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build_model(cfg) -> ResNetCifar:
    if cfg["name"] != "resnet_cifar":
        raise ValueError(f"invalid model.name={cfg['name']!r}: the CIFAR-10 pipeline builds 'resnet_cifar'")
    return ResNetCifar(cfg["depth"], cfg["width"], cfg["num_classes"])
