"""Stand-in for the published MOSS-VL checkpoints' processor module, written for this project (not a processor).

Like the published module it imports under transformers 5.19, and its processor's attributes include a video
processor that ``AutoVideoProcessor`` resolves through ``video_processing_moss_vl.py``, which does not import
there. So loading the processor fails exactly where the published one does. Shipped by the ``tiny-real-layout``
checkpoint (``moss_vl_reference.tiny_checkpoint``); this project's processor is ``mossvl_ascend.processor``.
"""

from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
from transformers.processing_utils import ProcessorMixin


class MossVLImageProcessorFast(Qwen2VLImageProcessor):
    multi_image_max_pixels = None


class MossVLProcessor(ProcessorMixin):
    attributes = ["image_processor", "tokenizer", "video_processor"]
    image_processor_class = "AutoImageProcessor"
    video_processor_class = "AutoVideoProcessor"
    tokenizer_class = "AutoTokenizer"

    def __init__(self, image_processor=None, tokenizer=None, video_processor=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, video_processor, chat_template=chat_template)
