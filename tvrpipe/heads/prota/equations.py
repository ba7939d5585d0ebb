"""ProTA's equations as functions of tensors (the head is :mod:`tvrpipe.heads.prota`).

Eq. 2 / 6 soft maxima (:func:`soft_max_aggregate`), Eq. 3-4 kernels and Gram matrix
(:func:`rbf_kernels`, :func:`gram_matrix`), Eq. 10 (:func:`w2_similarity`, :func:`safe_sqrt`) and
Eq. 14's Gaussians (:func:`pooled_gaussian`, :func:`gaussian_kl`, :func:`gaussian_kl_matrix`).
Eq. 1-3, 6-8 and 10 for every pair of a batch are computed fused, with a hand-written backward
pass, by :func:`tvrpipe.heads.prota.pairs.pair_scores`. The choices behind each are in the head's
module docstring and docs/methods.md.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from tvrpipe.heads.losses import masked_mean

SQRT_FLOOR = 1e-12  # Eq. 10 under autograd: squared distances below it give 0 (gradient <= 1 / (2 sqrt(floor)))


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
    gammas = kernel_gammas(num_kernels, sigma2, mul)
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


def kernel_gammas(num_kernels: int, sigma2: float, mul: float) -> list[float]:
    """Eq. 3's R kernel rates 1 / (2 s_k^2), s_k^2 = sigma2 mul^(k - (R - 1) / 2), k = 0..R-1."""
    return [1 / (2 * sigma2 * mul ** (k - (num_kernels - 1) / 2)) for k in range(num_kernels)]


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
    ok = d2 > SQRT_FLOOR
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
