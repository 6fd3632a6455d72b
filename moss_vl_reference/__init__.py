"""Reference MOSS-VL for transformers, written for this project.

The remote code that `tiny_checkpoint` copies into every checkpoint it builds (the files import only each other,
relatively, plus torch/transformers/PIL/numpy/av):
  `configuration_moss_vl` (configs), `processing_moss_vl` (processor), `modeling_moss_vl` (the model math),
  `generation_moss_vl` (generate and the runner APIs the model class inherits), `realtime_moss_vl` (the realtime
  stream: one growing token sequence, its session API and queue loop), `queries_moss_vl` (torch-free:
  runner queries, the stream protocol, data URLs; also imported by the runners, the demo and the tests).
The model is the token-for-token oracle for the sglang engine and the model behind the standalone runners.
"""
