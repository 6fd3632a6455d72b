"""Stand-in for the published MOSS-VL checkpoints' video processor module, written for this project.

It reproduces the published module's imports that fail under transformers 5.19 (sglang 0.5.23's pin): the
``joblib`` and ``torchcodec`` packages (transformers' remote-code loader refuses the module when they are missing)
and ``BASE_VIDEO_PROCESSOR_DOCSTRING``, which transformers 5 no longer has. It is never meant to load here.
"""

from joblib import Parallel  # noqa: F401
from torchcodec.decoders import VideoDecoder  # noqa: F401
from transformers.video_processing_utils import BASE_VIDEO_PROCESSOR_DOCSTRING, BaseVideoProcessor  # noqa: F401


class MossVLVideoProcessor(BaseVideoProcessor):
    """Never reached under transformers 5: the imports above fail first."""
