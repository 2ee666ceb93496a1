"""`tinylm explain attention` and `tinylm explain forward`: look inside a trained Transformer.

Added to the `explain` group (built in `tinylm.cli.explain`) by `add_model_commands`.
"""

from __future__ import annotations

import argparse


def add_model_commands(subparsers: argparse._SubParsersAction) -> None:
    """tinylm explain attention and tinylm explain forward (filled in as the library lands)."""
