"""Record the calls of a module function while a test runs (the tests of the calls already checked use it to
see which calls were checked)."""


def record_calls(monkeypatch, module, name: str) -> list:
    """Patch ``module.name`` to record each call's positional arguments before calling it; the list."""
    calls = []
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args: calls.append(args) or original(*args))
    return calls
