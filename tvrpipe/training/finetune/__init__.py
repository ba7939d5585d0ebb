"""``tvrpipe finetune``: train a registered head on live CLIP features of decoded frames.

The full-paper path (docs/design.md, "Stages and data flow"). ``--end-to-end`` unfreezes both CLIP
towers, as the papers finetune them (CLIP4Clip Sec. 4.1, X-Pool Sec. 4, UATVR Sec. 4.1, DUQ Sec. 4.1,
T-MASS Sec. 4.1); without it CLIP stays frozen and the head trains on live features with
training-time frame sampling.

:func:`~tvrpipe.training.finetune.run.finetune` reads top to bottom: build the job, dry run, lock, start the run, run the loop here
or launch it on Ray. Each job it calls has its module:

- :mod:`~tvrpipe.training.finetune.run`: the driver, :func:`finetune`;
- :mod:`~tvrpipe.training.finetune.config`: the settings (:class:`FinetuneConfig`);
- :mod:`~tvrpipe.training.finetune.job`: the job built from the manifest (:func:`build_job`);
- :mod:`~tvrpipe.training.finetune.dryrun`: what the run will do (``--dry-run``);
- :mod:`~tvrpipe.training.finetune.loop`: the training loop of one process (:func:`run_job`);
- :mod:`~tvrpipe.training.finetune.failures`: videos that fail to decode;
- :mod:`~tvrpipe.training.finetune.export`: the selected CLIP, for ``extract``;
- :mod:`~tvrpipe.training.finetune.launch`: this process or Ray Train workers.

The epoch skeleton it shares with ``train-head`` (selection, checkpoints, resume, run files) is
:mod:`tvrpipe.training.core`, the live model :mod:`tvrpipe.training.live`, a step's gradients
(chunked or not) :mod:`tvrpipe.training.step`.

- **Same head inputs**: the live CLIP yields ``TextBatch`` / ``VideoBatch`` through extraction's
  own functions (:func:`~tvrpipe.features.clip.image_features`, :func:`~tvrpipe.features.clip.text_features`),
  so every registered head trains unchanged and a head never knows whether it reads a store.
- **Data** (:mod:`tvrpipe.training.videodata`): DataLoader workers decode with extraction's
  decoder; random frame offsets within uniform segments in training, segment centres at
  evaluation; an epoch pairs every training caption with its video once (the papers'; or one
  caption per video), no video twice in a batch; a bad video is skipped and counted.
- **Optimisation** (the papers'): AdamW with one learning rate for CLIP and one for the head
  (X-Pool / T-MASS / DUQ: 1e-6 and 1e-5), weight decay 0.2 on weight matrices only (gains, biases,
  embeddings and the logit scale exempt: a choice, the sources differ; docs/training.md), warmup
  over the first 10 % of the steps then cosine decay, gradient norm clipped to 1 (X-Pool), optional
  AMP (fp16 with a gradient scaler, or bf16) and gradient checkpointing.
- **Protocol**: the epoch is selected on validation (the manifest's ``val`` split or carved from
  train exactly as ``train-head`` carves it), test is evaluated once with the selected weights,
  through the same evaluation engine and run-directory layout as ``train-head``.
- **Distributed** (``num_workers`` >= 1): the same loop under Ray Train's ``TorchTrainer`` (DDP).
  The text and video features of every worker are gathered (with gradients) before the head's
  loss, as open_clip's ``gather_with_grad`` does, so every worker computes the loss of the whole
  global batch and one step of N workers x b pairs equals one step of one process with N x b pairs
  (tested). Rank 0 evaluates and writes; the run directory must be on storage every worker reaches.
- **Resume**: a checkpoint (CLIP, head, optimiser, scaler) after every epoch; rerunning the same
  command continues after the last complete epoch.
- **Export** (end-to-end): the selected CLIP is written as ``clip.safetensors``, an open_clip
  state dict that ``tvrpipe extract --pretrained`` loads; the run's head then evaluates on that
  store with ``tvrpipe evaluate`` (the store's weights hash must match the export's).
"""

from __future__ import annotations

from typing import Any

# Names load on first use: the CLI reads FinetuneConfig's defaults for --help without importing torch.
_LAZY = {
    **dict.fromkeys(("EXECUTION", "PRECISIONS", "RESUMABLE", "FinetuneConfig"), "tvrpipe.training.finetune.config"),
    **dict.fromkeys(("FinetuneJob", "build_job"), "tvrpipe.training.finetune.job"),
    "CLIP_FILE": "tvrpipe.training.finetune.export",
    "NO_GPU": "tvrpipe.training.finetune.launch",
    "run_job": "tvrpipe.training.finetune.loop",
    "finetune": "tvrpipe.training.finetune.run",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tvrpipe.training.finetune' has no attribute {name!r}")
