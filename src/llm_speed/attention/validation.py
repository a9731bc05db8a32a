"""TEMPORARY: the names ``decode.py`` still imports from here, until its conversion (to
``llm_speed.attention.checks``) is merged. Delete this file then."""

from .checks import HEAD_DIM_MULTIPLE, MAX_HEAD_DIM, SUPPORTED_DTYPES, check_softcap, check_window  # noqa: F401
