"""Stand-in for the published MOSS-VL checkpoints' config class (transformers 4.57 style), written for this project.

Shipped by the ``tiny-real-layout`` checkpoint (``moss_vl_reference.tiny_checkpoint``) so that sglang builds its
config the way it builds a published checkpoint's: through this remote class, from a config.json in the 4.57 form.
Like the published class it keeps ``rope_scaling`` as given, calls the 4.x ``rope_config_validation`` helper
(deprecated but still present in transformers 5.19, which converts the dict in place) and stores
``vision_seq_pad_multiple``. It imports and loads under 5.19; what does not is the checkpoint's processor and model
code (``video_processing_moss_vl.py``, ``modeling_moss_vl.py`` here).
"""

from transformers.configuration_utils import PretrainedConfig
from transformers.modeling_rope_utils import rope_config_validation


class MossVLVisionConfig(PretrainedConfig):
    model_type = "moss_vl_vision"
    base_config_key = "vision_config"

    def __init__(self, depth=27, hidden_size=1152, num_heads=16, **kwargs):
        super().__init__(**kwargs)
        self.depth = depth
        self.hidden_size = hidden_size
        self.num_heads = num_heads


class MossVLTextConfig(PretrainedConfig):
    model_type = "moss_vl_text"
    base_config_key = "text_config"

    def __init__(self, rope_theta=5000000.0, rope_scaling=None, cross_attention_layers=None, **kwargs):
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        rope_config_validation(self, ignore_keys={"mrope_section", "mrope_interleaved"})
        self.cross_attention_layers = cross_attention_layers
        super().__init__(**kwargs)


class MossVLConfig(PretrainedConfig):
    model_type = "moss_vl"
    sub_configs = {"vision_config": MossVLVisionConfig, "text_config": MossVLTextConfig}

    def __init__(self, text_config=None, vision_config=None, vision_seq_pad_multiple=8, **kwargs):
        self.text_config = MossVLTextConfig(**(text_config or {}))
        self.vision_config = MossVLVisionConfig(**(vision_config or {}))
        self.vision_seq_pad_multiple = vision_seq_pad_multiple
        super().__init__(**kwargs)
