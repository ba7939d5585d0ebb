"""X-Pool: text-conditioned attention pooling of the frames.

Paper: Gorti et al., "X-Pool: Cross-Modal Language-Video Attention for Text-Video Retrieval"
(CVPR 2022), the cross-modal attention of its model section and Fig. 2. Official code:
layer6ai-labs/xpool, ``modules/transformer.py`` (``MultiHeadedAttention``, ``Transformer``),
``modules/metrics.py`` (cosine similarity), ``modules/loss.py`` (symmetric CE = base ``loss``).

Equations (c_t = sentence embedding (D,), C_v = frames (F, D), LN = LayerNorm)::

    Q_t = LN(c_t) W_Q,   K_v = LN(C_v) W_K,   V_v = LN(C_v) W_V
    Attention(Q_t, K_v, V_v) = softmax(Q_t K_v^T / sqrt(D_p)) V_v          # over the real frames
    r_{v|t} = LN(Attention(Q_t, K_v, V_v) W_O)
    z_{v|t} = LN(FC(r_{v|t}) + r_{v|t})                                      # FC with residual
    s(t, v) = cos(c_t, z_{v|t})

The three LayerNorms are the code's ``layer_norm1`` (shared by text and frames), ``layer_norm2``
and ``layer_norm3``; FC is ``linear_proj`` with dropout on its output (``transformer_dropout``).
(The paper's text is not among ../shared/papers; the chain above is the paper's model section as
published, and the official ``Transformer.forward`` implements exactly this chain.)

Taken from the official code where the paper is silent:
- one attention head (``num_mha_heads=1``; the paper writes a single query per text), D_p = D;
- dropout 0.3 on FC's output (``transformer_dropout``; T-MASS Sec. 4.1 keeps X-Pool's 0.3);
- identity initialisation of W_Q, W_K, W_V, W_O and FC, zero biases (``_init_parameters``), so the
  untrained head is a parameter-free text-conditioned pooling;
- the sentence enters the cosine raw (not layer-normalised), as ``sim_matrix_training`` does.
Where they differ, the paper is followed:
- W_Q, W_K, W_V, W_O are bias-free projection matrices as in the paper's equations (the code's
  ``nn.Linear`` layers carry biases initialised to zero; the key bias is provably inert: it adds the
  same logit to every frame of a softmax, so it can never receive gradient). FC keeps its bias.
  ``proj_bias=True`` adds the code's four biases (zero at init), so that an official checkpoint,
  whose trained query, value and output biases move the scores, gives the same scores here (a video
  with no real frame then pools to zero without b_O, where the official code has no padding).
- The code attends over every frame slot (its videos always have 12 frames); here padded frames
  get zero weight, and a video with no real frame has all-zero weights (its pooled vector before
  LN2 is zero) instead of NaN.
- ``logit_scale`` starts at the features' CLIP's learned scale, as X-Pool reuses it (``clip_head_config``).

Efficiency (exact algebra, no approximation): keys and values depend only on the video, so
``encode_videos`` computes K = LN(C_v) W_K and V W_O (W_O is linear, so it commutes with the
attention-weighted sum) once per video, and ``encode_texts`` computes the query. ``similarity``
then needs the (n_text, n_video, F) attention weights. In evaluation (dropout off) the rest is
also factored: given a pair's attention weights a (over the F frame slots), LN2's mean and scale
are scalars of the pair, so r is an affine function of a; FC and the residual are linear, so they
fold into per-video vectors R_j; LN3's mean and variance and the final cosine are quadratic forms
of a with per-video F x F Gram matrices. Per pair this costs O(F D) for two matrix products plus
O(F^2), and no (n_text, n_video, D) tensor is ever built (``_similarity_factored``). Training with
dropout, where FC's output is masked per pair and per channel, uses the explicit pooled vectors
(``pooled_videos``); both paths are tested against a per-pair loop written from the equations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tvrpipe.config import at_least, within
from tvrpipe.errors import ConfigError
from tvrpipe.heads.base import Emb, Head, HeadConfig, TextBatch, VideoBatch, register_head


@dataclass(frozen=True)
class Config(HeadConfig):
    """X-Pool: one cross-modal attention block from the sentence to the frames."""

    num_heads: int = at_least(1, 1)  # X-Pool code num_mha_heads=1 (paper: a single query per text), D_p = D
    dropout: float = within(0.0, 1.0, 0.3, below=True)  # X-Pool code transformer_dropout=0.3; T-MASS Sec. 4.1 keeps X-Pool's 0.3
    identity_init: bool = True  # X-Pool code Transformer._init_parameters: identity projections, zero biases
    # True: the official code's nn.Linear biases (zero at init), so that its trained checkpoints score the same
    proj_bias: bool = False  # X-Pool's equations: bias-free W_Q, W_K, W_V, W_O

    def check(self) -> None:
        if self.embed_dim % self.num_heads:
            raise ConfigError(f"{self.owner}: embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}")


@register_head("xpool")
class XPool(Head):
    """X-Pool: cosine between the sentence and the frames pooled by attention to that sentence."""

    score_meaning = ("the cosine of the sentence embedding and the video pooled by attention to that sentence, from -1"
                     " to 1 (higher ranks first)")
    score_range = (-1.0, 1.0)  # a cosine, or an average of cosines

    uses_tokens = False  # reads the sentence embedding only

    Config = Config

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        d = config.embed_dim
        self.layer_norm1 = nn.LayerNorm(d)
        self.q_proj = nn.Linear(d, d, bias=config.proj_bias)
        self.k_proj = nn.Linear(d, d, bias=config.proj_bias)
        self.v_proj = nn.Linear(d, d, bias=config.proj_bias)
        self.out_proj = nn.Linear(d, d, bias=config.proj_bias)
        self.layer_norm2 = nn.LayerNorm(d)
        self.linear_proj = nn.Linear(d, d)
        self.dropout = nn.Dropout(config.dropout)
        self.layer_norm3 = nn.LayerNorm(d)
        if config.identity_init:
            for lin in (self.q_proj, self.k_proj, self.v_proj, self.out_proj, self.linear_proj):
                nn.init.eye_(lin.weight)
                if lin.bias is not None:
                    nn.init.zeros_(lin.bias)

    # -- per-item work --------------------------------------------------------------------------

    def encode_texts(self, texts: TextBatch) -> Emb:
        t = texts.sentence  # (B, D)
        return {"sentence": F.normalize(t, dim=-1), "query": self.q_proj(self.layer_norm1(t))}  # (B, D) each

    def encode_videos(self, videos: VideoBatch) -> Emb:
        mask = videos.frame_mask.bool()  # (B, F)
        frames = torch.where(mask.unsqueeze(-1), videos.frames, torch.zeros_like(videos.frames))
        x = self.layer_norm1(frames)  # (B, F, D)
        b, n_frames, d = x.shape
        h = self.config.num_heads
        values = self.v_proj(x).view(b, n_frames, h, d // h)  # (B, F, H, d_h)
        w_o = self.out_proj.weight.view(d, h, d // h)  # (D_out, H, d_h): W_O's columns per head
        # V W_O per head: head h's attention output only meets W_O's columns of head h.
        values_o = torch.einsum("bfhc,ehc->bhfe", values, w_o).reshape(b, h * n_frames, d)  # (B, J=H*F, D)
        if self.out_proj.bias is not None:  # proj_bias: each head's weights sum to 1, so H slots of b_O / H add b_O
            values_o = values_o + self.out_proj.bias / h
        return {"keys": self.k_proj(x), "values": values_o, "frame_mask": mask, **self._factors(values_o)}

    def _factors(self, values_o: Tensor) -> Emb:
        """Per-video vectors and Gram matrices of the factored LN2 -> FC -> LN3 -> cosine."""
        g2, g3, b3 = self.layer_norm2.weight, self.layer_norm3.weight, self.layer_norm3.bias  # (D,)
        w_fc = self.linear_proj.weight  # (D, D)
        c2c = self._offset()  # (D,)
        pc = values_o - values_o.mean(-1, keepdim=True)  # (B, J, D) centred: p - mean(p) = sum_j a_j pc_j
        gpc = g2 * pc  # (B, J, D)
        rc = gpc + gpc @ w_fc.t()  # (B, J, D): y = r + FC(r) is linear in r
        rc = rc - rc.mean(-1, keepdim=True)  # (B, J, D) centred for LN3
        quad = torch.cat([
            pc @ pc.transpose(1, 2),  # (B, J, J) a^T G a = ||p - mean p||^2 (LN2 variance)
            rc @ rc.transpose(1, 2),  # (B, J, J) -> ||y - mean y||^2 (LN3 variance)
            (rc * g3.square()) @ rc.transpose(1, 2),  # (B, J, J) -> sum g3^2 (y - mean y)^2
            # (B, J, 3) linear terms
            torch.stack([rc @ c2c, rc @ (g3.square() * c2c), rc @ (g3 * b3)], dim=-1),
        ], dim=-1)  # (B, J, 3J + 3)
        return {"rc": rc, "quad": quad}

    def _offset(self) -> Tensor:
        """The pair-independent part of y = r + FC(r), centred: (D,)."""
        b2, w_fc, b_fc = self.layer_norm2.bias, self.linear_proj.weight, self.linear_proj.bias
        c2 = b2 + b2 @ w_fc.t() + b_fc  # (D,)
        return c2 - c2.mean()

    # -- pairwise work --------------------------------------------------------------------------

    def attention(self, text_emb: Emb, video_emb: Emb) -> Tensor:
        """Attention of each text over each video's frame slots: (n_text, n_video, J = H * F)."""
        q, keys, mask = text_emb["query"], video_emb["keys"], video_emb["frame_mask"]
        h = self.config.num_heads
        n_v, n_frames, d = keys.shape
        q = q.reshape(q.shape[0], h, d // h)  # (n_t, H, d_h)
        logits = torch.einsum("thc,vfhc->tvhf", q, keys.reshape(n_v, n_frames, h, d // h))  # (n_t, n_v, H, F)
        logits = logits / math.sqrt(d // h)
        keep = mask[None, :, None, :]  # (1, n_v, 1, F)
        # Set (not add) the padded logits, then zero their weights: exact zeros, and an all-padded
        # video gets all-zero weights instead of NaN.
        logits = logits.masked_fill(~keep, torch.finfo(logits.dtype).min)
        weights = logits.softmax(-1) * keep  # (n_t, n_v, H, F)
        return weights.flatten(2)  # (n_t, n_v, J)

    def pooled_videos(self, text_emb: Emb, video_emb: Emb) -> Tensor:
        """The text-conditioned video embeddings z_{v|t}: (n_text, n_video, D).

        Materialises (n_text, n_video, D): for training batches, or where a caller needs z itself.
        """
        a = self.attention(text_emb, video_emb)  # (n_t, n_v, J)
        pooled = torch.einsum("tvj,vjd->tvd", a, video_emb["values"])  # (n_t, n_v, D) = Attention W_O
        r = self.layer_norm2(pooled)  # (n_t, n_v, D)
        return self.layer_norm3(r + self.dropout(self.linear_proj(r)))  # (n_t, n_v, D)

    def similarity(self, text_emb: Emb, video_emb: Emb) -> Tensor:
        if self.training and self.config.dropout > 0:
            return self._similarity_pooled(text_emb, video_emb)
        return self._similarity_factored(text_emb, video_emb)

    def _similarity_pooled(self, text_emb: Emb, video_emb: Emb) -> Tensor:
        z = F.normalize(self.pooled_videos(text_emb, video_emb), dim=-1)  # (n_t, n_v, D)
        return torch.einsum("td,tvd->tv", text_emb["sentence"], z)  # (n_t, n_v)

    def _similarity_factored(self, text_emb: Emb, video_emb: Emb) -> Tensor:
        f = self.factored(text_emb, video_emb)
        return (f["dot"] / f["norm_z"].clamp(min=1e-12)).t()  # (n_t, n_v), F.normalize semantics

    def factored(self, text_emb: Emb, video_emb: Emb) -> dict[str, Tensor]:
        """The per-pair scalars of the eval-mode (no dropout) chain, video-major, without any
        (n_text, n_video, D) tensor.

        Returns ``a`` (n_v, n_t, J) attention weights and, each (n_v, n_t): ``inv_sigma`` and
        ``inv_s`` (1 / the LN2 and LN3 scales), ``dot`` = <t / |t|, z> and ``norm_z`` = |z|. With
        P = sum_j a_j rc_j (``rc`` of ``encode_videos``), the pooled video is
        z = g3 * (inv_sigma P + c) * inv_s + b3, c = :meth:`_offset` (heads that need z use this).
        """
        # Exact closed form of cos(t, LN3(y)), y = r + FC(r), r = LN2(sum_j a_j VO_j); no dropout.
        # With pc_j, rc_j the centred per-slot vectors of encode_videos:
        #   sigma^2 = a^T Gp a / D + eps2                      (LN2)
        #   y~ = y - mean(y) = sum_j a_j rc_j / sigma + c2c     (FC and residual folded into rc_j)
        #   s^2 = ||y~||^2 / D + eps3                           (LN3),  z = g3 * y~ / s + b3
        #   cos = <t, z> / ||z||, both expanded in a with per-video Gram matrices.
        t = text_emb["sentence"]  # (n_t, D) unit
        d = t.shape[-1]
        g3, b3 = self.layer_norm3.weight, self.layer_norm3.bias  # (D,)
        c2c = self._offset()  # (D,)
        a = self.attention(text_emb, video_emb)  # (n_t, n_v, J)
        n_slots = a.shape[-1]

        a_v = a.transpose(0, 1)  # (n_v, n_t, J)
        forms = torch.bmm(a_v, video_emb["quad"])  # (n_v, n_t, 3J + 3): a^T G for the 3 Grams, then a.e
        # (n_v, n_t) each
        qp, qy, qz = ((forms[..., k * n_slots:(k + 1) * n_slots] * a_v).sum(-1) for k in range(3))
        ly, lz, lb = forms[..., 3 * n_slots:].unbind(-1)  # (n_v, n_t) each

        inv_sigma = (qp / d + self.layer_norm2.eps).rsqrt()  # (n_v, n_t) 1 / LN2 scale
        var_y = (qy * inv_sigma.square() + 2 * ly * inv_sigma + c2c.square().sum()) / d
        inv_s = (var_y + self.layer_norm3.eps).rsqrt()  # (n_v, n_t) 1 / LN3 scale

        tg = t * g3  # (n_t, D)
        t_rc = (tg @ video_emb["rc"].flatten(0, 1).t()).view(t.shape[0], -1, n_slots)  # (n_t, n_v, J)
        t_y = (a * t_rc).sum(-1).t() * inv_sigma + tg @ c2c  # (n_v, n_t) <t * g3, y~>
        dot = t_y * inv_s + t @ b3  # (n_v, n_t) <t, z>
        # sum g3^2 y~^2
        g3y2 = qz * inv_sigma.square() + 2 * lz * inv_sigma + (g3.square() * c2c.square()).sum()
        g3b3y = lb * inv_sigma + (g3 * b3 * c2c).sum()  # sum g3 b3 y~
        norm_z = (g3y2 * inv_s.square() + 2 * g3b3y * inv_s + b3.square().sum()).clamp(min=0).sqrt()
        return {"a": a_v, "inv_sigma": inv_sigma, "inv_s": inv_s, "dot": dot, "norm_z": norm_z}
