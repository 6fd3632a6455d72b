"""The chat template MOSS-VL prompts are rendered with, and the realtime checkpoints' default system prompt.

Media stay one placeholder each in the rendered text (``<|image|>``, ``<|video|>``); the processor expands them.
"""

# Our wording of the realtime checkpoints' default system prompt: perceive continuously, answer and update the
# answer as the scene changes, and output <|silence|> when there is nothing (more) to say.
DEFAULT_REALTIME_SYSTEM_PROMPT = (
    "You are watching a live video stream frame by frame. Keep perceiving it continuously; answer the user "
    "when what you see lets you, and update your answer when the scene changes. When you cannot answer yet or "
    "have finished answering, output <|silence|> directly."
)


def chat_template(default_system_prompt: str = "") -> str:
    """The Qwen-style chat template (media placeholders inline, no separators).

    Without a default system prompt an empty system turn is left out: exactly what sglang's "moss-vl" conversation
    template renders for an OpenAI chat. With one (the realtime checkpoints'), every conversation opens with a
    system turn, that prompt when none or an empty one is given."""
    if default_system_prompt:
        opening = (
            "{%- if not messages or messages[0]['role'] != 'system' -%}"
            "{{- '<|im_start|>system\n" + default_system_prompt + "<|im_end|>\n' -}}{%- endif -%}"
        )
        system_rule = (
            "{%- if message['role'] == 'system' and text == '' -%}{%- set text = '"
            + default_system_prompt
            + "' -%}{%- endif -%}{%- if true -%}"
        )
    else:
        opening, system_rule = "", "{%- if not (message['role'] == 'system' and text == '') -%}"
    return (
        opening + "{%- for message in messages -%}"
        "{%- if message['content'] is string -%}{%- set text = message['content'] -%}"
        "{%- else -%}{%- set text = namespace(v='') -%}"
        "{%- for item in message['content'] -%}"
        "{%- if item['type'] == 'text' -%}{%- set text.v = text.v + item['text'] -%}"
        "{%- elif item['type'] in ('image', 'image_url') -%}{%- set text.v = text.v + '<|image|>' -%}"
        "{%- elif item['type'] in ('video', 'video_url') -%}{%- set text.v = text.v + '<|video|>' -%}"
        "{%- endif -%}{%- endfor -%}{%- set text = text.v -%}{%- endif -%}"
        + system_rule
        + "{{- '<|im_start|>' + message['role'] + '\n' + text + '<|im_end|>\n' -}}"
        "{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
    )


CHAT_TEMPLATE = chat_template()
REALTIME_CHAT_TEMPLATE = chat_template(DEFAULT_REALTIME_SYSTEM_PROMPT)
