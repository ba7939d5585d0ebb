"""The work that extraction's Ray processes run (:mod:`tvrpipe.features.extract` drives them).

Imported by every decode and encode worker, so this module imports nothing heavy at load time:
decord, PyAV, torch and open_clip load inside the workers that use them.
"""

from __future__ import annotations

import numpy as np

from tvrpipe.features.store import nonfinite_rows


class DecodeStage:
    """Ray Data callable: decodes one batch of video rows into uint8 frames (or a failure)."""

    def __init__(self, frames: int, image_size: int, timeout_s: float) -> None:
        from tvrpipe.features.decode import DecodeWorker

        self.frames, self.image_size = frames, image_size
        self.worker = DecodeWorker(timeout_s=timeout_s)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from tvrpipe.features.decode import DecodeFailure

        n, F, S = len(batch["row"]), self.frames, self.image_size
        frames = np.zeros((n, F, S, S, 3), np.uint8)
        mask = np.zeros((n, F), bool)
        stamps = np.full((n, F), np.nan, np.float32)
        errors = np.array([""] * n, dtype=object)
        for i in range(n):
            start, end = batch["start_s"][i], batch["end_s"][i]
            try:
                d = self.worker.decode(
                    str(batch["path"][i]), F, S,
                    None if np.isnan(start) else float(start), None if np.isnan(end) else float(end),
                )
                frames[i], mask[i], stamps[i] = d.frames, d.mask, d.timestamps
            except DecodeFailure as e:
                errors[i] = f"{e.kind}: {e.detail}"
        return {"row": batch["row"], "frames": frames, "mask": mask, "timestamps": stamps, "error": errors}


class EncodeStage:
    """Ray Data callable: encodes the valid frames of a batch of videos with open_clip."""

    def __init__(self, model: str, pretrained: str, device: str, seed: int, threads: int) -> None:
        import torch

        from tvrpipe.features.clip import load_clip

        if device == "cpu":
            torch.set_num_threads(max(1, threads))
        self.bundle = load_clip(model, pretrained, device=device, seed=seed)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from tvrpipe.features.clip import encode_frames

        frames, mask = batch["frames"], batch["mask"]  # (B, F, S, S, 3), (B, F)
        B, F = mask.shape
        out = np.zeros((B, F, self.bundle.embed_dim), np.float16)
        error = batch["error"].copy()
        if mask.any():
            emb = encode_frames(self.bundle, frames[mask])  # (n_valid, D)
            out[mask] = emb.numpy().astype(np.float16)
            bad = nonfinite_rows(out)  # e.g. fp16 overflow: never stored as if it were a feature
            if bad.any():
                out[bad], mask = 0, mask.copy()
                mask[bad] = False
                error[bad] = "nonfinite: the encoder returned NaN or infinity for this video's frames"
        return {"row": batch["row"], "emb": out, "mask": mask, "timestamps": batch["timestamps"], "error": error,
                "weights": np.full(B, self.bundle.weights_sha256, dtype=object)}


class TextStage:
    """Ray Data callable: tokenises and encodes one shard of captions per call."""

    def __init__(self, model: str, pretrained: str, device: str, seed: int, max_words: int, threads: int) -> None:
        import torch

        from tvrpipe.features.clip import load_clip

        if device == "cpu":
            torch.set_num_threads(max(1, threads))
        self.bundle = load_clip(model, pretrained, device=device, seed=seed)
        self.max_words = max_words

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from tvrpipe.features.clip import encode_text_tokens, tokenize

        ids, mask = tokenize(self.bundle, [str(t) for t in batch["text"]], self.max_words)
        tokens, sentence = encode_text_tokens(self.bundle, ids)
        return {"row": batch["row"], "tokens": tokens.numpy().astype(np.float16),
                "token_mask": mask.numpy(), "sentence": sentence.numpy().astype(np.float16),
                "weights": np.full(len(batch["row"]), self.bundle.weights_sha256, dtype=object)}
