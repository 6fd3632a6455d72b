"""The MOSS-VL attention core, in layers that each import only the ones below:

1. math (pure torch, no sglang): :mod:`.primitives` (attention with per-row log-sum-exp, one implementation per
   device) and :mod:`.blocks` (frame-causal block plan over per-row encoder boundaries, LSE merge in fp32);
2. batch: :mod:`.metadata` (one typed object per forward: lengths, boundaries, plans, padded slot tables, built
   once and shared by every layer) and :mod:`.core` (one layer's attention for a whole batch, few calls per layer);
3. sglang adapter: :mod:`.sglang_layer` (one RadixAttention layer of a ForwardBatch: KV write, then the core).
The sglang hooks that call it live in the patch modules (``native_attention``, ``ascend_backend``,
``cpu_attention``, ``compact_visibility``).
"""
