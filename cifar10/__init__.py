"""CIFAR-10 / ResNet-110 reproduction of the SLAMB paper's first table (``python -m cifar10.train``)."""
