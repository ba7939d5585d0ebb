"""The full check of a store (``tvrpipe features verify``): every written chunk against its marker's size and
CRC-32, the embeddings scanned for non-finite values, and the row tables read."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from tvrpipe.features.store.layout import ARRAYS, KINDS, NOT_WRITTEN, Damage, Layout, StoreError
from tvrpipe.features.store.provenance import maker_command
from tvrpipe.features.store.reader import open_checked, read_sidecars


@dataclass
class VerifyReport:
    """What :func:`verify_store` found.

    Attributes:
        dir: the store.
        complete: whether the extraction finished.
        shards: shards checked (every written one).
        not_written: shards of an unfinished extraction that have not been written yet.
        bytes: chunk bytes read and checksummed.
        seconds: wall time.
        damage: damaged shards, each naming the array, the chunk and the rows.
        nonfinite: for each embedding array, the rows holding NaN or infinite values.
        tables: of a complete store, why its row tables (videos, texts, failures) cannot be read, or None.
    """

    dir: Path
    complete: bool
    shards: int = 0
    not_written: int = 0
    bytes: int = 0
    seconds: float = 0.0
    damage: list[Damage] = field(default_factory=list)
    nonfinite: dict[str, list[int]] = field(default_factory=dict)
    made_by: str = "tvrpipe extract"
    tables: str | None = None

    @property
    def ok(self) -> bool:
        """No damage, no non-finite value, and tables that read."""
        return not self.damage and not any(self.nonfinite.values()) and self.tables is None


def verify_store(features_dir: str | os.PathLike[str]) -> VerifyReport:
    """Check every written chunk of a store against its marker (size and CRC-32) and scan the
    embeddings for non-finite values; works on unfinished stores too (unwritten shards are counted).

    Example:
        >>> report = verify_store("features/msrvtt-vitb32")  # doctest: +SKIP
        >>> report.ok, [str(d) for d in report.damage]  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    d = Path(features_dir)
    group, prov = open_checked(d)
    layout = Layout(d, group)
    report = VerifyReport(d, complete=bool(prov.get("complete")), made_by=maker_command(prov.get("made_by")))
    for kind in KINDS:
        for shard in layout.shards(kind):
            problem = layout.check(shard, checksums=True, scan=report.nonfinite)
            if problem == NOT_WRITTEN and not report.complete:
                report.not_written += 1
                continue
            report.shards += 1
            if problem is None:
                report.bytes += sum(layout.chunk_path(shard, n).stat().st_size for n in ARRAYS[kind])
            else:
                report.damage.append(Damage(shard, "its completion marker is missing" if problem == NOT_WRITTEN
                                            else problem))
    if report.complete:  # every command reads the row tables first: one that does not read is a broken store
        try:
            read_sidecars(d, prov, report.made_by)
        except StoreError as e:
            report.tables = str(e)
    report.seconds = time.perf_counter() - t0
    return report
