"""Every attention test starts from kernel outputs poisoned with NaN: an unwritten element fails the test."""

import pytest


@pytest.fixture(autouse=True)
def _poison_outputs(nan_poisoned):
    """The shared fixture of tests/conftest.py, made automatic here."""


@pytest.fixture
def policy():
    """``policy(**changes)``: launch under the current policy with ``changes`` (fields of
    :class:`llm_speed.core.policy.LaunchPolicy`) for the rest of the test, as ``use_policy`` does for a
    block; plans are keyed on the policy, so none made under another is reused."""
    import contextlib

    from llm_speed.core.policy import use_policy

    with contextlib.ExitStack() as stack:
        yield lambda name=None, **changes: stack.enter_context(use_policy(name, **changes))
