"""ProTA's pair scores, fused: Eq. 1 or 10, Eq. 3 (the G_tv block), 2, 6, 7 and 8 for every (text, video) pair.

Written directly (:func:`~tvrpipe.heads.prota.equations.soft_max_aggregate` over broadcast tensors), a training
step builds a dozen (n_t, L, n_v, F) tensors (the token similarities, their kernels, each soft maximum's
exponentials and products), autograd keeps most of them for the backward pass, and both passes stream them
through memory: that was most of ProTA's step. :func:`pair_scores` computes the same values in blocks of texts
whose tensors stay in cache, with the backward pass written out:

- the video tokens are ordered frame-major, so a block is (c, L, F, n_v) and both soft maxima (over frames,
  dim 2; over words, dim 1) reduce an outer dimension, vectorised over the videos;
- exponentials are ``exp2`` of log2(e)-scaled arguments (torch's ``exp2`` is much faster than its ``exp`` on the
  CPUs of docs/performance.md); the kernels' R exponentials are one ``exp2`` and R - 1 squarings;
- padding enters the exponent as -1e30 (weight 0); an item without a real token gets 0, and is masked;
- the backward pass keeps only the outputs of the two matrix products (the token cosines and, for Eq. 10,
  the spread terms of the squared distance) and small per-row tensors (maxima, sums), recomputes a block's
  weights from them and sends the block's gradient straight into the products' gradients: no
  (n_t, L, n_v, F) gradient is written out whole.

Eq. 10's squared distance is one product of augmented rows, |mu_t - mu_v|^2 + |s_t - s_v|^2 =
2 - 2 cos + [s_t, |s_t|^2 + 2, 1] . [-2 s_v, 1, |s_v|^2] (unit means; ``s`` the spreads centred at 1), so the
gradients of |s|^2 come out of the product's own backward. A soft maximum y = sum_j x_j p_j, p = softmax(lambda x)
over the real positions, has dy/dx_j = p_j (1 + lambda (x_j - y)); the hard max (lambda = inf) passes the
gradient to the maximum, shared among ties, as ``amax`` does. Two choices differ from autograd on the direct
formulation at single points only: below a squared distance of 1e-12 Eq. 10 is 0 with gradient 0 (as
:func:`~tvrpipe.heads.prota.equations.safe_sqrt`), and the kernels' derivative at a cosine that rounding put
above 1 is their derivative at 1 (the direct form's clamp gives 0 there).

tests/heads/test_prota.py compares values and gradients with the direct formulation (in float64, and in float32
against float32's own error) and the scores with per-pair NumPy loops; ``tvrpipe bench step`` measures the
training step against X-Pool's (docs/performance.md, "ProTA's step against X-Pool's").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from tvrpipe.heads.prota.equations import SQRT_FLOOR, kernel_gammas

LOG2E = 1.4426950408889634  # exp(x) = exp2(x log2(e))
_MASKED = -1e30  # a padding position's offset in the exponent: weight 0, and an all-padding row stays finite
# elements of a (c, L, F, n_v) block, 2 MB in float32 (B = 128, L = 32, F = 12: 10 texts a block); chosen by
# timing 2^15..2^21 (docs/performance.md, "ProTA's step against X-Pool's")
_BLOCK_ELEMENTS = 1 << 19


@dataclass(frozen=True)
class PairSettings:
    """What the pair scores depend on beyond the tokens: the head's Config fields and G_tv's smallest value.

    ``shared_exp``: Eq. 6's two directions share one exponential shifted by xi * 1 (G_tv <= 1), exact as long as
    exp(xi (floor - 1)) stays far above float32's smallest normal (xi (1 - floor) < 80).
    """

    lam: float
    xi: float
    inter: bool
    gram: str
    num_kernels: int
    kernel_sigma2: float
    kernel_mul: float
    gram_floor: float

    @property
    def shared_exp(self) -> bool:
        return self.inter and not math.isinf(self.xi) and self.xi * (1 - self.gram_floor) < 80


def pair_scores(xt: Tensor, xv: Tensor, text_mask: Tensor, frame_mask: Tensor, text_weight: Tensor,
                frame_weight: Tensor, settings: PairSettings, spread_t: Tensor | None = None,
                spread_v: Tensor | None = None, spread_sq_t: Tensor | None = None,
                spread_sq_v: Tensor | None = None) -> Tensor:
    """S (Eq. 8) or S^p (Eq. 11) of every pair: (n_t, n_v).

    ``xt`` (n_t, L, D) and ``xv`` (n_v, F, D): unit tokens (Eq. 1) or unit means (Eq. 10), zero at padding;
    masks (n_t, L), (n_v, F); the intra weights h_{t->t} (n_t, L) and h_{v->v} (n_v, F), zero at padding.
    With ``spread_t`` / ``spread_v`` (the same shapes as the tokens, centred at 1, zero at padding) and their
    squared norms (n_t, L), (n_v, F), Eq. 10's negative 2-Wasserstein distance replaces the cosine. Token
    columns that are padding in every item are left out first. An item with no real token contributes 0
    for its direction. Differentiable (a hand-written backward; see the module docstring).
    """
    keep_t, keep_v = _real_width(text_mask), _real_width(frame_mask)
    xt, text_mask, text_weight = xt[:, :keep_t], text_mask[:, :keep_t].bool(), text_weight[:, :keep_t]
    xv, frame_mask, frame_weight = xv[:, :keep_v], frame_mask[:, :keep_v].bool(), frame_weight[:, :keep_v]
    (t, length, d), (v, frames, _) = xt.shape, xv.shape
    rows_t = xt.reshape(t * length, d)
    rows_v = xv.transpose(0, 1).reshape(frames * v, d)  # frame-major: row f * n_v + j is frame f of video j
    aug_t = aug_v = None
    if spread_t is not None:  # Eq. 10: d2 = aug_t . aug_v - 2 cos
        spread_t, spread_v = spread_t[:, :keep_t], spread_v[:, :keep_v]
        sq_t, sq_v = spread_sq_t[:, :keep_t, None], spread_sq_v[:, :keep_v, None]
        aug_t = torch.cat([spread_t, sq_t + 2, torch.ones_like(sq_t)], -1).reshape(t * length, d + 2)
        aug_v = torch.cat([-2 * spread_v, torch.ones_like(sq_v), sq_v], -1)
        aug_v = aug_v.transpose(0, 1).reshape(frames * v, d + 2)
    weight_v = frame_weight.t()  # (F, n_v)
    inputs = (rows_t, rows_v, aug_t, aug_v, text_weight, weight_v)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs):
        return _PairScores.apply(*inputs, text_mask, frame_mask.t(), settings)
    return _forward(*inputs, text_mask, frame_mask.t(), settings, keep=False)[0]


def _real_width(mask: Tensor) -> int:
    """Leading columns of ``mask`` (n, L) that hold a real position of some row (at least 1)."""
    real = mask.any(0).nonzero()
    return max(int(real[-1]) + 1 if len(real) else 0, 1)


# -- one block of texts against every video: (c, L, F, n_v) ------------------------------------------------
# Every block-sized result is written into one of a few buffers reused from block to block: a fresh tensor per
# operation lands on memory that is not in cache.
#
# A soft maximum is aggregated in coordinates shifted by its row's maximum m (by 1 for Eq. 6's shared exponential):
# d = x - m, e = exp(temperature d), y = m + sum(e d) / sum(e). Its gradient e (1 + temperature (x - y)) / sum(e)
# then takes x - y as d - (y - m), both small near the maximum: x - y taken from y itself would carry y's rounding
# times the temperature, in float32 several times the error of autograd on the direct formulation (the tests
# bound the fused path's error by the direct formulation's).


def _low(cos: Tensor, extra: Tensor | None, out: Tensor) -> Tensor:
    """Eq. 1 (the cosines themselves) or Eq. 10: -sqrt(extra - 2 cos), 0 below a squared distance of 1e-12."""
    if extra is None:
        return cos
    d2 = torch.add(extra, cos, alpha=-2, out=out)
    return torch.nn.functional.threshold_(d2, SQRT_FLOOR, 0.0).sqrt_().neg_()


def _gram(cos: Tensor, s: PairSettings, out: Tensor, scratch: Tensor,
          slope: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """G_tv from the cosines (Eq. 3, or the cosines for G-dagger) into ``out`` and, given a ``slope`` buffer, its
    derivative in the cosine (None for G-dagger, whose derivative is 1)."""
    if s.gram == "dot":
        return cos, None
    r, gammas = s.num_kernels, kernel_gammas(s.num_kernels, s.kernel_sigma2, s.kernel_mul)
    if s.kernel_mul == 2.0:  # gamma_k = g0 2^k: exp(-gamma_k |x - y|^2) = q^(2^k), q = exp(2 g0 (cos - 1))
        g0 = min(gammas)
        q = torch.sub(cos, 1, out=scratch).clamp_(max=0).mul_(2 * g0 * LOG2E).exp2_()
        acc = out.copy_(q)
        if slope is not None:
            slope.copy_(q)
        for k in range(1, r):
            q.square_()
            acc.add_(q)
            if slope is not None:
                slope.add_(q, alpha=2.0 ** k)  # d q^(2^k) / d cos = 2^k q^(2^k) 2 g0
        return acc.div_(r), None if slope is None else slope.mul_(2 * g0 / r)
    d2 = torch.mul(cos, -2, out=scratch).add_(2).clamp_(min=0)  # |x - y|^2 of unit vectors
    acc = out.zero_()
    if slope is not None:
        slope.zero_()
    e = torch.empty_like(d2)
    for g in gammas:
        torch.mul(d2, -g * LOG2E, out=e).exp2_()
        acc.add_(e)
        if slope is not None:
            slope.add_(e, alpha=2 * g)
    return acc.div_(r), None if slope is None else slope.div_(r)


def _exp(d: Tensor, temperature: float, out: Tensor, clamp: bool = False) -> tuple[Tensor, Tensor]:
    """The weights exp(temperature d) of shifted values ``d`` (<= 0 at the maximum, -1e30 at padding) and ``d``;
    temperature inf: the indicator of the maximum (d = 0). With ``clamp`` (the backward pass, whose products
    with ``d`` could overflow at -1e30), ``d`` is first raised to where the weight is 0 in float64 anyway
    (temperature d = -1100 log 2), which changes no weight."""
    if math.isinf(temperature):
        return torch.eq(d, 0, out=out), d  # 1.0 / 0.0 in ``out``'s dtype
    if clamp:
        d.clamp_(min=-1100 / (temperature * LOG2E))
    return torch.mul(d, temperature * LOG2E, out=out).exp2_(), d


def _shifted(x: Tensor, bias: Tensor, dim: int, out: Tensor,
             shift: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x - max along ``dim`` over the real positions (``bias`` -1e30 at padding) and the max (``shift``: a saved
    one). An all-padding row keeps finite values."""
    d = torch.add(bias, x, out=out)
    m = d.amax(dim, keepdim=True) if shift is None else shift
    return d.sub_(m), m


