"""ProTA: dual partial-related aggregation + token-based probabilistic alignment.

Paper: Fang, Zang et al., "ProTA: Probabilistic Token Aggregation for Text-Video Retrieval"
(../shared/papers/prota.txt), Sec. 3, Eq. 1-16; settings Sec. 4.1 and Supp. B (R = 5,
lambda = xi = 100, eta = beta = 5e-4, temporal transformer 4 layers x 8 heads x 512); Tab. 1
ablation, Tab. 10 (temperatures), Tab. 11 (R).
No official code exists: every reading of an ambiguous equation below is a choice, with its reason.

Tokens: text tokens f_t are the cached word tokens (SOS, words, EOS: the paper lists t_SOS among
them); video tokens f_v are the frames after CLIP4Clip's temporal transformer (``seqtransf``'s
blocks and residual). Both are l2-normalised per token. Masks hold everywhere: padding never enters
a softmax, a max, a sum or a Gram matrix. Equations (t2v shown; v2t is the mirror)::

    s_ij            = <t_i, v_j>                                                    Eq. 1
    l_{t_i->v}      = sum_j s_ij softmax_j(lambda s_ij)                              Eq. 2
    g_ij            = 1/R sum_k exp(-|f_i - f_j|^2 / (2 s_k^2))   over f = [f_t; f_v]  Eq. 3-4
    h_{t->t}        = softmax_i(W_t(G_tt f_t / N))       (N,) token weights            Eq. 5
    h_{t_i->v}      = sum_j g_ij softmax_j(xi g_ij)                                  Eq. 6
    h^_t            = h_{t->v} (.) h_{t->t} / sum_i |.|  elementwise, normalised, (N,)  Eq. 7
    S(t, v)         = (<l_{t->v}, h^_t> + <l_{v->t}, h^_v>) / 2                        Eq. 8
    mu = W^mean(f), sigma^2 = exp W^var(f)               per token                     Eq. 9
    s^p_ij          = -sqrt(|mu_t^i - mu_v^j|^2 + |sigma_t^i - sigma_v^j|^2)           Eq. 10
    S^p             = Eq. 2-8 with s^p in Eq. 1 and G^p built from the means           Eq. 11
    L^kl            = 1/2 [KL(N_t || N(0, I)) + KL(N_v || N(0, I))]                    Eq. 12
    L_t2v           = -E log exp((S^p_ii - eta m_ii)/tau) / sum_j exp(S^d_ij/tau)        Eq. 13
    m_t2v           = exp(-KL(N_t || N_v))                                             Eq. 14
    L = (L_t2v + L_v2t)/2 + beta L^kl                                                  Eq. 15-16

Choices (docs/methods.md, "ProTA"):

- **Eq. 1 is a cosine**: the tokens are l2-normalised. lambda = xi = 100 are CLIP's logit scale for
  cosines; on raw 512-d dot products (norms ~10) a softmax at 100 would be a hard max everywhere,
  and Tab. 10 reports the hard max ("max") as a different setting.
- **Eq. 2 and 6 are soft maxima**: the softmax runs over the other modality's real tokens;
  ``lam`` / ``xi`` = inf is Tab. 10's "max" row.
- **Eq. 5: W_t yields one weight per token**: the two-layer MLP maps each re-aggregated token
  (G_tt f_t)_i to a logit (Linear D->2D, ReLU, Linear 2D->1: the token-weight MLP of Mean-Max/DRL,
  the paper's [22] and Tab. 1 baseline) and a softmax over the real tokens makes the weights, so
  h_{t->t} is (N,) like l_{t->v} (Eq. 8 takes their inner product; a (N, D) h could not be). The
  output layer has no bias: the softmax is shift-invariant, so a bias there could never learn
  (its gradient is exactly zero) and would change no weight.
  G_tt f_t is divided by N (``gram_aggregation="mean"``): a sum would scale with the caption's
  length, which an MLP on frozen features cannot undo; "sum" is the literal print. The MLP's
  output layer starts at zero, so the untrained weights are uniform (the LdA row's means).
- **Eq. 7's product is elementwise** (the "double weighting"): both factors are per-token (N,)
  vectors; an inner product would give a scalar, and Eq. 8 would then multiply the vector
  l_{t->v} by a scalar, which is not a similarity. The product is **normalised over the real
  tokens** (divided by sum_i |h_{t_i->v}| h_{t_i->t}), so S is a weighted mean of l whatever
  the sign of the token similarity. Unnormalised (as printed), h_{t->v} in (0, 1] scales each
  pair's score by how well its tokens align, which inverts the ranking once s is negative, as
  Eq. 10's negative distance always is: a better-aligned pair gets a larger h and so a more
  negative S^p (measured, untrained on a D = 64 generated store: validation R@1 0 with mean rank
  78 of 100, the deterministic head 12 with mean rank 21). Normalised, the printed Eq. 11 works
  with the printed Eq. 10. Without G_inter, h_{t->t} sums to 1 and nothing changes.
- **Kernels**: R Gaussian kernels on the unit-norm tokens with bandwidths s_k^2 = s^2 mul^(k - (R-1)/2),
  s^2 = 1 and mul = 2 (the multi-bandwidth family of multi-kernel MMD, geometric around the
  squared distance of two orthogonal unit vectors, 2 = 2 s^2). Fixed, not estimated from the
  batch: a bandwidth from the batch would make a pair's score depend on its neighbours. With
  mul = 2 the R kernels are one exp and R-1 squarings (exp(-a 2^k) = exp(-a)^(2^k)).
- **No (N+M)^2 Gram per pair**: G_tt depends on the text only and G_vv on the video only (both
  computed once per item at encoding), and G_tv is a function of the same token cosines as
  Eq. 1 (|x - y|^2 = 2 - 2 cos for unit vectors), so a pair needs one (N, M) cosine matrix.
  :func:`gram_matrix` builds the full matrix of Eq. 4; the tests check the blocks against it.
- **Eq. 10 is the 2-Wasserstein distance**: for diagonal Gaussians W2^2 = |mu_1 - mu_2|^2 +
  |sigma_1 - sigma_2|^2 with sigma the *standard deviations*. As printed, Eq. 10 subtracts
  sigma^2, which Eq. 9 defines as the variance; the text names W2, so the standard deviations are
  the default and ``w2_spread="variance"`` is the literal print. Under autograd a squared
  distance below 1e-12 counts as 0 (sqrt's gradient is unbounded at 0).
- **Means are l2-normalised** (mu = normalize(f + W^mean(f))): the Gram kernels and lambda are set
  for unit vectors, as in the deterministic path. W^mean is a residual two-layer MLP whose output
  layer starts at zero, so mu starts at the token itself (``mean_residual=False``: the plain MLP);
  W^var is a two-layer MLP with torch's default initialisation and log-variance bias
  ``log_var_init`` = 0 (sigma^2 = 1, where Eq. 12's KL is minimal in sigma); the untrained
  spreads then differ by |sigma_t - sigma_v|^2 ~ 0.07 at D = 64 (measured), small against the
  means' 2 - 2 cos. Zero-initialising W^var's output would be a fixed point: with every sigma
  equal, Eq. 10's gradient in sigma is 0.
- **Eq. 12 per token**: each token's KL to N(0, I) (closed form, summed over dimensions), averaged
  over the item's real tokens, then over the batch.
- **Eq. 13's S^d**: the denominator's logits are S^p with the margin subtracted from the positive
  only (so the positive appears in numerator and denominator alike and L_t2v is a proper
  cross-entropy, >= 0). tau is the learnable CLIP temperature every head has. Reading S^d as the
  deterministic Eq. 8 score would make the loss unbounded below (numerator and denominator on
  different scores) and cost a second similarity for nothing at inference.
- **Eq. 14's distributions**: N_t and N_v are the caption's and the video's token distributions
  as a whole: the equal-weight mixture of their token Gaussians, moment-matched to one diagonal
  Gaussian (mean = mean of mu_i, variance = mean of sigma_i^2 + mu_i^2 minus the squared mean).
  KL is asymmetric, so m_t2v = exp(-KL(N_t || N_v)) and m_v2t = exp(-KL(N_v || N_t)), as
  Fig. 3(b) averages two different margins. The margin is an indicator (the paper's word) and is
  detached: with gradient through m the loss would be lowered by pushing matched pairs' KL up
  (``margin_grad=True`` lets it flow).
- **Inference** is S^p (S with ``probabilistic=False``), deterministic: no samples anywhere.
- **Readouts**: mean token variance of texts and videos (item readouts, Fig. 3(a) plots log
  sigma^2) and the adaptive margin (m_t2v + m_v2t)/2 of every validation pair, averaged over
  matching and non-matching pairs (Fig. 3(b)), logged per epoch and plotted.

Ablations (Tab. 1): LdA ``intra=False inter=False probabilistic=False kl_weight=0 margin_weight=0``;
+G_intra ``intra=True``; +G_inter ``inter=True``; G-dagger ``gram=dot``; DPA-section-sign
``probabilistic=True``; +L^kl ``kl_weight``; +AC ``margin_weight``. Tab. 10 ``lam``, ``xi``; Tab. 11
``num_kernels``. docs/methods.md lists the ``--set`` line of every row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tvrpipe.config import above, at_least, one_of
from tvrpipe.errors import ConfigError
from tvrpipe.heads.base import Copied, Emb, Head, HeadConfig, LossOutput, TextBatch, VideoBatch, register_head
from tvrpipe.heads.losses import kl_to_standard_normal, masked_mean
from tvrpipe.heads.prota.equations import (  # noqa: F401  (re-exported: the equations of the head)
    gaussian_kl,
    gaussian_kl_matrix,
    gram_matrix,
    gram_of_cosines,
    pooled_gaussian,
    rbf_kernels,
    safe_sqrt,
    soft_max_aggregate,
    w2_similarity,
)
from tvrpipe.heads.prota.pairs import PairSettings, pair_scores
from tvrpipe.heads.seqtransf import (
    ResidualAttentionBlock,
    attention_heads,
    copy_clip_text_layers,
    init_sequence_transformer,
    length_groups,
    sequence_transformer,
)
from tvrpipe.heads.tokenwise import masked_normalize, without_first

# texts per evaluation tile, grouped by length (1k-A similarity, texts x elements: 16 x 1<<17 9.7 s,
# 32 x 1<<18 6.9 s, 64 x 1<<19 7.2 s)
_TILE_TEXTS = 32
_PAIR_KEYS = ("x", "mask", "weight", "spread", "spread_sq")  # per-token embedding entries the pair scores read
# (texts, tokens, videos, frames) elements of a tile, 4 MB in float32 (1k-A: 1<<16 9.3 s, 1<<18 6.9 s, 1<<20 6.6 s)
_TILE_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class Config(HeadConfig):
    """ProTA: DPA (Eq. 1-8) over token Gaussians (Eq. 9-11), KL and adaptive-margin InfoNCE."""

    num_layers: int = 4  # ProTA Supp. B: temporal transformer 4 layers (CLIP4Clip seqTransf)
    num_heads: int | None = at_least(1, None)  # None: D // 64 (8 at D = 512), ProTA Supp. B: 8 heads
    mlp_ratio: int = 4  # CLIP4Clip code (module_cross.ResidualAttentionBlock): MLP width 4D
    max_frames: int = 77  # CLIP4Clip code: position table = CLIP context length 77
    ln_eps: float = 1e-12  # CLIP4Clip code module_cross.LayerNorm (TF style)
    zero_init: bool = True  # choice: as seqtransf, identity temporal transformer at the start (no CLIP weights)
    drop_sot: bool = False  # ProTA Sec. 3: f_t = {t_SOS, t_1, ..., t_EOS}, SOS included
    lam: float = above(0, 100.0, infinite=True)  # lambda, ProTA Sec. 4.1, Tab. 10: Eq. 2 (inf: "max")
    xi: float = above(0, 100.0, infinite=True)  # xi, ProTA Sec. 4.1, Tab. 10: Eq. 6 (inf: "max")
    num_kernels: int = at_least(1, 5)  # R, ProTA Sec. 4.1 / Tab. 11
    kernel_sigma2: float = above(0, 1.0)  # choice: middle bandwidth s^2 (2 s^2 = squared distance of orthogonal unit vectors)
    kernel_mul: float = above(0, 2.0)  # choice: bandwidth ratio between kernels (multi-kernel MMD family)
    gram: str = one_of(("rbf", "dot"), "rbf")  # ProTA Tab. 1: "rbf" (G, Eq. 3) or "dot" (G-dagger, Gram by dot product)
    gram_aggregation: str = one_of(("mean", "sum"), "mean")  # choice: Eq. 5's G_tt f_t divided by N; "sum" = as printed
    intra: bool = True  # ProTA Tab. 1 "+G_intra" (Eq. 5); False: uniform token weights
    inter: bool = True  # ProTA Tab. 1 "+G_inter" (Eq. 6-7); False: h_{t->v} = 1
    probabilistic: bool = True  # ProTA Tab. 1 "DPA-section" (Eq. 9-11); False: DPA on the tokens (Eq. 8)
    w2_spread: str = one_of(("std", "variance"), "std")  # choice: Eq. 10 with standard deviations (W2); "variance" = as printed
    mean_residual: bool = True  # choice: mu = f + W^mean(f), output layer zero (starts at f); False: plain MLP
    log_var_init: float = 0.0  # choice: W^var output bias, sigma^2 = 1 (KL minimum in sigma)
    kl_weight: float = at_least(0, 5e-4)  # beta, ProTA Sec. 4.1 / Eq. 16; 0 = Tab. 1 without "+L^kl"
    margin_weight: float = at_least(0, 5e-4)  # eta, ProTA Sec. 4.1 / Eq. 13; 0 = Tab. 1 without "+AC"
    margin_grad: bool = False  # choice: the margin is a detached indicator (ProTA Sec. 3.2, "indicator")

    def check(self) -> None:
        attention_heads(self.owner, "num_heads", self.embed_dim, self.num_heads)
        if not self.probabilistic and (self.kl_weight or self.margin_weight):
            raise ConfigError(f"{self.owner}: kl_weight and margin_weight need the token distributions of "
                              "probabilistic=True; for the deterministic rows of Tab. 1 add "
                              "--set kl_weight=0 --set margin_weight=0")


# train-head's learning rate when --lr is not given, by feature width D: 3e-4 at D = 64 from the
# validation curves of `tvrpipe bench convergence` (docs/training.md, "Default learning rates, and what
# chose them"); at D = 512 the calibrated world's first epochs (docs/training.md, "Heads against
# zero-shot"): 3e-3 collapsed ProTA in its first epoch on 1,000 videos (validation R@1 36.8 -> 26.4),
# 1e-4 lifted it to 55.6, 3e-4 to 51.6
DEFAULT_LR = {64: 3e-4, 512: 1e-4}


def _at_least_fp32(emb: Emb) -> Emb:
    """``emb``'s float tensors in float32 where they are half precision (fp16 / bf16 under autocast);
    float32 and float64 as they are, masks untouched."""
    return {k: v.to(torch.promote_types(v.dtype, torch.float32)) if v.is_floating_point() else v
            for k, v in emb.items()}


class TokenMLP(nn.Sequential):
    """Linear -> ReLU -> Linear over the last dimension (the paper's "two-layer MLP").

    ``out_bias=False`` drops the output layer's bias, for an MLP whose output feeds a softmax over
    tokens: softmax is shift-invariant, so that bias would get an exactly zero gradient and change no
    score. A checkpoint that holds it loads with it discarded, which changes nothing either.
    """

    def __init__(self, dim: int, hidden: int, out: int, out_bias: bool = True) -> None:
        super().__init__(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, out, bias=out_bias))
        if not out_bias:
            self.register_load_state_dict_pre_hook(_drop_shift_bias)

    def tokens(self, x: Tensor, mask: Tensor) -> Tensor:
        """The MLP on the real tokens only, zero at padding: (B, L, D) -> (B, L, out)."""
        real = self(x[mask])  # (n_real, out): no work on the padded tails of short captions
        return real.new_zeros(*mask.shape, real.shape[-1]).index_put((mask,), real)


def _drop_shift_bias(module: nn.Module, state_dict: dict, prefix: str, *_) -> None:
    """Load-state hook of a bias-free :class:`TokenMLP`: a checkpoint's output bias is a constant shift
    of the softmax's logits, so it is dropped, not refused."""
    state_dict.pop(f"{prefix}2.bias", None)


# -- the head --------------------------------------------------------------------------------------


@register_head("prota")
class ProTA(Head):
    """ProTA: S^p of Eq. 11 (or S of Eq. 8), trained with Eq. 16."""

    score_meaning = ("ProTA Eq. 11 (probabilistic, the default): the token-level aggregation (Eq. 2-8) of negative "
                     "2-Wasserstein distances between the text's and the video's token Gaussians, at most 0; higher "
                     "(nearer 0) ranks first. With probabilistic=false, Eq. 8: the same aggregation of word-frame "
                     "cosines, from -1 to 1 (higher ranks first)")
    uncertainty_meaning = ("probabilistic ProTA: the mean of the text's and the video's token variance (Eq. 9), above 0: "
                           "larger, less certain (smaller, more certain); none with probabilistic=false")
    score_range = (None, 1.0)  # either variant's: at most 0 (Eq. 11), or from -1 to 1 (Eq. 8)

    Config = Config
    default_lr = DEFAULT_LR

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        cfg, d = config, config.embed_dim
        heads = attention_heads("prota", "num_heads", d, cfg.num_heads)
        # the smallest value G_tv can take (pair_scores' shared-exp check): its value at cosine -1
        # (the dot product's -1; the kernels' mean at the largest squared distance of unit vectors, 4)
        self._gram_floor = float(gram_of_cosines(torch.tensor(-1.0, dtype=torch.float64), cfg))
        self.frame_position_embeddings = nn.Embedding(cfg.max_frames, d)
        self.blocks = nn.ModuleList(ResidualAttentionBlock(d, heads, cfg.mlp_ratio, cfg.ln_eps)
                                    for _ in range(cfg.num_layers))
        init_sequence_transformer(self.frame_position_embeddings, self.blocks, cfg.zero_init)
        if cfg.intra:  # W_t, W_v (Eq. 5): token weight logits, uniform at the start; no output bias (a softmax follows)
            self.text_weight = TokenMLP(d, 2 * d, 1, out_bias=False)
            self.video_weight = TokenMLP(d, 2 * d, 1, out_bias=False)
            for mlp in (self.text_weight, self.video_weight):
                nn.init.zeros_(mlp[2].weight)
        if cfg.probabilistic:  # W^mean, W^var (Eq. 9), one pair per modality
            self.text_mean, self.video_mean = TokenMLP(d, d, d), TokenMLP(d, d, d)
            self.text_var, self.video_var = TokenMLP(d, d, d), TokenMLP(d, d, d)
            for mlp in (self.text_var, self.video_var):
                nn.init.constant_(mlp[2].bias, cfg.log_var_init)
            if cfg.mean_residual:
                for mlp in (self.text_mean, self.video_mean):
                    nn.init.zeros_(mlp[2].weight)
                    nn.init.zeros_(mlp[2].bias)

    # -- per-item work ------------------------------------------------------------------------------

    def init_from_clip(self, clip: nn.Module) -> Copied:
        """The temporal transformer from CLIP's text transformer (ProTA Supp. B, as CLIP4Clip's seqTransf)."""
        return copy_clip_text_layers(clip, self.blocks, self.frame_position_embeddings)

    def _intra_weights(self, x: Tensor, mask: Tensor, mlp: nn.Module | None) -> Tensor:
        """Eq. 5: h_{t->t} = softmax over the real tokens of W_t(G_tt f_t): (B, L, D) -> (B, L)."""
        count = mask.sum(1, keepdim=True).clamp(min=1).to(x.dtype)  # (B, 1)
        if mlp is None:
            return mask.to(x.dtype) / count  # uniform: the LdA row's means
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        g = gram_of_cosines(x @ x.transpose(1, 2), self.config)  # (B, L, L) G_tt
        g = torch.where(mask[:, None, :], g, zero)  # real columns only
        agg = g @ x  # (B, L, D)
        if self.config.gram_aggregation == "mean":
            agg = agg / count[:, :, None]
        logits = mlp.tokens(agg, mask).squeeze(-1)  # (B, L); in the MLP's dtype (fp16 under autocast)
        logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
        return torch.where(mask, logits.softmax(-1), zero)

    def _encode(self, f: Tensor, mask: Tensor, weight: nn.Module | None, mean: nn.Module | None,
                var: nn.Module | None) -> Emb:
        """Tokens (B, L, D) with their mask -> the head's per-item embedding (tokens l2-normalised first)."""
        f = masked_normalize(f, mask)  # (B, L, D), zero at padding
        emb: Emb = {"mask": mask}
        if self.config.probabilistic:
            mu = mean.tokens(f, mask) + f if self.config.mean_residual else mean.tokens(f, mask)
            mu = masked_normalize(mu, mask)  # (B, L, D)
            log_var = var.tokens(f, mask)  # (B, L, D) Eq. 9: sigma^2 = exp W^var(f), 0 at padding
            spread = torch.exp(0.5 * log_var) if self.config.w2_spread == "std" else torch.exp(log_var)
            # centred at the prior's 1 (Eq. 10 uses differences only): no cancellation in |a|^2 + |b|^2 - 2ab
            spread = torch.where(mask[..., None], spread - 1, torch.zeros((), dtype=f.dtype, device=f.device))
            variance = torch.exp(log_var)
            pool_mu, pool_var = pooled_gaussian(mu, variance, mask)  # (B, D) each, Eq. 14
            kl = kl_to_standard_normal(mu, 0.5 * log_var)  # (B, L) Eq. 12 per token
            n = mask.sum(1).to(f.dtype)
            emb.update(x=mu, spread=spread, spread_sq=spread.square().sum(-1), pool_mu=pool_mu, pool_var=pool_var,
                       kl=masked_mean(kl, mask, dim=1),
                       var_mean=masked_mean(variance.mean(-1), mask, dim=1), n_tokens=n)
        else:
            emb["x"] = f
        emb["weight"] = self._intra_weights(emb["x"], mask, weight)
        return emb

    def encode_texts(self, texts: TextBatch) -> Emb:
        mask = without_first(texts.token_mask) if self.config.drop_sot else texts.token_mask.bool()
        return self._encode(texts.tokens, mask, getattr(self, "text_weight", None),
                            getattr(self, "text_mean", None), getattr(self, "text_var", None))

    def encode_videos(self, videos: VideoBatch) -> Emb:
        n, mask = videos.frames.shape[1], videos.frame_mask.bool()
        if n > self.config.max_frames:
            raise ConfigError(f"prota: videos have {n} frames but max_frames is {self.config.max_frames}; "
                              f"set --set max_frames={n}")
        h = sequence_transformer(videos.frames, mask, self.frame_position_embeddings.weight, self.blocks)
        return self._encode(h, mask, getattr(self, "video_weight", None),
                            getattr(self, "video_mean", None), getattr(self, "video_var", None))

    # -- pairwise work ------------------------------------------------------------------------------

    def _scores(self, te: Emb, ve: Emb) -> Tensor:
        """S^p (or S) of every pair of ``te`` x ``ve``: (n_t, n_v), in float32 (or float64) even under
        autocast: Eq. 2 and 6's soft-max at temperature 100 takes exp(100 (s - 1)), which fp16 flushes to
        zero for every similarity below ~0.83 (its smallest value is 6e-8), leaving a pair no weight."""
        with torch.autocast(te["x"].device.type, enabled=False):
            return self._scores_fp32(_at_least_fp32(te), _at_least_fp32(ve))

    def _scores_fp32(self, te: Emb, ve: Emb) -> Tensor:
        # Eq. 1 (or 10), G_tv (Eq. 3) from the same cosines, Eq. 2, 6-8: fused, with a hand-written backward (pairs.py)
        cfg = self.config
        settings = PairSettings(cfg.lam, cfg.xi, cfg.inter, cfg.gram, cfg.num_kernels, cfg.kernel_sigma2,
                                cfg.kernel_mul, self._gram_floor)
        spreads = {}
        if cfg.probabilistic:
            spreads = dict(spread_t=te["spread"], spread_v=ve["spread"], spread_sq_t=te["spread_sq"],
                           spread_sq_v=ve["spread_sq"])
        return pair_scores(te["x"], ve["x"], te["mask"], ve["mask"], te["weight"], ve["weight"], settings, **spreads)

    @property
    def dsl_not_applicable(self) -> str | None:
        """Eq. 11's score averages negative W2 distances (Eq. 10), so DSL's sim x prior would invert
        its ranking; the paper reports no DSL either ("without any augmentation [1]", Sec. 4.3)."""
        if self.config.probabilistic:
            return ("ProTA's Eq. 11 score is an average of negative W2 distances (Eq. 10); DSL's "
                    "sim x softmax(100 sim) presumes non-negative similarities and would invert the ranking")
        return None

    def similarity(self, text_emb: Emb, video_emb: Emb) -> Tensor:
        """Eq. 11 (Eq. 8 with ``probabilistic=False``): (n_text, n_video), deterministic.

        With autograd off, pairs are computed in small tiles of texts and videos grouped by length
        and cut after their last real token (padding never enters, so a pair's score does not
        depend on its tile): memory is bounded by the tile (4 MB per tensor) and the work by the
        real lengths.
        """
        if torch.is_grad_enabled():
            return self._scores(text_emb, video_emb)
        out = text_emb["x"].new_empty(text_emb["x"].shape[0], video_emb["x"].shape[0],
                                      dtype=torch.promote_types(text_emb["x"].dtype, torch.float32))  # as _scores
        for ti, tk in length_groups(text_emb["mask"], _TILE_TEXTS):
            te = {k: text_emb[k][ti, :tk] for k in _PAIR_KEYS if k in text_emb}
            tile_v = max(1, _TILE_ELEMENTS // (len(ti) * tk * video_emb["x"].shape[1]))
            for vi, vk in length_groups(video_emb["mask"], tile_v):
                ve = {k: video_emb[k][vi, :vk] for k in _PAIR_KEYS if k in video_emb}
                out[ti[:, None], vi[None, :]] = self._scores(te, ve)
        return out

    def pair_margins(self, text_emb: Emb, video_emb: Emb) -> tuple[Tensor, Tensor]:
        """Eq. 14 for every pair: m_t2v = exp(-KL(N_t || N_v)), m_v2t = exp(-KL(N_v || N_t)), (n_t, n_v) each."""
        tm, tv, vm, vv = text_emb["pool_mu"], text_emb["pool_var"], video_emb["pool_mu"], video_emb["pool_var"]
        return torch.exp(-gaussian_kl_matrix(tm, tv, vm, vv)), torch.exp(-gaussian_kl_matrix(vm, vv, tm, tv).t())

    def pair_readouts(self, text_emb: Emb, video_emb: Emb) -> dict[str, Tensor]:
        """The adaptive margin (m_t2v + m_v2t) / 2 of every pair (ProTA Fig. 3(b))."""
        if not self.config.probabilistic:
            return {}
        m_t2v, m_v2t = self.pair_margins(text_emb, video_emb)
        return {"margin": (m_t2v + m_v2t) / 2}

    def config_meaning(self) -> tuple[str, tuple[float | None, float | None], str | None]:
        """The score, its range and the uncertainty of this config's variant (Eq. 11, or Eq. 8 and none)."""
        if self.config.probabilistic:
            return ("ProTA Eq. 11: the token-level aggregation (Eq. 2-8) of negative 2-Wasserstein distances between "
                    "the text's and the video's token Gaussians, at most 0; higher (nearer 0) ranks first", (None, 0.0),
                    "the mean of the text's and the video's token variance (Eq. 9), above 0: larger, less certain "
                    "(smaller, more certain)")
        return ("ProTA Eq. 8: the token-level aggregation (Eq. 2-8) of word-frame cosines, from -1 to 1 (higher ranks "
                "first)", (-1.0, 1.0), None)

    def pair_uncertainty(self, text_emb: Emb, video_emb: Emb) -> Tensor | None:
        """The mean of the text's and the video's token variance (probabilistic ProTA; None otherwise)."""
        if not self.config.probabilistic:
            return None
        return (text_emb["var_mean"].float()[:, None] + video_emb["var_mean"].float()[None, :]) / 2

    def item_readouts(self, text_emb: Emb, video_emb: Emb) -> dict[str, float]:
        """Mean token variance (over real tokens and dimensions) of the texts and of the videos."""
        if not self.config.probabilistic:
            return {}
        out = {}
        for side, emb in (("text", text_emb), ("video", video_emb)):
            n = emb["n_tokens"].double()
            out[f"var_{side}"] = float((emb["var_mean"].double() * n).sum() / n.sum().clamp(min=1))
        return out

    # -- training ------------------------------------------------------------------------------------

    def loss(self, texts: TextBatch, videos: VideoBatch) -> LossOutput:
        """Eq. 16: the adaptive-margin symmetric InfoNCE (Eq. 13-15) + beta L^kl (Eq. 12)."""
        cfg = self.config
        te, ve = self.encode_texts(texts), self.encode_videos(videos)
        scale = self.logits_scale()
        logits = self.similarity(te, ve) * scale  # (B, B)
        target = torch.arange(logits.shape[0], device=logits.device)
        t2v_logits, v2t_logits = logits, logits
        if cfg.probabilistic and cfg.margin_weight > 0:  # Eq. 13-14: margin on the positives only (S^d)
            m_t2v = torch.exp(-gaussian_kl(te["pool_mu"], te["pool_var"], ve["pool_mu"], ve["pool_var"]))  # (B,)
            m_v2t = torch.exp(-gaussian_kl(ve["pool_mu"], ve["pool_var"], te["pool_mu"], te["pool_var"]))
            if not cfg.margin_grad:
                m_t2v, m_v2t = m_t2v.detach(), m_v2t.detach()
            t2v_logits = logits - torch.diag(cfg.margin_weight * m_t2v) * scale
            v2t_logits = logits - torch.diag(cfg.margin_weight * m_v2t) * scale
        contra = (F.cross_entropy(t2v_logits, target) + F.cross_entropy(v2t_logits.t(), target)) / 2  # Eq. 15
        terms = {"contra": contra}
        total = contra
        if cfg.probabilistic and cfg.kl_weight > 0:
            kl = (te["kl"].mean() + ve["kl"].mean()) / 2  # Eq. 12
            terms["kl"] = kl
            total = total + cfg.kl_weight * kl
        return LossOutput(total=total, terms={k: v.detach() for k, v in terms.items()})
