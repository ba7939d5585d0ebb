"""``python -m tvrpipe``: the command line."""

from tvrpipe.cli.main import main

main()