def _shared_shifted(g: Tensor, t_bias: Tensor, f_bias: Tensor, out: Tensor) -> Tensor:
    """g - 1 at the real (word, frame) positions, -1e30 elsewhere: Eq. 6's two directions share one exponential
    shifted by 1 (softmax is shift-invariant, and g <= 1)."""
    return torch.sub(g, 1, out=out).add_(f_bias).add_(t_bias)


def _side(l: Tensor, h: Tensor | None, w: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Eq. 7-8 for one direction: <l, h^> with h^ = h w / sum |h| w, summed over dim 1 of (c, K, n_v);
    without G_inter <l, w> (w sums to 1). Returns the side and its numerator and denominator."""
    if h is None:
        return (l * w).sum(1), None, None
    num, den = (l * h * w).sum(1), (h.abs() * w).sum(1)
    return num / den.clamp(min=torch.finfo(l.dtype).tiny), num, den


def _side_backward(g: Tensor, l: Tensor, h: Tensor | None, w: Tensor, num: Tensor | None,
                   den: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor]:
    """Gradients of :func:`_side` in l, h (None without G_inter) and w (unreduced, (c, K, n_v)). A side whose
    denominator is 0 (an item whose weights are all 0: no real token) is 0 whatever l and h, and gets none."""
    if h is None:
        return g[:, None] * w, None, g[:, None] * l
    tiny = torch.finfo(l.dtype).tiny
    ok, den_c = den >= tiny, den.clamp(min=tiny)
    g_num = torch.where(ok, g / den_c, 0.0)[:, None]
    g_den = torch.where(ok, -g * num / den_c.square(), 0.0)[:, None]
    return g_num * h * w, (g_num * l + g_den * h.sign()) * w, g_num * l * h + g_den * h.abs()


def _slopes(g_y: Tensor, offset: Tensor, s: Tensor, temperature: float,
            dim: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """The gradient of a soft maximum y = m + offset, offset = sum(e d) / s, is e (a + b (d - offset)) with
    a = g_y / s, b = temperature g_y / s: returns offset, a, b (b None for the hard max), unsqueezed at ``dim``.
    A row whose weights are all 0 has g_y = 0 (its item is padding) and gets 0."""
    a = g_y * torch.where(s > 0, 1 / s, 0.0)
    b = None if math.isinf(temperature) else (a * temperature).unsqueeze(dim)
    return offset.unsqueeze(dim), a.unsqueeze(dim), b


def _through(e: Tensor, d: Tensor, slopes: tuple[Tensor, Tensor, Tensor | None],
             out: Tensor | None = None) -> Tensor:
    """e (a + b (d - offset)) written over ``d``'s buffer, or added to ``out``."""
    offset, a, b = slopes
    if b is None:
        part = torch.mul(e, a, out=d)
    else:
        part = torch.addcmul(a, d.sub_(offset), b, out=d).mul_(e)
    return part if out is None else out.add_(part)


@dataclass
class _Block:
    """What a block's backward pass needs besides the products' outputs: small tensors, (c, ..., n_v). The
    backward pass gets them as one tensor a field over all texts, saved with ``save_for_backward`` (so
    :func:`~tvrpipe.training.plan.saved_activation_bytes` counts them, as the products' outputs)."""

    rows: slice
    m_f: Tensor  # Eq. 2's row maxima over frames (c, L, 1, n_v) and over words (c, 1, F, n_v)
    m_l: Tensor
    l_t2v: Tensor  # Eq. 2 (c, L, n_v), its offset from the maximum, its weights' sum; v->t (c, F, n_v)
    o_f: Tensor
    s_f: Tensor
    l_v2t: Tensor
    o_l: Tensor
    s_l: Tensor
    h_t2v: Tensor | None = None  # Eq. 6, offsets, sums (and maxima, without the shared exponential)
    og_f: Tensor | None = None
    sg_f: Tensor | None = None
    h_v2t: Tensor | None = None
    og_l: Tensor | None = None
    sg_l: Tensor | None = None
    mg_f: Tensor | None = None
    mg_l: Tensor | None = None
    t_num: Tensor | None = None  # Eq. 7's numerators and denominators (c, n_v)
    t_den: Tensor | None = None
    v_num: Tensor | None = None
    v_den: Tensor | None = None


_STATS = tuple(f for f in _Block.__dataclass_fields__ if f != "rows")


def _masks(text_mask: Tensor, mask_v: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The offsets of padding: words (n_t, L, 1, 1) and frames (1, 1, F, n_v), 0 or -1e30."""
    zero = torch.zeros((), dtype=dtype, device=text_mask.device)
    return zero.masked_fill(~text_mask, _MASKED)[:, :, None, None], zero.masked_fill(~mask_v, _MASKED)[None, None]


def _aggregate(x: Tensor, bias: Tensor, temperature: float, dim: int, bd: Tensor,
               be: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Eq. 2 / 6 along ``dim``: y, its offset from the row maximum, the weights' sum and the maximum. A row
    without a real position (its item has no real token) gives y = 0, not the -1e30 of its padding, so that
    the products of Eq. 7-8 stay finite where they are masked."""
    d, m = _shifted(x, bias, dim, bd)
    e, d = _exp(d, temperature, be)
    s = e.sum(dim)
    offset = d.mul_(e).sum(dim) / s.clamp(min=torch.finfo(x.dtype).tiny)
    return torch.where(m > _MASKED / 2, m, 0.0).squeeze(dim) + offset, offset, s, m


def _forward(rows_t: Tensor, rows_v: Tensor, aug_t: Tensor | None, aug_v: Tensor | None, text_weight: Tensor,
             weight_v: Tensor, text_mask: Tensor, mask_v: Tensor, s: PairSettings,
             keep: bool) -> tuple[Tensor, int, Tensor | None, Tensor | None, list[Tensor | None]]:
    """The scores block by block and the texts a block; with ``keep``, the products' outputs (n_t, L, F, n_v)
    and the blocks' small tensors for the backward pass (:data:`_STATS`, over all texts)."""
    t, length = text_mask.shape
    frames, v = mask_v.shape
    c = max(1, min(t, _BLOCK_ELEMENTS // (length * frames * v)))  # texts a block
    t_bias, f_bias = _masks(text_mask, mask_v, rows_t.dtype)
    cos_all = rows_t.new_empty(t if keep else c, length, frames, v)
    extra_all = None if aug_t is None else rows_t.new_empty(t if keep else c, length, frames, v)
    bx, bd, be, bg, bq = (rows_t.new_empty(c, length, frames, v) for _ in range(5))
    out = rows_t.new_empty(t, v)
    any_v, any_t = mask_v.any(0), text_mask.any(1)  # (n_v,), (n_t,)
    tiny = torch.finfo(rows_t.dtype).tiny
    blocks = []
    for a in range(0, t, c):
        rows = slice(a, min(a + c, t))
        n = rows.stop - a
        here = slice(a, rows.stop) if keep else slice(0, n)
        lines = slice(a * length, rows.stop * length)
        cos = cos_all[here]
        torch.mm(rows_t[lines], rows_v.t(), out=cos.view(n * length, frames * v))  # Eq. 1
        extra = None
        if aug_t is not None:
            extra = extra_all[here]
            torch.mm(aug_t[lines], aug_v.t(), out=extra.view(n * length, frames * v))
        x = _low(cos, extra, bx[:n])  # (c, L, F, n_v) Eq. 1 / 10
        tb = t_bias[rows]
        l_t2v, o_f, s_f, m_f = _aggregate(x, f_bias, s.lam, 2, bd[:n], be[:n])  # (c, L, n_v) Eq. 2
        l_v2t, o_l, s_l, m_l = _aggregate(x, tb, s.lam, 1, bd[:n], be[:n])  # (c, F, n_v) Eq. 2, v->t
        blk = _Block(rows, m_f, m_l, l_t2v, o_f, s_f, l_v2t, o_l, s_l)
        if s.inter:  # Eq. 6 on G_tv (Eq. 3)
            g, _ = _gram(cos, s, bg[:n], bq[:n])
            if s.shared_exp:
                e, d = _exp(_shared_shifted(g, tb, f_bias, bd[:n]), s.xi, be[:n])
                ed = d.mul_(e)
                blk.sg_f, blk.sg_l = e.sum(2), e.sum(1)
                blk.og_f, blk.og_l = ed.sum(2) / blk.sg_f.clamp(min=tiny), ed.sum(1) / blk.sg_l.clamp(min=tiny)
                blk.h_t2v, blk.h_v2t = blk.og_f + 1, blk.og_l + 1
            else:
                blk.h_t2v, blk.og_f, blk.sg_f, blk.mg_f = _aggregate(g, f_bias, s.xi, 2, bd[:n], be[:n])
                blk.h_v2t, blk.og_l, blk.sg_l, blk.mg_l = _aggregate(g, tb, s.xi, 1, bd[:n], be[:n])
        t_side, blk.t_num, blk.t_den = _side(l_t2v, blk.h_t2v, text_weight[rows, :, None])  # (c, n_v)
        v_side, blk.v_num, blk.v_den = _side(l_v2t, blk.h_v2t, weight_v[None])
        # Eq. 8; an item with no real token contributes 0 for its direction
        out[rows] = (torch.where(any_v[None], t_side, 0.0) + torch.where(any_t[rows, None], v_side, 0.0)) / 2
        if keep:
            blocks.append(blk)
    if not keep:
        return out, c, None, None, []
    stats = [None if getattr(blocks[0], f) is None else torch.cat([getattr(b, f) for b in blocks])
             for f in _STATS]
    return out, c, cos_all, extra_all, stats


class _PairScores(torch.autograd.Function):
    """:func:`pair_scores` with its backward pass written out (the module docstring)."""

    @staticmethod
    def forward(ctx, rows_t, rows_v, aug_t, aug_v, text_weight, weight_v, text_mask, mask_v, settings):
        out, c, cos_all, extra_all, stats = _forward(rows_t, rows_v, aug_t, aug_v, text_weight, weight_v,
                                                     text_mask, mask_v, settings, keep=True)
        ctx.save_for_backward(rows_t, rows_v, aug_t, aug_v, text_weight, weight_v, text_mask, mask_v, cos_all,
                              extra_all, *stats)
        ctx.block, ctx.settings = c, settings
        return out

    @staticmethod
    def backward(ctx, grad_out):
        rows_t, rows_v, aug_t, aug_v, text_weight, weight_v, text_mask, mask_v, cos_all, extra_all, *stats = \
            ctx.saved_tensors
        s, c = ctx.settings, ctx.block
        t, length = text_mask.shape
        frames, v = mask_v.shape
        t_bias, f_bias = _masks(text_mask, mask_v, rows_t.dtype)
        half = grad_out / 2
        g_tside = torch.where(mask_v.any(0)[None], half, 0.0)  # (n_t, n_v)
        g_vside = torch.where(text_mask.any(1)[:, None], half, 0.0)
        g_rows_t, g_rows_v = torch.empty_like(rows_t), torch.zeros_like(rows_v)
        g_aug_t = None if aug_t is None else torch.empty_like(aug_t)
        g_aug_v = None if aug_v is None else torch.zeros_like(aug_v)
        g_tw, g_wv = torch.empty_like(text_weight), torch.zeros_like(weight_v)
        bx, b1, b2, be, bg, bq, bs = (rows_t.new_empty(c, length, frames, v) for _ in range(7))
        for a in range(0, t, c):
            rows = slice(a, min(a + c, t))
            blk = _Block(rows, *(None if x is None else x[rows] for x in stats))
            n = rows.stop - a
            lines = slice(a * length, rows.stop * length)
            tb = t_bias[rows]
            cos = cos_all[rows]
            extra = None if extra_all is None else extra_all[rows]
            # Eq. 7-8 back to l, h and the intra weights
            g_lt, g_ht, g_twf = _side_backward(g_tside[rows], blk.l_t2v, blk.h_t2v, text_weight[rows, :, None],
                                               blk.t_num, blk.t_den)
            g_lv, g_hv, g_wvf = _side_backward(g_vside[rows], blk.l_v2t, blk.h_v2t, weight_v[None], blk.v_num,
                                               blk.v_den)
            g_tw[rows] = g_twf.sum(2)
            g_wv.add_(g_wvf.sum(0))
            # Eq. 2 back to the token similarities x (g_x in b1)
            x = _low(cos, extra, bx[:n])
            e, d = _exp(_shifted(x, f_bias, 2, b1[:n], blk.m_f)[0], s.lam, be[:n], clamp=True)
            g_x = _through(e, d, _slopes(g_lt, blk.o_f, blk.s_f, s.lam, 2))
            e, d = _exp(_shifted(x, tb, 1, b2[:n], blk.m_l)[0], s.lam, be[:n], clamp=True)
            _through(e, d, _slopes(g_lv, blk.o_l, blk.s_l, s.lam, 1), out=g_x)
            # Eq. 6 back to G_tv, and G_tv back to the cosines (g_cos in bq)
            g_cos = None
            if s.inter:
                g, slope = _gram(cos, s, bg[:n], bq[:n], bs[:n])
                slopes_f = _slopes(g_ht, blk.og_f, blk.sg_f, s.xi, 2)
                slopes_l = _slopes(g_hv, blk.og_l, blk.sg_l, s.xi, 1)
                if s.shared_exp:  # one exponential, one shift: e (a_f + b_f (d - o_f) + a_l + b_l (d - o_l))
                    e, d = _exp(_shared_shifted(g, tb, f_bias, b2[:n]), s.xi, be[:n], clamp=True)
                    g_g = _through(e, bq[:n].copy_(d), slopes_f)
                    _through(e, d, slopes_l, out=g_g)
                else:
                    e, d = _exp(_shifted(g, f_bias, 2, bq[:n], blk.mg_f)[0], s.xi, be[:n], clamp=True)
                    g_g = _through(e, d, slopes_f)
                    e, d = _exp(_shifted(g, tb, 1, b2[:n], blk.mg_l)[0], s.xi, be[:n], clamp=True)
                    _through(e, d, slopes_l, out=g_g)
                g_cos = g_g if slope is None else g_g.mul_(slope)
            if extra is None:  # Eq. 1: x is the cosine
                g_cos = g_x if g_cos is None else g_cos.add_(g_x)
                g_extra = None
            else:  # Eq. 10: x = -sqrt(extra - 2 cos), dx/dextra = 1 / (2 x); 0 below the floor (x = 0)
                ratio = g_x.div_(x).nan_to_num_(0.0, 0.0, 0.0)  # g_x / x
                g_cos = torch.neg(ratio, out=b2[:n]) if g_cos is None else g_cos.sub_(ratio)
                g_extra = ratio.mul_(0.5)
            # the products' gradients
            g_cos = g_cos.view(n * length, frames * v)
            torch.mm(g_cos, rows_v, out=g_rows_t[lines])
            g_rows_v.addmm_(g_cos.t(), rows_t[lines])
            if g_extra is not None:
                g_extra = g_extra.view(n * length, frames * v)
                torch.mm(g_extra, aug_v, out=g_aug_t[lines])
                g_aug_v.addmm_(g_extra.t(), aug_t[lines])
        return g_rows_t, g_rows_v, g_aug_t, g_aug_v, g_tw, g_wv, None, None, None
