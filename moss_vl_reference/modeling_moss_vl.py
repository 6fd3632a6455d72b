"""MOSS-VL model for transformers: vision tower + Qwen3-style decoder with gated cross-attention.

Computes what stock sglang 0.5.23's `models/moss_vl.py` computes (same weights, same math):
  * vision: Conv3d patch embed + bilinearly interpolated learned position table, 2-D rotary
    (rows, cols) in ViT blocks that attend within a frame, one merger over the final state and
    the deepstack block outputs (LayerNorm each, concatenate, 2x2 merge, fc1-GELU-fc2), then a
    learned separator after every frame;
  * text: self-attention layers (q/k RMSNorm, GQA, interleaved 3-D MRoPE) and, at
    `cross_attention_layers`, gated cross-attention layers: queries rotated with text positions,
    vision keys with vision position ids (XRoPE), values not rotated; a text row sees the frames
    up to its visible-frame count and contributes nothing (attention and MLP) when it sees none.

Attention goes through transformers' attention interface (`config._attn_implementation`): `eager` (this
file), `sdpa`, and `flash_attention_2`/`_3` for the vision tower and the causal self-attention. Per-row frame
visibility is a dense mask that FlashAttention's padding-mask API cannot express, so cross-attention runs
`sdpa` when the model-wide choice is a FlashAttention kernel.

Shapes: B batch, L text length, E encoder (vision) length, H heads, D head dim. Masks handed to an attention
function are additive (0 where attention is allowed, dtype min where it is not), except FlashAttention's
(B, keys) padding mask (1 = real token). Generation and the runner APIs (`generate`,
`offline_batch_generate`, `offline_generate`, `create_realtime_session`, `online_generate`) are
`generation_moss_vl.MossVLGenerationMixin`, which the model class inherits as in the public checkpoints.
"""

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_outputs import ModelOutput
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_moss_vl import MossVLConfig, MossVLTextConfig, MossVLVisionConfig
from .generation_moss_vl import MossVLGenerationMixin

DENSE_MASK_IMPLEMENTATIONS = ("eager", "sdpa")


# ----------------------------------------------------------------------------- shared pieces


class MossVLRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hk, N, D) -> (B, Hk*groups, N, D): query head h reads key head h // groups."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention in plain torch (transformers' attention-function signature).

    query (B, Hq, Lq, D), key/value (B, Hk, Lk, D) with Hq = Hk * module.num_key_value_groups; attention_mask
    additive, broadcastable to (B, Hq, Lq, Lk), 0 where attention is allowed. -> output (B, Lq, Hq, D) and
    the fp32-softmax weights (B, Hq, Lq, Lk)."""
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def attention_function(implementation: Optional[str]) -> Callable:
    """The attention function transformers registers under `implementation` (eager: this file's)."""
    return ALL_ATTENTION_FUNCTIONS.get_interface(implementation or "sdpa", eager_attention_forward)


# A masked call of at most this many query rows runs with its GQA query heads folded into rows (`grouped_attention`);
# the mask it repeats per folded head grows with the rows (the plugin's CPU kernel measured even at 32 masked rows).
FOLD_MAX_ROWS = 16


class _FoldedHeads:
    """What an attention function reads from its module for a folded call: one query head per KV head."""

    num_key_value_groups = 1
    is_causal = False


def grouped_attention(
    module: nn.Module,
    implementation: Optional[str],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: Optional[torch.Tensor],
) -> torch.Tensor:
    """`attention_function(implementation)` -> output (B, Lq, Hq, D); arguments as `eager_attention_forward`.

    Given a mask, eager and sdpa copy K/V once per query head (GQA expansion), so a few-row masked call (a realtime
    frame step's dozen rows) would cost as much as its keys, self or cross, however few rows it has. Such a call
    folds the query heads of each KV head into rows instead ((B, Hq, L, D) -> (B, Hk, groups * L, D); row g * L + r
    of KV head h is row r of query head h * groups + g) and repeats the (B, 1, L, keys) mask per folded head: the
    same math per row (bitwise on CPU), K/V read in place."""
    groups = module.num_key_value_groups
    function = attention_function(implementation)
    rows = query.shape[2]
    if groups == 1 or mask is None or rows > FOLD_MAX_ROWS or not takes_dense_mask(implementation):
        return function(module, query, key, value, mask, scaling=module.scaling)[0]
    batch, _, _, dim = query.shape
    kv_heads = key.shape[1]
    folded = query.reshape(batch, kv_heads, groups * rows, dim)
    mask = mask.expand(batch, 1, rows, -1).repeat(1, 1, groups, 1)
    out = function(_FoldedHeads(), folded, key, value, mask, scaling=module.scaling)[0]  # (B, groups * L, Hk, D)
    return out.view(batch, groups, rows, kv_heads, dim).permute(0, 2, 3, 1, 4).reshape(batch, rows, -1, dim)


def takes_dense_mask(implementation: Optional[str]) -> bool:
    """False for FlashAttention kernels, which take a (B, keys) padding mask and causality as a flag."""
    return (implementation or "sdpa") in DENSE_MASK_IMPLEMENTATIONS


def additive_bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """True = may attend -> 0, False -> dtype min (finite, so a row with nothing visible stays NaN-free)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves: x = [x1, x2] -> [x1*cos - x2*sin, x2*cos + x1*sin]; cos/sin cover one half."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def xrope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, mrope_section
) -> tuple[torch.Tensor, torch.Tensor]:
    """Interleaved 3-D MRoPE tables. positions (3, B, N) (t, h, w) -> cos, sin (B, 1, N, head_dim/2).

    Frequency pair j takes its angle from axis h when j % 3 == 1 and j < 3*section[1], from axis w
    when j % 3 == 2 and j < 3*section[2], else from axis t."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = positions.float().unsqueeze(-1) * inv_freq.to(positions.device)  # (3, B, N, D/2)
    pair = torch.arange(head_dim // 2, device=positions.device)
    axis = torch.zeros_like(pair)
    axis[(pair % 3 == 1) & (pair < 3 * mrope_section[1])] = 1
    axis[(pair % 3 == 2) & (pair < 3 * mrope_section[2])] = 2
    chosen = angles.gather(0, axis.view(1, 1, 1, -1).expand(1, *angles.shape[1:])).squeeze(0)
    return chosen.cos().unsqueeze(1), chosen.sin().unsqueeze(1)


class KVBuffer:
    """Keys and values of one attention layer, (B, Hk, N, D) each, grown along N in place.

    Storage is preallocated with doubling capacity, so appending n rows copies n rows (a cache grown with
    torch.cat copies all of it every step, which makes a long stream's step cost grow with its length).
    `drop_front(n)` forgets the oldest n rows (the realtime frame window) without moving the others."""

    def __init__(self):
        self.keys: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None
        self.start = self.end = 0

    def __len__(self) -> int:
        return self.end - self.start

    def extend(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (B, Hk, n, D) rows -> views of every row held, oldest first."""
        count = keys.shape[2]
        if self.keys is None or self.end + count > self.keys.shape[2]:
            self._reallocate(max(16, 2 * (len(self) + count)), keys)
        self.keys[:, :, self.end : self.end + count] = keys
        self.values[:, :, self.end : self.end + count] = values
        self.end += count
        return self.view()

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[:, :, self.start : self.end], self.values[:, :, self.start : self.end]

    def drop_front(self, count: int) -> None:
        self.start = min(self.start + count, self.end)

    def _reallocate(self, capacity: int, like: torch.Tensor) -> None:
        shape = (*like.shape[:2], capacity, like.shape[3])
        keys, values = like.new_empty(shape), like.new_empty(shape)
        if self.keys is not None:
            keys[:, :, : len(self)], values[:, :, : len(self)] = self.view()
        self.keys, self.values, self.start, self.end = keys, values, 0, len(self)


# ----------------------------------------------------------------------------- vision tower


class MossVLVisionAttention(nn.Module):
    """Bidirectional attention within each frame (2-D rotary over rows and cols), no mask."""

    is_causal = False
    num_key_value_groups = 1

    def __init__(self, config: MossVLVisionConfig):
        super().__init__()
        self.config = config
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.scaling = self.head_dim**-0.5
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frame_sizes: list[int]) -> torch.Tensor:
        """x (N, C) patches of consecutive frames with `frame_sizes` patches each; attention stays
        inside a frame. cos/sin (N, head_dim)."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + torch.cat((-q[..., self.head_dim // 2 :], q[..., : self.head_dim // 2]), -1) * sin
        k = k * cos + torch.cat((-k[..., self.head_dim // 2 :], k[..., : self.head_dim // 2]), -1) * sin
        attend = attention_function(self.config._attn_implementation)
        outputs, start = [], 0
        for size, count in _runs(frame_sizes):
            span = slice(start, start + size * count)
            frames = [t[span].view(count, size, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v)]
            attended, _ = attend(self, *frames, None, scaling=self.scaling)
            outputs.append(attended.reshape(count * size, -1))
            start += size * count
        return self.proj(torch.cat(outputs))


def frame_chunks(grid_thw: list[list[int]], frames_per_chunk: int) -> list[list[tuple[int, int, int]]]:
    """Split media (t, h, w) into consecutive chunks of at most `frames_per_chunk` frames, each chunk a grid
    list of its own: [[3, 4, 4], [2, 6, 6]] by 2 -> [[(2, 4, 4)], [(1, 4, 4), (1, 6, 6)], [(1, 6, 6)]]."""
    chunks, current, size = [], [], 0
    for t, h, w in grid_thw:
        while t:
            take = min(t, frames_per_chunk - size)
            current.append((take, h, w))
            size, t = size + take, t - take
            if size == frames_per_chunk:
                chunks.append(current)
                current, size = [], 0
    return chunks + [current] if current else chunks


def _runs(values: list[int]) -> list[tuple[int, int]]:
    """Run-length encoding: [4, 4, 9] -> [(4, 2), (9, 1)]."""
    runs = []
    for value in values:
        if runs and runs[-1][0] == value:
            runs[-1] = (value, runs[-1][1] + 1)
        else:
            runs.append((value, 1))
    return runs


class MossVLVisionMLP(nn.Module):
    def __init__(self, config: MossVLVisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class MossVLVisionBlock(nn.Module):
    def __init__(self, config: MossVLVisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = MossVLVisionAttention(config)
        self.mlp = MossVLVisionMLP(config)

    def forward(self, x, cos, sin, frame_sizes):
        x = x + self.attn(self.norm1(x), cos, sin, frame_sizes)
        return x + self.mlp(self.norm2(x))


class MossVLVisionPatchMerger(nn.Module):
    """LayerNorm the final state and each deepstack state, concatenate per patch, group the 2x2
    merge window (consecutive patches) into one vector, fc1 -> GELU -> fc2."""

    def __init__(self, config: MossVLVisionConfig):
        super().__init__()
        num_features = 1 + len(config.deepstack_visual_indexes)
        self.input_size = config.hidden_size * config.spatial_merge_size**2 * num_features
        self.norms = nn.ModuleList([nn.LayerNorm(config.hidden_size, eps=1e-6) for _ in range(num_features)])
        self.linear_fc1 = nn.Linear(self.input_size, self.input_size, bias=True)
        self.act_fn = nn.GELU()
        self.linear_fc2 = nn.Linear(self.input_size, config.out_hidden_size, bias=True)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat([norm(f) for norm, f in zip(self.norms, features)], dim=-1).view(-1, self.input_size)
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class MossVLVisionPatchEmbed(nn.Module):
    def __init__(self, config: MossVLVisionConfig):
        super().__init__()
        self.config = config
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        c = self.config
        x = pixel_values.view(-1, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        return self.proj(x.to(self.proj.weight.dtype)).view(-1, c.hidden_size)


class MossVLVisionModel(nn.Module):
    def __init__(self, config: MossVLVisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = MossVLVisionPatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList([MossVLVisionBlock(config) for _ in range(config.depth)])
        self.merger = MossVLVisionPatchMerger(config)

    def merge_order(self, grid: torch.Tensor) -> torch.Tensor:
        """(h, w, ...) per-patch grid -> (h*w, ...) in merge-window order, matching pixel_values."""
        m = self.config.spatial_merge_size
        h, w = grid.shape[:2]
        return grid.reshape(h // m, m, w // m, m, *grid.shape[2:]).transpose(1, 2).reshape(h * w, *grid.shape[2:])

    def interpolated_positions(self, h: int, w: int) -> torch.Tensor:
        """Learned side x side position table sampled bilinearly at an h x w grid -> (h*w, C) merge order."""
        side = int(self.config.num_position_embeddings**0.5)
        table = self.pos_embed.weight
        rows = torch.linspace(0, side - 1, h, device=table.device)
        cols = torch.linspace(0, side - 1, w, device=table.device)
        r0, c0 = rows.int(), cols.int()
        r1, c1 = (r0 + 1).clip(max=side - 1), (c0 + 1).clip(max=side - 1)
        dr, dc = (rows - r0)[:, None], (cols - c0)[None, :]
        corners = [
            (r0[:, None] * side + c0[None, :], (1 - dr) * (1 - dc)),
            (r0[:, None] * side + c1[None, :], (1 - dr) * dc),
            (r1[:, None] * side + c0[None, :], dr * (1 - dc)),
            (r1[:, None] * side + c1[None, :], dr * dc),
        ]
        weighted = [table[idx.long()] * weight.to(table.dtype)[..., None] for idx, weight in corners]
        grid = weighted[0] + weighted[1] + weighted[2] + weighted[3]
        return self.merge_order(grid)

    def rotary_cos_sin(self, h: int, w: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """2-D rotary over (row, col) per patch, merge order -> cos, sin (h*w, head_dim)."""
        head_dim = self.config.hidden_size // self.config.num_heads
        quarter = head_dim // 2
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, quarter, 2, dtype=torch.float32, device=device) / quarter))
        rows = torch.arange(h, device=device)[:, None].expand(h, w)
        cols = torch.arange(w, device=device)[None, :].expand(h, w)
        angles = torch.cat((rows[..., None] * inv_freq, cols[..., None] * inv_freq), dim=-1)
        angles = self.merge_order(angles)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values (N, 3*P*P), grid_thw (M, 3) -> merged tokens (N / merge^2, out_hidden_size)."""
        x = self.patch_embed(pixel_values)
        positions, cos, sin, frame_sizes = [], [], [], []
        for t, h, w in grid_thw.tolist():
            positions.append(self.interpolated_positions(h, w).repeat(t, 1))
            c, s = self.rotary_cos_sin(h, w, x.device)
            cos.append(c.repeat(t, 1))
            sin.append(s.repeat(t, 1))
            frame_sizes += [h * w] * t
        x = x + torch.cat(positions)
        cos, sin = torch.cat(cos).to(x.dtype), torch.cat(sin).to(x.dtype)
        features = []
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, frame_sizes)
            if index in self.config.deepstack_visual_indexes:
                features.append(x)
        return self.merger([x] + features)


# ----------------------------------------------------------------------------- text decoder


class MossVLTextMLP(nn.Module):
    def __init__(self, config: MossVLTextConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MossVLProjections(nn.Module):
    """q/k/v/o projections with per-head q/k RMSNorm, shared by self- and cross-attention."""

    def __init__(self, config: MossVLTextConfig):
        super().__init__()
        self.config = config
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.num_key_value_groups = self.num_heads // self.num_kv_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)
        self.q_norm = MossVLRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = MossVLRMSNorm(self.head_dim, config.rms_norm_eps)

    def heads(self, x: torch.Tensor, proj: nn.Linear, count: int) -> torch.Tensor:
        b, n, _ = x.shape
        return proj(x).view(b, n, count, self.head_dim).transpose(1, 2)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rope = self.config.rope_scaling
        cos, sin = xrope_cos_sin(positions, self.head_dim, self.config.rope_theta, rope["mrope_section"])
        return rotate_neox(x, cos.to(x.dtype), sin.to(x.dtype))

    def query(self, hidden, positions):
        return self.rotate(self.q_norm(self.heads(hidden, self.q_proj, self.num_heads)), positions)

    def key_value(self, states, positions):
        k = self.rotate(self.k_norm(self.heads(states, self.k_proj, self.num_kv_heads)), positions)
        return k, self.heads(states, self.v_proj, self.num_kv_heads)

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        """attended (B, L, H, D), as attention functions return it -> (B, L, hidden)."""
        b, n = attended.shape[:2]
        return self.o_proj(attended.reshape(b, n, -1))


class MossVLSelfAttention(MossVLProjections):
    """Causal GQA self-attention over the text (with the decoding cache)."""

    is_causal = True

    @property
    def implementation(self) -> str:
        return self.config._attn_implementation or "sdpa"

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        mask: Optional[torch.Tensor],
        cache: Optional[KVBuffer],
    ) -> torch.Tensor:
        """hidden (B, L, hidden); positions (3, B, L) MRoPE ids. mask: for eager/sdpa additive (B, 1, L, past + L),
        0 where a row may attend (causal and not padding); for FlashAttention the (B, past + L) padding mask,
        1 = real token. cache: the K/V of earlier steps, (B, Hk, past, D) each, extended with this step's."""
        q = self.query(hidden, positions)
        k, v = self.key_value(hidden, positions)
        if cache is not None:
            k, v = cache.extend(k, v)
        return self.output(grouped_attention(self, self.implementation, q, k, v, mask))


class MossVLCrossAttention(MossVLProjections):
    """Text queries over the vision encoder's keys/values, each row limited to its visible frames."""

    is_causal = False

    @property
    def implementation(self) -> str:
        """`cross_attention_implementation` (a from_pretrained kwarg) overrides the model-wide choice; a model-wide
        FlashAttention kernel cannot take the per-row frame mask, so cross-attention then runs sdpa."""
        explicit = getattr(self.config, "cross_attention_implementation", None)
        if explicit is not None and not takes_dense_mask(explicit):
            raise ValueError(
                f"cross_attention_implementation {explicit!r} cannot express per-row frame visibility; "
                f"use one of {', '.join(DENSE_MASK_IMPLEMENTATIONS)}"
            )
        implementation = explicit or self.config._attn_implementation
        return implementation if takes_dense_mask(implementation) else "sdpa"

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        key_value: tuple[torch.Tensor, torch.Tensor],
        bias: torch.Tensor,
    ) -> torch.Tensor:
        """hidden (B, L, hidden); positions (3, B, L); key_value (B, Hk, E, D) each, computed once per prompt;
        bias additive (B, 1, L, E), 0 where the row sees the key's frame (frame < the row's visible count and
        the key is not padding)."""
        q = self.query(hidden, positions)
        return self.output(grouped_attention(self, self.implementation, q, *key_value, bias))


class MossVLSelfAttentionDecoderLayer(nn.Module):
    def __init__(self, config: MossVLTextConfig):
        super().__init__()
        self.self_attn = MossVLSelfAttention(config)
        self.mlp = MossVLTextMLP(config)
        self.input_layernorm = MossVLRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = MossVLRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        self_mask: Optional[torch.Tensor],
        cache: Optional[KVBuffer],
        **_,
    ) -> torch.Tensor:
        """Pre-norm self-attention + MLP residual block; arguments as `MossVLSelfAttention.forward`."""
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), positions, self_mask, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class MossVLCrossAttentionDecoderLayer(nn.Module):
    """Tanh-gated cross-attention block; rows that see no frame add nothing."""

    def __init__(self, config: MossVLTextConfig):
        super().__init__()
        self.cross_attn = MossVLCrossAttention(config)
        self.input_layernorm = MossVLRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.cross_attn_attn_gate = nn.Parameter(torch.zeros(1))
        self.mlp = MossVLTextMLP(config)
        self.post_attention_layernorm = MossVLRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.cross_attn_mlp_gate = nn.Parameter(torch.zeros(1))

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cross_kv: Optional[tuple[torch.Tensor, torch.Tensor]],
        cross_bias: Optional[torch.Tensor],
        row_sees_vision: Optional[torch.Tensor],
        **_,
    ) -> torch.Tensor:
        """hidden (B, L, hidden); cross_kv / cross_bias as `MossVLCrossAttention.forward` (None: no vision in the
        batch, the block is skipped); row_sees_vision (B, L, 1) 1.0 where the row sees at least one frame, 0.0
        where it sees none (its attention and MLP outputs are dropped)."""
        if cross_kv is None:
            return hidden
        attended = self.cross_attn(self.input_layernorm(hidden), positions, cross_kv, cross_bias)
        hidden = hidden + self.cross_attn_attn_gate.tanh() * (row_sees_vision * attended)
        mlp_out = self.mlp(self.post_attention_layernorm(hidden))
        return hidden + self.cross_attn_mlp_gate.tanh() * (row_sees_vision * mlp_out)


class MossVLTextModel(nn.Module):
    def __init__(self, config: MossVLTextConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [
                MossVLCrossAttentionDecoderLayer(config)
                if i in config.cross_attention_layers
                else MossVLSelfAttentionDecoderLayer(config)
                for i in range(config.num_hidden_layers)
            ]
        )
        self.norm = MossVLRMSNorm(config.hidden_size, config.rms_norm_eps)


# ----------------------------------------------------------------------------- positions and visibility


@dataclass
class XRopePositions:
    """text (3, B, L) MRoPE positions; vision (3, B, E) key positions; next_text (B,) the position
    of the first generated token (= max text position + 1)."""

    text: torch.Tensor
    vision: torch.Tensor
    next_text: torch.Tensor


def frame_block_positions(t0: int, eh: int, ew: int) -> tuple[torch.Tensor, int]:
    """The XRoPE block a frame opens at position t0: (3, eh*ew + 1) positions of its vision tokens, (t0, t0 + y,
    t0 + x) in row-major merged-grid order, then its separator (t0 + s - 1,)*3 with s = max(eh, ew) + 1; and the
    position of the frame's own `<|image_pad|>` text token, t0 + s - 1 (the next text token takes t0 + s)."""
    last = t0 + max(eh, ew)
    ys = torch.arange(eh).repeat_interleave(ew)
    xs = torch.arange(ew).repeat(eh)
    block = torch.stack((torch.full_like(ys, t0), t0 + ys, t0 + xs))
    return torch.cat((block, torch.full((3, 1), last)), dim=1), last


def compute_xrope_positions(
    input_ids, attention_mask, frame_grids: list[list[tuple[int, int]]], image_token_id: int
) -> XRopePositions:
    """Positions as MOSS-VL defines them, one token at a time.

    Regular tokens count up from 0 (padding gets 0). Each frame token (`image_token_id`) opens a
    block of size s = max(eh, ew) + 1 after the current position t0: its vision tokens get
    (t0, t0 + y, t0 + x), its separator (t0 + s - 1,)*3, the frame token itself t0 + s - 1, and
    every later position is shifted by s. frame_grids[b] lists (eh, ew) merged-grid sizes of
    sample b's frames in text order."""
    batch, length = input_ids.shape
    encoder_len = max([sum(eh * ew + 1 for eh, ew in grids) for grids in frame_grids] + [0])
    text = torch.zeros(3, batch, length, dtype=torch.long)
    vision = torch.zeros(3, batch, encoder_len, dtype=torch.long)
    next_text = torch.zeros(batch, dtype=torch.long)
    for b in range(batch):
        frames = iter(frame_grids[b])
        regular, shift, cursor, row_max = 0, 0, 0, 0
        for i, (token, keep) in enumerate(zip(input_ids[b].tolist(), attention_mask[b].tolist())):
            if not keep:
                continue
            if token == image_token_id:
                eh, ew = next(frames)
                t0 = regular + shift
                block, position = frame_block_positions(t0, eh, ew)
                vision[:, b, cursor : cursor + block.shape[1]] = block
                cursor += block.shape[1]
                shift += position + 1 - t0
            else:
                position = regular + shift
                regular += 1
            text[:, b, i] = position
            row_max = max(row_max, position)
        next_text[b] = row_max + 1
    return XRopePositions(text, vision, next_text)


def visible_frame_counts(cross_attention_mask: Optional[torch.Tensor], input_ids: torch.Tensor) -> torch.Tensor:
    """(B, L) number of frames each text row sees, from the processor's mask (True = masked)."""
    if cross_attention_mask is None:
        return torch.zeros(input_ids.shape, dtype=torch.long, device=input_ids.device)
    return (~cross_attention_mask.bool()).sum(-1).squeeze(1).to(input_ids.device)


def referenced_media(
    pixel_values: torch.Tensor, grid_thw: torch.Tensor, media_nums_per_sample: Optional[list], frame_tokens: list[int]
) -> tuple[torch.Tensor, torch.Tensor, Optional[list]]:
    """The media of the samples that have ``<|image_pad|>`` tokens. A text-only sample carries the processor's blank
    frame (counted in its media_nums_per_sample, seen by no row): it contributes no frame, so a batch may mix text-only
    and media samples. Without media_nums_per_sample every medium is the first sample's and all are kept."""
    if media_nums_per_sample is None or len(media_nums_per_sample) != len(frame_tokens):
        return pixel_values, grid_thw, media_nums_per_sample  # encoder_batch says what does not match
    if all(tokens or not count for tokens, count in zip(frame_tokens, media_nums_per_sample)):
        return pixel_values, grid_thw, media_nums_per_sample
    keep_sample = torch.tensor([tokens > 0 for tokens in frame_tokens])
    keep_media = keep_sample.repeat_interleave(torch.tensor(list(media_nums_per_sample)))
    keep_rows = keep_media.repeat_interleave(grid_thw.prod(dim=-1).cpu())
    counts = [count if tokens else 0 for tokens, count in zip(frame_tokens, media_nums_per_sample)]
    return pixel_values[keep_rows.to(pixel_values.device)], grid_thw[keep_media.to(grid_thw.device)], counts


# ----------------------------------------------------------------------------- cache and outputs


@dataclass
class MossVLCache:
    """Decoding state: per-layer self-attention K/V ({layer: KVBuffer}, grown each step); cross-attention K/V of the
    encoder (computed once at prefill); the encoder's frame index per key and validity; the
    visible-frame count of the last prompt row (copied to generated rows); the next position."""

    self_kv: dict
    cross_kv: dict
    key_frame: Optional[torch.Tensor]
    key_valid: Optional[torch.Tensor]
    last_visible: torch.Tensor
    next_position: torch.Tensor
    attention_mask: torch.Tensor


@dataclass
class MossVLOutput(ModelOutput):
    logits: torch.Tensor = None
    past_key_values: Optional[MossVLCache] = None


# ----------------------------------------------------------------------------- the model


class MossVLPreTrainedModel(PreTrainedModel):
    config_class = MossVLConfig
    base_model_prefix = "model"
    _supports_sdpa = True
    _supports_flash_attn = True
    _no_split_modules = ["MossVLVisionBlock", "MossVLSelfAttentionDecoderLayer", "MossVLCrossAttentionDecoderLayer"]

    def _init_weights(self, module):
        std = self.config.text_config.initializer_range
        if isinstance(module, (nn.Linear, nn.Conv3d)):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, (nn.LayerNorm, MossVLRMSNorm)):
            nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)


class MossVLModel(nn.Module):
    def __init__(self, config: MossVLConfig):
        super().__init__()
        self.visual = MossVLVisionModel(config.vision_config)
        self.language_model = MossVLTextModel(config.text_config)
        self.separator_token = nn.Parameter(torch.zeros(config.vision_config.out_hidden_size))


class MossVLForConditionalGeneration(MossVLGenerationMixin, MossVLPreTrainedModel):
    """MOSS-VL with its LM head; `forward` is one prefill or decode step, generation is the mixin's.

    forward / generate take the processor's output:
      input_ids (B, L) and attention_mask (B, L), 1 = real token, 0 = left padding;
      pixel_values (N, 3*P*P) patches of every frame, media in text order; grid_thw (M, 3) (frames, rows, cols)
      in patches per medium; media_nums_per_sample list[int] (len B): media per sample;
      cross_attention_mask (B, 1, L, F) bool, True = the row does NOT see that frame (the processor's polarity;
      the processor builds a frame prefix; any frame set per row is honoured)."""

    def __init__(self, config: MossVLConfig, cross_attention_implementation: Optional[str] = None):
        super().__init__(config)
        if cross_attention_implementation is not None:
            config.text_config.cross_attention_implementation = cross_attention_implementation
        self.model = MossVLModel(config)
        self.lm_head = nn.Linear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)
        self.post_init()

    # ---- encoder

    def encode_frames(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, vision_chunked_length: Optional[int] = None
    ) -> torch.Tensor:
        """Merged vision tokens of every frame (N / merge^2, hidden), media in order.

        With `vision_chunked_length` the tower runs on at most that many frames at a time: attention never
        crosses a frame and every other op is per patch, so the result is the same while the activations held
        at once (deepstack features included) shrink to one chunk's."""
        if not vision_chunked_length:
            return self.model.visual(pixel_values, grid_thw)
        pieces, start = [], 0
        for chunk in frame_chunks(grid_thw.tolist(), vision_chunked_length):
            rows = sum(t * h * w for t, h, w in chunk)
            pieces.append(self.model.visual(pixel_values[start : start + rows], grid_thw.new_tensor(chunk)))
            start += rows
        return torch.cat(pieces)

    def encode_media(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, vision_chunked_length: Optional[int] = None
    ) -> list[torch.Tensor]:
        """Per medium: (frames * (tokens_per_frame + 1), hidden) with a separator after each frame."""
        merge = self.config.vision_config.spatial_merge_size**2
        merged = self.encode_frames(pixel_values, grid_thw, vision_chunked_length)
        separator = self.model.separator_token.to(merged.dtype)
        media, start = [], 0
        for t, h, w in grid_thw.tolist():
            per_frame = h * w // merge
            frames = merged[start : start + t * per_frame].view(t, per_frame, -1)
            media.append(torch.cat((frames, separator.view(1, 1, -1).expand(t, 1, -1)), dim=1).flatten(0, 1))
            start += t * per_frame
        return media

    def encoder_batch(
        self,
        pixel_values: torch.Tensor,
        grid_thw: torch.Tensor,
        media_nums_per_sample: Optional[list],
        batch: int,
        vision_chunked_length: Optional[int] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[tuple[int, int]]]]:
        """Per-sample encoder sequences padded to E: states (B, E, C), frame index of each key
        (B, E), key validity (B, E) True = real key, and per-sample frame grids (eh, ew) in order."""
        merge = self.config.vision_config.spatial_merge_size
        media = self.encode_media(pixel_values, grid_thw, vision_chunked_length)
        counts = list(media_nums_per_sample) if media_nums_per_sample is not None else [len(media)] + [0] * (batch - 1)
        if len(counts) != batch or sum(counts) != len(media):
            raise ValueError(f"media_nums_per_sample {counts} does not match {batch} samples and {len(media)} media")
        grids = grid_thw.tolist()
        sequences, frame_ids, frame_grids, index = [], [], [], 0
        for count in counts:
            ids, sample_grids, frame = [], [], 0
            for t, h, w in grids[index : index + count]:
                per_frame = h * w // merge**2 + 1
                ids.append(torch.arange(frame, frame + t).repeat_interleave(per_frame))
                sample_grids += [(h // merge, w // merge)] * t
                frame += t
            parts = media[index : index + count]
            index += count
            sequences.append(
                torch.cat(parts) if parts else pixel_values.new_zeros(0, self.model.separator_token.shape[0])
            )
            frame_ids.append(torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long))
            frame_grids.append(sample_grids)
        length = max(s.shape[0] for s in sequences)
        states = torch.stack([F.pad(s, (0, 0, 0, length - s.shape[0])) for s in sequences])
        key_frame = torch.stack([F.pad(f, (0, length - f.shape[0])) for f in frame_ids]).to(states.device)
        key_valid = torch.stack([torch.arange(length) < f.shape[0] for f in frame_ids]).to(states.device)
        return states, key_frame, key_valid, frame_grids

    # ---- forward

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: Optional[torch.Tensor] = None,
        pixel_values: Optional[torch.Tensor] = None,
        grid_thw: Optional[torch.Tensor] = None,
        media_nums_per_sample: Optional[list] = None,
        cross_attention_mask: Optional[torch.Tensor] = None,
        past_key_values: Optional[MossVLCache] = None,
        position_ids: Optional[torch.Tensor] = None,
        use_cache: bool = False,
        vision_chunked_length: Optional[int] = None,
        **_,
    ) -> MossVLOutput:
        """Prefill when `past_key_values` is None (full prompt), else decode the new `input_ids`
        (attention_mask then covers past + new tokens). position_ids (3, B, L) override the
        computed text positions (used to recompute a generated continuation without a cache).
        vision_chunked_length: frames the vision tower encodes at a time (None: all at once).
        A prompt row attends to the frames its `cross_attention_mask` row leaves visible (any set of frames, a
        prefix as the processor builds it or a window as a realtime stream's); a decoded row sees what the
        prompt's last row sees."""
        batch, length = input_ids.shape
        device = input_ids.device
        if attention_mask is None:
            past = 0 if past_key_values is None else past_key_values.attention_mask.shape[1]
            attention_mask = torch.ones(batch, past + length, dtype=torch.long, device=device)
        if past_key_values is None:
            cache = self.prefill_state(
                input_ids,
                attention_mask,
                pixel_values,
                grid_thw,
                media_nums_per_sample,
                cross_attention_mask,
                position_ids,
                vision_chunked_length,
            )
            positions, frame_visible = cache.pop("positions"), cache.pop("frame_visible")
            cache.pop("visible")
            cache = MossVLCache(**cache)
            sees = None
            if cache.key_frame is not None:
                key_frame = cache.key_frame[:, None, :].expand(-1, length, -1).clamp(max=frame_visible.shape[-1] - 1)
                sees = frame_visible.gather(2, key_frame) & cache.key_valid[:, None, :]
        else:
            cache = past_key_values
            steps = torch.arange(length, device=device)
            positions = (cache.next_position[:, None] + steps).unsqueeze(0).expand(3, -1, -1)
            visible = cache.last_visible[:, None].expand(batch, length)
            cache.next_position = cache.next_position + length
            cache.attention_mask = attention_mask
            sees = None
            if cache.key_frame is not None:
                sees = (cache.key_frame[:, None, :] < visible[:, :, None]) & cache.key_valid[:, None, :]
        self_kv = cache.self_kv if use_cache else None
        logits = self.decode_text(input_ids, positions, attention_mask, self_kv, cache.cross_kv, sees)
        return MossVLOutput(logits=logits, past_key_values=cache if use_cache else None)

    def decode_text(
        self,
        input_ids: torch.LongTensor,
        positions: torch.Tensor,
        attention_mask: torch.Tensor,
        self_kv: Optional[dict],
        cross_kv: dict,
        sees: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """The decoder over new text rows -> logits (B, L, vocab).

        input_ids (B, L) the new rows; positions (3, B, L) their MRoPE ids; attention_mask (B, past + L), 1 = real
        token; self_kv {layer: KVBuffer} holding the past rows' K/V, extended with the new ones (None: no cache,
        past must be 0); cross_kv {cross layer: (k, v)} the encoder K/V, (B, Hk, E, D) each; sees (B, L, E) bool,
        True where the row attends to the encoder key (None: no encoder). A row that sees no key adds nothing in
        the cross-attention layers."""
        length = input_ids.shape[1]
        device = input_ids.device
        hidden = self.model.language_model.embed_tokens(input_ids)
        dtype = hidden.dtype
        past_len = attention_mask.shape[1] - length
        query_index = past_len + torch.arange(length, device=device)
        allowed = (torch.arange(attention_mask.shape[1], device=device)[None, :] <= query_index[:, None])[
            None
        ] & attention_mask.bool()[:, None, :]
        dense = takes_dense_mask(self.config.text_config._attn_implementation)
        self_mask = additive_bias(allowed.unsqueeze(1), dtype) if dense else attention_mask
        if dense and length == 1 and bool(allowed.all()):
            # One row that sees every key: no mask, so sdpa reads grouped K/V heads in place instead of copying
            # them per query head every step (same result; a long stream's decode step would grow with it).
            self_mask = None
        cross_bias, row_sees_vision = None, None
        if sees is not None:
            cross_bias = None if bool(sees.all()) else additive_bias(sees.unsqueeze(1), dtype)
            row_sees_vision = sees.any(dim=-1, keepdim=True).to(dtype)
        for index, layer in enumerate(self.model.language_model.layers):
            hidden = layer(
                hidden,
                positions=positions,
                self_mask=self_mask,
                cache=None if self_kv is None else self_kv.setdefault(index, KVBuffer()),
                cross_kv=cross_kv.get(index) if sees is not None else None,
                cross_bias=cross_bias,
                row_sees_vision=row_sees_vision,
            )
        return self.lm_head(self.model.language_model.norm(hidden))

    def prefill_state(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor,
        pixel_values: Optional[torch.Tensor],
        grid_thw: Optional[torch.Tensor],
        media_nums_per_sample: Optional[list],
        cross_attention_mask: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor],
        vision_chunked_length: Optional[int] = None,
    ) -> dict:
        """Everything the prompt fixes: positions, visibility and, once, the cross-attention K/V
        (arguments as `forward`)."""
        batch = input_ids.shape[0]
        image_token_id = self.config.image_token_id
        cross_kv, key_frame, key_valid, frame_grids = {}, None, None, [[] for _ in range(batch)]
        frame_tokens = (input_ids == image_token_id).sum(dim=1).tolist()
        if pixel_values is not None and grid_thw is not None and grid_thw.numel() and any(frame_tokens):
            pixel_values, grid_thw, media_nums_per_sample = referenced_media(
                pixel_values, grid_thw, media_nums_per_sample, frame_tokens
            )
            states, key_frame, key_valid, frame_grids = self.encoder_batch(
                pixel_values, grid_thw, media_nums_per_sample, batch, vision_chunked_length
            )
        if frame_tokens != [len(g) for g in frame_grids]:
            raise ValueError(
                f"frames per sample {[len(g) for g in frame_grids]} do not match <|image_pad|> tokens {frame_tokens}"
            )
        xrope = compute_xrope_positions(input_ids.cpu(), attention_mask.cpu(), frame_grids, image_token_id)
        positions = (xrope.text if position_ids is None else position_ids).to(input_ids.device)
        if key_frame is not None:
            vision_positions = xrope.vision.to(input_ids.device)
            for index, layer in enumerate(self.model.language_model.layers):
                if isinstance(layer, MossVLCrossAttentionDecoderLayer):
                    cross_kv[index] = layer.cross_attn.key_value(states, vision_positions)
        visible = visible_frame_counts(cross_attention_mask, input_ids)
        frame_visible = (
            ~cross_attention_mask.bool().squeeze(1).to(input_ids.device)
            if cross_attention_mask is not None
            else torch.zeros((*input_ids.shape, 1), dtype=torch.bool, device=input_ids.device)
        )
        return {
            "self_kv": {},
            "cross_kv": cross_kv,
            "key_frame": key_frame,
            "key_valid": key_valid,
            "last_visible": visible[:, -1].clone(),
            "next_position": xrope.next_text.to(input_ids.device)
            if position_ids is None
            else positions[0].max(dim=1).values + 1,
            "attention_mask": attention_mask,
            "positions": positions,
            "visible": visible,
            "frame_visible": frame_visible,
        }


__all__ = ["MossVLForConditionalGeneration", "MossVLPreTrainedModel", "compute_xrope_positions"]
