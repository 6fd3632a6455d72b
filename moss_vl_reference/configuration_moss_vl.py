"""MOSS-VL configuration: a text decoder with gated cross-attention layers and a vision tower.

Field names follow the public MOSS-VL checkpoints and what stock sglang's `models/moss_vl.py`
reads, so a checkpoint saved with these classes loads in sglang unchanged.
"""

from transformers import PretrainedConfig

# 3-D interleaved MRoPE ("XRoPE") over head_dim/2 rotary pairs, as in the real checkpoints.
DEFAULT_ROPE_SCALING = {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True}


class MossVLVisionConfig(PretrainedConfig):
    """Vision tower: Conv3d patch embed, learned 2-D position table, `depth` ViT blocks,
    one merger fed by the final state and the `deepstack_visual_indexes` block outputs.

    Args:
        depth: number of ViT blocks.
        hidden_size: width of the ViT blocks.
        hidden_act: activation of the ViT MLPs (a transformers ACT2FN name).
        intermediate_size: inner width of the ViT MLPs.
        num_heads: attention heads per ViT block (head dim = hidden_size / num_heads, split in two halves for
            the row and column rotary angles).
        in_channels: image channels (3, RGB).
        patch_size: side in pixels of one square patch.
        spatial_merge_size: the merger folds a spatial_merge_size x spatial_merge_size window of patches into
            one vision token (so one frame of h x w patches gives h*w / merge^2 tokens, plus a separator).
        temporal_patch_size: consecutive frames stacked into one patch (1: every frame is its own).
        out_hidden_size: width of the merged vision tokens, equal to the text decoder's hidden_size.
        num_position_embeddings: size of the learned position table, a square number (side x side), sampled
            bilinearly at each frame's patch grid.
        deepstack_visual_indexes: ViT blocks whose outputs join the final state in the merger (never the last
            block: stock sglang 0.5.23 cannot serve such a config, see DESIGN.md).
        initializer_range: std of the normal initialiser.
    """

    model_type = "moss_vl_vision"
    base_config_key = "vision_config"

    def __init__(
        self,
        depth=27,
        hidden_size=1152,
        hidden_act="gelu_pytorch_tanh",
        intermediate_size=4304,
        num_heads=16,
        in_channels=3,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=1,
        out_hidden_size=4096,
        num_position_embeddings=2304,
        deepstack_visual_indexes=(8, 16, 24),
        initializer_range=0.02,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.depth = depth
        self.hidden_size = hidden_size
        self.hidden_act = hidden_act
        self.intermediate_size = intermediate_size
        self.num_heads = num_heads
        self.in_channels = in_channels
        self.patch_size = patch_size
        self.spatial_merge_size = spatial_merge_size
        self.temporal_patch_size = temporal_patch_size
        self.out_hidden_size = out_hidden_size
        self.num_position_embeddings = num_position_embeddings
        self.deepstack_visual_indexes = list(deepstack_visual_indexes)
        self.initializer_range = initializer_range


class MossVLTextConfig(PretrainedConfig):
    """Qwen3-shaped decoder; layers listed in `cross_attention_layers` are gated cross-attention
    blocks instead of self-attention blocks.

    Args:
        vocab_size: rows of the token embedding and the LM head.
        hidden_size: model width.
        intermediate_size: inner width of the SiLU-gated MLPs.
        num_hidden_layers: decoder layers, self- and cross-attention together.
        num_attention_heads: query heads per attention layer.
        num_key_value_heads: key/value heads (GQA: query head h reads key head h // (heads / kv_heads)).
        head_dim: width of one head (q/k RMSNorm is per head).
        hidden_act: activation of the MLPs.
        max_position_embeddings: longest position the model was trained for.
        rms_norm_eps: epsilon of every RMSNorm.
        rope_theta: rotary base, used when the rope dict does not carry its own.
        rope_scaling: the rope dict of an upstream config.json: ``mrope_section`` [t, h, w] counts of rotary
            pairs per axis (summing to head_dim / 2), ``mrope_interleaved`` True (pairs cycle t, h, w).
        rope_parameters: the same dict under transformers 5's name (a saved config carries this one).
        attention_bias: bias on the q/k/v/o projections.
        cross_attention_layers: indexes of the gated cross-attention layers.
        initializer_range: std of the normal initialiser.
        bos_token_id / eos_token_id / pad_token_id: special token ids of the tokenizer.
        tie_word_embeddings: share the embedding and LM head weights (False for MOSS-VL).
        cross_attention_implementation (kwarg, optional): attention implementation of the cross-attention
            layers only (eager or sdpa), overriding the model-wide ``attn_implementation``.
    """

    model_type = "moss_vl_text"
    base_config_key = "text_config"

    def __init__(
        self,
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        hidden_act="silu",
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        rope_theta=5000000.0,
        rope_scaling=None,
        rope_parameters=None,
        attention_bias=False,
        cross_attention_layers=(2, 6, 10, 14, 18, 22, 26, 30, 34, 38, 42, 46),
        initializer_range=0.02,
        bos_token_id=151643,
        eos_token_id=151645,
        pad_token_id=None,
        tie_word_embeddings=False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.attention_bias = attention_bias
        self.cross_attention_layers = list(cross_attention_layers)
        self.initializer_range = initializer_range
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.tie_word_embeddings = tie_word_embeddings
        # transformers 5 aliases `rope_scaling` to `rope_parameters`; a saved config carries the
        # latter, an upstream config.json the former. Both name the same dict.
        rope = dict(rope_parameters or rope_scaling or DEFAULT_ROPE_SCALING)
        rope.setdefault("rope_theta", rope_theta)
        self.rope_theta = rope["rope_theta"]
        self.rope_scaling = rope


class MossVLConfig(PretrainedConfig):
    """Top-level MOSS-VL config: `text_config`, `vision_config` and the special token ids.

    Args:
        text_config: a MossVLTextConfig or its dict (default: the 11B model's decoder).
        vision_config: a MossVLVisionConfig or its dict (default: the 11B model's vision tower).
        image_token_id: ``<|image_pad|>``, one per frame in the expanded prompt (images and video frames alike);
            it opens the frame's XRoPE position block.
        video_token_id: ``<|video_pad|>`` (kept for checkpoint compatibility; frames use image_token_id).
        vision_start_token_id / vision_end_token_id: ``<|vision_start|>`` / ``<|vision_end|>`` around a video's
            frames and around each realtime frame (an image's ``<|image_pad|>`` is bare).
        tie_word_embeddings: share the embedding and LM head weights (False for MOSS-VL).
    """

    model_type = "moss_vl"
    sub_configs = {"text_config": MossVLTextConfig, "vision_config": MossVLVisionConfig}

    def __init__(
        self,
        text_config=None,
        vision_config=None,
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        tie_word_embeddings=False,
        **kwargs,
    ):
        if isinstance(text_config, dict):
            text_config = MossVLTextConfig(**text_config)
        self.text_config = text_config if text_config is not None else MossVLTextConfig()
        if isinstance(vision_config, dict):
            vision_config = MossVLVisionConfig(**vision_config)
        self.vision_config = vision_config if vision_config is not None else MossVLVisionConfig()
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id
        self.vision_start_token_id = vision_start_token_id
        self.vision_end_token_id = vision_end_token_id
        self.tie_word_embeddings = tie_word_embeddings
        super().__init__(**kwargs)
