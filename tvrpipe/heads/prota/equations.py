"""ProTA's equations as functions of tensors (the head is :mod:`tvrpipe.heads.prota`).

Eq. 2 / 6 soft maxima (:func:`soft_max_aggregate`, :func:`soft_max_aggregate_both`), Eq. 3-4
kernels and Gram matrix (:func:`rbf_kernels`, :func:`gram_matrix`), Eq. 10 (:func:`w2_similarity`,
:func:`safe_sqrt`), Eq. 14's Gaussians (:func:`pooled_gaussian`, :func:`gaussian_kl`,
:func:`gaussian_kl_matrix`) and Eq. 2, 6-8 for every pair of a tile (:func:`dpa_scores`). The
choices behind each are in the head's module docstring and docs/methods.md.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from tvrpipe.heads.losses import masked_mean

_SQRT_FLOOR = 1e-12  # Eq. 10 under autograd: squared distances below it give 0 (gradient <= 1 / (2 sqrt(floor)))


def soft_max_aggregate(x: Tensor, valid: Tensor, temperature: float, dim: int) -> Tensor:
    """Eq. 2 / Eq. 6: ``sum_k x_k softmax_k(temperature x_k)`` over the ``valid`` positions of
    ``dim`` (``valid`` broadcasts to ``x``); ``temperature`` = inf is the hard max. A slice with no
    valid position gives a finite value that callers must mask."""
    low = torch.finfo(x.dtype).min
    if math.isinf(temperature):
        return x.masked_fill(~valid, low).amax(dim)
    bias = torch.zeros((), dtype=x.dtype, device=x.device).masked_fill(~valid, low)
    z = torch.add(bias, x, alpha=temperature)
    if torch.is_grad_enabled():
        e = (z - z.amax(dim, keepdim=True)).exp()
        return (e * x).sum(dim) / e.sum(dim)
    e = z.sub_(z.amax(dim, keepdim=True)).exp_()  # in place (no autograd): fewer passes over memory
    den = e.sum(dim)
    return e.mul_(x).sum(dim).div_(den)


def rbf_kernels(cos: Tensor, num_kernels: int, sigma2: float, mul: float) -> Tensor:
    """Eq. 3 for unit vectors from their cosine: the mean of R Gaussian kernels
    exp(-|x - y|^2 / (2 s_k^2)), |x - y|^2 = 2 - 2 cos, s_k^2 = sigma2 mul^(k - (R - 1) / 2)."""
    gammas = [1 / (2 * sigma2 * mul ** (k - (num_kernels - 1) / 2)) for k in range(num_kernels)]
    if mul != 2.0:
        d2 = (2 - 2 * cos).clamp(min=0)
        return sum(torch.exp(-g * d2) for g in gammas) / num_kernels
    # gamma_k = gamma_min 2^k: exp(-gamma_k d2) = q^(2^k) with q = exp(-gamma_min d2) = exp(2 gamma_min (cos - 1))
    g0 = min(gammas)
    if torch.is_grad_enabled():
        q = ((cos - 1).clamp(max=0) * (2 * g0)).exp()
        acc = q
        for _ in range(1, num_kernels):
            q = q * q
            acc = acc + q
        return acc / num_kernels
    q = (cos - 1).clamp_(max=0).mul_(2 * g0).exp_()  # in place (no autograd)
    acc = q.clone()
    for _ in range(1, num_kernels):
        acc.add_(q.square_())
    return acc.div_(num_kernels)


def gram_of_cosines(cos: Tensor, cfg: Any) -> Tensor:
    """Gram entries of unit vectors from their cosines, with the head's Config ``cfg`` (gram,
    num_kernels, kernel_sigma2, kernel_mul): the cosines themselves for "dot", Eq. 3 otherwise."""
    return cos if cfg.gram == "dot" else rbf_kernels(cos, cfg.num_kernels, cfg.kernel_sigma2, cfg.kernel_mul)


def gram_matrix(f: Tensor, cfg: Any) -> Tensor:
    """Eq. 3-4: the (N + M, N + M) Gram matrix of the unit-norm joint tokens ``f`` (kernel or dot)."""
    return gram_of_cosines(f @ f.t(), cfg)


def w2_similarity(mu_a: Tensor, spread_a: Tensor, mu_b: Tensor, spread_b: Tensor) -> Tensor:
    """Eq. 10 between token distributions broadcast against each other: -sqrt(|mu_a - mu_b|^2 +
    |spread_a - spread_b|^2), reduced over the last dimension."""
    d2 = (mu_a - mu_b).square().sum(-1) + (spread_a - spread_b).square().sum(-1)
    return -safe_sqrt(d2)


def safe_sqrt(d2: Tensor) -> Tensor:
    """sqrt of a squared distance that rounding may have made slightly negative: exact above a
    floor of 1e-12, 0 below it (where the gradient of sqrt is unbounded) and at negative values."""
    if not torch.is_grad_enabled():
        return d2.clamp(min=0).sqrt_()
    ok = d2 > _SQRT_FLOOR
    return torch.where(ok, torch.where(ok, d2, torch.ones_like(d2)).sqrt(), torch.zeros_like(d2))


def gaussian_kl(mu_p: Tensor, var_p: Tensor, mu_q: Tensor, var_q: Tensor) -> Tensor:
    """KL(N(mu_p, diag var_p) || N(mu_q, diag var_q)), reduced over the last dimension."""
    return 0.5 * (var_p / var_q + (mu_q - mu_p).square() / var_q - 1 + var_q.log() - var_p.log()).sum(-1)


def gaussian_kl_matrix(mu_p: Tensor, var_p: Tensor, mu_q: Tensor, var_q: Tensor) -> Tensor:
    """:func:`gaussian_kl` of every (p_i, q_j): (n_p, D) x (n_q, D) -> (n_p, n_q), by matrix products."""
    inv_q = 1 / var_q  # (n_q, D)
    quad = (var_p + mu_p.square()) @ inv_q.t() - 2 * mu_p @ (mu_q * inv_q).t()  # (n_p, n_q)
    per_q = (mu_q.square() * inv_q).sum(-1) + var_q.log().sum(-1)  # (n_q,)
    kl = 0.5 * (quad + per_q[None, :] - var_p.log().sum(-1)[:, None] - mu_p.shape[-1])
    return kl.clamp(min=0)  # >= 0; the expansion can round a zero KL slightly below


def pooled_gaussian(mu: Tensor, var: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Eq. 14's item distribution: the equal-weight mixture of the real tokens' Gaussians,
    moment-matched: (B, L, D) x2 -> mean (B, D), variance (B, D)."""
    mean = masked_mean(mu, mask, dim=1)
    second = masked_mean(var + mu.square(), mask, dim=1)
    return mean, (second - mean.square()).clamp(min=1e-12)


