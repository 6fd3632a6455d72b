"""The oracle of the reference model's realtime stream: a cold prefill of the stream's final token sequence.

The model's ordinary full forward over every token the stream holds, with every frame's pixels and, per row, the
frames that row may see (a prefix; with the frame window on, the frames still in the window when the row was
written). Every token the stream chose must be the greedy pick of the cold logits of the row before it, and the
stream's logits must equal the cold ones within 1e-5.
"""

import re

import torch
from PIL import Image


def cold_logits(model, processor, tokens: list[int], images: list[Image.Image], row_frames) -> torch.Tensor:
    """The model's plain forward over `tokens`; row_frames(row, frames_so_far) -> visible frame indexes."""
    ids = torch.tensor([tokens])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if images:
        image_processor = processor.image_processor
        patches = [image_processor.realtime_frame(image) for image in images]
        pad = model.config.image_token_id
        seen = torch.cumsum(ids[0] == pad, 0).tolist()
        mask = torch.ones(1, 1, len(tokens), len(images), dtype=torch.bool)
        for row, count in enumerate(seen):
            for frame in row_frames(row, count):
                mask[0, 0, row, frame] = False
        inputs.update(
            pixel_values=torch.cat([p for p, _ in patches]),
            grid_thw=torch.tensor([g for _, g in patches]),
            media_nums_per_sample=[len(images)],
            cross_attention_mask=mask,
        )
    with torch.no_grad():
        return model(**inputs).logits[0]


def greedy_pick(logits: torch.Tensor, tokenizer) -> int:
    """Greedy over the tokens a realtime stream may say: no <|...|> control token but <|silence|>, no row past
    the tokenizer's vocabulary."""
    masked = logits.clone()
    for token, token_id in tokenizer.get_added_vocab().items():
        if re.fullmatch(r"<\|[^|]+\|>", token) and token != "<|silence|>":
            masked[token_id] = float("-inf")
    masked[len(tokenizer) :] = float("-inf")
    return int(masked.argmax())


def assert_stream_equals_cold(model, processor, session, images, row_frames=lambda row, count: range(count)):
    """``session`` (closed, recorded with ``record_logits=True``) equals a cold prefill of its final sequence."""
    tokens = session.stream.tokens
    cold = cold_logits(model, processor, tokens, images, row_frames)
    assert len(session.step_logits) >= 3
    for row, logits in session.step_logits:
        torch.testing.assert_close(logits, cold[row], rtol=1e-5, atol=1e-5)
        if row + 1 < len(tokens):
            assert tokens[row + 1] == greedy_pick(cold[row], processor.tokenizer), f"token after row {row}"
