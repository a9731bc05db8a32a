"""TEMPORARY: the one name ``decode.py`` still imports from here, until its conversion (to
``llm_speed.core.kernel_math.dot``) is merged. Delete this file then."""

from ..core.kernel_math import dot as _dot  # noqa: F401
