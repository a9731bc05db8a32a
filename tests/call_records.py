"""Record the calls of a module function while a test runs (the tests of the calls already checked use it to
see which calls were checked)."""


def record_calls(monkeypatch, module, name: str) -> list:
    """Patch ``module.name`` to record each call's positional arguments before calling it; the list."""
    calls = []
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args: calls.append(args) or original(*args))
    return calls


def record_checks(monkeypatch, device, module, name: str) -> list:
    """The start of a test of an op's calls already checked: skip where Triton cannot run on ``device``,
    forget every plan and kept call, and record the calls of the op's check ``module.name``; the list."""
    import pytest

    from llm_speed.core import launch, runtime

    if not runtime.triton_runs_on(device):
        pytest.skip("Triton cannot run on this device (CPU without TRITON_INTERPRET=1)")
    launch.clear_plans()
    return record_calls(monkeypatch, module, name)
