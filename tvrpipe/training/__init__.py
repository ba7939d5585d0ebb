"""Training: ``fit`` trains a head on a cached feature store, ``finetune`` trains it on live CLIP
features (end-to-end or frozen)."""
