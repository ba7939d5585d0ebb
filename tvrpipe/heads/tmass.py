"""T-MASS: text modelled as a stochastic embedding ("text mass") around the sentence embedding.

Paper: Wang et al., "Text Is MASS: Modeling as Stochastic Embedding for Text-Video Retrieval"
(CVPR 2024), Sec. 3.3, Eq. 5-10; settings Sec. 4.1; ablations Tab. 5, Tab. 6a/6b, Fig. 6.
Official code: Jiamian-Wang/T-MASS-text-video-retrieval (``modules/stochastic_module.py``,
``trainer/trainer_stochastic.py``, ``model/clip_stochastic.py``).

Equations (t = raw sentence embedding (D,), f_1..f_F = raw frame embeddings, v = z_{v|t} = the
X-Pool embedding of the video pooled with the text t, :class:`tvrpipe.heads.xpool.XPool`)::

    S_i = cos(t, f_i),  i = 1..F over the REAL frames               (Eq. 6)
    R = exp(S W + b)  (W: F x D)   | exp(theta mean S) | exp(mean S)   (Eq. 7; Tab. 5)
    t_s = t + R * eps,  eps ~ P                                       (Eq. 5)
    L_s   = symmetric InfoNCE over cos(t_s, v)                        (Sec. 3.3, "Learning text mass")
    t_sup = t + (v - t) / |v - t| * R                                 (Eq. 8)
    L_sup = symmetric InfoNCE over cos(t_sup, v)
    L     = L_s + alpha L_sup  (+ w_ce L_ce on t, the Tab. 6a rows)   (Eq. 9)
    score(t, v) = max_{m = 1..M} cos(t + R * eps_m, v)                (Eq. 10)

Choices (docs/methods.md, "T-MASS"):

- **Radius for every pair.** R depends on the (text, video) pair. In training the radius of
  every (text_i, video_j) of the batch is computed and t_s / t_sup of that pair are scored
  against z_{j|i}, exactly as at inference (``train_radius="pairs"``). The official code computes
  R only from each text's paired video and reuses it against every video of the batch;
  ``train_radius="paired"`` does that (with v of Eq. 8 the pair's own pooled video, where the
  official code averages video i's pooled embeddings over every text of the batch).
- **Training noise**: one eps per caption per step, shared by the videos it is scored against
  (common random numbers across the row, as at inference); drawn from torch's global RNG, which
  the trainer seeds.
- **Prior**: N(0, I) as the paper writes (``prior="normal"``, ``prior_std`` = 1); the official
  code's default is U[0, 1) (``stochastic_prior='uniform01'``), available as ``prior="uniform"``
  (its released LSMDC run uses normal with std 3e-3). Uniform noise is not centred: it shifts every
  text by R/2 along the positive orthant. A draw of N(0, I) is about as long as the raw sentence
  embedding (sqrt(D) against ~10), so until training shrinks R the samples swamp t, and the max of
  Eq. 10 ranks videos by how they line up with the draws: the untrained head scores far below X-Pool,
  and a run catches up only as fast as R shrinks (docs/methods.md, "Why T-MASS trails zero-shot on
  the generated stores"; none of the official README's runs uses N(0, 1)).
- **alpha = 1.2** as the paper's Sec. 4 and Fig. 6; the official code's default
  ``support_loss_weight`` is 0 and its README trains MSR-VTT with 0.8.
- **Radius variants**: the official code implements only exp(S W) (its ``learnable_scalar`` is
  never used); the scalar and mean variants follow the paper's Tab. 5 text.
- **The radius layer's bias**: Eq. 7 writes R = exp(S W) with "W ... the learnable weights in the
  linear layer"; the official code's linear layer has a bias (zero at init), kept here
  (``radius_bias``). It lets R shrink in every dimension at once, which W alone can do only through
  S, whose entries are cosines in [-1, 1]. Measured without it (``radius_bias=false``), the default run's
  validation R@1 is 34.0 and 26.5 on the small and medium convergence stores, against 33.0 and
  30.0 with it (docs/training.md).
- **Padding**: S has entries for real frames only. For exp(S W) the padded slots of S are 0, so
  the rows of W for padded positions never contribute (the official code assumes 12 real frames);
  the two mean variants average over the real frames. A video with no real frame has S = 0.
- **Initialisation** as the official code: W = identity on its first F rows (``nn.init.eye_`` on
  the (D, F) weight), bias 0, so R starts at exp(S_d) on the first F channels and 1 elsewhere;
  theta starts at 1 (the official ``nn.Parameter(torch.Tensor(1))`` is left uninitialised), so
  the scalar variant starts as the parameter-free exp(mean S).
- **Leak-free inference**: every (query text, video) pair pools the video with the query text.
  The official ``eval`` selects the best sample against the query-pooled video, but its final
  cosine (``sim_matrix_inference_stochastic``, which keeps ``sims[i, :, :, i]``) uses each video
  pooled with its own captions (docs/design.md, "Evaluation protocol").
- **Fixed noise** (docs/design.md, "A method head is done when"): the M inference draws
  eps_1..eps_M are a (M, D) buffer drawn once from ``noise_seed``; every pair uses the same M
  draws, so a pair's score is a pure function of the pair and the weights. The official code draws
  fresh noise for every video.

Efficiency (exact): with eps fixed, a pair with radius R, raw text t and pooled video z has::

    cos_m = (<t, z> + <R * z, eps_m>) / (|z| sqrt(|t|^2 + 2 <R * t, eps_m> + <R^2, eps_m^2>))

so the M samples cost matrix products with the (D, M) noise, never M D-vectors per pair. <t, z>
and |z| are X-Pool's factored scalars (:meth:`XPool.factored`); z = g3 (inv_sigma P + c) inv_s + b3
with P = sum_j a_j rc_j, so <R * z, eps_m> = inv_s inv_sigma <R * P, g3 eps_m> + inv_s <R, c g3
eps_m> + <R, b3 eps_m>: per pair the D-sized work is P (a J x D product), R = exp(S W + b) and
three products with the noise. A scalar radius (Tab. 5 rows 1-2) needs only <z, eps_m>. Texts
are processed in chunks so that each (n_video, chunk, D) tensor stays under ``_PAIR_BUDGET``
elements: memory beyond the score matrix is bounded whatever the engine's block sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tvrpipe.config import above, at_least, one_of
from tvrpipe.errors import ConfigError
from tvrpipe.heads.base import Emb, LossOutput, TextBatch, VideoBatch, register_head
from tvrpipe.heads.losses import symmetric_infonce
from tvrpipe.heads.xpool import Config as XPoolConfig
from tvrpipe.heads.xpool import XPool

RADII = ("linear", "scalar", "mean")
PRIORS = ("normal", "uniform")
TRAIN_RADII = ("pairs", "paired")
_PAIR_BUDGET = 1 << 21  # elements of one (videos, texts, D) tile tensor at evaluation (8 MB in float32)
_TILE_TEXTS = 32  # texts per evaluation tile (measured: larger tiles re-read less of the per-video factors)


@dataclass(frozen=True)
class Config(XPoolConfig):
    """T-MASS: X-Pool video embedding, stochastic text with a similarity-aware radius."""

    num_frames: int = at_least(1, 12)  # T', T-MASS Sec. 4.1 (12 frames): the rows of W in R = exp(S W)
    radius: str = one_of(RADII, "linear")  # T-MASS Eq. 7 / Tab. 5 final model exp(S W); "scalar": exp(theta mean S), "mean": exp(mean S)
    prior: str = one_of(PRIORS, "normal")  # T-MASS Eq. 5: P = N(0, I); "uniform": U[0, 1), the official code's default
    prior_std: float = above(0, 1.0)  # T-MASS Eq. 5: N(0, 1); official stochastic_prior_std (its LSMDC run: normal, 3e-3)
    num_samples: int = at_least(0, 20, why="0: score t itself")  # M, T-MASS Sec. 4.1 / Tab. 6b (M = 20); 0 scores t itself ("w/o sampling")
    alpha: float = at_least(0, 1.2)  # T-MASS Eq. 9 / Fig. 6: weight of L_sup (0 drops it)
    w_s: float = at_least(0, 1.0)  # T-MASS Eq. 9 / Tab. 6a: weight of L_s on sampled t_s (0 drops it)
    w_ce: float = at_least(0, 0.0)  # T-MASS Tab. 6a: weight of L_ce on t itself (rows 1-2; the final model has none)
    train_radius: str = one_of(TRAIN_RADII, "pairs")  # choice: radius of every (text, video) pair as at inference; "paired": official code
    theta_init: float = 1.0  # choice: official code leaves theta uninitialised; 1 starts at exp(mean S)
    noise_seed: int = 0  # choice (common random numbers, docs/design.md): seed of the fixed (M, D) noise
    radius_bias: bool = True  # T-MASS Eq. 7 "the linear layer": the official nn.Linear(T', d) has a bias

    def check(self) -> None:
        super().check()
        if self.alpha + self.w_s + self.w_ce == 0:
            raise ConfigError(f"{self.owner}: the loss weights alpha, w_s, w_ce must not all be 0")


@register_head("tmass")
class TMass(XPool):
    """T-MASS: the max over M fixed samples of the stochastic text's cosine with the pooled video."""

    score_meaning = ("T-MASS Eq. 10: the best cosine, over the text mass's fixed samples, of a sampled text and the "
                     "video pooled by attention to the sentence; from -1 to 1 (higher ranks first)")
    uncertainty_meaning = ("the radius |R|_1 of the text mass around the query for that video (Sec. 3.2), at least 0: "
                           "larger, a less certain query (smaller, more certain)")
    score_range = (-1.0, 1.0)  # a cosine, or an average of cosines

    Config = Config

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        d = config.embed_dim
        if config.radius == "linear":
            self.radius_proj = nn.Linear(config.num_frames, d, bias=config.radius_bias)  # S (F,) -> log R (D,)
            nn.init.eye_(self.radius_proj.weight)  # official LinearCosRadius._init_parameters
            if self.radius_proj.bias is not None:
                nn.init.zeros_(self.radius_proj.bias)
        elif config.radius == "scalar":
            self.theta = nn.Parameter(torch.tensor(float(config.theta_init)))
        g = torch.Generator().manual_seed(config.noise_seed)
        self.register_buffer("noise", self._draw((config.num_samples, d), g), persistent=False)  # (M, D)

    def param_groups(self) -> dict[str, list[nn.Parameter]]:
        """``radius``: the similarity-aware radius (W, b of Eq. 7, or theta), a group of its own so that a run
        can give it a rate (``--group-lr radius=...``); ``head``: everything else. Sec. 4.1 names R's rate
        beside psi's ("the same initial learning rate of 1e-5 to train psi and R (3e-5 for MSRVTT)"), and
        the official code trains both at its one ``noclip_lr``: by default both groups take the run's lr."""
        radius = [p for m in ("radius_proj", "theta") if hasattr(self, m)
                  for p in (getattr(self, m).parameters() if isinstance(getattr(self, m), nn.Module)
                            else [getattr(self, m)]) if p.requires_grad]
        ids = {id(p) for p in radius}
        return {"head": [p for p in self.parameters() if p.requires_grad and id(p) not in ids], "radius": radius}

    def _draw(self, shape: tuple[int, ...], generator: torch.Generator | None = None,
              device: torch.device | None = None) -> Tensor:
        """Samples of the prior P of Eq. 5."""
        if self.config.prior == "normal":
            return self.config.prior_std * torch.randn(shape, generator=generator, device=device)
        return torch.rand(shape, generator=generator, device=device)  # the official code ignores the std here

    # -- per-item work --------------------------------------------------------------------------

    def encode_texts(self, texts: TextBatch) -> Emb:
        return {**super().encode_texts(texts), "raw": texts.sentence}  # t of Eq. 5, not normalised

    def encode_videos(self, videos: VideoBatch) -> Emb:
        n_frames = videos.frames.shape[1]
        if self.config.radius == "linear" and n_frames > self.config.num_frames:
            raise ConfigError(f"tmass: videos have {n_frames} frame slots but W of R = exp(S W) has "
                              f"num_frames={self.config.num_frames} rows; set --set num_frames={n_frames}")
        mask = videos.frame_mask.bool()
        unit = F.normalize(torch.where(mask.unsqueeze(-1), videos.frames, torch.zeros_like(videos.frames)), dim=-1)
        return {**super().encode_videos(videos), "frames_unit": unit}  # (B, F, D), zero rows at padding

    # -- the radius (Eq. 6-7) -------------------------------------------------------------------

    def _radius_vt(self, text_emb: Emb, video_emb: Emb) -> Tensor:
        """R of every pair, video-major: (n_video, n_text, D) (last dim 1 for the scalar variants)."""
        f_unit = video_emb["frames_unit"]  # (n_v, F, D), zero at padding
        n_v, n_frames, _ = f_unit.shape
        s = (f_unit.flatten(0, 1) @ text_emb["sentence"].t()).view(n_v, n_frames, -1).transpose(1, 2)  # (n_v, n_t, F)
        if self.config.radius == "linear":
            # padded slots of S are 0: their rows of W never contribute (W[:, :F] = S zero-padded to num_frames)
            log_r = s @ self.radius_proj.weight[:, :n_frames].t()  # (n_v, n_t, D)
            return torch.exp(log_r if self.radius_proj.bias is None else log_r + self.radius_proj.bias)
        n_real = video_emb["frame_mask"].sum(-1).clamp(min=1).to(s.dtype)  # (n_v,)
        mean_s = (s.sum(-1) / n_real[:, None]).unsqueeze(-1)  # (n_v, n_t, 1) mean over the real frames
        return torch.exp(self.theta * mean_s) if self.config.radius == "scalar" else torch.exp(mean_s)

    def radius(self, text_emb: Emb, video_emb: Emb) -> Tensor:
        """R of every (text, video) pair: (n_text, n_video, D), Eq. 6-7 (Tab. 5 variants broadcast)."""
        r = self._radius_vt(text_emb, video_emb)
        return r.expand(*r.shape[:2], self.config.embed_dim).transpose(0, 1)

    # -- pairwise work --------------------------------------------------------------------------

    def _tiles(self, text_emb: Emb, video_emb: Emb):
        """Tiles (texts a:b, videos c:d) small enough that one (videos, texts, D) tensor fits the
        budget; a pair's result does not depend on the tile it is computed in."""
        n_t, n_v = text_emb["raw"].shape[0], video_emb["keys"].shape[0]
        per_text = max(1, _PAIR_BUDGET // self.config.embed_dim)  # pairs per tile
        tile_t = max(1, min(n_t, _TILE_TEXTS, per_text))
        tile_v = max(1, per_text // tile_t)
        for a in range(0, n_t, tile_t):
            te = {k: v[a:a + tile_t] for k, v in text_emb.items()}
            for c in range(0, n_v, tile_v):
                yield a, min(a + tile_t, n_t), c, min(c + tile_v, n_v), te, {k: v[c:c + tile_v] for k, v in
                                                                             video_emb.items()}

    def similarity(self, text_emb: Emb, video_emb: Emb) -> Tensor:
        """Eq. 10 in eval mode (fixed noise); the plain X-Pool cosine with M = 0; Eq. 5's single
        draw against each pair's pooled video in training (the L_s logits)."""
        if self.training:
            return self._train_logits(text_emb, video_emb, terms=("s",))["s"]
        if self.config.num_samples == 0:
            return super().similarity(text_emb, video_emb)
        eps = self.noise.to(text_emb["raw"].dtype)  # (M, D)
        m = eps.shape[0]
        g3, b3, c = self.layer_norm3.weight, self.layer_norm3.bias, self._offset()  # (D,) each
        eps_t, eps_g = eps.t(), (g3 * eps).t()  # (D, M)
        eps_bc = torch.cat([b3 * eps, c * g3 * eps]).t()  # (D, 2M)
        out = text_emb["raw"].new_empty(text_emb["raw"].shape[0], video_emb["keys"].shape[0])
        inplace = not torch.is_grad_enabled()  # in-place products save a pass, but break autograd
        for a, b, c0, d0, te, ve in self._tiles(text_emb, video_emb):
            # z = g3 * (inv_sigma P + c) * inv_s + b3 (X-Pool's chain, folded per slot), P = sum_j a_j rc_j
            f = self.factored(te, ve)  # video-major (n_v, n) scalars: inv_sigma, inv_s, dot, norm_z
            t = te["raw"]  # (n, D)
            t_z = f["dot"] * t.norm(dim=-1)  # (n_v, n) <t, z>
            p = torch.bmm(f["a"], ve["rc"])  # (n_v, n, D)
            r = self._radius_vt(te, ve)  # (n_v, n, D or 1)
            inv_s, inv_sigma = f["inv_s"].unsqueeze(-1), f["inv_sigma"].unsqueeze(-1)  # (n_v, n, 1)
            if r.shape[-1] == 1:  # scalar radius: R * eps_m = r eps_m
                z_eps = inv_s * inv_sigma * (p @ eps_g) + inv_s * (c * g3 @ eps_t) + b3 @ eps_t  # (n_v, n, M) <z, eps_m>
                r_z, r_t, r2 = r * z_eps, r * (t @ eps_t), r.square() * eps.square().sum(-1)  # (n_v, n, M) each
            else:
                r_b, r_c = (r @ eps_bc).split(m, dim=-1)  # (n_v, n, M): <R b3, eps_m>, <R c g3, eps_m>
                r_p = p.mul_(r) if inplace else p * r  # (n_v, n, D)
                r_z = inv_s * inv_sigma * (r_p @ eps_g) + inv_s * r_c + r_b  # (n_v, n, M) <R * z, eps_m>
                r_t = (r * t) @ eps_t  # (n_v, n, M) <R * t, eps_m>
                r2 = (r.square_() if inplace else r.square()) @ eps.square().t()  # (n_v, n, M) <R^2, eps_m^2>
            norm_ts = (t.square().sum(-1)[:, None] + 2 * r_t + r2).clamp(min=0).sqrt()  # (n_v, n, M) |t_s|
            cos = (t_z.unsqueeze(-1) + r_z) / (norm_ts.clamp(min=1e-12) * f["norm_z"].clamp(min=1e-12).unsqueeze(-1))
            out[a:b, c0:d0] = cos.amax(-1).t()  # Eq. 10: the best of the M samples
        return out

    def pair_readouts(self, text_emb: Emb, video_emb: Emb) -> dict[str, Tensor]:
        """|R|_1 of every pair (T-MASS Fig. 3 and 5: small for matching pairs once trained)."""
        out = text_emb["raw"].new_empty(text_emb["raw"].shape[0], video_emb["keys"].shape[0])
        for a, b, c, d, te, ve in self._tiles(text_emb, video_emb):
            r = self._radius_vt(te, ve)  # (n_v, n, D or 1)
            out[a:b, c:d] = (r.sum(-1) * (self.config.embed_dim / r.shape[-1])).t()  # R > 0: |R|_1 = sum R
        return {"radius_l1": out}

    def pair_uncertainty(self, text_emb: Emb, video_emb: Emb) -> Tensor:
        """The radius |R|_1 of the text mass around each pair's text (Sec. 3.2: larger, a less certain text)."""
        return self.pair_readouts(text_emb, video_emb)["radius_l1"]

    # -- training (Eq. 5, 8, 9) -----------------------------------------------------------------

    def _train_logits(self, text_emb: Emb, video_emb: Emb, eps: Tensor | None = None,
                      terms: tuple[str, ...] = ("s", "sup", "ce")) -> dict[str, Tensor]:
        """Cosines of the batch's (text_i, video_j) pairs for each of ``terms``: (B_t, B_v) each.

        ``"s"``: the sampled t_s (Eq. 5), ``"sup"``: the support text (Eq. 8), ``"ce"``: t itself.
        ``eps`` (B_t, D): this step's draw of the prior (default: a fresh one).
        """
        cfg = self.config
        v = self.pooled_videos(text_emb, video_emb)  # (B_t, B_v, D) z_{j|i}, dropout in training
        t = text_emb["raw"].unsqueeze(1)  # (B_t, 1, D)
        r = self.radius(text_emb, video_emb)  # (B_t, B_v, D)
        out: dict[str, Tensor] = {}
        if cfg.train_radius == "paired":  # official code: R of (t_i, v_i) against every video j
            idx = torch.arange(min(r.shape[0], r.shape[1]), device=r.device)
            r = r[idx, idx].unsqueeze(1)  # (B, 1, D)
        if "s" in terms:
            if eps is None:
                eps = self._draw(tuple(text_emb["raw"].shape), device=t.device).to(t.dtype)
            out["s"] = F.cosine_similarity(t + r * eps.unsqueeze(1), v, dim=-1)  # Eq. 5
        if "sup" in terms:
            if cfg.train_radius == "paired":
                toward = v[idx, idx].unsqueeze(1) - t  # (B, 1, D) v of the pair itself
            else:
                toward = v - t  # (B_t, B_v, D)
            t_sup = t + F.normalize(toward, dim=-1) * r  # Eq. 8
            out["sup"] = F.cosine_similarity(t_sup, v, dim=-1)
        if "ce" in terms:
            out["ce"] = F.cosine_similarity(t, v, dim=-1)
        return out

    def loss(self, texts: TextBatch, videos: VideoBatch, eps: Tensor | None = None) -> LossOutput:
        """L = w_s L_s + alpha L_sup + w_ce L_ce (Eq. 9; Tab. 6a switches), every term logged."""
        weights = {"s": self.config.w_s, "sup": self.config.alpha, "ce": self.config.w_ce}
        te, ve = self.encode_texts(texts), self.encode_videos(videos)
        cos = self._train_logits(te, ve, eps, terms=tuple(k for k, w in weights.items() if w > 0))
        cos = {k: self.mix_zero_shot(te, ve, c) for k, c in cos.items()}  # as is, unless zero_shot_start
        scale = self.logits_scale()
        terms = {k: symmetric_infonce(c * scale) for k, c in cos.items()}
        total = sum(weights[k] * v for k, v in terms.items())
        return LossOutput(total=total, terms={k: v.detach() for k, v in terms.items()})
