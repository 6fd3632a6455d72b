"""Stand-in for the published MOSS-VL checkpoints' modeling module, written for this project.

It reproduces the published module's import that fails under transformers 5.19: ``OutputRecorder`` from
``transformers.utils.generic`` (moved in transformers 5). The standalone runners load this project's reference model
class (``moss_vl_reference.modeling_moss_vl``) instead, with the checkpoint's weights under their own names.
"""

from transformers.modeling_utils import PreTrainedModel
from transformers.utils.generic import OutputRecorder  # noqa: F401

from .configuration_moss_vl import MossVLConfig


class MossVLForConditionalGeneration(PreTrainedModel):
    """Never reached under transformers 5: the import above fails first."""

    config_class = MossVLConfig
