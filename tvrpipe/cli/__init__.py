"""The ``tvrpipe`` command line: thin typer commands over the library (see ``main.py``)."""
