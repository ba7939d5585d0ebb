"""DUQ: dual uncertainty quantification (intra-pair similarity, inter-pair distance).

Paper: "DUQ: Dual Uncertainty Quantification for Text-Video Retrieval" (IJCAI 2025), Sec. 3,
Eq. 1-16; settings Sec. 4.1 (alpha = 0.1, beta = 1e-4, gamma1 = gamma2 = 0.1, K = 7); Tab. 3.
Official code: OPA067/DUQ (``models/modeling.py``, ``models/uncertainty.py`` ``UM``,
``models/module_agg.py``, ``models/module_prob.py``), which differs from the paper in many places
(see docs/methods.md); the paper is followed.

Equations (s = X-Pool cosine of the sentence and the text-conditioned video, :mod:`tvrpipe.heads.xpool`)::

    L_S    = symmetric InfoNCE over lambda s                                      Eq. 1
    ISUM   alpha_ij = ReLU(S_ij) + 1, S_i = sum_j alpha_ij, p_ij = alpha_ij / S_i
           L_i = sum_j (y_ij - p_ij)^2 + p_ij (1 - p_ij) / (S_i + 1),  y = I       Eq. 4-6
           L_S^U = 1/B (sum_i L_i + sum_j L_j)   (rows and columns)               Eq. 7
           u = B / sum_j alpha_ij                                                 Eq. 3
    IDUM   z_t, z_v = local aggregation (multi-head attention over words / frames) fused with
           the global feature by concatenation; mu = h_mu(z), sigma = exp(h_sigma(z)) (linear)   Eq. 8
           z^k = mu + sigma eps_k, k = 1..K                                       Eq. 9
           d = 1 - cos(z_t^{i,m}, z_v^{j,n})                                      Eq. 10
           D_ij = max_{m,n} d for i != j, min_{m,n} d for i = j (training)        Eq. 11
           L_D = symmetric InfoNCE over -lambda D; L_D^U = Eq. 7 on D with y = 1 - I   Eq. 12-13
    KL     KL(N(mu_t, sigma_t^2) || N(0, I)) + KL(N(mu_v, sigma_v^2) || N(0, I))  Eq. 14
    L = L_S + L_S^U + alpha (L_D + L_D^U) + beta L_KL                             Eq. 15
    s' = exp(-g1 u_d) (1 - d) exp(-g2 u_s) s                                      Eq. 16 (inference)

Choices (docs/methods.md, "DUQ"):

- **Evidence from raw cosines** (ISUM and u_s): Sec. 3.2 asks the similarity matrix itself to approach
  the identity matrix, which is a statement about cosines in [-1, 1] (a logit matrix scaled by
  lambda ~ 100 can never equal I); the official ``UM`` also receives the unscaled cosines. So
  alpha in [1, 2] and, over N candidates, u in [1/2, 1].
- **Eq. 12's sign.** As printed, L_D is +log softmax(lambda D)_ii: minimising it pushes the *farthest*
  negatives hardest (gradient lambda p_ij on d_ij). It is read as what its text says ("similar to
  Eq. 1"): the InfoNCE of Eq. 1 with the similarity 1 - D, i.e. over -lambda D, which pulls the
  matched pair's boundary distance down and pushes the closest negatives hardest.
- **Local feature aggregation**: one pre-LN residual multi-head attention layer (``seqtransf``'s
  block without its MLP: the paper names multi-head attention only; the official ``module_agg``
  adds an MLP, which would triple the per-token cost; 8 heads at D = 512) over the real words
  (frames), their masked mean,
  concatenated with the global feature and projected back to D (a linear map of [local ; global]).
  The mean is computed by :func:`attention_block_mean` (value and output projections after it:
  the same function, half the per-token work).
  The words are F_t = [w_1, ..., w_Nt] (Sec. 3.1): CLIP's start token, whose output is the same for
  every caption, is left out (``drop_sot``, as ``tokenwise`` and ``uatvr``); EOT stays.
  The global text feature is the EOS sentence; the global video feature is the mean of its frames
  (X-Pool's F_v is text-conditioned, which would make z_v, hence every sample, a per-pair quantity
  at K x D per pair).
- **sigma is a standard deviation** (Eq. 9 multiplies eps by e^{h_sigma}); the KL is its closed form
  in that sigma, mean over the batch.
- **Identity initialisation of the distance branch** (``identity_init``): h_mu = I and the fusion
  passes the global feature through (local part 0), so mu_t = sentence and mu_v = mean frame and the
  branch starts at the cached features' zero-shot alignment, as X-Pool's official init makes its
  pooling start as a parameter-free one. In the paper the branch sits on a CLIP being finetuned;
  on cached features, two independent random maps for texts and videos start unaligned, and at
  alpha = 0.1 they did not align in 12 epochs (distance-only R@1 at chance, re-ranking 40 -> 6 on
  the test's store). With the identity start: distance-only R@1 46, raw 40, re-ranked 49 after 4
  epochs.
- **Eq. 11 is separable by sigma alone**: with min over the K x K sample pairs for the positive and
  max for the negatives, inflating sigma lowers every positive distance and raises every negative
  one without any alignment; measured with the random init, L_D fell to 5e-6 while the distance
  ranked at chance. The paper's reduction stays the default; ``distance_reduction="mean"`` trains
  every pair with the inference reduction instead (measured: distance-only R@1 47 vs 46).
- **Inference distance**: Eq. 11's min/max needs the ground truth, unknown at inference. Every pair
  uses the same reduction: the mean of d over the K x K pairs of fixed samples (the Monte Carlo
  expected distance, between the min the positives were trained with and the max of the
  negatives). It factors exactly: mean_{m,n} cos = <mean_m z^m/|z^m|, mean_n z^n/|z^n|>, one
  (D,)-vector per item and a matrix product. The K samples use a fixed noise buffer drawn from
  ``noise_seed`` (common random numbers: docs/design.md, "A method head is done when"), independent
  for texts and videos.
- **Eq. 16 is a step over the full score matrix** (``Head.rerank``), after the block engine:
  u_s and u_d of a query are Eq. 3 over its whole candidate set (a caption's videos for t2v, a
  video's captions for v2t), so each direction gets its own re-ranked matrix, reported as
  ``t2v_rerank`` / ``v2t_rerank`` beside the raw scores. Since u_s and u_d are per query, the factors
  exp(-g1 u_d) exp(-g2 u_s) are constant along each ranked list: under this protocol (each query
  ranks its own candidates) they cannot change a rank, and only (1 - d) reorders candidates; they
  would matter only where scores of different queries are compared. No softmax over the test
  queries is ever applied (the official evaluation applies one on single-caption test sets; DSL is
  a separate, opt-in post-processing). When both 1 - d and s are negative their product is
  positive; Eq. 16 is kept as printed. ``rerank=False`` turns it off.
- **Readouts**: mean u_s and u_d over validation queries whose raw top-1 is correct vs incorrect,
  per direction, logged per epoch and plotted.

Ablations (Tab. 3): ``uncertainty_weight`` (L_S^U), ``distance_weight`` (alpha on L_D and L_D^U),
``distance_infonce`` (L_D on/off), ``distance_uncertainty`` (L_D^U on/off), ``kl_weight``,
``num_samples`` (K), ``gamma1``/``gamma2``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tvrpipe.config import at_least, one_of, within
from tvrpipe.heads.base import (
    Emb,
    Head,
    HeadConfig,
    LossOutput,
    Reranked,
    TextBatch,
    VideoBatch,
    register_head,
)
from tvrpipe.heads.losses import kl_to_standard_normal, masked_mean, symmetric_infonce
from tvrpipe.heads.seqtransf import ResidualAttentionBlock, attention_heads, length_groups
from tvrpipe.heads.tokenwise import without_first
from tvrpipe.heads.xpool import Config as XPoolConfig
from tvrpipe.heads.xpool import XPool


@dataclass(frozen=True)
class Config(HeadConfig):
    """DUQ: X-Pool similarity + ISUM evidential loss + IDUM Gaussian embeddings + Eq. 16 re-ranking."""

    xpool_dropout: float = within(0.0, 1.0, 0.3, below=True)  # X-Pool code transformer_dropout (DUQ Sec. 3.1 adopts X-Pool)
    num_samples: int = at_least(1, 7)  # K, DUQ Sec. 4.1
    uncertainty_weight: float = at_least(0, 1.0)  # DUQ Eq. 15: L_S^U weight 1; 0 = Tab. 3 without "+L_S^U"
    distance_weight: float = at_least(0, 0.1)  # alpha, DUQ Eq. 15 / Sec. 4.1; 0 = Tab. 3 without "+L_D"
    # "boundary": Eq. 11 (max over sample pairs for i != j, min for i = j); "mean": the inference
    # reduction for every pair (an option: Eq. 11 is separable by inflating sigma, docs/methods.md)
    distance_reduction: str = one_of(("boundary", "mean"), "boundary")  # DUQ Eq. 11
    distance_infonce: bool = True  # DUQ Eq. 12 / Tab. 3 "+L_D" (row #5 has L_D^U without L_D)
    distance_uncertainty: bool = True  # DUQ Eq. 13 / Tab. 3 "+L_D^U"
    kl_weight: float = at_least(0, 1e-4)  # beta, DUQ Eq. 15 / Sec. 4.1
    gamma1: float = at_least(0, 0.1)  # DUQ Eq. 16 / Sec. 4.1: weight of u_d
    gamma2: float = at_least(0, 0.1)  # DUQ Eq. 16 / Sec. 4.1: weight of u_s
    rerank: bool = True  # DUQ Sec. 3.4 "Inference": report the Eq. 16 re-ranking beside the raw scores
    agg_heads: int | None = at_least(1, None)  # None: D // 64 (8 at D = 512), DUQ code module_agg num_heads=8
    drop_sot: bool = True  # DUQ Sec. 3.1: F_t = [w_1, ..., w_Nt], the words (no SOT), as tokenwise and uatvr
    noise_seed: int = 0  # choice (common random numbers, docs/design.md): seed of the fixed (K, D) noise
    log_sigma_init: float = 0.0  # choice: initial bias of h_sigma (0: sigma ~ 1, torch's default Linear init)
    # h_mu = identity and the fusion passes the global feature through, so the distance branch starts
    # at the zero-shot alignment of the cached features (as X-Pool's official identity init)
    identity_init: bool = True  # choice: see the module doc (False: torch's default init)

    def check(self) -> None:
        attention_heads(self.owner, "agg_heads", self.embed_dim, self.agg_heads)


def evidential_mse(sim: Tensor, target: Tensor) -> Tensor:
    """Eq. 6 per row: sum_j (y_ij - p_ij)^2 + p_ij (1 - p_ij) / (S_i + 1), p = alpha / S, alpha = ReLU(sim) + 1."""
    alpha = F.relu(sim) + 1  # (B, B)
    strength = alpha.sum(-1, keepdim=True)  # (B, 1) S_i
    p = alpha / strength
    return ((target - p).square() + p * (1 - p) / (strength + 1)).sum(-1)  # (B,)


def uncertainty_mass(sim: Tensor, dim: int = -1) -> Tensor:
    """Eq. 3: u = N / sum_j (ReLU(s_j) + 1) over the candidates along ``dim``."""
    return sim.shape[dim] / (F.relu(sim) + 1).sum(dim)


class LocalAggregation(nn.Module):
    """Multi-head attention over local features (pre-LN, residual, no MLP), masked mean, fused with
    the global feature by concatenation: z = W [mean(x + MHA(LN(x))) ; g] + b."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.block = ResidualAttentionBlock(dim, heads, mlp_ratio=0, ln_eps=1e-5)  # attention only
        self.fuse = nn.Linear(2 * dim, dim)

    def forward(self, x: Tensor, mask: Tensor, global_feature: Tensor) -> Tensor:
        mask = mask.bool()
        local = x.new_empty(x.shape[0], x.shape[2])  # (B, D)
        for idx, keep in length_groups(mask):  # no work on the padded tails of short captions
            m = mask[idx, :keep]
            xi = x[idx, :keep].masked_fill_(~m.unsqueeze(-1), 0.0)  # padding never enters (x[idx] is a copy)
            local[idx] = attention_block_mean(self.block, xi, m)
        return self.fuse(torch.cat([local, global_feature], dim=-1))  # (B, D)


