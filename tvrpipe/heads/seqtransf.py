"""CLIP4Clip sequential type with a temporal transformer ("seqTransf").

Paper: Luo et al., "CLIP4Clip: An Empirical Study of CLIP for End to End Video Clip Retrieval"
(Neurocomputing 2022), Sec. 3.3 "Similarity Calculator", sequential type: learned frame position
embeddings P are added to the frame embeddings Z, a transformer encoder models the temporal
relations, its output is added back to the frames (residual), and the result is mean-pooled and
compared with the sentence by cosine. Loss: the symmetric InfoNCE (base class default).
Official code: ArrowLuo/CLIP4Clip, ``modules/modeling.py`` ``_loose_similarity`` with
``sim_header="seqTransf"``, and ``modules/module_cross.py`` (CLIP-style residual blocks).

Equations (Z = frames (F, D), mask over the F frames)::

    Z~ = TransformerEnc(Z + P; key padding mask) + Z           # residual to the original frames
    v  = mean_{m: mask_m} Z~_m / ||Z~_m||                       # masked mean of normalised frames
    s(t, v) = <t / ||t||, v / ||v||>

The encoder is CLIP's pre-LN residual block (``x += attn(ln_1(x)); x += mlp(ln_2(x))``, MLP width
4D with QuickGELU), ``num_layers`` = 4, width D, D // 64 heads; padded frames are masked as keys
(the code adds -1e6 to their logits; here they are excluded exactly).

Choices where the paper is silent or the code cannot be followed:
- Initialisation. CLIP4Clip copies the first 4 blocks of CLIP's *text* transformer and CLIP's text
  position embedding into the temporal module. A head trained on cached features has no CLIP
  weights, so the blocks get CLIP's own initialisation (normal, std width^-0.5 for the attention
  input projection, (2 width)^-0.5 for the MLP input) except that the *output* projections of
  attention and MLP and the frame position embeddings start at zero (``zero_init=True``). Every
  block is then the identity, ``Z~ = 2 Z``, and after per-frame normalisation the untrained head
  equals ``meanpool`` exactly, which is what the residual design intends: training starts from
  the zero-shot mean-pooling baseline. At the very first step only the output projections and
  the position embeddings receive gradient; the rest follows once those are non-zero.
- ``max_frames`` = 77: the code sizes the frame position table to CLIP's context length (77);
  DiDeMo uses 64 frames.
- No dropout, as in the code (``nn.MultiheadAttention`` with its default dropout 0).
- LayerNorm epsilon 1e-12, as CLIP4Clip's TF-style ``module_cross.LayerNorm`` (torch's default
  1e-5 was the whole 3.3e-6 difference found side by side on identical weights).
- A video with no real frame is the zero vector (similarity 0).
- ``logit_scale`` starts at the features' CLIP's learned scale, as CLIP4Clip reuses it (``clip_head_config``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tvrpipe.config import at_least
from tvrpipe.errors import ConfigError
from tvrpipe.heads.base import Copied, Emb, Head, HeadConfig, TextBatch, VideoBatch, register_head
from tvrpipe.heads.losses import masked_mean


@dataclass(frozen=True)
class Config(HeadConfig):
    """seqTransf: a CLIP-style temporal transformer over the frames."""

    num_layers: int = 4  # CLIP4Clip code cross_num_hidden_layers=4; UATVR Sec. 4.1: four layers, after CLIP4Clip
    num_heads: int | None = at_least(1, None)  # None: D // 64, CLIP4Clip code transformer_heads = width // 64 (8)
    mlp_ratio: int = 4  # CLIP4Clip code (module_cross.ResidualAttentionBlock): MLP width 4D
    max_frames: int = 77  # CLIP4Clip code: position table = CLIP context length 77 (DiDeMo: 64 frames)
    zero_init: bool = True  # choice: no CLIP weights to copy; zero out-projections + positions = meanpool
    ln_eps: float = 1e-12  # CLIP4Clip code module_cross.LayerNorm (TF style, eps 1e-12); torch's default is 1e-5

    def check(self) -> None:
        attention_heads(self.owner, "num_heads", self.embed_dim, self.num_heads)


# train-head's learning rate when --lr is not given: chosen on the validation curves of
# `tvrpipe bench convergence`, whose runs and figures are in docs/training.md ("Default learning rates, and what chose them")
DEFAULT_LR = 1e-4


class QuickGELU(nn.Module):
    """CLIP's GELU approximation, x * sigmoid(1.702 x)."""

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(1.702 * x)


