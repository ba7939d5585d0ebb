"""Progress bars: one look for every long loop (extraction, training, generation, sweeps, thumbnails).

Every bar is rich's ``Progress`` with the same columns, in this order: the description, the bar, done / total,
then what the caller asks for (a line of its own ``field``, the time elapsed, the time remaining). Texts are
rendered with ``markup=False``: a description or a field holds user text (a file name ``clip [final].mp4``,
a head's name, a query) that must print as it is. A disabled bar prints nothing, so library calls pass
``enabled=progress`` rather than branching.

Example:
    >>> with progress_bar(field="info", eta=True, enabled=False) as bar:
    ...     task = bar.add_task("train xpool", total=3, info="")
    ...     for _ in range(3):
    ...         bar.advance(task)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from rich.progress import Progress

T = TypeVar("T")


def progress_bar(*, field: str | None = None, elapsed: bool = False, eta: bool = False, enabled: bool = True,
                 transient: bool = False) -> Progress:
    """A progress bar (use it as a context manager; its tasks' descriptions name what runs).

    Args:
        field: the name of a task field shown after done / total (``add_task(..., info="")`` for
            ``field="info"``): the caller's own line, such as a loss or a rate.
        elapsed: show the time elapsed.
        eta: show the time remaining.
        enabled: False: print nothing.
        transient: remove the bar when it ends.
    """
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = [TextColumn("{task.description}", style="bold", markup=False), BarColumn(), MofNCompleteColumn()]
    if field is not None:
        columns.append(TextColumn(f"{{task.fields[{field}]}}", markup=False))
    if elapsed:
        columns.append(TimeElapsedColumn())
    if eta:
        columns.append(TimeRemainingColumn())
    return Progress(*columns, disable=not enabled, transient=transient)


def track(items: Iterable[T], description: str, total: int | None = None, enabled: bool = True,
          transient: bool = False) -> Iterator[T]:
    """``items``, with a progress bar of :func:`progress_bar`'s look (time elapsed) while they are consumed.
    ``total``: how many there are, where ``items`` has no ``len``."""
    if total is None:
        try:
            total = len(items)  # type: ignore[arg-type]
        except TypeError:
            total = None
    with progress_bar(elapsed=True, enabled=enabled, transient=transient) as bar:
        task = bar.add_task(description, total=total)
        for item in items:
            yield item
            bar.advance(task)


def stages(names: Sequence[str], enabled: bool = True) -> Iterator[str]:
    """``names``, one at a time, under a bar of :func:`progress_bar`'s look that names the stage running, done /
    total and the time elapsed: for work of a few long steps that show nothing of their own (a benchmark's runs,
    each a fresh process)."""
    with progress_bar(elapsed=True, enabled=enabled) as bar:
        task = bar.add_task(names[0] if names else "", total=len(names))
        for name in names:
            bar.update(task, description=name)
            yield name
            bar.advance(task)
