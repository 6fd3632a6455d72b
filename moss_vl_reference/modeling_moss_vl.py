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

Shapes: B batch, L text length, E encoder (vision) length, H heads, D head dim.
Runner APIs (`offline_batch_generate`, `offline_generate`, `create_realtime_session`,
`online_generate`) live in the model class, as in the public checkpoints.
"""

import logging
import queue
import re
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_outputs import ModelOutput

from .configuration_moss_vl import MossVLConfig, MossVLTextConfig, MossVLVisionConfig

logger = logging.getLogger(__name__)

ROUND_START = "<|round_start|>"
ROUND_END = "<|round_end|>"
ERROR_PREFIX = "[ERROR] "


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


def attend(q, k, v, bias: Optional[torch.Tensor], implementation: str) -> torch.Tensor:
    """Softmax attention. q (B,Hq,Lq,D), k/v (B,Hk,Lk,D) with Hq a multiple of Hk (query head h
    reads key head h // (Hq/Hk)); bias additive, broadcastable to (B,Hq,Lq,Lk). -> (B,Hq,Lq,D)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scale = q.shape[-1] ** -0.5
    if implementation == "eager":
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        if bias is not None:
            scores = scores + bias
        return torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype), v)
    if implementation == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    raise ValueError(f"unsupported attention implementation {implementation!r} (use 'eager' or 'sdpa')")


def additive_bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """True = may attend -> 0, False -> dtype min (finite, so a row with nothing visible stays NaN-free)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves: x = [x1, x2] -> [x1*cos - x2*sin, x2*cos + x1*sin]; cos/sin cover one half."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def xrope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, mrope_section) -> tuple[torch.Tensor, torch.Tensor]:
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


# ----------------------------------------------------------------------------- vision tower


class MossVLVisionAttention(nn.Module):
    def __init__(self, config: MossVLVisionConfig):
        super().__init__()
        self.config = config
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
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
        outputs, start = [], 0
        implementation = self.config._attn_implementation or "sdpa"
        for size, count in _runs(frame_sizes):
            span = slice(start, start + size * count)
            frames = [t[span].view(count, size, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v)]
            outputs.append(attend(*frames, None, implementation).transpose(1, 2).reshape(count * size, -1))
            start += size * count
        return self.proj(torch.cat(outputs))


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
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
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
        b, _, n, _ = attended.shape
        return self.o_proj(attended.transpose(1, 2).reshape(b, n, -1))

class MossVLSelfAttention(MossVLProjections):
    @property
    def implementation(self) -> str:
        return self.config._attn_implementation or "sdpa"

    def forward(self, hidden, positions, bias, cache: Optional[list]):
        q = self.query(hidden, positions)
        k, v = self.key_value(hidden, positions)
        if cache is not None:
            if cache:
                k, v = torch.cat((cache[0], k), dim=2), torch.cat((cache[1], v), dim=2)
            cache[:] = [k, v]
        return self.output(attend(q, k, v, bias, self.implementation))


class MossVLCrossAttention(MossVLProjections):
    @property
    def implementation(self) -> str:
        """`cross_attention_implementation` (a from_pretrained kwarg) overrides the model-wide choice."""
        return getattr(self.config, "cross_attention_implementation", None) or self.config._attn_implementation or "sdpa"

    def forward(self, hidden, positions, key_value, bias):
        return self.output(attend(self.query(hidden, positions), *key_value, bias, self.implementation))


class MossVLSelfAttentionDecoderLayer(nn.Module):
    def __init__(self, config: MossVLTextConfig):
        super().__init__()
        self.self_attn = MossVLSelfAttention(config)
        self.mlp = MossVLTextMLP(config)
        self.input_layernorm = MossVLRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = MossVLRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, positions, self_bias, cache, **_):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), positions, self_bias, cache)
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

    def forward(self, hidden, positions, cross_kv, cross_bias, row_sees_vision, **_):
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
                MossVLCrossAttentionDecoderLayer(config) if i in config.cross_attention_layers else MossVLSelfAttentionDecoderLayer(config)
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


def compute_xrope_positions(input_ids, attention_mask, frame_grids: list[list[tuple[int, int]]], image_token_id: int) -> XRopePositions:
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
                span = max(eh, ew) + 1
                ys = torch.arange(eh).repeat_interleave(ew)
                xs = torch.arange(ew).repeat(eh)
                block = torch.stack((torch.full_like(ys, t0), t0 + ys, t0 + xs))
                vision[:, b, cursor : cursor + eh * ew] = block
                vision[:, b, cursor + eh * ew] = t0 + span - 1
                cursor += eh * ew + 1
                shift += span
                position = t0 + span - 1
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


# ----------------------------------------------------------------------------- cache and outputs


@dataclass
class MossVLCache:
    """Decoding state: per-layer self-attention K/V (grown each step); cross-attention K/V of the
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


