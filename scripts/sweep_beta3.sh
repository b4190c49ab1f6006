#!/usr/bin/env bash
# SLAMB's beta3 in 0.9, 0.99, 0.999 (configs/sweep/beta3.yaml) for any pipeline and SLAMB experiment:
#   PIPELINE=cifar10 EXPERIMENT=cifar10/slamb scripts/sweep_beta3.sh [overrides...]
exec "$(dirname "$0")/sweep.sh" beta3 "$@"
