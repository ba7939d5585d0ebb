"""Generated worlds: data with known ground truth, made offline, for every stage to run on.

- ``videos.py`` renders a text-video dataset: H.264 mp4 files of moving shapes, their captions,
  attributes and manifest (``tvrpipe synth``, the quickstart, the data root's ``synthetic``).
- ``features.py`` writes a feature store of CLIP-like features from a latent model, with no video
  and no CLIP, and holds the worlds' presets (``tvrpipe synth --features-only``, the benches).
- ``stats.py`` measures a store's statistics beside real CLIP ViT-B/32's on MSR-VTT, with their
  sources (``tvrpipe synth --describe``), the targets ``features.py`` is calibrated on.
"""
