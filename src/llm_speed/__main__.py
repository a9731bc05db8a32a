"""``python -m llm_speed``: the ``llm-speed`` command."""

import sys

from llm_speed.cli import main

if __name__ == "__main__":
    sys.exit(main())
