"""The head interface, its inputs and outputs, and the registry.

A *head* turns cached (or live) CLIP features into a text-video similarity. Every head has the
same small interface (docs/design.md, "Heads"):

- ``encode_texts(TextBatch) -> Emb`` and ``encode_videos(VideoBatch) -> Emb``: per-item work,
  computed once per item at evaluation;
- ``similarity(text_emb, video_emb) -> Tensor[n_text, n_video]``: pairwise; text-conditioned heads
  (X-Pool, T-MASS, DUQ) do their per-pair work here, and the evaluation engine calls it on blocks
  so memory is bounded by the block size;
- ``loss(TextBatch, VideoBatch) -> LossOutput(total, terms)``: the training objective on a batch
  of B matching (text_i, video_i) pairs, every term logged;
- optionally ``pair_readouts(text_emb, video_emb) -> {name: Tensor[n_text, n_video]}``: per-pair
  quantities (an uncertainty, a radius) that evaluation averages over matching and non-matching
  pairs and training logs per epoch; ``item_readouts(text_emb, video_emb) -> {name: float}`` for
  quantities of the items themselves (a mean variance);
- optionally ``pair_uncertainty(text_emb, video_emb) -> Tensor[n_text, n_video]``: the head's own
  uncertainty about each pair, for a head that models one (``tvrpipe search`` prints it per hit);
- optionally ``rerank(sim, text_emb, video_emb) -> Reranked``: a row- or column-wise step over the
  full score matrix after the block engine (DUQ's Eq. 16), reported beside the raw scores.

``Emb`` is a dict of tensors that all have the items as their first dimension, so the engine can
concatenate chunks and slice blocks without knowing what a head keeps.

Padding (``token_mask`` / ``frame_mask`` False) never enters a head's result: the tests check that
junk in it changes nothing. The data loader relies on it: a split is loaded only up to its last
real token, and ``loss`` gets only as many token columns as the longest caption of its batch has
(the columns left out are padding in every caption).

Each head is one file: a frozen ``Config`` dataclass (defaults are the paper's values, each with
a comment naming its source) and a class decorated with ``@register_head("name")``. The trainer,
evaluator and CLI never branch on which head they hold.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor, nn

from tvrpipe.config import check_fields
from tvrpipe.errors import ConfigError
from tvrpipe.heads.pooling import mean_video

Emb = dict[str, Tensor]


@dataclass(frozen=True)
class TextBatch:
    """Text features of B captions: word tokens with their mask, and the EOS sentence embedding."""

    tokens: Tensor  # (B, L, D) projected word tokens
    token_mask: Tensor  # (B, L) bool, True for real tokens
    sentence: Tensor  # (B, D) EOS embedding (= open_clip encode_text)

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> TextBatch:
        """The batch on ``device`` (float tensors cast to ``dtype`` when given)."""
        cast = (lambda x: x.to(device, dtype)) if dtype else (lambda x: x.to(device))
        return TextBatch(cast(self.tokens), self.token_mask.to(device), cast(self.sentence))

    @classmethod
    def of_sentences(cls, sentence: Tensor) -> TextBatch:
        """Sentences alone, for a head that reads no word tokens: empty ``(B, 0, D)`` tokens and ``(B, 0)`` mask."""
        B, D = sentence.shape
        return cls(torch.zeros((B, 0, D)), torch.zeros((B, 0), dtype=torch.bool), sentence)

    def __len__(self) -> int:
        return self.sentence.shape[0]


@dataclass(frozen=True)
class VideoBatch:
    """Frame features of B videos with the mask of real (not padded) frames."""

    frames: Tensor  # (B, F, D) projected frame [CLS] embeddings
    frame_mask: Tensor  # (B, F) bool, True for real frames

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> VideoBatch:
        """The batch on ``device`` (frames cast to ``dtype`` when given)."""
        frames = self.frames.to(device, dtype) if dtype else self.frames.to(device)
        return VideoBatch(frames, self.frame_mask.to(device))

    def __len__(self) -> int:
        return self.frames.shape[0]


@dataclass
class LossOutput:
    """A training loss: the total to back-propagate and every term, for logging."""

    total: Tensor
    terms: dict[str, Tensor]


@dataclass
class Reranked:
    """A head's re-ranking of a full score matrix (:meth:`Head.rerank`), one matrix per direction.

    Both are (n_text, n_video): ``t2v`` ranks the videos of each caption (row), ``v2t`` the
    captions of each video (column). ``query_readouts`` holds per-query quantities the re-ranking
    used, ``{"t2v": {name: Tensor[n_text]}, "v2t": {name: Tensor[n_video]}}``; evaluation reports
    their means over queries whose raw top-1 is correct and over the others.
    """

    t2v: Tensor
    v2t: Tensor
    query_readouts: dict[str, dict[str, Tensor]] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class HeadConfig:
    """Fields every head's config has; each head's ``Config`` subclasses this."""

    embed_dim: int = 512  # D: CLIP ViT-B/32 projection width; the trainer sets it from the store
    # the papers reuse CLIP's learned scale: train-head and finetune set it from the features' CLIP
    # (clip_head_config)
    logit_scale_init: float = math.log(1 / 0.07)  # CLIP Sec. 2.5 init, where no CLIP's scale is known
    # score = cos(sentence, mean of the frames) + g x (the head's score), g a parameter that starts at 0,
    # so training starts at zero-shot CLIP (train-head --zero-shot-start)
    zero_shot_start: bool = False  # choice, not part of any paper

    owner: ClassVar[str] = "head"  # not a setting: the head's registered name, for messages (register_head)

    def __post_init__(self) -> None:
        # every field's declared range, NaN nowhere (it passes every range check: nan > 0 and nan < 0
        # are both False), an infinity only where a field says it means something (a hard max); then
        # the checks that involve several fields. A config that exists is one its head accepts.
        check_fields(self, self.owner)
        self.check()

    def check(self) -> None:
        """Checks of several fields together (each head's Config adds its own); raise ConfigError."""



class Copied(list):
    """What :meth:`Head.init_from_clip` copied from CLIP (a list of names); ``reason`` says why nothing
    was, when it is empty (no such module, or a width, head count or MLP ratio that differs)."""

    def __init__(self, names: Iterable[str] = (), reason: str = "") -> None:
        super().__init__(names)
        self.reason = reason


ZS_TEXT, ZS_VIDEO = "zero_shot_sentence", "zero_shot_video"  # the keys zero_shot_start adds to Emb


def _zero_shot_text(texts: TextBatch) -> Emb:
    return {ZS_TEXT: torch.nn.functional.normalize(texts.sentence, dim=-1)}


def _zero_shot_video(videos: VideoBatch) -> Emb:
    """The zero-shot row's video: meanpool's ``mean_video`` (the normalised mean of the L2-normalised
    real frames), so that g = 0 is that row's computation, not an approximation of it."""
    return {ZS_VIDEO: mean_video(videos.frames, videos.frame_mask)}


class Head(nn.Module):
    """Base class of every retrieval head.

    Subclasses set ``Config`` (a frozen dataclass subclassing :class:`HeadConfig`) and implement
    ``encode_texts``, ``encode_videos`` and ``similarity``; the default ``loss`` is the symmetric
    InfoNCE over ``similarity`` scaled by the learnable ``logit_scale`` every head has
    (CLIP4Clip Eq. 6-8).
    """

    name: ClassVar[str] = ""
    Config: ClassVar[type[HeadConfig]] = HeadConfig
    # False for heads that read only the sentence embedding: loaders then pass an empty
    # (B, 0, D) tokens tensor and skip gathering and casting word tokens (most of a batch's bytes).
    uses_tokens: ClassVar[bool] = True
    # The learning rate ``train-head`` uses when --lr is not given: a training setting, not part of
    # the head's Config (the papers' lrs are for end-to-end finetuning, where CLIP itself moves).
    # Each head sets it from the validation curves of `tvrpipe bench convergence` (docs/training.md):
    # one lr, or ``{D: lr}`` where the curves at several widths D disagree (a wider head can need a
    # smaller lr); :meth:`lr_for` reads it at a store's width.
    default_lr: ClassVar[float | Mapping[int, float]] = 1e-3
    # What the raw score of a (text, video) pair means and which way ranks first, and what the pair's
    # uncertainty (:meth:`pair_uncertainty`) is and which way is less certain: one sentence each, for people.
    # `tvrpipe search --help`, the search page's legend and docs/search.md's table read them; register_head
    # refuses a head that does not state its own score_meaning (and an uncertainty_meaning where it reports an
    # uncertainty). A head whose config changes them (ProTA's probabilistic switch) says so here and gives
    # its config's words in :meth:`config_meaning`.
    score_meaning: ClassVar[str] = ""
    uncertainty_meaning: ClassVar[str | None] = None
    # The bounds of the raw score, (low, high), None for an unbounded side: a cosine's (-1, 1). `tvrpipe search`
    # refuses a --min-score outside them (it would cut every hit, or none).
    score_range: ClassVar[tuple[float | None, float | None]] = (None, None)
    # True where the head's score is the search's first stage's own (the cosine of the sentence and the
    # L2-normalised mean of the L2-normalised frames, :mod:`tvrpipe.search.index`): a two-stage search then
    # keeps the first stage's order and cosines instead of reading the shortlist's frames to score them again.
    ranks_as_first_stage: ClassVar[bool] = False
    # (text key, video key) where ``similarity`` is exactly the inner product of those two embeddings and the
    # text's reads the sentence alone (CLIP4Clip's meanP and seqTransf): the video side is then a fixed vector
    # per video, which a search's ``head-embedding`` first stage indexes (its ranking is the head's own).
    embedding_keys: ClassVar[tuple[str, str] | None] = None
    # (text vectors, text mask, video vectors, video mask) where ``similarity`` is the token-wise interaction of
    # UATVR Eq. 7 (:func:`tvrpipe.heads.tokenwise.token_wise_similarity`) of those encodings, each side's vectors
    # independent of the other (tokenwise, uatvr): a search's ``late-interaction`` first stage indexes the video
    # side, shrunk to a few segments.
    token_wise_keys: ClassVar[tuple[str, str, str, str] | None] = None

    def indexable(self) -> tuple[str, str] | None:
        """:attr:`embedding_keys`, unless this head mixes in the zero-shot score (``zero_shot_start``), which
        is not one inner product."""
        return None if self.config.zero_shot_start or self.uses_tokens else self.embedding_keys

    def init_from_clip(self, clip: nn.Module) -> Copied:
        """Initialise modules from the live CLIP where the head's paper does (finetune ``--init-from-clip``;
        CLIP4Clip's seqTransf, ProTA and UATVR copy CLIP's text transformer into their temporal one).
        Returns what was copied; a head with nothing to take from CLIP copies nothing, and says why."""
        return Copied([], f"{self.name} has no module that starts from CLIP")

    def param_groups(self) -> dict[str, list[nn.Parameter]]:
        """The head's trainable parameters by group, for a learning rate per group (finetune's
        ``--group-lr NAME=LR``): every parameter in exactly one group. One group, ``head``, unless a head
        names modules that its paper trains at a rate of their own (T-MASS's radius module)."""
        return {"head": [p for p in self.parameters() if p.requires_grad]}

    @classmethod
    def lr_for(cls, embed_dim: int) -> float:
        """The default learning rate at width ``embed_dim`` (D): ``default_lr`` if it is one number;
        for a ``{D: lr}`` table, the lr at a measured width, the geometric interpolation between the
        two measured widths around D (log lr linear in log D), and the nearest measured width's lr
        below the smallest or above the largest.

        Example:
            >>> class H(Head):
            ...     default_lr = {64: 3e-3, 512: 3e-4}
            >>> H.lr_for(64), H.lr_for(768), round(H.lr_for(128), 6)
            (0.003, 0.0003, 0.001392)
        """
        table = cls.default_lr
        if not isinstance(table, Mapping):
            return float(table)
        widths = sorted(table)
        if embed_dim <= widths[0]:
            return float(table[widths[0]])
        if embed_dim >= widths[-1]:
            return float(table[widths[-1]])
        hi = next(w for w in widths if w >= embed_dim)
        lo = widths[widths.index(hi) - 1]
        t = math.log(embed_dim / lo) / math.log(hi / lo)
        return float(table[lo] * (table[hi] / table[lo]) ** t)

    @classmethod
    def lr_text(cls) -> str:
        """``default_lr`` for people: ``1e-3``, or ``3e-3 at D=64, 3e-4 at D=512`` for a table."""
        table = cls.default_lr
        if not isinstance(table, Mapping):
            return f"{table:g}"
        return ", ".join(f"{table[w]:g} at D={w}" for w in sorted(table))

    @property
    def dsl_not_applicable(self) -> str | None:
        """Why DSL (``--post dsl``) does not apply to this head's scores, or None where it does.

        DSL re-weights a similarity by a prior in (0, 1], ``sim * softmax(T sim)``; that presumes
        non-negative similarities such as CLIP cosines. On a score that is a negative distance the
        product inverts the ranking (the pair the prior favours most gets the most negative score),
        so a head whose scores are distances says so here and the engine reports no DSL for it.
        """
        return None

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config
        self.logit_scale = nn.Parameter(torch.tensor(float(config.logit_scale_init)))
        if config.zero_shot_start:
            self.zero_shot_gate = nn.Parameter(torch.zeros(()))
            # Instance attributes shadow the class's methods, so every caller (the losses, evaluation,
            # search) gets the mixed score and the sentence and mean-pooled video it needs, while the
            # head's own code (super() calls, its sub-modules) stays the paper's.
            cls = type(self)
            self.encode_texts = lambda texts: {**cls.encode_texts(self, texts), **_zero_shot_text(texts)}
            self.encode_videos = lambda videos: {**cls.encode_videos(self, videos), **_zero_shot_video(videos)}
            self.similarity = lambda t, v: self.mix_zero_shot(t, v, cls.similarity(self, t, v))

    def config_meaning(self) -> tuple[str, tuple[float | None, float | None], str | None]:
        """This head's score sentence, score range and uncertainty sentence under its config: the class's
        :attr:`score_meaning`, :attr:`score_range` and :attr:`uncertainty_meaning`, unless a head whose config
        changes them overrides this."""
        return self.score_meaning, self.score_range, self.uncertainty_meaning

    def meaning(self) -> str:
        """What a pair's score means, in words (the search page's legend): :meth:`config_meaning`'s, and with
        ``zero_shot_start`` the mix it is part of."""
        words = self.config_meaning()[0]
        if not self.config.zero_shot_start:
            return words
        return (f"cos(sentence, mean of the frames) + g x (the {self.name} score: {words}); "
                f"g = {float(self.zero_shot_gate.detach()):.3g}, learned from 0 (--zero-shot-start, not in the papers)")

    def score_bounds(self) -> tuple[float | None, float | None]:
        """The bounds of this head's scores (None: unbounded), with ``zero_shot_start`` those of the mix:
        [-1, 1] + g x :meth:`config_meaning`'s range."""
        low, high = self.config_meaning()[1]
        if not self.config.zero_shot_start:
            return low, high
        g = float(self.zero_shot_gate.detach())
        if g == 0:
            return -1.0, 1.0
        low, high = (low, high) if g > 0 else (high, low)
        return (None if low is None else g * low - 1.0), (None if high is None else g * high + 1.0)

    def uncertainty_text(self) -> str | None:
        """What :meth:`pair_uncertainty` means under this head's config (None: it reports none)."""
        return self.config_meaning()[2]

    def mix_zero_shot(self, text_emb: Emb, video_emb: Emb, score: Tensor) -> Tensor:
        """``score`` (n_text, n_video), or with ``zero_shot_start`` cos(sentence, mean-pooled video) + g x
        ``score``: heads whose loss scores pairs other than through :meth:`similarity` pass those scores
        here."""
        if not self.config.zero_shot_start:
            return score
        cos = text_emb[ZS_TEXT].to(score.dtype) @ video_emb[ZS_VIDEO].to(score.dtype).t()
        return cos + self.zero_shot_gate.to(score.dtype) * score

    def encode_texts(self, texts: TextBatch) -> Emb:
        raise NotImplementedError

    def encode_videos(self, videos: VideoBatch) -> Emb:
        raise NotImplementedError

    def similarity(self, text_emb: Emb, video_emb: Emb) -> Tensor:
        raise NotImplementedError

    def pair_readouts(self, text_emb: Emb, video_emb: Emb) -> dict[str, Tensor]:
        """Per-pair quantities to log beside the metrics: ``{name: Tensor[n_text, n_video]}``.

        The evaluation engine calls it on the same blocks as ``similarity`` (when asked for
        readouts) and reports each quantity's mean over matching and over non-matching pairs;
        the trainer logs them per validation epoch and plots them (T-MASS: the radius |R|_1 of
        its Fig. 3 and 5). Default: none.
        """
        return {}

    def pair_uncertainty(self, text_emb: Emb, video_emb: Emb) -> Tensor | None:
        """How uncertain the head is about each pair, ``Tensor[n_text, n_video]`` (larger: less certain), for
        a head that models it (``tvrpipe search`` prints it beside each hit); None for a head that does not.
        Default: None."""
        return None

    def item_readouts(self, text_emb: Emb, video_emb: Emb) -> dict[str, float]:
        """Quantities over all encoded texts and videos of a split (e.g. UATVR's geometric mean of
        sigma, its Fig. 3), logged beside the metrics like :meth:`pair_readouts`. Default: none."""
        return {}

    def rerank(self, sim: Tensor, text_emb: Emb, video_emb: Emb) -> Reranked | None:
        """A re-ranking of the full raw score matrix ``sim`` (n_text, n_video), for heads whose
        inference step needs a query's whole candidate set (DUQ's Eq. 16); evaluation reports it
        under ``t2v_rerank`` / ``v2t_rerank`` beside the raw metrics. ``text_emb`` / ``video_emb``
        are every item's embeddings, on the CPU. Default: None (no re-ranking)."""
        return None

    def logits_scale(self) -> Tensor:
        """The multiplier of similarities inside the contrastive loss."""
        return self.logit_scale.exp().clamp(max=100.0)  # CLIP clamps its learned scale at 100

    def loss(self, texts: TextBatch, videos: VideoBatch) -> LossOutput:
        """Symmetric InfoNCE over the B x B similarity of a batch of matching pairs."""
        from tvrpipe.heads.losses import symmetric_infonce

        sim = self.similarity(self.encode_texts(texts), self.encode_videos(videos))  # (B, B)
        nce = symmetric_infonce(sim * self.logits_scale())
        return LossOutput(total=nce, terms={"infonce": nce.detach()})


H = TypeVar("H", bound=type[Head])
_HEADS: dict[str, type[Head]] = {}


def register_head(name: str) -> Callable[[H], H]:
    """Class decorator: register a :class:`Head` subclass under ``name``."""

    def deco(cls: H) -> H:
        if name in _HEADS:
            raise ValueError(f"head {name!r} registered twice")
        if not (dataclasses.is_dataclass(cls.Config) and cls.Config.__dataclass_params__.frozen):
            raise TypeError(f"{cls.__name__}.Config must be a frozen dataclass")
        _check_default_lr(cls)
        _check_meaning(cls)
        cls.name = name
        if "Config" in cls.__dict__:  # its own Config, not one inherited from the head it extends
            cls.Config.owner = name
        _HEADS[name] = cls
        return cls

    return deco


def _check_default_lr(cls: type[Head]) -> None:
    """``default_lr`` is a positive lr or a non-empty ``{D: lr}`` table of positive ints and lrs."""
    lrs = cls.default_lr
    table = dict(lrs) if isinstance(lrs, Mapping) else {1: lrs}
    ok = table and all(isinstance(w, int) and w > 0 for w in table) and all(
        isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0 for lr in table.values())
    if not ok:
        raise TypeError(f"{cls.__name__}.default_lr must be a positive learning rate or a non-empty "
                        f"{{embed_dim: lr}} table of positive values, not {lrs!r}")


def _check_meaning(cls: type[Head]) -> None:
    """The head states what its score means (its own words, not a parent's), its score range as (low, high)
    with None for an unbounded side, and what its uncertainty means where it reports one."""
    words = cls.__dict__.get("score_meaning")
    if not isinstance(words, str) or not words.strip():
        raise TypeError(f"{cls.__name__}.score_meaning must say, in one sentence of its own, what the head's score "
                        "of a (text, video) pair is and which way ranks first (docs/search.md lists them)")
    low, high = rng = cls.score_range if isinstance(cls.score_range, tuple) and len(cls.score_range) == 2 else (0, 0)
    ok = all(b is None or (isinstance(b, (int, float)) and math.isfinite(b)) for b in rng)
    if not ok or (low is not None and high is not None and low >= high):
        raise TypeError(f"{cls.__name__}.score_range must be (low, high), low < high, None for an unbounded side, "
                        f"not {cls.score_range!r}")
    if cls.pair_uncertainty is not Head.pair_uncertainty and not (
            isinstance(cls.uncertainty_meaning, str) and cls.uncertainty_meaning.strip()):
        raise TypeError(f"{cls.__name__} reports a pair_uncertainty: its uncertainty_meaning must say what it is and "
                        "which way is less certain")


def list_heads() -> list[str]:
    """Names of the registered heads, sorted."""
    _import_all()
    return sorted(_HEADS)


def head_class(name: str) -> type[Head]:
    """The class registered under ``name``; raises ConfigError naming the known heads."""
    _import_all()
    if name not in _HEADS:
        raise ConfigError(f"unknown method {name!r}; known: {', '.join(sorted(_HEADS))}")
    return _HEADS[name]


def make_config(name: str, **overrides: Any) -> HeadConfig:
    """The head's default config with ``overrides`` applied; unknown keys fail loudly."""
    cls = head_class(name)
    fields = {f.name: f for f in dataclasses.fields(cls.Config)}
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ConfigError(f"{name}: unknown config key(s) {unknown}; valid: {', '.join(sorted(fields))}")
    return dataclasses.replace(cls.Config(), **overrides)


def clip_head_config(name: str, embed_dim: int, logit_scale: float | None,
                     overrides: dict[str, Any] | None = None) -> HeadConfig:
    """The config of head ``name`` on the features of a CLIP: what it takes from that CLIP, then the
    user's ``overrides`` (``--set``; they always win, and unknown keys fail).

    ``embed_dim`` is D; ``logit_scale`` is CLIP's learned scale as its parameter stores it (a store's
    ``logit_scale`` provenance, :attr:`tvrpipe.features.clip.ClipBundle.logit_scale`): the papers'
    heads reuse CLIP's scale (log 100 for OpenAI's weights), so it is every head's ``logit_scale_init``.
    None (a generated store, or one extracted before the scale was recorded) keeps CLIP's initial
    log(1/0.07).

    Raises:
        ConfigError: an unknown key, or a value the config or the head refuses.
    """
    from_clip: dict[str, Any] = {"embed_dim": int(embed_dim)}
    if logit_scale is not None:
        from_clip["logit_scale_init"] = float(logit_scale)
    return make_config(name, **{**from_clip, **(overrides or {})})


def create_head(name: str, **overrides: Any) -> Head:
    """Build a registered head with its default config plus ``overrides``.

    Example:
        >>> head = create_head("meanpool", embed_dim=512)  # doctest: +SKIP
    """
    return head_class(name)(make_config(name, **overrides))


def _import_all() -> None:
    # Importing the package registers every head (one import line per head in heads/__init__.py).
    import tvrpipe.heads  # noqa: F401
