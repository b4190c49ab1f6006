"""Test tiers (``multiprocess``, ``e2e``, ``netns``, ``gpu``): explicit marks on the tests, checked at
run time against what each test does (:mod:`tests.tiers`).

``make test`` runs every tier; ``make test-quick`` (``-m "not multiprocess and not e2e"``) is the
quick subset for the edit-test loop.
"""
from tests.tiers import pytest_collection_modifyitems, pytest_runtest_call, pytest_runtest_setup

__all__ = ["pytest_collection_modifyitems", "pytest_runtest_call", "pytest_runtest_setup"]
