"""What a projection alone gains over zero-shot on a feature store: the check of a world's learnable share
against the published "projections only" row (docs/synthetic.md, "The learnable share").

The probe is CLIP4Clip's meanP with only a linear map trained: the cached sentence goes through a D x D
matrix that starts at the identity (so the untrained probe is zero-shot CLIP, mean pooling), the video is the
mean of its L2-normalised frames, the score their cosine times a fixed logit scale of 100 (CLIP's), the loss
the symmetric InfoNCE. Adam at ``--lr`` for ``--epochs`` epochs of batches of 128 train pairs; the epoch with
the best validation t2v R@1 is kept (epoch 0, zero-shot, competes); test t2v R@1 is then set beside zero-shot's
on the same queries, with the paired bootstrap interval of the difference.

    .venv/bin/python scripts/projection_probe.py STORE [--epochs 20] [--lr 1e-3] [--side text|video]

A store without a val split has 10 % of its train videos (at most 1,000) carved out as validation, each with
its first caption, as train-head does (not the same videos: another permutation).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F

from tvrpipe.evaluation.metrics import paired_recall_difference
from tvrpipe.features.store import open_store


def split_features(store, split: str, carved: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """Sentences (n_t, D), mean-pooled unit videos (n_v, D) and each sentence's video index, of ``split``;
    ``carved``: train video rows taken out as validation (first caption each) when the store has no val split."""
    in_split = (store.videos["split"] == split).to_numpy().copy()
    if split == "val" and len(carved):
        in_split = np.isin(np.arange(len(in_split)), carved)
    elif split == "train":
        in_split &= ~np.isin(np.arange(len(in_split)), carved)
    vrows = np.flatnonzero(in_split)
    texts = store.texts[np.isin(store.texts["video_row"].to_numpy(), vrows)]
    if split == "val" and len(carved):
        texts = texts.drop_duplicates("video_row")
    frames = torch.from_numpy(store.read("videos/frames", vrows).astype(np.float32))  # (n_v, F, D)
    mask = torch.from_numpy(store.read("videos/frame_mask", vrows).astype(bool))
    unit = F.normalize(frames, dim=-1) * mask[..., None]
    videos = F.normalize(unit.sum(1) / mask.sum(1, keepdim=True).clamp(min=1), dim=-1)
    sent = torch.from_numpy(store.read("texts/sentence", texts.index.to_numpy()).astype(np.float32))
    where = {row: i for i, row in enumerate(vrows)}
    return sent, videos, np.array([where[r] for r in texts["video_row"].to_numpy()])


def ranks(sim: torch.Tensor, target: np.ndarray) -> np.ndarray:
    """1-based t2v rank of each sentence's video (ties count against)."""
    pos = sim[torch.arange(len(target)), torch.from_numpy(target)]
    return (sim > pos[:, None]).sum(1).numpy() + 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("store")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--side", choices=("text", "video"), default="text", help="which side the map is on")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    store = open_store(args.store)
    carved = np.array([], int)
    if not (store.videos["split"] == "val").any():  # as train-head: 10 % of train, at most 1,000, as validation
        train_rows = np.flatnonzero((store.videos["split"] == "train").to_numpy())
        n = min(1000, max(1, len(train_rows) // 10))
        carved = np.sort(np.random.default_rng(20240501).choice(train_rows, n, replace=False))
    train, val, test = (split_features(store, s, carved) for s in ("train", "val", "test"))
    D = train[0].shape[1]
    W = torch.nn.Parameter(torch.eye(D))
    opt = torch.optim.Adam([W], lr=args.lr)

    def score(sent: torch.Tensor, videos: torch.Tensor) -> torch.Tensor:
        if args.side == "text":
            return F.normalize(sent @ W, dim=-1) @ videos.T
        return F.normalize(sent, dim=-1) @ F.normalize(videos @ W, dim=-1).T

    def evaluate(split) -> np.ndarray:
        with torch.no_grad():
            return ranks(score(split[0], split[1]), split[2])

    zero_val, zero_test = evaluate(val), evaluate(test)
    best, best_W = float((zero_val == 1).mean()), W.detach().clone()
    rng = np.random.default_rng(args.seed)
    sent, videos, target = train
    for epoch in range(1, args.epochs + 1):
        order = rng.permutation(len(target))
        for a in range(0, len(order) - 1, 128):
            b = order[a:a + 128]
            # one caption per video in a batch, so the InfoNCE targets are the diagonal
            _, first = np.unique(target[b], return_index=True)
            b = b[np.sort(first)]
            logits = 100.0 * score(sent[b], videos[target[b]])
            y = torch.arange(len(b))
            loss = (F.cross_entropy(logits, y) + F.cross_entropy(logits.T, y)) / 2
            opt.zero_grad()
            loss.backward()
            opt.step()
        r1 = float((evaluate(val) == 1).mean())
        if r1 > best:
            best, best_W = r1, W.detach().clone()
        print(f"epoch {epoch}: val R@1 {100 * r1:.1f}", flush=True)
    with torch.no_grad():
        W.copy_(best_W)
    got = evaluate(test)
    diff, lo, hi = paired_recall_difference(got, zero_test)
    print(f"{args.side}-side projection: val R@1 {100 * (zero_val == 1).mean():.1f} -> {100 * best:.1f}; "
          f"test R@1 {100 * (got == 1).mean():.1f} against zero-shot {100 * (zero_test == 1).mean():.1f}: "
          f"{diff:+.1f} [{lo:+.1f}, {hi:+.1f}]")


if __name__ == "__main__":
    main()
