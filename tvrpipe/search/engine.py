"""``tvrpipe search``: rank a feature store's videos for sentences (or pictures), with a trained run's head or
zero-shot CLIP.

Two stages (:func:`search`): the first ranks every video's pooled CLIP embedding against the query's
sentence embedding (:mod:`tvrpipe.search.index`, with a first stage of :mod:`tvrpipe.search.first_stages`:
exact, or an index); the run's head then scores the
``candidates`` best of them and the top ``k`` of its scores are the hits. With ``candidates`` None (or at
least the collection's size) the head scores every video (:func:`exhaustive`), in blocks of videos so
memory stays bounded: the two stages with K = n are the exhaustive search. The first stage may be split over Ray
actors (``--shards``, :mod:`tvrpipe.search.shards`); the head re-ranks their merged shortlist here all the same.

The queries are encoded by the CLIP the run learnt with, exactly as extraction encodes captions (word
tokens, mask and EOS sentence, rounded to float16 as the store holds them):

- a ``train-head`` run: the store's CLIP (the store's provenance names the weights; their sha256 is checked);
- a ``finetune --end-to-end`` run: its exported CLIP (``clip.safetensors`` in the run);
- no run: the store's CLIP, and the meanpool head untrained (zero-shot CLIP, mean-pooled).

The store must hold the features of that same CLIP (model, width, weights), or the search is refused.

A picture (``--image``) is encoded by that CLIP's image tower exactly as extraction encodes a frame
(:mod:`tvrpipe.features.images`), and its embedding stands in the sentence's place, for the first stage and the
head alike; only heads that read the sentence alone (``uses_tokens`` False) take it, treating it as the sentence
embedding (a choice: the papers search with sentences only).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pandas as pd
import torch

from tvrpipe.errors import ConfigError, RunError
from tvrpipe.features.store import FeatureStore, open_store
from tvrpipe.heads.base import Head, TextBatch
from tvrpipe.search.batches import video_batch
from tvrpipe.search.encoded import EncodedVideos, head_encodings
from tvrpipe.search.results import Hit

log = logging.getLogger(__name__)

DEFAULT_TOP_K = 10
VIDEO_BLOCK = 2048  # videos per head call: (block x F x D) float32 frames, 48 MiB at F=12, D=512
ZERO_SHOT = "zero-shot CLIP (meanpool, untrained)"
CLIP_KEYS = ("model", "embed_dim", "weights_sha256")  # what the run's CLIP and the store's must share


class Shortlister(Protocol):
    """What :func:`two_stage` needs of a first stage: one index in this process
    (:class:`~tvrpipe.search.index.FirstStage`) or one split over Ray actors
    (:class:`~tvrpipe.search.shards.ShardedFirstStage`)."""

    rows: np.ndarray  # (n,) the store row of each position

    def __len__(self) -> int: ...

    def top(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(positions into rows (Q, k), scores (Q, k))``, best first, for ``(Q, D)`` sentence embeddings."""
        ...

    def top_texts(self, texts: TextBatch, k: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`top` for a batch of queries (a first stage that reads their words takes them)."""
        ...


@dataclass
class Searcher:
    """A head, the store it searches, and how to encode queries for it.

    Attributes:
        store: the feature store searched.
        head: the scoring head, in eval mode.
        label: what ranks, for people: the run and its method, or :data:`ZERO_SHOT`.
        max_words: L, the token length queries are encoded with (the head's training length).
        clip: ``(model, pretrained, seed)`` the queries are encoded with (None: ``encode`` is not available).
        device: where the head runs.
        video_root: the folder the store's paths are relative to (for thumbnails), where known.
        run: the run directory whose head ranks (None: zero-shot); a distilled first stage is fitted to it.
    """

    store: FeatureStore
    head: Head
    label: str
    max_words: int
    clip: tuple[str, str, int] | None
    device: str = "cpu"
    video_root: Path | None = None
    run: Path | None = None
    _bundle: Any = field(default=None, repr=False)

    def encode(self, queries: Sequence[str]) -> TextBatch:
        """The queries as extraction encodes captions: word tokens, mask, EOS sentence (float16-rounded)."""
        from tvrpipe.features.clip import encode_text_tokens, tokenize

        check_queries(queries)
        bundle = self._clip_bundle("sentence")
        ids, mask = tokenize(bundle, [str(q) for q in queries], self.max_words)
        tokens, sentence = encode_text_tokens(bundle, ids)
        # the store holds float16 features: a query is rounded as the captions the head learnt from were
        return TextBatch(tokens.half().float(), mask, sentence.half().float())

    def encode_images(self, paths: Sequence[str | os.PathLike[str]]) -> TextBatch:
        """Pictures as queries: each one's CLIP image embedding, computed as extraction computes a frame's
        (:mod:`tvrpipe.features.images`) and rounded to float16 as the store holds frames, in the sentence's
        place; no word tokens (``(Q, 0, D)``), so only a head that reads the sentence alone takes it.

        Raises:
            ConfigError: the head reads word tokens (naming the heads that take pictures); a picture is missing or
                unreadable (naming it); the store's CLIP cannot be had (a generated store, a moved checkpoint).
        """
        from tvrpipe.features.clip import encode_frames
        from tvrpipe.features.images import frame_of_image, open_image

        check_image_head(self.head, self.label)
        if not paths:
            raise ConfigError("no picture: give --image PATH")
        if self.clip is None:  # a generated store: refused, naming its maker, before any picture is read
            self._clip_bundle("picture")
        images = []
        for p in paths:
            try:
                images.append(open_image(p))
            except ConfigError as e:
                raise ConfigError(f"--image {e}") from None
        bundle = self._clip_bundle("picture")
        frames = np.stack([frame_of_image(im, bundle.image_size) for im in images])  # (Q, S, S, 3) uint8
        emb = encode_frames(bundle, frames, autocast=False)  # (Q, D) float32, as extraction on a CPU
        D = emb.shape[1]
        return TextBatch(torch.zeros(len(paths), 0, D), torch.zeros(len(paths), 0, dtype=torch.bool),
                         emb.half().float())

    def share_clip(self, other: Searcher) -> bool:
        """Take ``other``'s loaded query CLIP where it is the one this store records (a store reopened after an
        extract): no second load. Returns whether it was taken."""
        if (other._bundle is None or other.clip is None or other.clip != self.clip
                or other._bundle.weights_sha256 != self.store.provenance.get("weights_sha256")):
            return False
        self._bundle = other._bundle
        return True

    def _clip_bundle(self, what: str) -> Any:
        """The store's CLIP (loaded once, its weights' sha256 checked against the store's), to encode a ``what``."""
        if self.clip is None:
            raise ConfigError(f"--features {self.store.dir} was generated by `{self.store.made_by}`: its features are "
                              f"of no CLIP, so no {what} can be encoded to search them; search a store of "
                              "`tvrpipe extract`")
        from tvrpipe.features.clip import load_clip

        if self._bundle is None:
            model, pretrained, seed = self.clip
            try:
                self._bundle = load_clip(model, pretrained, device="cpu", seed=seed)
            except ConfigError as e:  # a checkpoint moved since extraction, or a relative path from elsewhere
                raise ConfigError(f"the queries need the CLIP of --features {self.store.dir}, which cannot be "
                                  f"loaded ({e}); pass --pretrained with its checkpoint") from None
            want = self.store.provenance.get("weights_sha256")
            if self._bundle.weights_sha256 != want:
                raise ConfigError(
                    f"the CLIP weights at {pretrained!r} are not those of --features {self.store.dir} (sha256 "
                    f"{self._bundle.weights_sha256[:12]} vs the store's {str(want)[:12]}); pass --pretrained with "
                    "the checkpoint the store was extracted with")
        return self._bundle


def image_heads() -> list[str]:
    """The registered heads that take a picture as the query: those reading the sentence embedding alone."""
    from tvrpipe.heads.base import head_class, list_heads

    return [name for name in list_heads() if not head_class(name).uses_tokens]


def check_image_head(head: Head, label: str) -> None:
    """A picture has no word tokens: only a head that reads the sentence embedding alone (``uses_tokens``
    False) takes one, with the picture's embedding as the sentence's.

    Raises:
        ConfigError: naming what ranks and the heads that take pictures.
    """
    if head.uses_tokens:
        raise ConfigError(f"--image: {label} reads the query's word tokens, which a picture does not have; search "
                          "pictures zero-shot (without --run), or with a run of a head that reads the sentence "
                          f"embedding alone: {', '.join(image_heads())}")


def check_queries(queries: Sequence[str]) -> None:
    """At least one query, none empty (white space only counts as empty).

    Raises:
        ConfigError: naming the empty query's position.
    """
    if not queries:
        raise ConfigError("no query: give one or more sentences, or --queries FILE (one per line)")
    for i, q in enumerate(queries):
        if not str(q).strip():
            raise ConfigError(f"query {i + 1} is empty: every query needs words to search for")


def read_queries(path: str | os.PathLike[str]) -> list[str]:
    """One query per line of a UTF-8 text file; blank lines and lines starting with ``#`` are skipped.

    Raises:
        ConfigError: the file cannot be read or holds no query.
    """
    from tvrpipe.data.manifest import read_text_file
    from tvrpipe.errors import ManifestError

    try:
        text = read_text_file(path)
    except ManifestError as e:
        raise ConfigError(f"--queries {e}") from None
    queries = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if not queries:
        raise ConfigError(f"--queries {path}: no query in it (one sentence per line)")
    return queries


def check_collection_unchanged(store: FeatureStore, video_root: Path | None, pretrained: str | None = None) -> None:
    """A collection's files are as extraction found them (size and modification time), so no hit is served
    from features of a file changed or removed since. A folder that is not reachable here (another machine,
    an unmounted disk) is not checked: the hits name files the store describes.

    Raises:
        ConfigError: files changed or were removed; naming the first few and the two commands to rerun, complete
            (the manifest folder, video folder and extract settings the store records; ``pretrained``: where its
            CLIP checkpoint is now).
    """
    import shlex

    from tvrpipe.features.collection import changed_files, describe_changes
    from tvrpipe.features.extract import MANIFEST_PLACEHOLDER, rebuild_command

    if store.provenance.get("kind") != "collection" or not {"bytes", "mtime_ns"} <= set(store.videos.columns):
        return
    if video_root is None or not video_root.is_dir():
        log.warning("%s: the collection's folder %s is not reachable here; its files are not checked for changes",
                    store.dir, video_root)
        return
    changed, gone = changed_files(store.videos, video_root)
    if changed or gone:
        manifest = store.provenance.get("manifest") or MANIFEST_PLACEHOLDER
        build = shlex.join(["tvrpipe", "manifest", "build", "--videos", str(video_root), "--out", str(manifest)])
        raise ConfigError(
            f"{len(changed) + len(gone)} videos of the collection in --features {store.dir} changed or were removed "
            f"under {video_root} since they were extracted ({describe_changes(changed, gone)}): update the store with "
            f"`{build}` and `{rebuild_command(store, video_root, pretrained)}` (only changed and new videos are "
            "encoded)" + ("" if manifest != MANIFEST_PLACEHOLDER else
                          f"; {MANIFEST_PLACEHOLDER}: a folder for the collection's manifest (the store records none)"))


def _selected_head(run: Path, device: str) -> tuple[Head, dict, dict]:
    from tvrpipe.rundir import BEST, CHECKPOINTS, check_checkpoint_sha, load_head, read_config, read_metrics

    config = read_config(run)
    metrics = read_metrics(run)
    if metrics is None:
        raise RunError(f"--run {run} has not finished training (no metrics.json): finish it (rerun the same "
                       "command, it resumes) before searching with it")
    check_checkpoint_sha(run, metrics)
    return load_head(run / CHECKPOINTS / BEST, device), config, metrics


def open_searcher(features: str | os.PathLike[str], run: str | os.PathLike[str] | None = None,
                  device: str = "cpu", pretrained: str | None = None,
                  video_root: str | os.PathLike[str] | None = None) -> Searcher:
    """The store, the head and the query encoder of a search, everything checked before any query is encoded.

    Args:
        features: the feature store to search (``tvrpipe extract --out``).
        run: a ``train-head`` or ``finetune`` run directory; None: zero-shot CLIP, mean-pooled.
        device: where the head runs.
        pretrained: where the store's CLIP weights are, when its provenance's path no longer reaches them
            (a moved checkpoint); their sha256 must be the store's.
        video_root: where the collection's files are now, when they moved since extraction (default: the
            folder the store records): its files are checked for changes there, and thumbnails read there.

    Raises:
        StoreError: the store is missing, incomplete or damaged.
        RunError: the run is unfinished, damaged, or a finetune run whose export is missing.
        ConfigError: the store holds no videos, or features of another CLIP than the run's; ``video_root``
            is not a folder; a collection's files changed since extraction.
    """
    from tvrpipe.heads.base import clip_head_config, head_class

    store = open_store(features)
    prov = store.provenance
    if int(prov.get("n_videos", len(store.videos))) == 0:
        raise ConfigError(f"--features {store.dir} holds no videos: there is nothing to search")
    D = int(prov["embed_dim"])
    clip = None if "generator" in prov else (str(prov["model"]), str(pretrained or prov["pretrained"]),
                                             int(prov.get("seed", 0)))
    if video_root is not None:
        video_root = Path(video_root)
        if not video_root.is_dir():
            raise ConfigError(f"--video-root {video_root} is not a folder")
    else:
        root = prov.get("video_root")
        video_root = Path(root) if root else None
    check_collection_unchanged(store, video_root, pretrained)
    if run is None:
        head = head_class("meanpool")(clip_head_config("meanpool", D, prov.get("logit_scale")))
        return Searcher(store, head.to(device).eval(), ZERO_SHOT, int(prov["max_words"]), clip, device, video_root)

    run = Path(run)
    head, config, metrics = _selected_head(run, device)
    want = {**(config.get("provenance") or {}), **(metrics.get("provenance") or {})}
    diff = [f"{k} {want[k]!r} vs the store's {prov.get(k)!r}" for k in CLIP_KEYS
            if k in want and want[k] != prov.get(k) and not (k == "model" and same_architecture(want[k], prov))]
    if diff:
        raise ConfigError(_other_clip(run, config, metrics, want, store, diff))
    if "finetune" in config and config["finetune"].get("end_to_end"):
        export = metrics.get("export")
        file = run / export["file"] if isinstance(export, dict) and export.get("file") else None
        if file is None or not file.is_file():
            raise RunError(f"--run {run} finetuned CLIP end to end but its exported CLIP "
                           f"({file or run / 'clip.safetensors'}) is missing: queries need the run's CLIP; "
                           "train the run again into a new --out")
        clip = (str(export["model"]), str(file), 0)
    label = f"{config['method']} ({run})"
    return Searcher(store, head, label, int(want.get("max_words", prov["max_words"])), clip, device, video_root, run)


def _other_clip(run: Path, config: dict, metrics: dict, want: Mapping[str, Any], store: FeatureStore,
                diff: list[str]) -> str:
    """Why a run cannot search a store of another CLIP, and what works: the store extracted with the run's CLIP
    (the complete command: the store's videos, the run's weights, frames and words), or the run's own store."""
    from tvrpipe.features.extract import extract_command
    from tvrpipe.features.store import STORE_NAME, StoreError, store_attributes
    from tvrpipe.rundir import run_clip
    from tvrpipe.worlds.features import MODEL as GENERATED

    prov = store.provenance
    why = f"--run {run} learnt with another CLIP than --features {store.dir} holds ({'; '.join(diff)})"
    same_way = "a generated store can only be searched by a run trained on a store generated the same way"
    if want.get("model") == GENERATED:
        if "generator" in prov:
            return (f"{why}: {same_way} (the same generator settings), and `tvrpipe search` encodes no sentence for "
                    "generated features: it needs a store of `tvrpipe extract` and a run trained on one")
        return (f"{why}: the run learnt on generated features, of no CLIP ({same_way}); a store of `tvrpipe extract` "
                f"is searched by a run trained on features of its CLIP: train one on this store (`tvrpipe train-head "
                f"--features {store.dir} --method {config.get('method')} --out NEW_RUN_DIR`)")
    clip = run_clip(run, config, metrics)
    own = clip.features if clip.features and (Path(clip.features) / STORE_NAME).is_dir() else None
    seed = clip.seed
    if own is not None and clip.pretrained == "none":  # random weights: the seed of its store rebuilds them
        try:
            seed = int(store_attributes(own).get("seed") or 0)
        except StoreError:
            pass
    settings = {"manifest": prov.get("manifest"), "video_root": prov.get("video_root"), "model": clip.model,
                "pretrained": clip.pretrained, "seed": seed,
                "frames": want.get("frames", prov.get("frames")), "max_words": want.get("max_words", prov.get("max_words"))}
    if "generator" in prov:  # its videos are not files: the run's own videos, where it records them
        settings.update(manifest=clip.manifest, video_root=clip.video_root)
    what = (f"--features {store.dir} was generated by `{store.made_by}`, of no CLIP ({same_way}); search a store "
            "of your videos" if "generator" in prov else "search a store of these videos")
    return (f"{why}: the run's CLIP is {clip.source}; {what} extracted with it: "
            f"`{extract_command(settings, 'NEW_STORE_DIR')}`" + (f", or the store the run trained on (--features "
                                                                f"{own})" if own is not None else ""))


def same_architecture(run_model: str, store: Mapping[str, Any]) -> bool:
    """Whether a run's CLIP architecture is the store's. A run that loaded QuickGELU weights from their tag
    (ViT-B-32 ``openai``) records the name that rebuilds them from a file, ``ViT-B-32-quickgelu``; a store
    extracted from that tag records ``ViT-B-32`` and ran QuickGELU all the same (their weights' sha256 is
    compared apart)."""
    model = str(store.get("model"))
    if run_model == model:
        return True
    if run_model != f"{model}-quickgelu":
        return False
    import open_clip

    tag = str(store.get("pretrained"))
    return tag in open_clip.list_pretrained_tags_by_model(model) and bool(
        open_clip.get_pretrained_cfg(model, tag).get("quick_gelu"))


# ------------------------------------------------------------------------------------------- ranking


def _top(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``k`` of each row, best first; equal scores keep the lower position first (stable)."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    return torch.gather(scores, 1, order), order


@dataclass
class Ranked:
    """Per query: the store rows of its hits, best first, their scores and uncertainties (NaN: none)."""

    rows: np.ndarray  # (Q, k) int64
    scores: np.ndarray  # (Q, k) float32
    uncertainty: np.ndarray  # (Q, k) float32
    candidates: int  # videos the head scored per query


def encoded_block(head: Head, store: FeatureStore, rows: np.ndarray, device: str = "cpu",
                  encoded: EncodedVideos | None = None) -> dict[str, torch.Tensor]:
    """The head's encodings of store rows ``rows``: read from ``encoded`` where given (the head's encodings kept
    beside the store, :mod:`tvrpipe.search.encoded`), else encoded from their frames."""
    if encoded is not None:
        return encoded.batch(rows, device)
    return head.encode_videos(video_batch(store, rows).to(device))


@torch.inference_mode()
def exhaustive(head: Head, texts: TextBatch, store: FeatureStore, rows: np.ndarray, k: int,
               device: str = "cpu", encoded: EncodedVideos | None = None) -> Ranked:
    """The head scores every video of ``rows`` for every query; the ``k`` best per query. The running top k
    is merged block by block, so memory is one block of scores, not the (Q, n) matrix. ``encoded``: the head's
    encodings of the videos, read instead of encoding their frames (:func:`encoded_block`)."""
    te = head.encode_texts(texts.to(device))
    Q = len(texts)
    best_s = torch.full((Q, 0), -torch.inf)
    best_p = torch.zeros((Q, 0), dtype=torch.long)
    best_u = torch.zeros((Q, 0))
    for a in range(0, len(rows), VIDEO_BLOCK):
        ve = encoded_block(head, store, rows[a : a + VIDEO_BLOCK], device, encoded)
        s = head.similarity(te, ve).float().cpu()
        u = head.pair_uncertainty(te, ve)
        u = torch.full_like(s, torch.nan) if u is None else u.float().cpu()
        pos = torch.arange(a, a + s.shape[1]).expand(Q, -1)
        s, p, u = torch.cat([best_s, s], 1), torch.cat([best_p, pos], 1), torch.cat([best_u, u], 1)
        best_s, order = _top(s, k)
        best_p, best_u = torch.gather(p, 1, order), torch.gather(u, 1, order)
    return Ranked(rows[best_p.numpy()], best_s.numpy(), best_u.numpy(), len(rows))


@torch.inference_mode()
def two_stage(head: Head, texts: TextBatch, store: FeatureStore, stage: Shortlister, k: int, candidates: int,
              device: str = "cpu", encoded: EncodedVideos | None = None) -> Ranked:
    """The first stage's ``candidates`` best videos per query, re-ranked by the head; the ``k`` best per query.

    A head whose score is the first stage's own cosine (meanpool, zero-shot CLIP: ``ranks_as_first_stage``) keeps
    the first stage's order and cosines, and no frame is read. Another head scores every query against the union
    of the queries' shortlists, block by block as the
    exhaustive search scores every video, and each query keeps its own shortlist's scores: a head's
    per-video work (X-Pool's Gram matrices, a transformer over frames) is done once per shortlisted video
    however many queries shortlist it, and the work is never more than the exhaustive search's. ``encoded``: the
    head's encodings of the videos, read instead of encoding the shortlisted videos' frames (:func:`encoded_block`).
    """
    K = min(candidates, len(stage))
    pos, first = stage.top_texts(texts, K)  # (Q, K) positions into stage.rows
    if keeps_first_stage(head, stage):  # the head's scores are these: its ranking of the K is theirs
        top = min(k, K)
        return Ranked(stage.rows[pos[:, :top]], first[:, :top].astype(np.float32),
                      np.full((len(texts), top), np.nan, np.float32), K)
    union, inverse = np.unique(pos, return_inverse=True)
    inverse = inverse.reshape(pos.shape)
    urows = stage.rows[union]
    te = head.encode_texts(texts.to(device))
    scores = torch.empty(len(texts), len(union))
    unc = torch.full((len(texts), len(union)), torch.nan)
    for a in range(0, len(union), VIDEO_BLOCK):
        ve = encoded_block(head, store, urows[a : a + VIDEO_BLOCK], device, encoded)
        s = head.similarity(te, ve).float().cpu()
        scores[:, a : a + s.shape[1]] = s
        u = head.pair_uncertainty(te, ve)
        if u is not None:
            unc[:, a : a + s.shape[1]] = u.float().cpu()
    rows, top_scores, top_unc = [], [], []
    for q in range(len(texts)):
        # the shortlist in row order before the stable sort, so ties break as in the exhaustive search
        cols = torch.from_numpy(np.sort(inverse[q]))
        top_s, order = _top(scores[q : q + 1, cols], k)
        picked = cols[order[0]]
        rows.append(urows[picked.numpy()])
        top_scores.append(top_s[0].numpy())
        top_unc.append(unc[q, picked].numpy())
    return Ranked(np.stack(rows), np.stack(top_scores), np.stack(top_unc), K)


def check_top_k(k: int, n: int, store: FeatureStore, what: str = "searchable videos", option: str = "--top-k") -> None:
    """``--top-k`` between 1 and ``n``, the store's searchable videos (or its videos, ``what``); ``option``: how
    the user gave k (``k=`` in a server's request).

    Raises:
        ConfigError: naming both numbers.
    """
    if k < 1:
        raise ConfigError(f"{_given(option, k)}: ask for at least 1 hit")
    if k > n:
        raise ConfigError(f"{_given(option, k)} is more than the {n} {what} of --features {store.dir}; "
                          f"ask for at most {n}")


def _given(option: str, k: int | str) -> str:
    """``--top-k 20`` on the command line, ``k=20`` in a request's address."""
    return f"{option} {k}" if option.startswith("-") else f"{option}={k}"


def hits_asked(k: int | None, searchable: int, store: FeatureStore, candidates: int | None,
               option: str = "--top-k") -> int:
    """The hits a search returns for a query: ``k``, or :data:`DEFAULT_TOP_K` (every video of a smaller store)
    when None; checked against the store's videos, its ``searchable`` videos and the ``candidates`` the head
    re-ranks, in that order (``tvrpipe search`` and ``tvrpipe serve`` refuse alike; ``option``: how the user gave
    k).

    Raises:
        ConfigError: k out of range, or more than the candidates.
    """
    if k is None:  # not asked: the default is said as such, not as an option the user never typed
        k = min(DEFAULT_TOP_K, searchable)
        if candidates is not None and candidates < k:
            raise ConfigError(f"--candidates {candidates} is fewer than the {k} hits a query returns by default: "
                              f"give at least {k} candidates, or ask for fewer hits ({_given(option, 'N')})")
        return k
    check_top_k(k, int(store.provenance.get("n_videos", len(store.videos))), store, "videos", option)
    check_candidates(candidates, k, option)
    check_top_k(k, searchable, store, option=option)
    check_candidates(candidates, k, option)
    return k


@dataclass(frozen=True)
class Found:
    """What :func:`search` found, and how.

    Attributes:
        hits: one :class:`Hit` per query and rank, queries in order, best first (those scoring below
            ``min_score`` cut).
        searchable: the store's videos with a decoded frame (the others cannot match).
        candidates: the videos the head scored per query: K of the two stages, or ``searchable`` when it
            scored every one (no K, or K at least the searchable videos).
        min_score: the score below which hits were cut (None: none were).
        cut: per query, the hits of its top k that scored below ``min_score`` (queries with none left out).
        top_k: the hits asked for per query, before the cut.
        per_video: at most this many hits of one file per query (its best moments); None: no limit.
        shards: the Ray actors the first stage was split over (:mod:`tvrpipe.search.shards`); None: one index
            in this process.
        encoded: the head read its kept encodings of the videos (:mod:`tvrpipe.search.encoded`), not their frames.
    """

    hits: list[Hit]
    searchable: int
    candidates: int
    min_score: float | None = None
    cut: Mapping[str, int] = field(default_factory=dict)
    top_k: int = 0
    per_video: int | None = None
    shards: int | None = None
    encoded: bool = False

    @property
    def exhaustive(self) -> bool:
        return self.candidates >= self.searchable

    def note(self, query: str) -> str | None:
        """What ``--min-score`` cut from ``query``'s hits, for people; None where it cut nothing."""
        n = self.cut.get(query, 0)
        if not n:
            return None
        if n == self.top_k:
            return f"no hit scored at least --min-score {self.min_score:.10g}: all {n} of the top {self.top_k} cut"
        return (f"{n} of the top {self.top_k} hits scored below --min-score {self.min_score:.10g} and "
                f"{'was' if n == 1 else 'were'} cut")


def check_min_score(searcher: Searcher, min_score: float, option: str = "--min-score") -> None:
    """``--min-score`` a finite number inside the bounds of the head's scores (:meth:`Head.score_bounds`): above
    them it would cut every hit, below them none. Scores compare within one head only, so the bounds are the
    ranking head's (with ``zero_shot_start``, those of its mix). ``option``: how the user gave it (``min_score``
    in a server's request, named ``min_score=X``).

    Raises:
        ConfigError: naming the value, what ranks, and the head's range.
    """
    import math

    if not math.isfinite(min_score):
        raise ConfigError(f"{_given(option, str(min_score))}: a finite number is needed")
    low, high = searcher.head.score_bounds()
    if (low is None or min_score >= low) and (high is None or min_score <= high):
        return
    span = (f"from {low:g} to {high:g}" if low is not None and high is not None
            else f"at most {high:g}" if high is not None else f"at least {low:g}")
    what = "every hit" if high is not None and min_score > high else "no hit"
    raise ConfigError(f"{_given(option, f'{min_score:.10g}')} is outside the scores of {searcher.label}, which "
                      f"are {span} ({searcher.head.meaning()}): it would cut {what}; each head scores on its own "
                      f"scale, so give a value {span}")


def search(searcher: Searcher, queries: Sequence[str], k: int | None = None, candidates: int | None = None,
           first_stage: str = "auto", index: str | os.PathLike[str] | None = None,
           texts: TextBatch | None = None, first_stage_settings: Sequence[str] | Mapping[str, Any] = (),
           min_score: float | None = None, images: bool = False, per_video: int | None = None,
           shards: int | None = None, address: str | None = None, progress: bool = False,
           encoded_videos: bool = False) -> Found:
    """The ``k`` best videos of the store for each query.

    Args:
        searcher: from :func:`open_searcher`.
        queries: the sentences.
        k: hits per query; None: :data:`DEFAULT_TOP_K`, or every video of a smaller store.
        candidates: K, the shortlist the head re-ranks; None (or >= the searchable videos): every video.
        first_stage: ``auto`` or a registered first stage (:func:`~tvrpipe.search.first_stages.list_first_stages`).
        index: an index exported by ``tvrpipe export --format faiss``: the first stage (``first_stage``
            must then be left at ``auto``).
        texts: the queries already encoded (:meth:`Searcher.encode`); encoded here when None.
        first_stage_settings: the first stage's settings over its Config's defaults (``KEY=VALUE`` items or a
            mapping); with ``index``, its search-time ones only.
        min_score: cut the hits scoring below it, after ranking (a query may keep fewer than ``k``, or none);
            None: keep all ``k``.
        images: ``queries`` are paths of pictures, encoded by :meth:`Searcher.encode_images` (their CLIP image
            embedding in the sentence's place, for the first stage and the head alike).
        per_video: keep at most this many hits of one file per query, its best (a collection cut into moments:
            the best N moments of each file); the ranking goes deep enough that the k hits kept are the k best
            under that limit (within the shortlist, with ``candidates``). None: no limit.
        shards: split the first stage over this many Ray actors (:mod:`tvrpipe.search.shards`), each building its
            part of the store's searchable videos; the head re-ranks their merged shortlist here. Needs
            ``address`` and ``candidates``; None: one index in this process.
        address: the Ray cluster of ``shards`` (``auto``, ``HOST:PORT``, or ``local``: a Ray started here).
        progress: a bar while the first stage's index is built (it is kept beside the store: built once), and
            while the videos are encoded for ``encoded_videos``.
        encoded_videos: the head reads its encodings of the videos, kept beside the store
            (:mod:`tvrpipe.search.encoded`: encoded once, on the first such search), instead of encoding the
            candidates' frames for every search; a search whose ranking is the first stage's reads neither.

    Returns:
        The hits (one per query and rank, queries in order, best first), how many videos were scored, and how
        many hits ``min_score`` cut.

    Raises:
        ConfigError: an empty query, ``k`` or ``candidates`` out of range, both ``index`` and a ``first_stage``,
            a first stage that cannot be had (checked before the first stage is built where the store's
            size is enough to tell), a ``min_score`` outside the head's scores (:func:`check_min_score`), or a
            picture that cannot be searched (:meth:`Searcher.encode_images`); all before the index is built.
            ``shards`` without ``address`` (or the other way round), below 1, with ``index`` or without
            ``candidates``; above the searchable videos, or an unreachable ``address`` (before any shard is built).
            ``encoded_videos`` without a run, or where the disk cannot hold the encodings.
    """
    from tvrpipe.search.index import exported_stage
    from tvrpipe.search.shards import sharded_first_stage

    store = searcher.store
    check_search(searcher, queries, k, candidates, first_stage, index, first_stage_settings, min_score, per_video,
                 shards, address, encoded_videos)
    # the queries first: a store whose sentences cannot be encoded (a generated one, a moved checkpoint) is refused
    # before its index is written
    if texts is None:
        texts = searcher.encode_images(queries) if images else searcher.encode(queries)
    if shards is not None:
        stage = sharded_first_stage(store, first_stage, first_stage_settings, shards, address, candidates)
    else:
        stage = (exported_stage(index, store, first_stage_settings) if index is not None
                 else first_stage_for(store, first_stage, first_stage_settings, searcher.head, searcher.run,
                                      progress))
    k = hits_asked(k, len(stage), store, candidates)
    depth = ranking_depth(store.videos, k, per_video, len(stage) if candidates is None else min(candidates, len(stage)))
    whole = candidates is None or candidates >= len(stage)
    encoded = kept_encodings(searcher, stage, candidates, progress) if encoded_videos else None
    if whole:
        ranked = exhaustive(searcher.head, texts, store, stage.rows, depth, searcher.device, encoded)
    else:
        ranked = two_stage(searcher.head, texts, store, stage, depth, candidates, searcher.device, encoded)
    hits = hits_of(queries, ranked, store.videos)
    if per_video is not None:
        hits = per_file(hits, per_video, k)
    return replace(cut_below(hits, min_score, len(stage), ranked.candidates, k, per_video), shards=shards,
                   encoded=encoded is not None)


def check_search(searcher: Searcher, queries: Sequence[str], k: int | None, candidates: int | None, first_stage: str,
                 index: str | os.PathLike[str] | None, first_stage_settings: Sequence[str] | Mapping[str, Any],
                 min_score: float | None, per_video: int | None, shards: int | None, address: str | None,
                 encoded_videos: bool = False) -> None:
    """Every option of :func:`search` that can be checked before a query is encoded or an index built (its
    Raises says what is refused)."""
    from tvrpipe.search.first_stages import resolve_first_stage, stage_config
    from tvrpipe.search.shards import check_sharding

    check_queries(queries)
    if encoded_videos:
        check_encoded(searcher)
    if per_video is not None and per_video < 1:
        raise ConfigError(f"--per-video {per_video}: keep at least 1 hit of a file")
    if candidates is not None and candidates < 1:
        raise ConfigError(f"--candidates {candidates}: the head needs at least 1 candidate per query")
    if index is not None and first_stage != "auto":
        raise ConfigError(f"--index {index} is the first stage; leave out --first-stage {first_stage}")
    check_sharding(shards, address, candidates, index)
    if index is None:  # an unknown name, a missing library or an unknown setting: refused before the queries
        stage_config(resolve_first_stage(first_stage, searcher.head if searcher.run else None), first_stage_settings)
        check_head_aware(searcher, first_stage, candidates, shards)
    if min_score is not None:
        check_min_score(searcher, min_score)
    if k is not None:  # the store's size bounds the searchable videos: refused before any index is built
        store = searcher.store
        check_top_k(k, int(store.provenance.get("n_videos", len(store.videos))), store, "videos")
        check_candidates(candidates, k)


def check_encoded(searcher: Searcher) -> None:
    """``--encoded-videos`` needs a run's head.

    Raises:
        ConfigError: zero-shot search, whose pooled frames the store already holds.
    """
    if searcher.run is None:
        raise ConfigError("--encoded-videos keeps a trained head's encodings of the videos: give --run (zero-shot "
                          "search ranks the pooled frames, which the store already holds)")


def kept_encodings(searcher: Searcher, stage: Any, candidates: int | None,
                   progress: bool = False) -> EncodedVideos | None:
    """The run's head's encodings of the store's videos (made and kept on first use, :mod:`tvrpipe.search.encoded`)
    where a search with ``stage`` and ``candidates`` reads videos; None where its ranking is the first stage's."""
    check_encoded(searcher)
    if candidates is not None and candidates < len(stage) and keeps_first_stage(searcher.head, stage):
        return None
    return head_encodings(searcher.store, searcher.head, searcher.run, progress)


def first_stage_for(store: FeatureStore, first_stage: str, settings: Sequence[str] | Mapping[str, Any] = (),
                    head: Head | None = None, run: str | os.PathLike[str] | None = None, progress: bool = False) -> Any:
    """The first stage ``first_stage`` over ``store``: a head-aware one (``distilled``, ``head-embedding``) built
    from ``run``'s ``head`` (:func:`tvrpipe.search.distilled.head_stage`), any other the store's own
    (:func:`tvrpipe.search.index.first_stage`).

    Raises:
        ConfigError: a head-aware first stage without a run (zero-shot search); as the builders raise.
    """
    from tvrpipe.search.distilled import head_stage
    from tvrpipe.search.first_stages import first_stage_class, resolve_first_stage, stage_config
    from tvrpipe.search.first_stages.base import head_aware_refusal
    from tvrpipe.search.index import first_stage as make_stage

    cls = first_stage_class(resolve_first_stage(first_stage, head if run is not None else None))
    if not cls.head_aware:
        return make_stage(store, first_stage, settings=settings, progress=progress)
    if run is None or head is None:
        raise ConfigError(head_aware_refusal(cls.name))
    return head_stage(store, head, run, cls.name, stage_config(cls.name, settings), progress=progress)


def shortlist_is_head_aware(stage: Any) -> bool:
    """Whether ``stage`` is built from a run's head (distilled, head-embedding), not from the pooled cosine."""
    return bool(getattr(getattr(stage, "index", None), "head_aware", False))


def keeps_first_stage(head: Head, stage: Any) -> bool:
    """Whether the two stages keep the first stage's order and scores (no frame read): the head scores as the
    pooled first stage does (meanpool), or the first stage is the head's own index (``ranks_as_head``)."""
    if getattr(getattr(stage, "index", None), "ranks_as_head", False):
        return True
    return head.ranks_as_first_stage and not shortlist_is_head_aware(stage)


def check_head_aware(searcher: Searcher, first_stage: str, candidates: int | None, shards: int | None) -> None:
    """A first stage built from a run's head (``distilled``, ``head-embedding``) needs that run, a shortlist, and
    one process.

    Raises:
        ConfigError: zero-shot (no ``--run``), no ``--candidates`` (the head would score every video: nothing
            to shortlist, and the distilled stage would be built for nothing), or ``--shards`` beside it.
    """
    from tvrpipe.search.first_stages import first_stage_class, resolve_first_stage
    from tvrpipe.search.first_stages.base import head_aware_refusal

    cls = first_stage_class(resolve_first_stage(first_stage, searcher.head if searcher.run else None))
    if not cls.head_aware:
        return
    if searcher.run is None:
        raise ConfigError(head_aware_refusal(cls.name))
    if candidates is None:
        raise ConfigError(f"--first-stage {cls.name} shortlists the videos the head re-ranks: give --candidates K "
                          f"(without it the head scores every video)")
    if shards is not None:
        raise ConfigError(f"--first-stage {cls.name} runs in this process: leave out --shards {shards}")


def cut_below(hits: list[Hit], min_score: float | None, searchable: int, candidates: int, k: int,
              per_video: int | None = None) -> Found:
    """The :class:`Found` of ranked ``hits`` (queries in order, best first) with those scoring below ``min_score``
    cut (None: none cut); the other fields as :class:`Found` names them."""
    if min_score is None:
        return Found(hits, searchable, candidates, top_k=k, per_video=per_video)
    cut: dict[str, int] = {}
    for h in hits:  # each query's hits are best first: the cut is a tail, and the ranks kept stay 1, 2, ...
        if h.score < min_score:
            cut[h.query] = cut.get(h.query, 0) + 1
    return Found([h for h in hits if h.score >= min_score], searchable, candidates, min_score, cut, k, per_video)


def ranking_depth(videos: pd.DataFrame, k: int, per_video: int | None, limit: int) -> int:
    """How deep to rank so that the ``k`` best hits with at most ``per_video`` of one file are among the ranked:
    each file kept can push past at most (its moments - ``per_video``) of its own, so ``k`` x (the most moments of
    one file - ``per_video`` + 1) rows suffice; at most ``limit`` (the searchable videos, or the shortlist)."""
    if per_video is None or "path" not in videos.columns or len(videos) == 0:
        return k
    most = int(videos["path"].value_counts().max())
    return min(limit, k * max(1, most - per_video + 1))


def per_file(hits: list[Hit], per_video: int, k: int) -> list[Hit]:
    """Each query's hits (best first), at most ``per_video`` of one file and ``k`` in all, ranked 1, 2, ... again."""
    out, kept, seen = [], {}, {}
    for h in hits:
        n = seen.setdefault(h.query, {})
        if n.get(h.path, 0) >= per_video or kept.get(h.query, 0) >= k:
            continue
        n[h.path] = n.get(h.path, 0) + 1
        kept[h.query] = kept.get(h.query, 0) + 1
        out.append(replace(h, rank=kept[h.query]))
    return out


def check_candidates(candidates: int | None, k: int, option: str = "--top-k") -> None:
    """Refuse a shortlist of ``candidates`` shorter than the ``k`` hits asked for (``option``: how k was given)."""
    if candidates is not None and candidates < k:
        raise ConfigError(f"--candidates {candidates} is fewer than {_given(option, k)}: the head re-ranks the shortlist, "
                          "so it must hold at least the hits asked for")


def hits_of(queries: Sequence[str], ranked: Ranked, videos: pd.DataFrame) -> list[Hit]:
    """The :class:`Hit` rows of a ranking, with the store's ids, paths and clip bounds."""
    def bound(name: str, row: int) -> float | None:
        if name not in videos.columns:
            return None
        v = videos[name].iat[row]
        return None if v is None or pd.isna(v) else float(v)

    out = []
    for q, query in enumerate(queries):
        for rank, (row, score, u) in enumerate(zip(ranked.rows[q], ranked.scores[q], ranked.uncertainty[q]), 1):
            row = int(row)
            out.append(Hit(query=str(query), rank=rank, video_id=str(videos["video_id"].iat[row]),
                           path=str(videos["path"].iat[row]) if "path" in videos.columns else "",
                           start_s=bound("start_s", row), end_s=bound("end_s", row), score=float(score),
                           uncertainty=None if np.isnan(u) else float(u), row=row))
    return out
