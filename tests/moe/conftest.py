"""Every MoE test starts from kernel outputs poisoned with NaN: an unwritten element fails the test."""

import pytest


@pytest.fixture(autouse=True)
def _poison_outputs(nan_poisoned):
    """The shared fixture of tests/conftest.py, made automatic here."""
