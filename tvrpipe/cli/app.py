"""The ``tvrpipe`` typer app object and the group class every command group uses.

Each command parses typed options and calls one library function. Library errors
(:class:`~tvrpipe.errors.TvrpipeError`) become one red line on stderr and exit code 1.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any

import click
import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.text import Text
from typer.core import TyperGroup

from tvrpipe import __version__
from tvrpipe.errors import TvrpipeError

# Every line a command prints goes through these two consoles. Markup and highlighting are off: queries,
# file and folder names, paths and ids came from the user or the disk and are printed as they are
# (`clip [final].mp4`, `AC/DC [/live]`); tvrpipe's own emphasis is a `style=` or a Text, never markup.
console = Console(markup=False, highlight=False)
err_console = Console(stderr=True, markup=False, highlight=False)


# `tvrpipe --help` shows the commands in the order of the work: the main path first, then the full
# papers and grids, then tools, then benchmarks (each command names its panel where it is declared)
MAIN_PATH = "Main path: manifest -> extract -> train-head -> evaluate / search / report"
PAPERS = "Full papers and grids"
TOOLS = "Tools"
BENCHMARKS = "Benchmarks"
COMMAND_ORDER = ("manifest", "extract", "train-head", "evaluate", "search", "report", "finetune", "recipes", "sweep", "features",
                 "export", "heads", "synth", "quickstart", "bench")


# what a stop means for a command that makes no output to resume: a server answers until it is stopped
_STOPPED = {"serve": "the server stopped"}


class _ErrorsAsMessages(TyperGroup):
    """A command group that reports :class:`TvrpipeError` (and file-system errors) as one line, exit 1.

    An ``OSError`` that the library did not turn into a message of its own (a disk that filled, a
    folder that became read-only mid-run) names its file and what the system said; ``-vv`` logs
    its traceback.
    """

    def list_commands(self, ctx: click.Context) -> list[str]:
        names = super().list_commands(ctx)
        rank = {n: i for i, n in enumerate(COMMAND_ORDER)}
        return sorted(names, key=lambda n: rank.get(n, len(COMMAND_ORDER)))  # stable: the rest keep their order

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The commands under their panels' headings, each with its whole first sentence (wrapped, not cut)."""
        panels: dict[str, list[tuple[str, str]]] = {}
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                panel = getattr(cmd, "rich_help_panel", None) or "Commands"
                panels.setdefault(panel, []).append((name, cmd.get_short_help_str(limit=1000)))
        for panel, rows in panels.items():
            with formatter.section(panel):
                formatter.write_dl(rows)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (Terminated): every output is resumable (_STOPPED: none)
            how, code = ("terminated (SIGTERM)", 143) if isinstance(e, Terminated) else ("interrupted", 130)
            said = (_STOPPED.get(ctx.invoked_subcommand or "") if ctx.parent is None else None) or (
                "what was finished is kept; rerun the same command to resume")
            err_console.print(Text.assemble((f"{how}:", "bold yellow"), f" {said}"), soft_wrap=True)
            raise typer.Exit(code) from None
        except BrokenPipeError:  # stdout's reader left where it was not wrapped (main() wraps it): nothing to say
            raise typer.Exit(0) from None
        except TvrpipeError as e:
            _one_line(str(e))
        except OSError as e:
            logging.getLogger("tvrpipe").debug("traceback", exc_info=True)
            where = f"{e.filename}: " if e.filename else ""
            _one_line(f"{where}{e.strerror or e} (check that the path exists, is writable and the disk has room)")


class QuietClosedPipe:
    """Standard output that a closed pipe silences instead of failing (``tvrpipe search ... | head -1``).

    Once the reader has gone, what is left to print is dropped and the command goes on: the files it
    writes never depend on stdout, and no "Broken pipe" error replaces its work. Everything else is the
    wrapped stream's (encoding, ``isatty``, ``fileno``), so Rich and click treat it as the terminal it is.
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.reader_gone = False

    def write(self, text: str) -> int:
        if not self.reader_gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._drop()
        return len(text)

    def flush(self) -> None:
        if not self.reader_gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._drop()

    def _drop(self) -> None:
        self.reader_gone = True
        try:  # what the stream still buffers, and the interpreter's flush at exit, go to /dev/null, quietly
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError):  # a stream without a descriptor (a test's buffer) has nothing to redirect
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's preemption, ``kill``), raised where the process is, as Ctrl-C would be:
    every command already leaves its outputs resumable on a KeyboardInterrupt."""


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated


