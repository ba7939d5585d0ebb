"""``tvrpipe search``: rank a feature store's videos for sentences, with a trained run's head or zero-shot CLIP.

Two stages (:func:`search`): the first ranks every video's pooled CLIP embedding against the query's
sentence embedding (:mod:`tvrpipe.search.index`: exact, or a FAISS index); the run's head then scores the
``candidates`` best of them and the top ``k`` of its scores are the hits. With ``candidates`` None (or at
least the collection's size) the head scores every video (:func:`exhaustive`), in blocks of videos so
memory stays bounded: the two stages with K = n are the exhaustive search.

The queries are encoded by the CLIP the run learnt with, exactly as extraction encodes captions (word
tokens, mask and EOS sentence, rounded to float16 as the store holds them):

- a ``train-head`` run: the store's CLIP (the store's provenance names the weights; their sha256 is checked);
- a ``finetune --end-to-end`` run: its exported CLIP (``clip.safetensors`` in the run);
- no run: the store's CLIP, and the meanpool head untrained (zero-shot CLIP, mean-pooled).

The store must hold the features of that same CLIP (model, width, weights), or the search is refused.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from tvrpipe.errors import ConfigError, RunError
from tvrpipe.features.store import FeatureStore, open_store
from tvrpipe.heads.base import Head, TextBatch, VideoBatch
from tvrpipe.search.index import FirstStage
from tvrpipe.search.results import Hit

log = logging.getLogger(__name__)

DEFAULT_TOP_K = 10
VIDEO_BLOCK = 2048  # videos per head call: (block x F x D) float32 frames, 48 MiB at F=12, D=512
ZERO_SHOT = "zero-shot CLIP (meanpool, untrained)"
CLIP_KEYS = ("model", "embed_dim", "weights_sha256")  # what the run's CLIP and the store's must share


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
    """

    store: FeatureStore
    head: Head
    label: str
    max_words: int
    clip: tuple[str, str, int] | None
    device: str = "cpu"
    video_root: Path | None = None
    _bundle: Any = field(default=None, repr=False)

    def encode(self, queries: Sequence[str]) -> TextBatch:
        """The queries as extraction encodes captions: word tokens, mask, EOS sentence (float16-rounded)."""
        check_queries(queries)
        if self.clip is None:
            raise ConfigError(f"--features {self.store.dir} was generated without a CLIP (tvrpipe bench); "
                              "its queries cannot be encoded")
        from tvrpipe.features.clip import encode_text_tokens, load_clip, tokenize

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
        ids, mask = tokenize(self._bundle, [str(q) for q in queries], self.max_words)
        tokens, sentence = encode_text_tokens(self._bundle, ids)
        # the store holds float16 features: a query is rounded as the captions the head learnt from were
        return TextBatch(tokens.half().float(), mask, sentence.half().float())


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


def check_collection_unchanged(store: FeatureStore, video_root: Path | None) -> None:
    """A collection's files are as extraction found them (size and modification time), so no hit is served
    from features of a file changed or removed since. A folder that is not reachable here (another machine,
    an unmounted disk) is not checked: the hits name files the store describes.

    Raises:
        ConfigError: files changed or were removed; naming the first few and the two commands to rerun.
    """
    from tvrpipe.features.collection import changed_files, describe_changes

    if store.provenance.get("kind") != "collection" or not {"bytes", "mtime_ns"} <= set(store.videos.columns):
        return
    if video_root is None or not video_root.is_dir():
        log.warning("%s: the collection's folder %s is not reachable here; its files are not checked for changes",
                    store.dir, video_root)
        return
    changed, gone = changed_files(store.videos, video_root)
    if changed or gone:
        raise ConfigError(
            f"{len(changed) + len(gone)} videos of the collection in --features {store.dir} changed or were removed "
            f"under {video_root} since they were extracted ({describe_changes(changed, gone)}): update the store with "
            f"`tvrpipe manifest build --videos {video_root} --out MANIFEST` and `tvrpipe extract --manifest MANIFEST "
            f"--video-root {video_root} --out {store.dir}` (only changed and new videos are encoded)")


