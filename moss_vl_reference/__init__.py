"""Reference MOSS-VL for transformers, written for this project.

`configuration_moss_vl`, `processing_moss_vl` and `modeling_moss_vl` are the remote code that
`tiny_checkpoint` copies into every checkpoint it builds (they import only each other,
relatively, plus torch/transformers/PIL/numpy/av). The model is the token-for-token oracle for
the sglang engine and the model behind the standalone runners.
"""