def finite_float(value: str | float) -> float:
    """The parser of every float option: a number, finite. NaN passes any range check a command makes
    (``nan > 0`` and ``nan < 0`` are both False) and infinities overflow what they feed, so both are
    refused here, naming the option, before anything runs."""
    try:
        x = float(value)
    except ValueError:
        raise typer.BadParameter(f"{value!r} is not a number") from None
    if not math.isfinite(x):
        raise typer.BadParameter(f"{value!r}: a finite number is needed (not NaN or an infinity)")
    return x


def explicit_options(ctx: click.Context) -> set[str]:
    """The parameters of the running command that the user gave (on the command line or through an
    environment variable), as opposed to their defaults: what overrides a recipe's values."""
    # by name: typer may hand over a context of its own click, whose enum is not click's
    given = {"COMMANDLINE", "ENVIRONMENT"}
    return {p.name for p in ctx.command.params
            if p.name and getattr(ctx.get_parameter_source(p.name), "name", None) in given}


def given(ctx: click.Context, values: Mapping[str, Any], names: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Of ``values`` (the command's parameters by name), those the user gave, keyed by the config field each sets
    (``names``: {parameter: field} where they differ, e.g. ``timeout``: ``timeout_s``): a command passes only
    these, and its config supplies every other default (declared once, there; ``--help`` shows it)."""
    names = names or {}
    explicit = explicit_options(ctx)
    return {names.get(k, k): v for k, v in values.items() if k in explicit}


def given_fields(ctx: click.Context, config: type, names: Mapping[str, str] | None = None,
                 convert: Mapping[str, Callable[[Any], Any]] | None = None) -> dict[str, Any]:
    """:func:`given` for every option of the command that sets a field of the dataclass ``config`` (by name, or
    through ``names``, {parameter: field}), read from ``ctx.params``: a command no longer names each of its
    options a second time, and an option added to it reaches the config by having the field's name.
    ``convert``: {parameter: function} for options given as text that the config takes parsed (``--group-lr``)."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(config)}
    names, convert = names or {}, convert or {}
    values = {k: convert[k](v) if k in convert else v for k, v in ctx.params.items() if names.get(k, k) in fields}
    return given(ctx, values, names)


def defaults_of(function: Any) -> Any:
    """The keyword defaults of a library ``function`` (a benchmark's, say), by name: where a command without a
    config takes its options' defaults from, so that they are declared once, in the function's signature."""
    import inspect
    from types import SimpleNamespace

    return SimpleNamespace(**{n: p.default for n, p in inspect.signature(function).parameters.items()
                              if p.default is not inspect.Parameter.empty})


def refuse_unused(ctx: click.Context, names: Iterable[str], why: str) -> None:
    """Refuse the options of ``names`` (parameter names) that the user gave explicitly although the run
    would not use them (``why`` says so): a run records its options, so one without effect would be
    recorded as if it had one.

    Raises:
        ConfigError: naming them.
    """
    from tvrpipe.errors import ConfigError

    given = explicit_options(ctx)
    unused = [f"--{n.replace('_', '-')}" for n in names if n in given]
    if unused:
        raise ConfigError(f"{', '.join(unused)}: {why}")


def _one_line(message: str) -> None:
    err_console.print(Text.assemble(("error:", "bold red"), " ", " ".join(message.split())), soft_wrap=True)
    raise typer.Exit(1)


def new_app(**kwargs: Any) -> typer.Typer:
    """A typer app (or sub-group) with tvrpipe's defaults."""
    return typer.Typer(**{"cls": _ErrorsAsMessages, "no_args_is_help": True, "pretty_exceptions_enable": False,
                          "rich_markup_mode": None, "add_completion": False, **kwargs})


app = new_app(
    help="tvrpipe: CLIP-based text-video retrieval. Build manifests, extract CLIP features, "
    "train and evaluate retrieval heads.",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"tvrpipe {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    verbose: Annotated[int, typer.Option("--verbose", "-v", count=True, help="More log output (-vv for debug).")] = 0,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread only
        signal.signal(signal.SIGTERM, _terminate)
    level = logging.WARNING - 10 * min(verbose, 2)
    handler = RichHandler(console=err_console, show_path=False)
    if not verbose:  # open_clip logs to the root logger (e.g. "No pretrained weights loaded" for 'none')
        handler.addFilter(lambda record: "open_clip" not in record.pathname or record.levelno >= logging.ERROR)
    logging.basicConfig(level=level, format="%(message)s", handlers=[handler], force=True)