def attention_block_mean(block: ResidualAttentionBlock, x: Tensor, mask: Tensor) -> Tensor:
    """``masked_mean(block(x, mask), mask)`` of an attention-only block, with half its work.

    The mean over the real queries commutes with the value and output projections (both linear,
    the attention weights of a query summing to 1): mean_q(x_q + W_o sum_k a_qk W_v y_k + b) =
    mean(x) + W_o (W_v sum_k abar_k y_k + b_v) + b_o, abar_k = mean_q a_qk per head, y = LN(x). So
    only the query and key projections run per token (2 D^2 instead of 4 D^2 multiply-adds), the
    value and output projections once per item. Equal to the block's output up to float rounding
    (tests/heads/test_duq.py); used in training and evaluation alike.
    """
    b, n, d = x.shape
    h = block.heads
    y = block.ln_1(x)
    a = block.attention_weights(y, mask)  # (B, H, N queries, N keys)
    abar = masked_mean(a.transpose(2, 3), mask[:, None, None, :], dim=-1)  # (B, H, N keys): over real queries
    pooled = torch.einsum("bhk,bkd->bhd", abar, y)  # (B, H, D): each head's weighted mean of LN(x)
    w_v = block.in_proj.weight[2 * d:].view(h, d // h, d)  # head h's rows of W_v
    v = torch.einsum("bhd,hcd->bhc", pooled, w_v).reshape(b, d) + block.in_proj.bias[2 * d:]  # (B, D)
    has_real = mask.any(1, keepdim=True).to(x.dtype)  # an all-padded item: 0, as masked_mean gives
    return masked_mean(x, mask, dim=1) + has_real * block.out_proj(v)


@register_head("duq")
class DUQ(Head):
    """DUQ: raw X-Pool scores; ISUM + IDUM in training; Eq. 16 re-ranking reported beside the raw."""

    score_meaning = ("DUQ Eq. 1, the X-Pool cosine of the sentence and the video pooled by attention to it, from -1 to"
                     " 1 (higher ranks first; Eq. 16's re-ranking is not applied)")
    score_range = (-1.0, 1.0)  # a cosine, or an average of cosines

    Config = Config

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        d = config.embed_dim
        heads = attention_heads("duq", "agg_heads", d, config.agg_heads)
        self.xpool = XPool(XPoolConfig(embed_dim=d, dropout=config.xpool_dropout))
        del self.xpool.logit_scale  # one lambda for every term: this head's logit_scale
        self.text_agg, self.video_agg = LocalAggregation(d, heads), LocalAggregation(d, heads)
        self.text_mu, self.text_sigma = nn.Linear(d, d), nn.Linear(d, d)  # Eq. 8: linear h_mu, h_sigma
        self.video_mu, self.video_sigma = nn.Linear(d, d), nn.Linear(d, d)
        for h_sigma in (self.text_sigma, self.video_sigma):
            nn.init.constant_(h_sigma.bias, config.log_sigma_init)
        if config.identity_init:
            for agg, h_mu in ((self.text_agg, self.text_mu), (self.video_agg, self.video_mu)):
                nn.init.zeros_(agg.fuse.weight[:, :d])  # local part starts at 0 ...
                nn.init.eye_(agg.fuse.weight[:, d:])  # ... the global feature passes through
                nn.init.zeros_(agg.fuse.bias)
                nn.init.eye_(h_mu.weight)
                nn.init.zeros_(h_mu.bias)
        g = torch.Generator().manual_seed(config.noise_seed)
        # independent draws for texts [0] and videos [1]: sample k of a caption and of a video must not
        # share eps_k, or the K x K mean distance would be biased by the correlated diagonal pairs
        self.register_buffer("noise", torch.randn(2, config.num_samples, d, generator=g), persistent=False)  # (2, K, D)

    # -- per-item work --------------------------------------------------------------------------

    def _gaussian(self, agg: LocalAggregation, h_mu: nn.Linear, h_sigma: nn.Linear, x: Tensor, mask: Tensor,
                  global_feature: Tensor, noise: Tensor) -> dict[str, Tensor]:
        z = agg(x, mask, global_feature)  # (B, D)
        mu, log_sigma = h_mu(z), h_sigma(z)  # Eq. 8
        # mean direction of the K fixed samples (Eq. 9): the inference distance factors through it
        samples = F.normalize(mu[:, None] + torch.exp(log_sigma)[:, None] * noise.to(mu.dtype), dim=-1)
        return {"mu": mu, "log_sigma": log_sigma, "sample_mean": samples.mean(1)}  # (B, D) each

    def encode_texts(self, texts: TextBatch) -> Emb:
        mask = without_first(texts.token_mask) if self.config.drop_sot else texts.token_mask.bool()
        g = self._gaussian(self.text_agg, self.text_mu, self.text_sigma, texts.tokens, mask, texts.sentence,
                           self.noise[0])
        return {**self.xpool.encode_texts(texts), **{f"p_{k}": v for k, v in g.items()}}

    def encode_videos(self, videos: VideoBatch) -> Emb:
        mask = videos.frame_mask.bool()
        frames = torch.where(mask.unsqueeze(-1), videos.frames, torch.zeros_like(videos.frames))
        g = self._gaussian(self.video_agg, self.video_mu, self.video_sigma, frames, mask,
                           masked_mean(frames, mask, dim=1), self.noise[1])
        return {**self.xpool.encode_videos(videos), **{f"p_{k}": v for k, v in g.items()}}

    # -- pairwise work --------------------------------------------------------------------------

    def similarity(self, text_emb: Emb, video_emb: Emb) -> Tensor:
        """The raw score: the X-Pool cosine s(t, v) (Eq. 1), deterministic; Eq. 16 is :meth:`rerank`."""
        return self.xpool.similarity(text_emb, video_emb)

    def distance(self, text_emb: Emb, video_emb: Emb) -> Tensor:
        """Inference distance d of every pair: mean of Eq. 10 over the K x K fixed samples, (n_t, n_v)."""
        return 1 - text_emb["p_sample_mean"] @ video_emb["p_sample_mean"].t()

    def rerank(self, sim: Tensor, text_emb: Emb, video_emb: Emb) -> Reranked | None:
        """Eq. 16 over the full matrix, with u_s and u_d (Eq. 3) over each query's candidates."""
        cfg = self.config
        if not cfg.rerank:
            return None
        d = torch.cat([self.distance({"p_sample_mean": text_emb["p_sample_mean"][a:a + 4096]}, video_emb)
                       for a in range(0, sim.shape[0], 4096)]).to(sim.dtype)  # (n_t, n_v)
        base = (1 - d) * sim
        out, readouts = {}, {}
        for direction, dim in (("t2v", 1), ("v2t", 0)):  # a caption's videos; a video's captions
            u_s, u_d = uncertainty_mass(sim, dim), uncertainty_mass(d, dim)  # (n_queries,)
            factor = torch.exp(-cfg.gamma1 * u_d - cfg.gamma2 * u_s)
            out[direction] = base * (factor[:, None] if dim == 1 else factor[None, :])
            readouts[direction] = {"u_s": u_s, "u_d": u_d}
        return Reranked(t2v=out["t2v"], v2t=out["v2t"], query_readouts=readouts)

    # -- training (Eq. 1-15) --------------------------------------------------------------------

    def loss(self, texts: TextBatch, videos: VideoBatch, eps: tuple[Tensor, Tensor] | None = None) -> LossOutput:
        """Eq. 15; ``eps`` = (text, video) noise (B, K, D) each (default: fresh draws)."""
        cfg = self.config
        te, ve = self.encode_texts(texts), self.encode_videos(videos)
        scale = self.logits_scale()  # lambda
        s = self.similarity(te, ve)  # (B, B) raw cosines (mixed with zero-shot's under zero_shot_start)
        eye = torch.eye(s.shape[0], device=s.device, dtype=s.dtype)
        terms = {"s": symmetric_infonce(s * scale)}  # Eq. 1
        total = terms["s"]
        if cfg.uncertainty_weight > 0:
            terms["s_u"] = (evidential_mse(s, eye).sum() + evidential_mse(s.t(), eye).sum()) / s.shape[0]  # Eq. 7
            total = total + cfg.uncertainty_weight * terms["s_u"]
        if cfg.distance_weight > 0 or cfg.kl_weight > 0:
            b, k = s.shape[0], cfg.num_samples
            if eps is None:
                eps = (torch.randn(b, k, cfg.embed_dim, device=s.device, dtype=s.dtype),
                       torch.randn(b, k, cfg.embed_dim, device=s.device, dtype=s.dtype))
            zt = F.normalize(te["p_mu"][:, None] + torch.exp(te["p_log_sigma"])[:, None] * eps[0], dim=-1)  # Eq. 9
            zv = F.normalize(ve["p_mu"][:, None] + torch.exp(ve["p_log_sigma"])[:, None] * eps[1], dim=-1)
            dist = 1 - torch.einsum("imc,jnc->ijmn", zt, zv).flatten(2)  # (B, B, K K) Eq. 10
            if cfg.distance_reduction == "boundary":
                dmat = torch.where(eye.bool(), dist.amin(-1), dist.amax(-1))  # Eq. 11
            else:
                dmat = dist.mean(-1)  # the inference distance, for every pair
            l_d = torch.zeros((), device=s.device, dtype=s.dtype)
            if cfg.distance_infonce:
                terms["d"] = symmetric_infonce(-dmat * scale)  # Eq. 12 (see the module doc on its sign)
                l_d = l_d + terms["d"]
            if cfg.distance_uncertainty:
                terms["d_u"] = (evidential_mse(dmat, 1 - eye).sum() + evidential_mse(dmat.t(), 1 - eye).sum()) / b
                l_d = l_d + terms["d_u"]  # Eq. 13
            terms["kl"] = (kl_to_standard_normal(te["p_mu"], te["p_log_sigma"])
                           + kl_to_standard_normal(ve["p_mu"], ve["p_log_sigma"])).mean()  # Eq. 14
            total = total + cfg.distance_weight * l_d + cfg.kl_weight * terms["kl"]
        return LossOutput(total=total, terms={k_: v_.detach() for k_, v_ in terms.items()})