def soft_max_aggregate_both(x: Tensor, words: Tensor, frames: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """:func:`soft_max_aggregate` over frames (dim 3) and over words (dim 1) of one (n_t, L, n_v, F)
    tensor bounded above by 1, sharing one exp: softmax is shift-invariant, so both directions
    use the fixed shift temperature * 1. Exact as long as exp(temperature (x - 1)) cannot underflow
    for a real entry (the caller checks temperature (1 - min x) < 80)."""
    valid = (words & frames).to(x.dtype)
    if torch.is_grad_enabled():
        e = torch.exp((x - 1) * temperature) * valid
        ex = e * x
    else:
        e = (x - 1).mul_(temperature).exp_().mul_(valid)
        ex = x * e
    tiny = torch.finfo(x.dtype).tiny  # an all-padding slice gives 0 / tiny = 0, masked by the caller
    return ex.sum(3) / e.sum(3).clamp(min=tiny), ex.sum(1) / e.sum(1).clamp(min=tiny)


def dpa_scores(low: Tensor, gram: Tensor | None, text_mask: Tensor, frame_mask: Tensor, text_weight: Tensor,
               frame_weight: Tensor, lam: float, xi: float, gram_floor: float = -1.0) -> Tensor:
    """Eq. 2, 6, 7, 8 for every pair, given the token similarities.

    ``low`` (Eq. 1 or Eq. 10) and ``gram`` (the G_tv block, None without G_inter; values in
    [``gram_floor``, 1]) are (n_t, L, n_v, F); masks (n_t, L) and (n_v, F); the intra weights
    h_{t->t} (n_t, L) and h_{v->v} (n_v, F) are zero at padding. Returns S (n_t, n_v); an item
    with no real token contributes 0 for its direction.
    """
    words = text_mask[:, :, None, None]  # (n_t, L, 1, 1)
    frames = frame_mask[None, None, :, :]  # (1, 1, n_v, F)
    l_t2v = soft_max_aggregate(low, frames, lam, dim=3)  # (n_t, L, n_v)  Eq. 2
    l_v2t = soft_max_aggregate(low, words, lam, dim=1)  # (n_t, n_v, F)  Eq. 2, v->t
    if gram is not None:  # Eq. 6-7: double weighting by the inter-modality soft maxima
        if xi * (1 - gram_floor) < 80:  # e^-80 is far above float32's smallest normal (1e-38)
            h_t2v, h_v2t = soft_max_aggregate_both(gram, words, frames, xi)
        else:
            h_t2v, h_v2t = soft_max_aggregate(gram, frames, xi, dim=3), soft_max_aggregate(gram, words, xi, dim=1)
        # h^_t = h_{t->v} * h_{t->t}, normalised over the tokens (Eq. 7): a weighted mean of l
        t_side = torch.einsum("tlv,tl->tv", l_t2v * h_t2v, text_weight) / \
            torch.einsum("tlv,tl->tv", h_t2v.abs(), text_weight).clamp(min=torch.finfo(low.dtype).tiny)
        v_side = torch.einsum("tvf,vf->tv", l_v2t * h_v2t, frame_weight) / \
            torch.einsum("tvf,vf->tv", h_v2t.abs(), frame_weight).clamp(min=torch.finfo(low.dtype).tiny)
    else:  # h^_t = h_{t->t}, which sums to 1 already
        t_side = torch.einsum("tlv,tl->tv", l_t2v, text_weight)  # <l_{t->v}, h^_t>
        v_side = torch.einsum("tvf,vf->tv", l_v2t, frame_weight)  # <l_{v->t}, h^_v>
    zero = torch.zeros((), dtype=low.dtype, device=low.device)
    t_side = torch.where(frame_mask.any(1)[None, :], t_side, zero)
    v_side = torch.where(text_mask.any(1)[:, None], v_side, zero)
    return (t_side + v_side) / 2  # Eq. 8 / Eq. 11
