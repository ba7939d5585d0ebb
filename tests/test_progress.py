"""The one progress bar: its columns, user text printed as it is, and track's items."""

from __future__ import annotations

from rich.console import Console

from tvrpipe.progress import progress_bar, track


def _rendered(bar) -> str:
    console = Console(record=True, width=200, color_system=None)
    console.print(bar.make_tasks_table(bar.tasks))
    return console.export_text()


def test_the_bar_shows_done_of_total_and_prints_user_text_as_it_is():
    bar = progress_bar(field="info", elapsed=True, eta=True)
    task = bar.add_task("clip [final].mp4", total=4, info="[bold]loss[/bold] 0.5")
    bar.advance(task, 3)
    text = _rendered(bar)
    assert "clip [final].mp4" in text and "[bold]loss[/bold] 0.5" in text and "3/4" in text
    assert text.index("clip [final].mp4") < text.index("3/4") < text.index("[bold]loss")  # description, bar, M/N, field


def test_the_columns_are_the_ones_asked_for():
    names = [type(c).__name__ for c in progress_bar().columns]
    assert names == ["TextColumn", "BarColumn", "MofNCompleteColumn"]
    names = [type(c).__name__ for c in progress_bar(field="rate", elapsed=True, eta=True).columns]
    assert names == ["TextColumn", "BarColumn", "MofNCompleteColumn", "TextColumn", "TimeElapsedColumn",
                     "TimeRemainingColumn"]
    assert progress_bar(enabled=False).disable and not progress_bar().disable


def test_track_yields_every_item_in_order_with_or_without_a_length(capsys):
    assert list(track([3, 1, 2], "items", enabled=False)) == [3, 1, 2]
    assert list(track((i * i for i in range(5)), "squares", total=5, enabled=False)) == [0, 1, 4, 9, 16]
    assert list(track(iter("ab"), "letters", enabled=False)) == ["a", "b"]  # no len, no total: a bar without an end
    assert capsys.readouterr().out == ""  # disabled: nothing printed


def test_stages_name_the_one_running_and_count_the_ones_done(monkeypatch):
    import tvrpipe.progress as progress

    seen, bars = [], []
    real = progress.progress_bar

    def recording(**kw):
        bars.append(real(**kw))
        return bars[-1]

    monkeypatch.setattr(progress, "progress_bar", recording)
    for name in progress.stages(["model alone", "in memory", "streamed"], enabled=False):
        [task] = bars[0].tasks
        seen.append((name, task.description, task.completed, task.total))
    assert seen == [("model alone", "model alone", 0, 3), ("in memory", "in memory", 1, 3),
                    ("streamed", "streamed", 2, 3)]
    assert bars[0].tasks[0].completed == 3 and "elapsed" in str([type(c).__name__ for c in bars[0].columns]).lower()
