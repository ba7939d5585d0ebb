"""Console-script entry point: the app with every command module registered."""

from __future__ import annotations

import sys

from tvrpipe.cli import (  # noqa: F401  (each adds its commands)
    bench,
    extract,
    finetune,
    manifest,
    quickstart,
    recipes,
    report,
    search,
    serve,
    sweep,
    synth,
    train,
)
from tvrpipe.cli.app import QuietClosedPipe, app

__all__ = ["app", "main"]


def main() -> None:
    """Run the ``tvrpipe`` command line."""
    sys.stdout = QuietClosedPipe(sys.stdout)
    app()


if __name__ == "__main__":
    main()
