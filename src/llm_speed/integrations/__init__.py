"""One-line use of llm-speed in other libraries' models. Each submodule imports its library lazily-optional:
``llm_speed.integrations.transformers`` needs ``pip install llm-speed[hf]``."""
