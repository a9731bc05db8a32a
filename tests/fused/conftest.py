"""Every fused-op test starts from kernel outputs poisoned with NaN: an unwritten element fails the test."""

import pytest

from accuracy_rule import nan_poisoned_outputs


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    nan_poisoned_outputs(monkeypatch)
