#!/usr/bin/env bash
# SLAMB's sync interval H in 5, 10, 20, 50 (configs/sweep/sync_interval.yaml); make_tables.py gives its line
# (top-1 and bytes by H, beside LAMB where LAMB runs of the same recipe are found):
#   PIPELINE=cifar10 EXPERIMENT=cifar10/slamb scripts/sweep_sync_interval.sh [overrides...]
exec "$(dirname "$0")/sweep.sh" sync_interval "$@"