def _selected_head(run: Path, device: str) -> tuple[Head, dict, dict]:
    from tvrpipe.rundir import BEST, CHECKPOINTS, load_head, read_config, read_metrics
    from tvrpipe.training.evaluate import check_checkpoint_sha

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
    check_collection_unchanged(store, video_root)
    if run is None:
        head = head_class("meanpool")(clip_head_config("meanpool", D, prov.get("logit_scale")))
        return Searcher(store, head.to(device).eval(), ZERO_SHOT, int(prov["max_words"]), clip, device, video_root)

    run = Path(run)
    head, config, metrics = _selected_head(run, device)
    want = {**(config.get("provenance") or {}), **(metrics.get("provenance") or {})}
    diff = [f"{k} {want[k]!r} vs the store's {prov.get(k)!r}" for k in CLIP_KEYS
            if k in want and want[k] != prov.get(k) and not (k == "model" and same_architecture(want[k], prov))]
    if diff:
        export = metrics.get("export")
        how = (f"`{export['extract']}`" if isinstance(export, dict) and export.get("extract")
               else f"tvrpipe extract --model {want.get('model', prov.get('model'))} with the weights the run learnt on")
        raise ConfigError(f"--run {run} learnt with another CLIP than --features {store.dir} holds "
                          f"({'; '.join(diff)}): search a store extracted with the run's CLIP ({how})")
    if "finetune" in config and config["finetune"].get("end_to_end"):
        export = metrics.get("export")
        file = run / export["file"] if isinstance(export, dict) and export.get("file") else None
        if file is None or not file.is_file():
            raise RunError(f"--run {run} finetuned CLIP end to end but its exported CLIP "
                           f"({file or run / 'clip.safetensors'}) is missing: queries need the run's CLIP; "
                           "train the run again into a new --out")
        clip = (str(export["model"]), str(file), 0)
    label = f"{config['method']} ({run})"
    return Searcher(store, head, label, int(want.get("max_words", prov["max_words"])), clip, device, video_root)


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


def _video_batch(store: FeatureStore, rows: np.ndarray, device: str) -> VideoBatch:
    from tvrpipe.training.data import read_rows

    order = np.argsort(rows, kind="stable")
    frames = read_rows(store.array("videos/frames"), rows[order])
    mask = read_rows(store.array("videos/frame_mask"), rows[order])
    back = np.empty_like(order)
    back[order] = np.arange(len(order))
    return VideoBatch(torch.from_numpy(frames[back].astype(np.float32)).to(device),
                      torch.from_numpy(mask[back]).to(device))


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


@torch.inference_mode()
def exhaustive(head: Head, texts: TextBatch, store: FeatureStore, rows: np.ndarray, k: int,
               device: str = "cpu") -> Ranked:
    """The head scores every video of ``rows`` for every query; the ``k`` best per query. The running top k
    is merged block by block, so memory is one block of scores, not the (Q, n) matrix."""
    te = head.encode_texts(texts.to(device))
    Q = len(texts)
    best_s = torch.full((Q, 0), -torch.inf)
    best_p = torch.zeros((Q, 0), dtype=torch.long)
    best_u = torch.zeros((Q, 0))
    for a in range(0, len(rows), VIDEO_BLOCK):
        ve = head.encode_videos(_video_batch(store, rows[a : a + VIDEO_BLOCK], device))
        s = head.similarity(te, ve).float().cpu()
        u = head.pair_uncertainty(te, ve)
        u = torch.full_like(s, torch.nan) if u is None else u.float().cpu()
        pos = torch.arange(a, a + s.shape[1]).expand(Q, -1)
        s, p, u = torch.cat([best_s, s], 1), torch.cat([best_p, pos], 1), torch.cat([best_u, u], 1)
        best_s, order = _top(s, k)
        best_p, best_u = torch.gather(p, 1, order), torch.gather(u, 1, order)
    return Ranked(rows[best_p.numpy()], best_s.numpy(), best_u.numpy(), len(rows))


@torch.inference_mode()
def two_stage(head: Head, texts: TextBatch, store: FeatureStore, stage: FirstStage, k: int, candidates: int,
              device: str = "cpu") -> Ranked:
    """The first stage's ``candidates`` best videos per query, re-ranked by the head; the ``k`` best per query.

    The head scores every query against the union of the queries' shortlists, block by block as the
    exhaustive search scores every video, and each query keeps its own shortlist's scores: a head's
    per-video work (X-Pool's Gram matrices, a transformer over frames) is done once per shortlisted video
    however many queries shortlist it, and the work is never more than the exhaustive search's.
    """
    K = min(candidates, len(stage))
    pos, _ = stage.top(texts.sentence.cpu().numpy(), K)  # (Q, K) positions into stage.rows
    union, inverse = np.unique(pos, return_inverse=True)
    inverse = inverse.reshape(pos.shape)
    urows = stage.rows[union]
    te = head.encode_texts(texts.to(device))
    scores = torch.empty(len(texts), len(union))
    unc = torch.full((len(texts), len(union)), torch.nan)
    for a in range(0, len(union), VIDEO_BLOCK):
        ve = head.encode_videos(_video_batch(store, urows[a : a + VIDEO_BLOCK], device))
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