class ResidualAttentionBlock(nn.Module):
    """CLIP's pre-LN transformer block, with an exact key padding mask."""

    def __init__(self, width: int, heads: int, mlp_ratio: int, ln_eps: float = 1e-12) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width, eps=ln_eps)
        self.in_proj = nn.Linear(width, 3 * width)
        self.out_proj = nn.Linear(width, width)
        self.mlp_ratio = mlp_ratio
        if mlp_ratio:  # 0: an attention-only block
            self.ln_2 = nn.LayerNorm(width, eps=ln_eps)
            self.c_fc = nn.Linear(width, mlp_ratio * width)
            self.gelu = QuickGELU()
            self.c_proj = nn.Linear(mlp_ratio * width, width)

    def attention_weights(self, x: Tensor, mask: Tensor) -> Tensor:
        """Softmax attention weights (B, H, F queries, F keys) of the (layer-normed) input ``x``."""
        b, f, d = x.shape
        w, bias = self.in_proj.weight[: 2 * d], self.in_proj.bias[: 2 * d]  # the query and key rows
        q, k = F.linear(x, w, bias).view(b, f, 2, self.heads, d // self.heads).unbind(2)  # 2 x (B, F, H, d_h)
        logits = torch.einsum("bqhc,bkhc->bhqk", q, k) / math.sqrt(d // self.heads)  # (B, H, F, F)
        # Padded frames are never attended to (set, not added, so no overflow; an all-padded video
        # gives finite uniform weights over garbage that is never read).
        return logits.masked_fill(~mask[:, None, None, :], torch.finfo(logits.dtype).min).softmax(-1)

    def attention(self, x: Tensor, mask: Tensor) -> Tensor:
        b, f, d = x.shape
        v = F.linear(x, self.in_proj.weight[2 * d:], self.in_proj.bias[2 * d:])
        v = v.view(b, f, self.heads, d // self.heads)  # (B, F, H, d_h)
        out = torch.einsum("bhqk,bkhc->bqhc", self.attention_weights(x, mask), v).reshape(b, f, d)
        return self.out_proj(out)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        x = x + self.attention(self.ln_1(x), mask)  # (B, F, D)
        if not self.mlp_ratio:
            return x
        return x + self.c_proj(self.gelu(self.c_fc(self.ln_2(x))))  # (B, F, D)


def attention_heads(head: str, option: str, width: int, heads: int | None) -> int:
    """Heads of a CLIP-style block: ``heads`` or width // 64 (CLIP's rule); width must divide."""
    heads = heads or max(1, width // 64)
    if width % heads:
        raise ConfigError(f"{head}: embed_dim {width} is not divisible by {option} {heads}")
    return heads


def copy_clip_text_layers(clip: nn.Module, blocks: nn.ModuleList, positions: nn.Embedding | None) -> Copied:
    """CLIP4Clip's initialisation of a temporal transformer from CLIP's text transformer (CLIP4Clip code,
    ``modeling.py``: ``transformer.resblocks.i`` -> block i, ``positional_embedding`` -> the frame
    positions): block i takes CLIP's text block i and ``positions`` CLIP's first rows, when the widths,
    heads and MLP ratios agree. Returns the names of what was copied (none, with the reason, when they
    do not agree).
    """
    text = getattr(clip, "transformer", None)
    resblocks = getattr(text, "resblocks", None)
    if resblocks is None or not len(resblocks):
        return Copied([], "CLIP has no text transformer")
    if not len(blocks):
        return Copied([], "the head's temporal transformer has no layer")
    src0, dst0 = resblocks[0], blocks[0]
    src_width, dst_width = src0.attn.in_proj_weight.shape[1], dst0.in_proj.weight.shape[1]
    if src_width != dst_width:
        return Copied([], f"widths differ (CLIP's text transformer {src_width}, the head's {dst_width})")
    if src0.attn.num_heads != dst0.heads:
        return Copied([], f"attention heads differ (CLIP's text transformer {src0.attn.num_heads}, "
                          f"the head's {dst0.heads})")
    if not dst0.mlp_ratio or src0.mlp.c_fc.weight.shape != dst0.c_fc.weight.shape:
        return Copied([], f"MLP widths differ (CLIP's text transformer {src0.mlp.c_fc.weight.shape[0]}, the "
                          f"head's {dst0.c_fc.weight.shape[0] if dst0.mlp_ratio else 0})")
    copied = []
    with torch.no_grad():
        for i, (src, dst) in enumerate(zip(resblocks, blocks)):
            pairs = [(dst.ln_1, src.ln_1), (dst.out_proj, src.attn.out_proj), (dst.ln_2, src.ln_2),
                     (dst.c_fc, src.mlp.c_fc), (dst.c_proj, src.mlp.c_proj)]
            for d, s in pairs:
                d.weight.copy_(s.weight)
                d.bias.copy_(s.bias)
            dst.in_proj.weight.copy_(src.attn.in_proj_weight)
            dst.in_proj.bias.copy_(src.attn.in_proj_bias)
            copied.append(f"block {i}")
        table = getattr(clip, "positional_embedding", None)
        if positions is not None and table is not None and table.shape[1] == positions.weight.shape[1]:
            rows = min(positions.num_embeddings, table.shape[0])
            positions.weight[:rows].copy_(table[:rows])
            copied.append(f"positions 0-{rows - 1}")
    return Copied(copied)


def init_sequence_transformer(positions: nn.Embedding, blocks: nn.ModuleList, zero_init: bool) -> None:
    """CLIP's text-transformer initialisation (openai/CLIP ``initialize_parameters``) of a
    seqTransf; with ``zero_init`` the output projections and positions start at zero (identity)."""
    width, layers = positions.weight.shape[1], len(blocks)
    attn_std, fc_std = width**-0.5, (2 * width) ** -0.5
    proj_std = width**-0.5 * (2 * max(1, layers)) ** -0.5
    nn.init.normal_(positions.weight, std=0.01)
    for block in blocks:
        nn.init.normal_(block.in_proj.weight, std=attn_std)
        nn.init.normal_(block.out_proj.weight, std=proj_std)
        nn.init.normal_(block.c_fc.weight, std=fc_std)
        nn.init.normal_(block.c_proj.weight, std=proj_std)
        for lin in (block.in_proj, block.out_proj, block.c_fc, block.c_proj):
            nn.init.zeros_(lin.bias)
        if zero_init:
            nn.init.zeros_(block.out_proj.weight)
            nn.init.zeros_(block.c_proj.weight)
    if zero_init:
        nn.init.zeros_(positions.weight)


def length_groups(mask: Tensor, group: int = 32):
    """Yield ``(idx, keep)``: items in groups of ``group`` sorted by their last real slot, and the
    number of leading slots that hold every real slot of the group. Per-item work run on
    ``x[idx, :keep]`` skips the padded tail of short items and gives the same results wherever
    padding never enters."""
    n = mask.shape[1]
    last = torch.where(mask.bool(), torch.arange(1, n + 1, device=mask.device), 0).amax(1)  # (B,)
    order = torch.argsort(last)
    for a in range(0, mask.shape[0], group):
        idx = order[a:a + group]
        yield idx, max(1, int(last[idx].max()))


def sequence_transformer(x: Tensor, mask: Tensor, positions: Tensor, blocks: nn.ModuleList,
                         extra: Tensor | None = None) -> Tensor:
    """CLIP4Clip's seqTransf over a masked sequence, optionally enlarged by learnable tokens.

    ``x`` (B, N, D) with ``mask`` (B, N) True for real items; ``positions`` (>= N, D) are added to
    the N slots; ``extra`` (C, D) tokens (UATVR's DSA tokens, no position) are appended after the
    N slots and always attended to. The blocks run over the N + C slots with padded slots masked
    as keys; the input ``x`` is added back to the N real slots (the residual of CLIP4Clip, which
    UATVR's code also applies to the real slots only). Returns (B, N + C, D); padded slots hold
    values that must never be read.
    """
    mask = mask.bool()
    # Padding never enters (torch.where, not a product: NaN or inf in padded slots stay out).
    x = torch.where(mask.unsqueeze(-1), x, torch.zeros_like(x))  # (B, N, D)
    h = x + positions[: x.shape[1]]  # (B, N, D)
    if extra is not None and extra.shape[0]:
        b = x.shape[0]
        h = torch.cat([h, extra.unsqueeze(0).expand(b, -1, -1)], dim=1)  # (B, N + C, D)
        x = torch.cat([x, torch.zeros_like(h[:, x.shape[1]:])], dim=1)  # no residual on the extra tokens
        mask = torch.cat([mask, mask.new_ones(b, extra.shape[0])], dim=1)  # (B, N + C)
    for block in blocks:
        h = block(h, mask)
    return h + x  # (B, N + C, D)


@register_head("seqtransf")
class SeqTransf(Head):
    """CLIP4Clip seqTransf: temporal transformer + residual, then mean pooling and cosine."""

    score_meaning = ("the cosine of the sentence embedding and the temporal transformer's video embedding, from -1 to "
                     "1 (higher ranks first)")
    score_range = (-1.0, 1.0)  # a cosine, or an average of cosines

    uses_tokens = False  # reads the sentence embedding only
    default_lr = DEFAULT_LR

    Config = Config

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        width = config.embed_dim
        heads = attention_heads("seqtransf", "num_heads", width, config.num_heads)
        self.frame_position_embeddings = nn.Embedding(config.max_frames, width)
        self.blocks = nn.ModuleList(
            ResidualAttentionBlock(width, heads, config.mlp_ratio, config.ln_eps) for _ in range(config.num_layers)
        )
        init_sequence_transformer(self.frame_position_embeddings, self.blocks, config.zero_init)

    def init_from_clip(self, clip: nn.Module) -> Copied:
        """The temporal transformer from CLIP's text transformer, as CLIP4Clip initialises seqTransf."""
        return copy_clip_text_layers(clip, self.blocks, self.frame_position_embeddings)

    def temporal(self, frames: Tensor, frame_mask: Tensor) -> Tensor:
        """The frames after the temporal transformer and the residual: (B, F, D) -> (B, F, D)."""
        n_frames, frame_mask = frames.shape[1], frame_mask.bool()
        if n_frames > self.config.max_frames:
            raise ConfigError(
                f"seqtransf: videos have {n_frames} frames but max_frames is "
                f"{self.config.max_frames}; create the head with max_frames={n_frames} or more"
            )
        return sequence_transformer(frames, frame_mask, self.frame_position_embeddings.weight, self.blocks)

    embedding_keys = ("sentence", "video")  # similarity: their inner product

    def encode_texts(self, texts: TextBatch) -> Emb:
        return {"sentence": F.normalize(texts.sentence, dim=-1)}  # (B, D)

    def encode_videos(self, videos: VideoBatch) -> Emb:
        frames = F.normalize(self.temporal(videos.frames, videos.frame_mask), dim=-1)  # (B, F, D)
        video = masked_mean(frames, videos.frame_mask, dim=1)  # (B, D)
        return {"video": F.normalize(video, dim=-1)}

    def similarity(self, text_emb: Emb, video_emb: Emb) -> Tensor:
        return text_emb["sentence"] @ video_emb["video"].t()  # (n_text, n_video)
