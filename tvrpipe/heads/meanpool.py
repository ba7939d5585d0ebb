"""CLIP4Clip mean pooling ("meanP"): the parameter-free video embedding.

Paper: Luo et al., "CLIP4Clip: An Empirical Study of CLIP for End to End Video Clip Retrieval"
(Neurocomputing 2022), Sec. 3.3 "Similarity Calculator", parameter-free type: the video is the
mean of its frame embeddings and the similarity is the cosine with the sentence embedding; the
loss is CLIP4Clip's symmetric cross-entropy (InfoNCE), the base class's default ``loss``.
Official code: ArrowLuo/CLIP4Clip, ``modules/modeling.py`` ``_loose_similarity`` with
``sim_header="meanP"``.

Equations (f_m = frame m, mask_m = 1 for real frames, t = EOS sentence embedding)::

    v = mean_{m: mask_m} f_m / ||f_m||          # masked mean of L2-normalised frames
    s(t, v) = <t / ||t||, v / ||v||>            # cosine

Choices:
- The frames are L2-normalised *before* the mean, as the official code does
  (``visual_output / visual_output.norm(...)`` then ``_mean_pooling_for_similarity_visual``);
  the paper's text says only "mean pooling".
- Padded frames never contribute; a video with no real frame gets the zero vector and
  similarity 0 (the code's mean is then zero too, but its final normalisation divides it by its
  zero norm: NaN).
- The only parameter is ``logit_scale``. CLIP4Clip reuses CLIP's own learned logit scale; the head
  starts from the scale of the CLIP its features come from (the store's ``logit_scale``, see
  ``clip_head_config``; CLIP's initial log(1/0.07) on a store without one), clamped to 100 by
  ``Head.logits_scale``. Untrained, the head is CLIP4Clip's zero-shot baseline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor

from tvrpipe.heads.base import Emb, Head, HeadConfig, TextBatch, VideoBatch, register_head
from tvrpipe.heads.pooling import mean_video


@dataclass(frozen=True)
class Config(HeadConfig):
    """meanP: no parameters besides the contrastive temperature."""



@register_head("meanpool")
class MeanPool(Head):
    """CLIP4Clip meanP: cosine between the sentence and the mean of the normalised frames."""

    score_meaning = ("the cosine of the sentence embedding and the mean of the frame embeddings, from -1 to 1 (higher "
                     "ranks first)")
    score_range = (-1.0, 1.0)  # a cosine, or an average of cosines

    uses_tokens = False  # reads the sentence embedding only
    ranks_as_first_stage = True  # its similarity is the first stage's cosine (no weight enters it)

    Config = Config

    def __init__(self, config: Config) -> None:
        super().__init__(config)

    embedding_keys = ("sentence", "video")  # similarity: their inner product

    def encode_texts(self, texts: TextBatch) -> Emb:
        return {"sentence": F.normalize(texts.sentence, dim=-1)}  # (B, D)

    def encode_videos(self, videos: VideoBatch) -> Emb:
        return {"video": mean_video(videos.frames, videos.frame_mask)}  # (B, D)

    def similarity(self, text_emb: Emb, video_emb: Emb) -> Tensor:
        return text_emb["sentence"] @ video_emb["video"].t()  # (n_text, n_video)