class MossVLForConditionalGeneration(MossVLPreTrainedModel):
    """forward / generate take the processor's output:
    input_ids, attention_mask (B, L); pixel_values (N, 3*P*P); grid_thw (M, 3);
    media_nums_per_sample list[int] (len B); cross_attention_mask (B, 1, L, F) bool, True = masked."""

    def __init__(self, config: MossVLConfig, cross_attention_implementation: Optional[str] = None):
        super().__init__(config)
        if cross_attention_implementation is not None:
            config.text_config.cross_attention_implementation = cross_attention_implementation
        self.model = MossVLModel(config)
        self.lm_head = nn.Linear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)
        self.post_init()

    # ---- encoder

    def encode_media(self, pixel_values, grid_thw) -> list[torch.Tensor]:
        """Per medium: (frames * (tokens_per_frame + 1), hidden) with a separator after each frame."""
        merge = self.config.vision_config.spatial_merge_size ** 2
        merged = self.model.visual(pixel_values, grid_thw)
        separator = self.model.separator_token.to(merged.dtype)
        media, start = [], 0
        for t, h, w in grid_thw.tolist():
            per_frame = h * w // merge
            frames = merged[start : start + t * per_frame].view(t, per_frame, -1)
            media.append(torch.cat((frames, separator.view(1, 1, -1).expand(t, 1, -1)), dim=1).flatten(0, 1))
            start += t * per_frame
        return media

    def encoder_batch(self, pixel_values, grid_thw, media_nums_per_sample, batch: int):
        """Per-sample encoder sequences padded to E: states (B, E, C), frame index of each key
        (B, E), key validity (B, E), and per-sample frame grids (eh, ew) in order."""
        merge = self.config.vision_config.spatial_merge_size
        media = self.encode_media(pixel_values, grid_thw)
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
            sequences.append(torch.cat(parts) if parts else pixel_values.new_zeros(0, self.model.separator_token.shape[0]))
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
        **_,
    ) -> MossVLOutput:
        """Prefill when `past_key_values` is None (full prompt), else decode the new `input_ids`
        (attention_mask then covers past + new tokens). position_ids (3, B, L) override the
        computed text positions (used to recompute a generated continuation without a cache)."""
        text_config = self.config.text_config
        batch, length = input_ids.shape
        device = input_ids.device
        if attention_mask is None:
            past = 0 if past_key_values is None else past_key_values.attention_mask.shape[1]
            attention_mask = torch.ones(batch, past + length, dtype=torch.long, device=device)
        if past_key_values is None:
            cache = self.prefill_state(input_ids, attention_mask, pixel_values, grid_thw, media_nums_per_sample, cross_attention_mask, position_ids)
            positions, visible = cache.pop("positions"), cache.pop("visible")
            cache = MossVLCache(**cache)
        else:
            cache = past_key_values
            steps = torch.arange(length, device=device)
            positions = (cache.next_position[:, None] + steps).unsqueeze(0).expand(3, -1, -1)
            visible = cache.last_visible[:, None].expand(batch, length)
            cache.next_position = cache.next_position + length
            cache.attention_mask = attention_mask
        hidden = self.model.language_model.embed_tokens(input_ids)
        dtype = hidden.dtype
        past_len = attention_mask.shape[1] - length
        query_index = past_len + torch.arange(length, device=device)
        allowed = (torch.arange(attention_mask.shape[1], device=device)[None, :] <= query_index[:, None])[None] & attention_mask.bool()[:, None, :]
        self_bias = additive_bias(allowed.unsqueeze(1), dtype)
        cross_bias, row_sees_vision = None, None
        if cache.key_frame is not None:
            sees = (cache.key_frame[:, None, :] < visible[:, :, None]) & cache.key_valid[:, None, :]
            cross_bias = additive_bias(sees.unsqueeze(1), dtype)
            row_sees_vision = (visible > 0).unsqueeze(-1).to(dtype)
        for index, layer in enumerate(self.model.language_model.layers):
            if use_cache:
                layer_cache = cache.self_kv.setdefault(index, [])
            else:
                layer_cache = None
            hidden = layer(
                hidden,
                positions=positions,
                self_bias=self_bias,
                cache=layer_cache,
                cross_kv=cache.cross_kv.get(index),
                cross_bias=cross_bias,
                row_sees_vision=row_sees_vision,
            )
        logits = self.lm_head(self.model.language_model.norm(hidden))
        return MossVLOutput(logits=logits, past_key_values=cache if use_cache else None)

    def prefill_state(self, input_ids, attention_mask, pixel_values, grid_thw, media_nums_per_sample, cross_attention_mask, position_ids) -> dict:
        """Everything the prompt fixes: positions, visibility and, once, the cross-attention K/V."""
        batch = input_ids.shape[0]
        image_token_id = self.config.image_token_id
        cross_kv, key_frame, key_valid, frame_grids = {}, None, None, [[] for _ in range(batch)]
        if pixel_values is not None and grid_thw is not None and grid_thw.numel():
            states, key_frame, key_valid, frame_grids = self.encoder_batch(pixel_values, grid_thw, media_nums_per_sample, batch)
        frame_tokens = (input_ids == image_token_id).sum(dim=1).tolist()
        if frame_tokens != [len(g) for g in frame_grids]:
            raise ValueError(f"frames per sample {[len(g) for g in frame_grids]} do not match <|image_pad|> tokens {frame_tokens}")
        xrope = compute_xrope_positions(input_ids.cpu(), attention_mask.cpu(), frame_grids, image_token_id)
        positions = (xrope.text if position_ids is None else position_ids).to(input_ids.device)
        if key_frame is not None:
            vision_positions = xrope.vision.to(input_ids.device)
            for index, layer in enumerate(self.model.language_model.layers):
                if isinstance(layer, MossVLCrossAttentionDecoderLayer):
                    cross_kv[index] = layer.cross_attn.key_value(states, vision_positions)
        visible = visible_frame_counts(cross_attention_mask, input_ids)
        return {
            "self_kv": {},
            "cross_kv": cross_kv,
            "key_frame": key_frame,
            "key_valid": key_valid,
            "last_visible": visible[:, -1].clone(),
            "next_position": xrope.next_text.to(input_ids.device) if position_ids is None else positions[0].max(dim=1).values + 1,
            "attention_mask": attention_mask,
            "positions": positions,
            "visible": visible,
        }

    # ---- generation

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.LongTensor,
        attention_mask: Optional[torch.Tensor] = None,
        pixel_values=None,
        grid_thw=None,
        media_nums_per_sample=None,
        cross_attention_mask=None,
        max_new_tokens: int = 16,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        repetition_penalty: float = 1.0,
        eos_token_id=None,
        pad_token_id: Optional[int] = None,
        use_cache: bool = True,
        on_token=None,
        stop_event: Optional[threading.Event] = None,
        **_,
    ) -> torch.LongTensor:
        """Greedy or sampled decoding -> (B, L + new) ids; finished rows are padded with
        `pad_token_id`. Cross-attention K/V are computed once at prefill and reused.
        `on_token(step_ids)` is called with the (B,) ids of each step (for streaming)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        eos = self.stop_token_ids(eos_token_id)
        pad = pad_token_id if pad_token_id is not None else (sorted(eos)[0] if eos else 0)
        output = self(input_ids, attention_mask, pixel_values, grid_thw, media_nums_per_sample, cross_attention_mask, use_cache=use_cache)
        cache, logits = output.past_key_values, output.logits[:, -1]
        sequences, finished = input_ids, torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for _ in range(max_new_tokens):
            logits = self.adjust_logits(logits, sequences, repetition_penalty)
            next_ids = self.pick(logits, do_sample, temperature, top_k, top_p).masked_fill(finished, pad)
            sequences = torch.cat((sequences, next_ids[:, None]), dim=1)
            attention_mask = torch.cat((attention_mask, (~finished).long()[:, None]), dim=1)
            if on_token is not None:
                on_token(next_ids)
            finished |= torch.isin(next_ids, torch.tensor(sorted(eos), device=next_ids.device))
            if finished.all() or (stop_event is not None and stop_event.is_set()):
                break
            if use_cache:
                logits = self(next_ids[:, None], attention_mask, past_key_values=cache, use_cache=True).logits[:, -1]
            else:
                logits = self.recompute_last_logits(sequences, attention_mask, input_ids.shape[1], pixel_values, grid_thw, media_nums_per_sample, cross_attention_mask)
        return sequences

    def recompute_last_logits(self, sequences, attention_mask, prompt_len, pixel_values, grid_thw, media_nums_per_sample, cross_attention_mask):
        """Logits of the last token from a full forward over prompt + continuation (no cache):
        generated tokens continue the prompt's positions and inherit its last row's visibility."""
        prompt = sequences[:, :prompt_len]
        state = self.prefill_state(prompt, attention_mask[:, :prompt_len], pixel_values, grid_thw, media_nums_per_sample, cross_attention_mask, None)
        extra = sequences.shape[1] - prompt_len
        steps = torch.arange(extra, device=sequences.device)
        continuation = (state["next_position"][:, None] + steps).unsqueeze(0).expand(3, -1, -1)
        positions = torch.cat((state["positions"], continuation), dim=2)
        mask = cross_attention_mask
        if mask is not None:
            mask = torch.cat((mask, mask[:, :, -1:].expand(-1, -1, extra, -1)), dim=2)
        return self(sequences, attention_mask, pixel_values, grid_thw, media_nums_per_sample, mask, position_ids=positions).logits[:, -1]

    def stop_token_ids(self, eos_token_id) -> set:
        """Explicit ids, else the config's eos plus generation_config's (as sglang's stop set)."""
        if eos_token_id is None:
            generation = getattr(self, "generation_config", None)
            eos_token_id = [self.config.text_config.eos_token_id, *_as_list(getattr(generation, "eos_token_id", None))]
        return set(_as_list(eos_token_id)) - {None}

    @staticmethod
    def adjust_logits(logits, sequences, repetition_penalty: float):
        if repetition_penalty == 1.0:
            return logits
        seen = torch.gather(logits, 1, sequences)
        seen = torch.where(seen > 0, seen / repetition_penalty, seen * repetition_penalty)
        return logits.scatter(1, sequences, seen)

    @staticmethod
    def pick(logits, do_sample: bool, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
        if not do_sample:
            return logits.argmax(dim=-1)
        logits = logits.float() / max(temperature, 1e-5)
        if top_k and top_k > 0:
            kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if top_p < 1.0:
            ordered, order = logits.sort(dim=-1, descending=True)
            drop = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1) > top_p
            logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
        return torch.multinomial(logits.softmax(-1), 1).squeeze(-1)

    # ---- runner APIs

    def processor_inputs(self, processor, query: dict) -> tuple[dict, dict]:
        """A query ({"messages": [...]} or {"prompt", "images", "videos", "system_prompt"}, with
        optional "media_kwargs"/"generate_kwargs") -> (processor output on the model's device,
        generate kwargs)."""
        messages = query_messages(query)
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        images, videos = processor.extract_media(messages)
        media_kwargs = query.get("media_kwargs") or {}
        inputs = processor(text=text, images=images or None, videos=videos or None, media_kwargs=media_kwargs)
        return self.to_device(inputs), dict(query.get("generate_kwargs") or {})

    def to_device(self, inputs) -> dict:
        return {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in dict(inputs).items()}

    def offline_batch_generate(self, processor, queries: list, vision_chunked_length: int = 64, **generate_kwargs) -> dict:
        """Answer each query independently -> {"results": [{"text": ...}, ...]}; a failing query
        yields {"text": "", "error": message}."""
        results = []
        for query in queries:
            try:
                inputs, kwargs = self.processor_inputs(processor, query)
                sequences = self.generate(**inputs, **{**generate_kwargs, **kwargs})
                text = processor.decode(sequences[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
                results.append({"text": text})
            except (ValueError, FileNotFoundError, RuntimeError) as error:
                logger.warning("query failed: %s", error)
                results.append({"text": "", "error": str(error)})
        return {"results": results}

    def offline_generate(self, processor, input_queue, output_queue, vision_chunked_length: int = 64, **generate_kwargs) -> None:
        """Serve queries from `input_queue` until {"stop_offline_generate": True}. For each query
        put <|round_start|>, text pieces as they decode, then <|round_end|>; a failure puts
        "[ERROR] <message>" before <|round_end|>."""
        while True:
            query = input_queue.get()
            if isinstance(query, dict) and query.get("stop_offline_generate"):
                return
            output_queue.put(ROUND_START)
            try:
                inputs, kwargs = self.processor_inputs(processor, query)
                self.stream(processor, inputs, output_queue, **{**generate_kwargs, **kwargs})
            except Exception as error:  # reported to the caller through the protocol
                logger.warning("offline query failed: %s", error)
                output_queue.put(f"{ERROR_PREFIX}{type(error).__name__}: {error}")
            output_queue.put(ROUND_END)

    def stream(self, processor, inputs: dict, output_queue, stop_event=None, **generate_kwargs) -> str:
        """generate() for one sample, putting newly decoded text on `output_queue` as it appears."""
        decoded, emitted = [], [""]

        def on_token(step_ids):
            decoded.append(int(step_ids[0]))
            text = processor.decode(decoded, skip_special_tokens=True)
            if len(text) > len(emitted[0]) and not text.endswith("\ufffd"):
                output_queue.put(text[len(emitted[0]) :])
                emitted[0] = text

        self.generate(**inputs, **generate_kwargs, on_token=on_token, stop_event=stop_event)
        # a trailing incomplete byte sequence was held back above; the answer ends here, so flush it
        final = processor.decode(decoded, skip_special_tokens=True)
        if len(final) > len(emitted[0]):
            output_queue.put(final[len(emitted[0]) :])
        return final

    def create_realtime_session(self, processor, initial_prompt: str = "", system_prompt: str = "", frame_queue_size: int = 256, max_tokens_per_turn: int = 256, **generate_kwargs):
        """A realtime session over a growing stream of timestamped frames (see MossVLRealtimeSession)."""
        return MossVLRealtimeSession(self, processor, initial_prompt, system_prompt, frame_queue_size, max_tokens_per_turn, generate_kwargs)

    def online_generate(self, processor, input_queue, output_queue, frame_queue_size: int = 256, max_tokens_per_turn: int = 256, **generate_kwargs) -> None:
        """Queue-driven realtime loop. First message: {initial_prompt, system_prompt, ...}; then
        {"frame": PIL image, "timestamp": s[, "prompt"]}, {"prompt": text} or
        {"stop_online_generate": True}. Answers are put on `output_queue` as text pieces."""
        first = input_queue.get()
        session = self.create_realtime_session(
            processor,
            initial_prompt=first.get("initial_prompt", ""),
            system_prompt=first.get("system_prompt", ""),
            frame_queue_size=first.get("frame_queue_size", frame_queue_size),
            max_tokens_per_turn=first.get("max_tokens_per_turn", max_tokens_per_turn),
            **generate_kwargs,
        )
        session.start()
        forwarder = threading.Thread(target=session.forward_output, args=(output_queue,), daemon=True)
        forwarder.start()
        try:
            while True:
                message = input_queue.get()
                if message.get("stop_online_generate"):
                    break
                if "frame" in message:
                    session.push_frame(message["frame"], message["timestamp"], prompt=message.get("prompt"), drop_oldest=message.get("drop_oldest", True))
                elif message.get("prompt"):
                    session.prompt(message["prompt"])
        finally:
            session.stop()
            forwarder.join(timeout=30)


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple, set)) else [value]


def query_messages(query: dict) -> list:
    """Chat messages of a runner query; the prompt form becomes one user turn with its images and
    videos (placed where `<|image|>`/`<|video|>` appear in the prompt, else before the text)."""
    if "messages" in query or "conversations" in query:
        return query.get("messages") or query["conversations"]
    images, videos = list(query.get("images") or []), list(query.get("videos") or [])
    prompt = query.get("prompt", "")
    content, rest = [], prompt
    if "<|image|>" not in prompt and "<|video|>" not in prompt:
        content += [{"type": "image", "image": i} for i in images] + [{"type": "video", "video": v} for v in videos]
        images, videos = [], []
    for piece in re.split(r"(<\|image\|>|<\|video\|>)", rest):
        if piece == "<|image|>":
            if not images:
                raise ValueError("prompt has more <|image|> placeholders than images")
            content.append({"type": "image", "image": images.pop(0)})
        elif piece == "<|video|>":
            if not videos:
                raise ValueError("prompt has more <|video|> placeholders than videos")
            content.append({"type": "video", "video": videos.pop(0)})
        elif piece:
            content.append({"type": "text", "text": piece})
    if images or videos:
        raise ValueError(f"{len(images)} image(s) and {len(videos)} video(s) have no placeholder in the prompt")
    messages = [{"role": "system", "content": query["system_prompt"]}] if query.get("system_prompt") else []
    return messages + [{"role": "user", "content": content}]


class MossVLRealtimeSession:
    """Realtime streaming over live frames.

    Frames (with timestamps) accumulate in a bounded window; each user prompt (and the initial
    prompt, once the first frame arrives) starts a turn that answers over the frames received so
    far, presented as one video with their real timestamps. Output text pieces are polled with
    `poll_output(timeout)`; `active` turns False after `stop()` once the last turn has finished."""

    def __init__(self, model, processor, initial_prompt, system_prompt, frame_queue_size, max_tokens_per_turn, generate_kwargs):
        self.model, self.processor = model, processor
        self.system_prompt = system_prompt
        self.pending_prompts = [initial_prompt] if initial_prompt else []
        self.frame_queue_size = frame_queue_size
        self.generate_kwargs = {**generate_kwargs, "max_new_tokens": max_tokens_per_turn}
        self.frames, self.timestamps, self.history = [], [], []
        self.outputs: queue.Queue = queue.Queue()
        self.events: queue.Queue = queue.Queue()
        self.stop_event = threading.Event()
        self.worker: Optional[threading.Thread] = None
        self.lock = threading.Lock()

    @property
    def active(self) -> bool:
        return self.worker is not None and self.worker.is_alive()

    def start(self):
        self.worker = threading.Thread(target=self.run, daemon=True)
        self.worker.start()
        return self

    def push_frame(self, frame, timestamp: float, prompt: Optional[str] = None, drop_oldest: bool = True) -> dict:
        """Add a frame; returns {"dropped_oldest": bool, "pending_frames": int}."""
        with self.lock:
            dropped = False
            if len(self.frames) >= self.frame_queue_size:
                if not drop_oldest:
                    raise ValueError(f"frame window full ({self.frame_queue_size} frames)")
                self.frames.pop(0)
                self.timestamps.pop(0)
                dropped = True
            self.frames.append(frame)
            self.timestamps.append(float(timestamp))
            pending = len(self.frames)
        if prompt:
            self.prompt(prompt)
        elif self.pending_prompts:
            self.events.put("turn")
        return {"dropped_oldest": dropped, "pending_frames": pending}

    def prompt(self, text: str):
        if not text:
            raise ValueError("empty prompt")
        with self.lock:
            self.pending_prompts.append(text)
        self.events.put("turn")

    def poll_output(self, timeout: float = 0.1) -> Optional[str]:
        try:
            return self.outputs.get(timeout=timeout)
        except queue.Empty:
            return None

    def forward_output(self, output_queue):
        while self.active or not self.outputs.empty():
            chunk = self.poll_output(0.1)
            if chunk is not None:
                output_queue.put(chunk)

    def stop(self):
        self.events.put("stop")
        if self.worker is not None:
            self.worker.join(timeout=60)

    def run(self):
        while True:
            event = self.events.get()
            if event == "stop":
                return
            with self.lock:
                if not self.pending_prompts or not self.frames:
                    continue
                prompt = self.pending_prompts.pop(0)
                video = {"frames": list(self.frames), "timestamps": list(self.timestamps)}
            try:
                self.answer(prompt, video)
            except Exception as error:  # surfaced to the client as an output line
                logger.warning("realtime turn failed: %s", error)
                self.outputs.put(f"{ERROR_PREFIX}{type(error).__name__}: {error}")

    def answer(self, prompt: str, video: dict):
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": [{"type": "video", "video": video}, {"type": "text", "text": prompt}]})
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True)
        inputs = self.model.to_device(self.processor(text=text, videos=[video], media_kwargs={"min_frames": 1, "max_frames": len(video["frames"])}))
        started = time.monotonic()
        answer = self.model.stream(self.processor, inputs, self.outputs, stop_event=self.stop_event, **self.generate_kwargs)
        logger.info("realtime turn: %d chars in %.2fs", len(answer), time.monotonic() - started)
        self.history.append((prompt, answer))


__all__ = ["MossVLForConditionalGeneration", "MossVLPreTrainedModel", "compute_xrope_positions"]