def check_top_k(k: int, n: int, store: FeatureStore, what: str = "searchable videos") -> None:
    """``--top-k`` between 1 and ``n``, the store's searchable videos (or its videos, ``what``).

    Raises:
        ConfigError: naming both numbers.
    """
    if k < 1:
        raise ConfigError(f"--top-k {k}: ask for at least 1 hit")
    if k > n:
        raise ConfigError(f"--top-k {k} is more than the {n} {what} of --features {store.dir}; "
                          f"ask for at most {n}")


@dataclass(frozen=True)
class Found:
    """What :func:`search` found, and how.

    Attributes:
        hits: one :class:`Hit` per query and rank, queries in order, best first.
        searchable: the store's videos with a decoded frame (the others cannot match).
        candidates: the videos the head scored per query: K of the two stages, or ``searchable`` when it
            scored every one (no K, or K at least the searchable videos).
    """

    hits: list[Hit]
    searchable: int
    candidates: int

    @property
    def exhaustive(self) -> bool:
        return self.candidates >= self.searchable


def search(searcher: Searcher, queries: Sequence[str], k: int | None = None, candidates: int | None = None,
           first_stage: str = "auto", index: str | os.PathLike[str] | None = None,
           texts: TextBatch | None = None) -> Found:
    """The ``k`` best videos of the store for each query.

    Args:
        searcher: from :func:`open_searcher`.
        queries: the sentences.
        k: hits per query; None: :data:`DEFAULT_TOP_K`, or every video of a smaller store.
        candidates: K, the shortlist the head re-ranks; None (or >= the searchable videos): every video.
        first_stage: ``auto`` | ``exact`` | ``faiss`` (:mod:`tvrpipe.search.index`).
        index: a FAISS index exported by ``tvrpipe export --format faiss``: the first stage (``first_stage``
            must then be left at ``auto``).
        texts: the queries already encoded (:meth:`Searcher.encode`); encoded here when None.

    Returns:
        The hits (one per query and rank, queries in order, best first), and how many videos were scored.

    Raises:
        ConfigError: an empty query, ``k`` or ``candidates`` out of range, both ``index`` and a ``first_stage``,
            or a first stage that cannot be had (checked before the first stage is built where the store's
            size is enough to tell).
    """
    from tvrpipe.search.index import exported_stage, resolve_first_stage
    from tvrpipe.search.index import first_stage as make_stage

    check_queries(queries)
    store = searcher.store
    if candidates is not None and candidates < 1:
        raise ConfigError(f"--candidates {candidates}: the head needs at least 1 candidate per query")
    if index is not None and first_stage != "auto":
        raise ConfigError(f"--index {index} is the first stage; leave out --first-stage {first_stage}")
    resolve_first_stage(first_stage)
    if k is not None:  # the store's size bounds the searchable videos: refused before any index is built
        check_top_k(k, int(store.provenance.get("n_videos", len(store.videos))), store, "videos")
    stage = exported_stage(index, store) if index is not None else make_stage(store, first_stage)
    k = min(DEFAULT_TOP_K, len(stage)) if k is None else k
    check_top_k(k, len(stage), store)
    if candidates is not None and candidates < k:
        raise ConfigError(f"--candidates {candidates} is fewer than --top-k {k}: the head re-ranks the shortlist, "
                          "so it must hold at least the hits asked for")
    texts = texts if texts is not None else searcher.encode(queries)
    if candidates is None or candidates >= len(stage):
        ranked = exhaustive(searcher.head, texts, store, stage.rows, k, searcher.device)
    else:
        ranked = two_stage(searcher.head, texts, store, stage, k, candidates, searcher.device)
    return Found(hits_of(queries, ranked, store.videos), len(stage), ranked.candidates)


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
