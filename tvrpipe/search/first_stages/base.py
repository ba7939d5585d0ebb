"""The first-stage interface and its registry.

A *first stage* ranks the pooled embeddings of a store's videos (L2-normalised, ``(n, D)`` float32) against
query sentence embeddings and keeps each query's ``k`` best; ``tvrpipe search --candidates K`` hands those
to the run's head. Every first stage has the same small interface (:class:`FirstStageIndex`):

- ``available()``: whether the library it needs is installed;
- ``build(pooled, config)``: the index of the pooled embeddings;
- ``top(queries, k)``: ``(positions into pooled (Q, k), scores (Q, k))``, best first;
- ``save(folder)`` / ``load(folder, pooled, config)``: its files (:attr:`~FirstStageIndex.files`) in a
  folder that also holds ``pooled.npy`` (the caller writes it), and back;
- ``describe()``: what runs, in words (``faiss-hnsw: IndexHNSWFlat M=32 ...``), for records.

Each first stage is one module of this package: a frozen ``Config`` dataclass and a class decorated with
``@register_first_stage("name")``; the package's ``__init__`` imports every module, which registers it.
The search, the export, the bench and ``--help`` read the names from :func:`list_first_stages` and never
branch on which first stage they hold.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import numpy as np

from tvrpipe.config import check_fields, parse_fields, split_item
from tvrpipe.errors import ConfigError

AUTO = "auto"  # not a first stage: the available one of highest auto_rank (FirstStageIndex.auto_rank)
FOR_HEAD = "head"  # not a first stage: the head-aware one made for the run's head (first_stage_for_head)


@dataclass(frozen=True)
class StageConfig:
    """Fields every first stage's config has (none yet); each first stage's ``Config`` subclasses this."""

    owner: ClassVar[str] = "first stage"  # not a setting: the registered name, for messages

    def __post_init__(self) -> None:
        check_fields(self, f"--first-stage-set of {self.owner}")  # the only way a user sets these


class FirstStageIndex(ABC):
    """A first stage over the pooled embeddings of a store's searchable videos.

    Class attributes a first stage sets:
        Config: its frozen settings dataclass (defaults with their source).
        summary: one line for ``--help`` and the docs: what it is and when it is exact.
        files: the files :meth:`save` writes into a folder; none (the exact stage) means the folder's
            ``pooled.npy`` is all it needs, and nothing is saved or exported for it.
        search_fields: the Config fields read at search time only (a beam, probes): an index built with
            other values is reused, not rebuilt.
        auto_rank: ``--first-stage auto`` takes the available first stage of highest rank; None: never.
        exact: whether :meth:`top` is the exact top k (the bench then compares it with nothing).
        install: what to install where :meth:`available` is False (a sentence after "needs").
        head_aware: ranks as a run's head does, so it is built from the head (:mod:`tvrpipe.search.distilled`),
            not from the pooled embeddings alone, and needs ``--run``.
        ranks_as_head: its top k and scores are the head's own (a head's indexed embedding): the two stages
            keep them and read no frame.
    """

    name: ClassVar[str] = ""  # set by register_first_stage
    aliases: ClassVar[tuple[str, ...]] = ()
    Config: ClassVar[type[StageConfig]] = StageConfig
    summary: ClassVar[str] = ""
    files: ClassVar[tuple[str, ...]] = ()
    search_fields: ClassVar[tuple[str, ...]] = ()
    auto_rank: ClassVar[int | None] = None
    exact: ClassVar[bool] = False
    install: ClassVar[str] = ""
    head_aware: ClassVar[bool] = False
    ranks_as_head: ClassVar[bool] = False  # its ranking and scores are the head's: nothing to re-rank

    def __init__(self, pooled: np.ndarray, config: StageConfig) -> None:
        self.pooled = pooled  # (n, D) float32, L2-normalised; a memory map where read from a folder
        self.config = config

    def __len__(self) -> int:
        return len(self.pooled)

    @classmethod
    def available(cls) -> bool:
        """Whether the library this first stage needs is installed."""
        return True

    @classmethod
    @abstractmethod
    def build(cls, pooled: np.ndarray, config: StageConfig | None = None) -> FirstStageIndex:
        """The index of ``pooled`` (``(n, D)`` float32, L2-normalised rows; a memory map is read in blocks)."""

    @abstractmethod
    def top(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` best rows of ``pooled`` for each query (``(Q, D)`` float32, L2-normalised; ``k`` at most
        the rows): ``(positions (Q, k) int64, scores (Q, k) float32)``, best first, no position missing."""

    def top_texts(self, texts: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`top` for a TextBatch of queries: their sentence embeddings, normalised (a first stage that
        ranks by the words overrides it)."""
        return self.top(normalised(texts.sentence.cpu().numpy()), k)

    def save(self, folder: Path) -> None:
        """Write :attr:`files` into ``folder`` (which exists); nothing where there are none."""

    @classmethod
    def load(cls, folder: Path, pooled: np.ndarray, config: StageConfig | None = None) -> FirstStageIndex:
        """The index :meth:`save` wrote into ``folder``, over the same ``pooled``; ``config``'s search fields
        apply. A first stage without files is built (which costs nothing beyond ``pooled``)."""
        return cls.build(pooled, config)

    @abstractmethod
    def describe(self) -> str:
        """What runs, in words, with its effective settings (index type, sizes, beam or probes)."""

    @classmethod
    def build_settings(cls, config: StageConfig) -> dict[str, Any]:
        """The settings an index is built with (the Config less :attr:`search_fields`): what index.json records
        and compares before reusing an index."""
        return {k: v for k, v in dataclasses.asdict(config).items() if k not in cls.search_fields}


class HeadAwareIndex(FirstStageIndex):
    """A first stage built from a run's head (:mod:`tvrpipe.search.distilled` builds it): its vectors and what they
    were made with (``source``: a fitted scorer, the head). Built from pooled embeddings alone, it is refused."""

    head_aware = True

    def __init__(self, vectors: np.ndarray, config: StageConfig, source: Any = None) -> None:
        super().__init__(vectors, config)
        self.source = source

    @classmethod
    def build(cls, pooled: np.ndarray, config: StageConfig | None = None) -> HeadAwareIndex:
        raise ConfigError(head_aware_refusal(cls.name))

    @classmethod
    def over(cls, vectors: np.ndarray, config: StageConfig, source: Any) -> HeadAwareIndex:
        """The index over ``vectors`` (the searchable videos', in order), made with ``source``."""
        return cls(vectors, config, source)


S = TypeVar("S", bound=type[FirstStageIndex])
_STAGES: dict[str, type[FirstStageIndex]] = {}
_ALIASES: dict[str, str] = {}


def register_first_stage(name: str, aliases: tuple[str, ...] = ()) -> Callable[[S], S]:
    """Class decorator: register a :class:`FirstStageIndex` subclass under ``name`` (and ``aliases``, other
    names that mean it on the command line and in older records).

    Example:
        >>> @register_first_stage("my-ann")  # doctest: +SKIP
        ... class MyAnn(FirstStageIndex): ...
    """

    def deco(cls: S) -> S:
        taken = [n for n in (name, *aliases) if n in _STAGES or n in _ALIASES or n in (AUTO, FOR_HEAD)]
        if taken:
            raise ValueError(f"first stage {taken[0]!r} registered twice")
        if not (dataclasses.is_dataclass(cls.Config) and cls.Config.__dataclass_params__.frozen):
            raise TypeError(f"{cls.__name__}.Config must be a frozen dataclass")
        unknown = set(cls.search_fields) - {f.name for f in dataclasses.fields(cls.Config)}
        if unknown:
            raise TypeError(f"{cls.__name__}.search_fields names no Config field: {', '.join(sorted(unknown))}")
        cls.name, cls.aliases = name, tuple(aliases)
        if "Config" in cls.__dict__:
            cls.Config.owner = name
        _STAGES[name] = cls
        _ALIASES.update({a: name for a in aliases})
        return cls

    return deco


def _import_all() -> None:
    import tvrpipe.search.first_stages  # noqa: F401  (registers every first stage)


def list_first_stages() -> list[str]:
    """Names of the registered first stages, sorted (aliases and ``auto`` not included)."""
    _import_all()
    return sorted(_STAGES)


def exportable_first_stages() -> list[str]:
    """The first stages ``tvrpipe export --format faiss`` can write: those with files of their own, sorted."""
    _import_all()
    return sorted(n for n, c in _STAGES.items() if c.files)


def first_stage_choices(auto: bool = True) -> str:
    """What ``--first-stage`` accepts, for messages: ``auto, head, exact, faiss-hnsw (or faiss), ...`` (``auto``
    and ``head`` left out where the option does not take them, as ``export``'s)."""
    _import_all()
    alias = {n: [a for a, m in _ALIASES.items() if m == n] for n in _STAGES}
    return ", ".join([AUTO, FOR_HEAD] * auto + [n + (f" (or {', '.join(alias[n])})" if alias[n] else "")
                                                 for n in sorted(_STAGES)])


def first_stage_help() -> str:
    """Every first stage in one paragraph, for ``--help``: ``auto`` (what it resolves to) and each registered
    name (with its aliases) and summary."""
    _import_all()
    order = sorted((c for c in _STAGES.values() if c.auto_rank is not None), key=lambda c: -c.auto_rank)
    auto = ", else ".join(f"{c.name}" + (" where installed" if c is not order[-1] else "") for c in order)
    alias = {n: [a for a, m in _ALIASES.items() if m == n] for n in _STAGES}
    head = (f"{FOR_HEAD}: the first stage made for the run's head (needs --run): head-embedding where the head has "
            f"its own video embedding, late-interaction where it scores word by frame, else distilled")
    return "; ".join([f"{AUTO}: {auto}", head] + [n + (f" (or {', '.join(alias[n])})" if alias[n] else "") +
                                             f": {_STAGES[n].summary}" for n in sorted(_STAGES)])


def first_stage_class(name: str, auto: bool = False) -> type[FirstStageIndex]:
    """The class registered under ``name`` or one of its aliases (not ``auto``: :func:`resolve_first_stage`).

    Raises:
        ConfigError: naming what ``--first-stage`` accepts (``auto`` among them where the caller takes it).
    """
    _import_all()
    name = _ALIASES.get(name, name)
    if name not in _STAGES:
        raise ConfigError(f"--first-stage {name!r}: choose one of {first_stage_choices(auto)}")
    return _STAGES[name]


def first_stage_for_head(head: Any) -> str:
    """The head-aware first stage made for ``head``: ``head-embedding`` where its score is the inner product with a
    query-independent video embedding (its ranking is the head's), ``late-interaction`` where it scores by the
    token-wise interaction of words and frames, else ``distilled``."""
    if head.indexable() is not None:
        return "head-embedding"
    return "late-interaction" if head.token_wise_keys is not None else "distilled"


def resolve_first_stage(name: str, head: Any = None) -> str:
    """The registered name ``name`` stands for: ``auto`` -> the available first stage of highest
    ``auto_rank`` (``faiss-hnsw`` where faiss-cpu is installed, else ``exact``); ``head`` -> the one made for the
    run's ``head`` (:func:`first_stage_for_head`); an alias -> its name.

    Raises:
        ConfigError: an unknown name, ``head`` without a run's head, or a first stage whose library is not
            installed (saying what to install).
    """
    _import_all()
    if name == FOR_HEAD:
        if head is None:
            raise ConfigError(head_aware_refusal(FOR_HEAD))
        return first_stage_for_head(head)
    if name == AUTO:
        ranked = [c for c in _STAGES.values() if c.auto_rank is not None and c.available()]
        return max(ranked, key=lambda c: c.auto_rank).name
    cls = first_stage_class(name, auto=True)
    if not cls.available():
        exact = [n for n, c in _STAGES.items() if c.exact and c.available()]
        raise ConfigError(f"--first-stage {name} needs {cls.install}" + (f", or use --first-stage {exact[0]}"
                                                                        if exact else ""))
    return cls.name


Settings = Mapping[str, Any] | Sequence[str]  # typed values, or the command line's KEY=VALUE items


def stage_settings(name: str, settings: Settings | None) -> dict[str, Any]:
    """``settings`` as typed values of the first stage ``name``'s Config: a mapping as it is, ``KEY=VALUE``
    items (``--first-stage-set``) parsed by the fields' types; an unknown key, in either form, fails loudly."""
    cls = first_stage_class(name)
    settings = settings or {}
    mapping = isinstance(settings, Mapping)
    fields = {f.name for f in dataclasses.fields(cls.Config)}
    keys = set(settings) if mapping else {split_item(item, "--first-stage-set")[0] for item in settings}
    unknown = sorted(keys - fields)
    if unknown:  # said before parse_fields would, with the settings there are
        raise ConfigError(f"first stage {cls.name} has no setting {unknown[0]!r}; known: "
                          f"{', '.join(sorted(fields)) or 'none'}")
    return dict(settings) if mapping else parse_fields(cls.Config, list(settings), cls.name, "--first-stage-set")


def stage_config(name: str, settings: Settings | None = None) -> StageConfig:
    """The first stage ``name``'s default Config with ``settings`` applied (:func:`stage_settings`); an unknown
    key fails loudly.

    Example:
        >>> stage_config("faiss-hnsw", ["ef_search=128"]).ef_search  # doctest: +SKIP
        128
    """
    cls = first_stage_class(name)
    return dataclasses.replace(cls.Config(), **stage_settings(name, settings))


def head_aware_refusal(name: str) -> str:
    """What a head-aware first stage asked for without a run's head says."""
    return (f"--first-stage {name} is fitted to a run's head: give --run (zero-shot CLIP ranks as the pooled first "
            f"stages do: exact, faiss-hnsw, faiss-ivfpq)")


def normalised(queries: np.ndarray) -> np.ndarray:
    """``(..., D)`` float32 vectors (the last axis) of unit length (a zero vector stays zero)."""
    q = np.asarray(queries, np.float32)
    return np.ascontiguousarray(q / np.maximum(np.linalg.norm(q, axis=-1, keepdims=True), 1e-12))
