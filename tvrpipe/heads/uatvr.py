"""UATVR: uncertainty-adaptive text-video retrieval.

Paper: Fang et al., "UATVR: Uncertainty-Adaptive Text-Video Retrieval" (ICCV 2023), Sec. 3.2
(dynamic semantic adaptation, DSA, Eq. 8), Sec. 3.3 (distribution-based uncertainty adaptation,
DUA, Eq. 9-11), Sec. 3.4 (Eq. 12-13); settings Sec. 4.1; ablations Tab. 1, 3, 4; Fig. 3.
Official code: bofang98/UATVR (``modules/modeling.py`` ``_loose_similarity``,
``probabilistic_video/text``; ``modules/until_module.py`` ``MILNCELoss_BoF``, ``KLdivergence``;
``prob_models/tensor_utils.py`` ``sample_gaussian_tensors``).

Equations (frames f^1..f^M, words w^1..w^N as in :mod:`tvrpipe.heads.tokenwise`)::

    DSA  [f~^1..f~^{M+C_v}] = seqTransf([f^1..f^M ; e_v^1..e_v^{C_v}])     (C_v = 3 learnable tokens)
         [w~^1..w~^{N+C_t}] = seqTransf([w^1..w^N ; e_t^1..e_t^{C_t}])     (C_t = 2)
         s(t, v) = 1/2 (mean_n max_m <w~^n, f~^m> + mean_m max_n <w~^n, f~^m>)   Eq. 8, channel-wise
                                                                           normalised tokens, real + extra
    DUA  mu = l2(LN(FC_mu(x))),  log sigma = FC_sigma(x)  per modality      Eq. 9
         x^(k) = mu + sigma * eps^k,  k = 1..K = 7                          Eq. 10
         L_DUA = multi-instance InfoNCE, all K x K samples of a matched pair positive   Eq. 11
    KL   L_KL = KL(N(mu_t, sigma_t^2) || N(0, I)) + KL(N(mu_v, sigma_v^2) || N(0, I))  Eq. 12
    L = L_DSA + 1e-2 L_DUA + 1e-4 L_KL                                      Eq. 13

Choices (also in docs/methods.md, "UATVR"):

- **Means in Eq. 8.** Eq. 8 prints sums, but the paper attaches "an average operation" to Eq. 7
  because sums "produce larger similarity sums for longer video and text input", and Eq. 8 is Eq. 7
  over enlarged sequences: a sum over frames would rank longer (less padded) videos higher for every
  query. So Eq. 8 uses means over the real and extra tokens, exactly ``tokenwise``'s function
  (plain means: the paper's Eq. 8, not the released code's DRL-weighted variant).
- **DSA transformers.** One seqTransf (CLIP4Clip structure, :mod:`tvrpipe.heads.seqtransf`: 4
  layers, LayerNorm eps 1e-12, zero-initialised output projections and positions) per modality,
  over [tokens + positions ; extra tokens]; the residual adds the input back to the real slots
  only, as the code does. ``share_transformer=True`` uses one transformer for both modalities, as
  the official code does (its ``transformerClip`` serves frames and words). The extra tokens are
  parameters of their own, normal(0, 0.02) (the code uses the position embeddings of the slots
  after the padded sequence, which makes them depend on the padding length); they carry no
  position and are never masked. Words: the start token is left out (``drop_sot``, as ``tokenwise``).
- **DUA models the global embeddings**, not every token (Fig. 2's caption suggests every token):
  Eq. 9 writes one distribution per caption and per video, and Eq. 11's s(t_i, v_i) compares one
  sample of each; per-token distributions would need a set-to-set similarity on samples that the
  paper never defines. The global embedding is the official code's: the l2-normalised mean of the
  normalised DSA outputs of the real frames (words). h_mu = FC + LayerNorm + l2-normalisation and
  h_sigma = a separate FC (Eq. 9) replace the code's PIE-Net attention modules.
- **sigma is a standard deviation everywhere**: h_sigma outputs log sigma; sampling uses
  sigma = exp(h_sigma) and the KL its closed form in sigma, 1/2 sum(sigma^2 + mu^2 - 1 - 2 log sigma).
  The official code samples with exp(logsigma) as the standard deviation but regularises with
  exp(logsigma) as the variance, and uses the mean of the samples instead of mu in the KL.
- **Eq. 11 as printed**: -log(sum over the K positives of exp s / sum over all B K of exp s), every
  sample of each side an anchor, both directions averaged.
- **L_DSA = (L_t2v + L_v2t) / 2**, as the official code (``(sim_loss1 + sim_loss2) / 2``) and every
  head here; Eq. 6 prints the sum, which would double L_DSA against the alpha and beta terms. s is the plain
  inner product of the samples, unscaled (the code; the paper does not name a temperature). The code
  averages the positives' log-probabilities instead (MIL-NCE "BoF"); that is not Eq. 11.
- **KL reduction**: the mean over the batch (Eq. 12 is per pair, like Eq. 4's 1/B); the official
  code sums over the batch (``kl_reduction="sum"``, 64x the weight at its batch of 64).
- **Inference** is the deterministic Eq. 8 score; no samples enter it.
- **Readout** (Fig. 3): the geometric mean of sigma over the validation texts and videos (and per
  modality), logged per epoch and plotted against validation R@1.

Ablations: Tab. 1 ``dsa=False, dua_weight=0, kl_weight=0`` (TI, = ``tokenwise``), ``+DSA``
(``dua_weight=0, kl_weight=0``), ``+DUA`` (``kl_weight=0``), ``+KL`` (defaults); Tab. 3
``extra_video_tokens`` / ``extra_text_tokens``; Tab. 4 ``num_samples``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tvrpipe.config import above, at_least, one_of
from tvrpipe.errors import ConfigError
from tvrpipe.heads.base import Copied, Emb, Head, HeadConfig, LossOutput, TextBatch, VideoBatch, register_head
from tvrpipe.heads.losses import kl_to_standard_normal, masked_mean, symmetric_infonce
from tvrpipe.heads.seqtransf import (
    ResidualAttentionBlock,
    attention_heads,
    copy_clip_text_layers,
    init_sequence_transformer,
    length_groups,
    sequence_transformer,
)
from tvrpipe.heads.tokenwise import masked_normalize, token_wise_similarity, without_first


@dataclass(frozen=True)
class Config(HeadConfig):
    """UATVR: DSA extra tokens + seqTransf, Eq. 8 token-wise score, DUA Gaussian embeddings."""

    dsa: bool = True  # UATVR Tab. 1 "+DSA": extra tokens and seqTransf; False = "TI" (tokenwise)
    extra_video_tokens: int = at_least(0, 3)  # C_v, UATVR Tab. 3 (best: 3); official code: 2 (docs/methods.md)
    extra_text_tokens: int = at_least(0, 2)  # C_t, UATVR Tab. 3 (best: 2)
    num_layers: int = 4  # UATVR Sec. 4.1: four-layer seqTransf, after CLIP4Clip
    num_heads: int | None = at_least(1, None)  # None: D // 64, CLIP4Clip code transformer_heads = width // 64
    mlp_ratio: int = 4  # CLIP4Clip code (module_cross.ResidualAttentionBlock): MLP width 4D
    max_len: int = 77  # CLIP4Clip code: position table = CLIP context length 77 (frames and words)
    ln_eps: float = 1e-12  # CLIP4Clip / UATVR code module_cross.LayerNorm eps (TF style)
    zero_init: bool = True  # choice: as seqtransf, identity transformers at the start (no CLIP weights to copy)
    share_transformer: bool = False  # choice: one seqTransf per modality; True: one shared (official code)
    drop_sot: bool = True  # UATVR Eq. 7-8: n = 1..N, no w^0 (SOT), as tokenwise
    num_samples: int = at_least(1, 7)  # K, UATVR Tab. 4 (best: 7)
    dua_weight: float = at_least(0, 1e-2)  # alpha, UATVR Eq. 13 / Sec. 4.1; 0 = Tab. 1 without "+DUA"
    kl_weight: float = at_least(0, 1e-4)  # beta, UATVR Eq. 13 / Sec. 4.1; 0 = Tab. 1 without "+KL"
    dua_temperature: float = above(0, 1.0)  # choice: Eq. 11 on plain inner products of samples, as the official code
    kl_reduction: str = one_of(("mean", "sum"), "mean")  # choice: mean over the batch (Eq. 12 per pair); "sum": official code

    def check(self) -> None:
        attention_heads(self.owner, "num_heads", self.embed_dim, self.num_heads)


# train-head's learning rate when --lr is not given, by feature width D (the curves
# at D = 64 and D = 512 disagree): chosen on the validation curves of
# `tvrpipe bench convergence`, whose runs and figures are in docs/training.md ("Default learning rates, and what chose them")
DEFAULT_LR = {64: 3e-3, 512: 3e-4}


class GaussianHead(nn.Module):
    """Eq. 9: h_mu = FC + LayerNorm + l2-normalisation; h_sigma = a separate FC giving log sigma."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.mu_fc = nn.Linear(dim, dim)
        self.mu_ln = nn.LayerNorm(dim)
        self.sigma_fc = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return F.normalize(self.mu_ln(self.mu_fc(x)), dim=-1), self.sigma_fc(x)  # mu (B, D), log sigma (B, D)


