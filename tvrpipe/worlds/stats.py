"""What a feature store's world looks like next to real CLIP: the statistics ``tvrpipe synth --describe`` prints.

A generated world is only an instrument if its features behave like real CLIP ViT-B/32 features
on MSR-VTT. :func:`measure` reads the same statistics from any store (generated or extracted) and
:data:`TARGETS` holds real CLIP's values, each with its source (docs/synthetic.md, "Calibration"):

- zero-shot t2v R@1 of three parameter-free scorers on a 1,000-video gallery (MSR-VTT 1k-A's size;
  smaller test splits use all their videos, and the gallery size is reported beside):
  mean pooling (cosine of the sentence with the mean of the L2-normalised frames, as the
  ``meanpool`` head and the zero-shot row score), one frame (the middle one),
  and token-wise matching (UATVR Eq. 7, the ``tokenwise`` head, which has no trained parameter);
- cosines of raw features: two frames of one video, two frames of different videos, a sentence
  with its video's frames and with other videos' frames.

Only the first caption of each video is a query (1k-A has one caption per test video).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tvrpipe.errors import ConfigError

GALLERY = 1000  # MSR-VTT 1k-A: the gallery the published zero-shot figures use


@dataclass(frozen=True)
class Target:
    """A statistic of real CLIP ViT-B/32 features on MSR-VTT, and how close a calibrated world must be.

    Attributes:
        name: the key in :func:`measure`'s result.
        label: what it is, for a table.
        value: real CLIP's value.
        tolerance: the largest |measured - value| one calibrated world (one seed) may show: two standard
            deviations of the statistic across worlds of other seeds (for R@1, 2.2 points for mean pooling, 2.2
            for the middle frame, 1.4 for token-wise, measured on seeds 0-4 by ``scripts/calibrate_share.py``:
            more than the 1.5 points of a recall over 1,000 queries, as a world's draw of concepts moves it too),
            plus the spread of the published values where there are several.
        source: where the value comes from (or why it was chosen, where nothing is published).
        kind: "published" (read off a paper's table or figure), "derived" (computed from published figures),
            or "chosen" (nothing is published: a value picked, with the reason in ``source``).
    """

    name: str
    label: str
    value: float
    tolerance: float
    source: str
    kind: str


TARGETS: tuple[Target, ...] = (
    Target("meanpool_r1", "R@1, mean pooling", 31.2, 5.0,
           "Portillo-Quintero et al. 2021 (arXiv 2102.12443) Tab. 2, ViT-B/32, 1k-A; CLIP4Clip (arXiv 2104.08860) "
           "Tab. 2 zero-shot: 30.6; X-Pool (arXiv 2203.15086) Fig. 3: 31.5", "published"),
    Target("frame_r1", "R@1, middle frame", 27.0, 4.5,
           "not published: chosen 4 points below mean pooling (OpenAI uses the middle frame as a lower bound for "
           "video, openai/CLIP issue 28; near-max query scoring is 1 point above the mean, CLIP-Hitchhiker README, "
           "B/16: frames of a clip are close views)", "chosen"),
    Target("tokenwise_r1", "R@1, token-wise", 20.0, 6.0,
           "not published: chosen below mean pooling, as CLIP trains only the EOT token to meet images and its other "
           "word outputs are not aligned with them; wide tolerance", "chosen"),
    Target("frame_cos_same", "cos, frames of one video", 0.80, 0.08,
           "not published for real videos: chosen between frames of one shot (~0.9) and frames across the shots of "
           "a 10-30 s MSR-VTT clip; above the 0.47 of unrelated images", "chosen"),
    Target("frame_cos_other", "cos, frames of two videos", 0.47, 0.05,
           "Liang et al. 2022, Mind the Gap (arXiv 2203.02053) Fig. 2a: CLIP image embeddings of MSCOCO, mean 0.468",
           "published"),
    Target("text_cos_other", "cos, sentences of two videos", 0.51, 0.05,
           "Mind the Gap Fig. 2a: CLIP text embeddings of MSCOCO captions, mean 0.508", "published"),
    Target("text_frame_cos_matched", "cos, sentence and its frames", 0.30, 0.04,
           "chosen inside a published range: Hessel et al. 2021, CLIPScore (arXiv 2104.08718) App. B, ViT-B/32 "
           "matched cosines run from ~0 to ~0.4 (rescaled by w = 2.5 to ~0.75); no mean is published, 0.30 is "
           "picked in the upper half, where a caption written for its video lies", "chosen"),
    Target("text_frame_cos_other", "cos, sentence and other frames", 0.15, 0.03,
           "derived from Mind the Gap: mean cosines 0.468 (images) and 0.508 (texts) and centroid distance 0.82 give "
           "a mean unmatched image-text cosine of (0.468 + 0.508 - 0.82^2) / 2 = 0.15", "derived"),
)
TARGET = {t.name: t for t in TARGETS}


@dataclass(frozen=True)
class Structure:
    """A rate of a generated world's structure (a :class:`~tvrpipe.worlds.features.GenSpec` field), beside
    what is published about MSR-VTT.

    Attributes:
        field: the generator field (``None``: a property of MSR-VTT the generator does not model).
        label: what it is, for a table.
        published: the benchmark's figure, or "not published".
        source: where the figure comes from, or how the world's value was chosen.
    """

    field: str | None
    label: str
    published: str
    source: str


STRUCTURE: tuple[Structure, ...] = (
    Structure("caption_shift", "learnable share: the captions' space turned by (degrees)",
              "+7.6 R@1 over zero-shot for a trained head on frozen CLIP",
              "MV-Adapter (arXiv 2301.07868) Tab. 1: seqTransf on a frozen ViT-B/16, 42.1 against 34.5 for B/16 "
              "mean pooling; Cross-Modal Adapter (arXiv 2211.09623) Tab. 4, ViT-B/32: 4 text-prompt tokens +8.0, "
              "the projections alone +0.8 (trained at CLIP4Clip's lr 1e-7: a lower bound). The angle is sized so "
              "that seqtransf gains that row on the msrvtt9k preset (docs/synthetic.md, 'The learnable share')"),
    Structure("shared_sources", "val/test videos that are clips of a train video's source",
              "37.2 % (372 of 1,000 1k-A test videos; 1k-B 38.0 %)",
              "MDMMT (arXiv 2103.10699) Tab. 11 and App. C.2.1: test videos sharing a YouTube source with 9k "
              "training videos"),
    Structure("near_duplicates", "videos that copy another video of their split but one concept",
              "not published within a split",
              "chosen; MDMMT Tab. 12 finds 114 hand-confirmed near-duplicates between the official full split's "
              "test and train, none measured inside a split"),
    Structure("multi_scene", "videos of several scenes (shots)", "not published",
              "chosen: shots per MSR-VTT clip were not found published; docs/training.md shows the heads across a "
              "range of it"),
    Structure("partial_captions", "captions of a multi-scene video that describe one scene", "not published",
              "chosen: the partially relevant retrieval papers state it only qualitatively"),
    Structure(None, "captions that repeat another caption's string", "16.5 % (200k captions, 167k distinct)",
              "MDMMT Tab. 1; not modelled: every generated caption is a draw of its own (a repeated string in "
              "MSR-VTT is mostly a generic sentence, and the latent model has no notion of a vague caption)"),
)


def structure_rows(generator: dict, calibrated: dict) -> list[tuple[str, str, str, str, str]]:
    """Rows (label, this store, the calibrated world, published, source) of :data:`STRUCTURE`, for the generator
    fields of a generated store's provenance."""
    def shown(spec: dict, field: str | None) -> str:
        if field is None:
            return "none"
        value = spec.get(field, 0.0)
        if field == "multi_scene" and spec.get("scenes", 1) == 1:
            value = 0.0  # one scene a video, whatever the fraction says
        return f"{value:g}" if field == "caption_shift" else f"{value:.0%}"

    return [(s.label, shown(generator, s.field), shown(calibrated, s.field), s.published, s.source)
            for s in STRUCTURE]


def _unit(x: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(x, axis=-1, keepdims=True)
    return np.divide(x, n, out=np.zeros_like(x), where=n > 0)


def _r1(sim: np.ndarray) -> float:
    """t2v R@1 in % of a (queries, gallery) score matrix whose diagonal holds the pairs; ties count against."""
    pos = np.diag(sim)
    return float(100.0 * ((sim >= pos[:, None]).sum(1) == 1).mean())  # only the pair itself at or above it


def _tokenwise(words: np.ndarray, wmask: np.ndarray, frames: np.ndarray, fmask: np.ndarray) -> np.ndarray:
    """The ``tokenwise`` head's score (UATVR Eq. 7, SOT left out), chunked over queries."""
    import torch

    from tvrpipe.heads.tokenwise import masked_normalize, token_wise_similarity, without_first

    wm = without_first(torch.from_numpy(wmask))
    fm = torch.from_numpy(fmask)
    f = masked_normalize(torch.from_numpy(frames), fm)
    out = []
    for a in range(0, len(words), 64):
        w = masked_normalize(torch.from_numpy(words[a:a + 64]), wm[a:a + 64])
        out.append(token_wise_similarity(w, wm[a:a + 64], f, fm).numpy())
    return np.concatenate(out)


def measure(store, split: str = "test", gallery: int = GALLERY, seed: int = 0) -> dict:
    """The statistics of :data:`TARGETS` on ``split`` of a feature store.

    Args:
        store: an open :class:`~tvrpipe.features.store.FeatureStore`.
        split: the split whose videos and (first) captions are measured.
        gallery: at most this many videos (a seeded sample when the split has more).
        seed: the sample's seed.

    Returns:
        ``{name: value}`` for every target, plus ``gallery`` (videos searched) and ``split``.
    """
    vrows = np.flatnonzero((store.videos["split"] == split).to_numpy())
    if len(vrows) < 2:
        raise ConfigError(f"{store.dir}: split {split!r} has {len(vrows)} videos; describing a world needs at least 2")
    if len(vrows) > gallery:
        vrows = np.sort(np.random.default_rng(seed).choice(vrows, gallery, replace=False))
    texts = store.texts
    first = texts[texts["video_row"].isin(vrows)].drop_duplicates("video_row")
    by_video = dict(zip(first["video_row"].to_numpy(), first.index.to_numpy()))
    vrows = np.array([v for v in vrows if v in by_video])
    if len(vrows) < 2:
        raise ConfigError(f"{store.dir}: split {split!r} has fewer than 2 captioned videos")
    trows = np.array([by_video[v] for v in vrows])  # caption i describes video i

    frames = store.read("videos/frames", vrows).astype(np.float32)  # (n, F, D)
    fmask = store.read("videos/frame_mask", vrows).astype(bool)  # (n, F)
    sent = store.read("texts/sentence", trows).astype(np.float32)  # (n, D)
    words = store.read("texts/tokens", trows).astype(np.float32)  # (n, L, D)
    wmask = store.read("texts/token_mask", trows).astype(bool)
    n = len(vrows)
    nf = fmask.sum(1)
    if (nf == 0).any():
        raise ConfigError(f"{store.dir}: a video of split {split!r} has no valid frame")

    s = _unit(sent.astype(np.float64))
    fu = _unit(frames.astype(np.float64)) * fmask[..., None]  # padded frames are zero
    mean = _unit(fu.sum(1) / nf[:, None])  # meanpool's mean_video: the frames are normalised first
    middle = fu[np.arange(n), _middle(fmask)]
    out = {
        "meanpool_r1": _r1(s @ mean.T),
        "frame_r1": _r1(s @ middle.T),
        "tokenwise_r1": _r1(_tokenwise(words, wmask, frames, fmask)),
    }
    # Frame pairs: each video's sum of unit frames gives the within-video pair sum; the all-pairs sum
    # minus those gives the across-video pairs.
    per_video = fu.sum(1)  # (n, D)
    self_pairs = (per_video**2).sum(1) - nf  # sum over ordered pairs i != j within the video
    total = (per_video.sum(0) ** 2).sum() - (per_video**2).sum()
    out["frame_cos_same"] = float(self_pairs.sum() / (nf * (nf - 1)).clip(min=1).sum())
    out["frame_cos_other"] = float(total / (nf.sum() ** 2 - (nf**2).sum()))
    out["text_cos_other"] = float(((s.sum(0) ** 2).sum() - n) / (n * (n - 1)))
    cos_tf = s @ per_video.T  # (n, n): sum over each video's frames of cos(sentence, frame)
    out["text_frame_cos_matched"] = float((np.diag(cos_tf) / nf).mean())
    off = cos_tf.sum(1) - np.diag(cos_tf)
    out["text_frame_cos_other"] = float((off / (nf.sum() - nf)).mean())
    out["gallery"] = n
    out["split"] = split
    return out


def _middle(fmask: np.ndarray) -> np.ndarray:
    """Index of each video's middle valid frame (valid frames are the leading ones or any subset)."""
    idx = []
    for row in fmask:
        valid = np.flatnonzero(row)
        idx.append(valid[len(valid) // 2])
    return np.array(idx)


def table(measured: dict) -> list[tuple[str, str, str, str, str]]:
    """Rows (label, measured, target, within tolerance, source) for printing."""
    rows = []
    for t in TARGETS:
        m = measured[t.name]
        fmt = "{:.1f}" if t.name.endswith("_r1") else "{:.2f}"
        if t.name.endswith("_r1") and measured["gallery"] != GALLERY:
            ok = f"n/a ({measured['gallery']} videos)"  # R@1 falls as the gallery grows
        else:
            ok = "yes" if abs(m - t.value) <= t.tolerance else "no"
        rows.append((t.label, fmt.format(m), f"{fmt.format(t.value)} ± {fmt.format(t.tolerance)}", ok, t.source))
    return rows
