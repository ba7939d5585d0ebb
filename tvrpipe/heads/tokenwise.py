"""Token-wise word-frame interaction: the UATVR baseline "TI".

Paper: Fang et al., "UATVR: Uncertainty-Adaptive Text-Video Retrieval" (ICCV 2023), Sec. 3.1
(Preliminary, "Fine-grained Interactions"), Eq. 7 (the token-wise matching of DRL, Wang et al. 2022, and
FILIP); Tab. 1 row "TI (Token-Wise)". Official code: bofang98/UATVR, ``modules/modeling.py``
(``token_wise_interaction``; the released model calls ``weighted_token_wise_intersection``).

Equation 7 with the averaging the paper attaches to it ("an average operation is attached before
addition"), words w^n (n = 1..N) and frames f^m (m = 1..M) channel-wise L2-normalised::

    s(t, v) = 1/2 * ( 1/N sum_n max_m <w^n, f^m>  +  1/M sum_m max_n <w^n, f^m> )

Plain (unweighted) means over the real tokens and the real frames; padded tokens/frames never enter a
max or a mean. The head's only parameter is ``logit_scale``.

Where paper and code disagree (the paper is followed):
- The released UATVR model uses DRL's *weighted* token-wise interaction (learned
  ``text_weight_fc``/``video_weight_fc`` softmax weights instead of the plain means); the paper's
  Eq. 7 and its text describe plain averages, which is what the "TI" row of Tab. 1 names.
- The features are the raw CLIP tokens and frames (Eq. 7, Tab. 1 "TI"); the released UATVR code
  would call its unweighted ``token_wise_interaction`` (commented out there) on the outputs of its
  seqTransf with the DSA tokens, which is ``uatvr`` here.
- The code's unweighted ``token_wise_interaction`` masks by multiplying the similarities by 0 before
  the max, so a padded position enters the max with value 0 whenever all real similarities are
  negative; here padding is excluded exactly.
- Which tokens take part: Eq. 7 sums over n = 1..N and leaves out w^0, the first token, which
  the paper calls [CLS]. The UATVR (CLIP4Clip-derived) data loaders build every caption as
  ``[CLS_TOKEN] + words + [SEP_TOKEN]`` with ``CLS_TOKEN = "<|startoftext|>"`` and
  ``SEP_TOKEN = "<|endoftext|>"``, so w^0 is CLIP's SOT and w^1..w^N are the words and EOT. The
  store's ``token_mask`` covers SOT..EOT the same way; with ``drop_sot=True`` (default) the first
  real position is left out and EOT stays. (SOT's output is the same for every caption under
  CLIP's causal mask, so keeping it would add a caption-independent term.) The released code keeps
  every position of its attention mask, SOT included (``drop_sot=False`` reproduces that). Reading
  w^0 as the sentence feature instead (Eq. 2 calls it that, but CLIP's sentence feature is EOT)
  would drop EOT, CLIP's only contrastively trained text token, and leave cached-feature training
  with the untrained word outputs alone; that reading is not taken.

Other choices: a text with no token left or a video with no real frame contributes 0 for its direction
(the corresponding mean is empty). ``logit_scale`` starts at the features' CLIP's
learned scale, as UATVR reuses it (``clip_head_config``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from tvrpipe.heads.base import Emb, Head, HeadConfig, TextBatch, VideoBatch, register_head


@dataclass(frozen=True)
class Config(HeadConfig):
    """Token-wise interaction: parameter-free apart from the contrastive temperature."""

    drop_sot: bool = True  # UATVR Eq. 7: n=1..N, no w^0 = SOT (its code: CLS_TOKEN, kept there)


def without_first(token_mask: Tensor) -> Tensor:
    """The mask without each row's first real position (SOT): (B, L) -> (B, L)."""
    mask = token_mask.bool()
    pos = torch.arange(mask.shape[1], device=mask.device)  # (L,)
    first = mask.int().argmax(dim=1)  # (B,) index of the first True
    return mask & (pos > first[:, None])


def masked_normalize(x: Tensor, mask: Tensor) -> Tensor:
    # Padded rows become exactly zero, whatever they held (NaN and inf included).
    return F.normalize(torch.where(mask.unsqueeze(-1), x, torch.zeros_like(x)), dim=-1)


def token_wise_similarity(words: Tensor, wmask: Tensor, frames: Tensor, fmask: Tensor) -> Tensor:
    """UATVR Eq. 7 (and Eq. 8 over enlarged sequences) with means: (n_text, n_video).

    ``words`` (n_t, L, D) and ``frames`` (n_v, F, D) L2-normalised, zero at padding; masks True for
    the positions that take part. 1/2 (mean over words of the best frame + mean over frames of the
    best word); padding never wins a max nor enters a mean; an empty side contributes 0.
    """
    neg_inf = torch.tensor(float("-inf"), dtype=words.dtype, device=words.device)
    zero = torch.zeros((), dtype=words.dtype, device=words.device)
    wbias = torch.where(wmask, zero, neg_inf)  # (n_t, L) 0 for words, -inf for padding
    fbias = torch.where(fmask, zero, neg_inf)  # (n_v, F)

    cos = torch.einsum("tld,vfd->tvlf", words, frames)  # (n_t, n_v, L, F)
    word_to_frame = (cos + fbias[None, :, None, :]).amax(dim=3)  # (n_t, n_v, L) best real frame per word
    cos.add_(wbias[:, None, :, None])  # in place: einsum does not keep its output for backward
    frame_to_word = cos.amax(dim=2)  # (n_t, n_v, F) best real word per frame

    n_words = wmask.sum(1).clamp(min=1).to(words.dtype)  # (n_t,)
    n_frames = fmask.sum(1).clamp(min=1).to(words.dtype)  # (n_v,)
    # torch.where (not a product) so -inf from empty sides never reaches the sums.
    t2v = torch.where(wmask[:, None, :] & fmask.any(1)[None, :, None], word_to_frame, zero).sum(2)
    v2t = torch.where(fmask[None, :, :] & wmask.any(1)[:, None, None], frame_to_word, zero).sum(2)
    return (t2v / n_words[:, None] + v2t / n_frames[None, :]) / 2  # (n_t, n_v)


@register_head("tokenwise")
class TokenWise(Head):
    """UATVR Eq. 7: mean of word-to-frame maxima and frame-to-word maxima of cosines."""

    score_meaning = ("UATVR Eq. 7: half the sum of each word's best frame cosine averaged over the words and each "
                     "frame's best word cosine averaged over the frames; from -1 to 1 (higher ranks first)")
    score_range = (-1.0, 1.0)  # a cosine, or an average of cosines

    Config = Config

    token_wise_keys = ("tokens", "token_mask", "frames", "frame_mask")  # similarity: token_wise_similarity of these

    def __init__(self, config: Config) -> None:
        super().__init__(config)

    def encode_texts(self, texts: TextBatch) -> Emb:
        mask = without_first(texts.token_mask) if self.config.drop_sot else texts.token_mask.bool()
        return {"tokens": masked_normalize(texts.tokens, mask), "token_mask": mask}  # (B, L, D), (B, L)

    def encode_videos(self, videos: VideoBatch) -> Emb:
        mask = videos.frame_mask.bool()
        return {"frames": masked_normalize(videos.frames, mask), "frame_mask": mask}  # (B, F, D), (B, F)

    def similarity(self, text_emb: Emb, video_emb: Emb) -> Tensor:
        return token_wise_similarity(text_emb["tokens"], text_emb["token_mask"], video_emb["frames"],
                                     video_emb["frame_mask"])