def multi_instance_infonce(logits: Tensor, k_rows: int, k_cols: int) -> Tensor:
    """Eq. 11: rows are the (B k_rows) anchor samples, columns the (B k_cols) samples of the other
    side; the k_cols samples of the anchor's own item are all positives.

    ``-mean_anchors log(sum_pos exp(logits) / sum_all exp(logits))``.
    """
    b = logits.shape[0] // k_rows
    own = torch.arange(b, device=logits.device).repeat_interleave(k_rows)[:, None] == \
        torch.arange(b, device=logits.device).repeat_interleave(k_cols)[None, :]  # (B k_rows, B k_cols)
    pos = logits.masked_fill(~own, float("-inf")).logsumexp(-1)
    return (logits.logsumexp(-1) - pos).mean()


@register_head("uatvr")
class UATVR(Head):
    """UATVR: Eq. 8 token-wise score over DSA-enlarged sequences; DUA and KL in training."""

    score_meaning = ("UATVR Eq. 8: the token-wise similarity (Eq. 7) over words, frames and the extra learnable "
                     "tokens, from -1 to 1 (higher ranks first)")
    uncertainty_meaning = ("the pair's sigma level, the geometric mean of the text's and the video's sigma (Sec. 3.3's "
                           "Gaussians), above 0: larger, less certain (smaller, more certain)")
    score_range = (-1.0, 1.0)  # a cosine, or an average of cosines

    Config = Config
    default_lr = DEFAULT_LR

    token_wise_keys = ("tokens", "token_mask", "frames", "frame_mask")  # similarity: token_wise_similarity of these

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        d = config.embed_dim
        heads = attention_heads("uatvr", "num_heads", d, config.num_heads)
        if config.dsa:
            def blocks() -> nn.ModuleList:
                return nn.ModuleList(ResidualAttentionBlock(d, heads, config.mlp_ratio, config.ln_eps)
                                     for _ in range(config.num_layers))

            self.frame_position_embeddings = nn.Embedding(config.max_len, d)
            self.word_position_embeddings = nn.Embedding(config.max_len, d)
            self.video_blocks = blocks()
            self.text_blocks = self.video_blocks if config.share_transformer else blocks()
            init_sequence_transformer(self.frame_position_embeddings, self.video_blocks, config.zero_init)
            init_sequence_transformer(self.word_position_embeddings, self.text_blocks, config.zero_init)
            # CLIP4Clip init_weights: embeddings normal(0, 0.02)
            self.video_tokens = nn.Parameter(0.02 * torch.randn(config.extra_video_tokens, d))
            self.text_tokens = nn.Parameter(0.02 * torch.randn(config.extra_text_tokens, d))
        self.text_dist = GaussianHead(d)
        self.video_dist = GaussianHead(d)

    @property
    def _dua(self) -> bool:
        return self.config.dua_weight > 0 or self.config.kl_weight > 0

    def init_from_clip(self, clip: nn.Module) -> Copied:
        """DSA's transformers from CLIP's text transformer, as CLIP4Clip (which UATVR builds on) initialises
        seqTransf: the video side with the frame positions, the text side (when not shared) with the word
        positions. Nothing without DSA."""
        if not self.config.dsa:
            return Copied([], "uatvr without DSA (dsa=False) has no transformer")
        video = copy_clip_text_layers(clip, self.video_blocks, self.frame_position_embeddings)
        copied = [f"video {c}" for c in video]
        if self.text_blocks is not self.video_blocks:
            copied += [f"text {c}" for c in copy_clip_text_layers(clip, self.text_blocks, self.word_position_embeddings)]
        return Copied(copied, video.reason)

    def _enlarge(self, x: Tensor, mask: Tensor, positions: nn.Embedding, blocks: nn.ModuleList,
                 extra: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """DSA over one modality: (normalised enlarged tokens, their mask, the global embedding)."""
        n = x.shape[1]
        if self.config.dsa:
            if n > self.config.max_len:
                raise ConfigError(f"uatvr: sequences of {n} items exceed max_len={self.config.max_len}; "
                                  f"set --set max_len={n}")
            h = self._packed_transformer(x, mask, positions.weight, blocks, extra)  # (B, n + C, D)
            mask = torch.cat([mask, mask.new_ones(x.shape[0], extra.shape[0])], dim=1)  # (B, n + C)
        else:
            h = x
        tokens = masked_normalize(h, mask)  # (B, n + C, D) channel-wise normalised, zero at padding
        # global embedding (DUA input): mean of the normalised real slots (no extra tokens), l2-normalised
        pooled = F.normalize(masked_mean(tokens[:, :n], mask[:, :n], dim=1), dim=-1)  # (B, D)
        return tokens, mask, pooled

    @staticmethod
    def _packed_transformer(x: Tensor, mask: Tensor, positions: Tensor, blocks: nn.ModuleList,
                            extra: Tensor, group: int = 32) -> Tensor:
        """:func:`sequence_transformer` on items grouped by length, each group cut after its last real
        slot: the same outputs (padding never enters; the cut slots are padding), without spending
        the transformer on the padded tail of short captions. Returns (B, n + C, D)."""
        b, n, _ = x.shape
        if bool(mask[:, -1].all()):  # no padded tail to cut
            return sequence_transformer(x, mask, positions, blocks, extra)
        out = x.new_zeros(b, n + extra.shape[0], x.shape[2])
        for idx, keep in length_groups(mask, group):
            h = sequence_transformer(x[idx, :keep], mask[idx, :keep], positions, blocks, extra)  # (g, keep + C, D)
            out[idx, :keep] = h[:, :keep]
            out[idx, n:] = h[:, keep:]
        return out

    def encode_texts(self, texts: TextBatch) -> Emb:
        mask = without_first(texts.token_mask) if self.config.drop_sot else texts.token_mask.bool()
        tokens, mask, pooled = self._enlarge(texts.tokens, mask, getattr(self, "word_position_embeddings", None),
                                             getattr(self, "text_blocks", None), getattr(self, "text_tokens", None))
        mu, log_sigma = self.text_dist(pooled)
        return {"tokens": tokens, "token_mask": mask, "mu": mu, "log_sigma": log_sigma}

    def encode_videos(self, videos: VideoBatch) -> Emb:
        tokens, mask, pooled = self._enlarge(videos.frames, videos.frame_mask.bool(),
                                             getattr(self, "frame_position_embeddings", None),
                                             getattr(self, "video_blocks", None), getattr(self, "video_tokens", None))
        mu, log_sigma = self.video_dist(pooled)
        return {"frames": tokens, "frame_mask": mask, "mu": mu, "log_sigma": log_sigma}

    def similarity(self, text_emb: Emb, video_emb: Emb) -> Tensor:
        """Eq. 8 (means) over the real and extra tokens: (n_text, n_video), deterministic."""
        return token_wise_similarity(text_emb["tokens"], text_emb["token_mask"], video_emb["frames"],
                                     video_emb["frame_mask"])

    def pair_uncertainty(self, text_emb: Emb, video_emb: Emb) -> Tensor:
        """The pair's sigma level: the geometric mean of the text's and the video's sigma (each the geometric
        mean over dimensions, as :meth:`item_readouts` reports Fig. 3's level), (n_text, n_video)."""
        lt, lv = text_emb["log_sigma"].float().mean(-1), video_emb["log_sigma"].float().mean(-1)
        return torch.exp((lt[:, None] + lv[None, :]) / 2)

    def item_readouts(self, text_emb: Emb, video_emb: Emb) -> dict[str, float]:
        """UATVR Fig. 3's uncertainty level: the geometric mean of sigma over texts and videos."""
        lt, lv = text_emb["log_sigma"].double(), video_emb["log_sigma"].double()
        return {"sigma": math.exp(float(torch.cat([lt.flatten(), lv.flatten()]).mean())),
                "sigma_text": math.exp(float(lt.mean())), "sigma_video": math.exp(float(lv.mean()))}

    def loss(self, texts: TextBatch, videos: VideoBatch, eps: tuple[Tensor, Tensor] | None = None) -> LossOutput:
        """L = L_DSA + alpha L_DUA + beta L_KL (Eq. 13); ``eps`` = (text, video) noise (B, K, D) each."""
        cfg = self.config
        te, ve = self.encode_texts(texts), self.encode_videos(videos)
        l_dsa = symmetric_infonce(self.similarity(te, ve) * self.logits_scale())
        terms = {"dsa": l_dsa}
        total = l_dsa
        if self._dua:
            b, d, k = te["mu"].shape[0], cfg.embed_dim, cfg.num_samples
            if eps is None:
                eps = (torch.randn(b, k, d, device=te["mu"].device, dtype=te["mu"].dtype),
                       torch.randn(ve["mu"].shape[0], k, d, device=te["mu"].device, dtype=te["mu"].dtype))
            t = te["mu"][:, None] + torch.exp(te["log_sigma"])[:, None] * eps[0]  # (B, K, D) Eq. 10
            v = ve["mu"][:, None] + torch.exp(ve["log_sigma"])[:, None] * eps[1]  # (B, K, D)
            logits = t.flatten(0, 1) @ v.flatten(0, 1).t() / cfg.dua_temperature  # (B K, B K)
            l_dua = (multi_instance_infonce(logits, k, k) + multi_instance_infonce(logits.t(), k, k)) / 2
            kl = kl_to_standard_normal(te["mu"], te["log_sigma"]) + kl_to_standard_normal(ve["mu"], ve["log_sigma"])
            l_kl = kl.mean() if cfg.kl_reduction == "mean" else kl.sum()
            terms.update(dua=l_dua, kl=l_kl)
            total = total + cfg.dua_weight * l_dua + cfg.kl_weight * l_kl
        return LossOutput(total=total, terms={k_: v_.detach() for k_, v_ in terms.items()})
