"""Served video sampling, bad media and media access: one server (page 128, fp32), the tiny checkpoint.

Sampling oracle: the published ``video_processing_moss_vl.py`` (``Joiin0392/moss-npu-adaptations``,
``vlm/MOSS-VL-Realtime-0708/``, commit 601fc6fa; line numbers as ``tests/test_processor_real_table.py`` cites them):
a whole video keeps ``n`` frames, ``n = ceil(duration * fps - 1e-6)`` (VIDEO:669-673) or, in
``calculate_num_frames``' fixed-count branch right after, ``num_frames``, clamped to
``[min_frames, min(max_frames, N)]``, at ``unique(int32(linspace(0, N - 1, n)))`` (VIDEO:1017-1019), stamped
``index / average_fps`` (PROC:627-634). The table below applies that by hand to ``VIDEO`` (32 frames at 4 fps, 8 s:
average fps 4). Each answer is then compared token for token with the reference model (fp32, greedy) given exactly
those decoded frames and stamps as a frame list, so the server's sampling is checked by frames, not by its own code.

Bad media: each a 400 with a message, the server healthy after and ``/v1/loads`` idle. Access: the server allows one
directory (``MOSSVL_ALLOWED_LOCAL_MEDIA_PATH``); everything else local answers the text a missing file does.
"""

from __future__ import annotations

import json
import threading
from fractions import Fraction
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
from PIL import Image

from moss_vl_reference.queries_moss_vl import file_data_url
from serving import eval_set, evaluate
from serving.launch import free_port
from support.loopback import stalling_port
from support.serving import ASSETS, GREEDY, MAX_TOKENS, TOKEN_IDS, kv_load, load_reference, reference_ids, wait_for_load
from support.videos import decoded_frames, write_video

pytestmark = pytest.mark.timeout(900)

VIDEO_FRAMES, VIDEO_FPS = 32, 4
QUESTION = "What moves in this video?"
QUESTION_PART = {"type": "text", "text": QUESTION}
# name -> (what the request asks, the frame indices the published rule keeps of VIDEO)
SAMPLINGS = {
    "num_frames_2": ({"media_io_kwargs": {"video": {"num_frames": 2}}}, [0, 31]),
    "num_frames_8": ({"media_io_kwargs": {"video": {"num_frames": 8}}}, [0, 4, 8, 13, 17, 22, 26, 31]),
    "num_frames_16": (
        {"media_io_kwargs": {"video": {"num_frames": 16}}},
        [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 31],
    ),
    "fps_0.5": ({"media_io_kwargs": {"video": {"fps": 0.5}}}, [0, 10, 20, 31]),  # ceil(8 * 0.5) = 4
    "fps_2": ({"video_config": {"fps": 2}}, [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 31]),
    "part_fps_2_max_frames_5": ({"part": {"fps": 2, "max_frames": 5}}, [0, 7, 15, 23, 31]),
    # the part's rate wins over the request's num_frames; the server's default 1 fps gives 8, max_frames 3 keeps 3
    "part_max_frames_3_over_request": (
        {"part": {"max_frames": 3}, "mm_processor_kwargs": {"video_fps": 1}},
        [0, 15, 31],
    ),
    "server_default_1_fps": ({}, [0, 4, 8, 13, 17, 22, 26, 31]),  # ceil(8 * 1.0) = 8
}


def stamped_prompt_text(indices: list[int]) -> str:
    return "".join(f"<|time_start|>{index / VIDEO_FPS:.1f} seconds<|time_end|><|image_pad|>" for index in indices)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """The allowed directory: the test video and the broken files; a private directory beside it."""
    root = tmp_path_factory.mktemp("served-media")
    allowed, private = root / "allowed", root / "private"
    allowed.mkdir()
    private.mkdir()
    write_video(allowed / "clip.mp4", VIDEO_FRAMES, VIDEO_FPS)
    (allowed / "notes.mp4").write_text("a text file, not a video")
    whole = (allowed / "clip.mp4").read_bytes()
    (allowed / "truncated.mp4").write_bytes(whole[: len(whole) // 2])
    write_video(allowed / "zero_frames.mp4", 0, VIDEO_FPS)
    write_video(allowed / "ten_hours.mp4", 3600, Fraction(1, 10))  # one frame every 10 s: 3600 frames, 10 hours
    Image.open(ASSETS / "square_64.png").save(allowed / "square.png")
    (private / "secret.png").write_bytes((ASSETS / "square_64.png").read_bytes())
    (allowed / "escape.png").symlink_to(private / "secret.png")
    return allowed, private


@pytest.fixture(scope="module")
def reference(checkpoint, media):
    """Prompt and completion ids of the reference model given each sampling's frames (decoded here) and stamps."""
    allowed, _ = media
    frames = [Image.fromarray(frame) for frame in decoded_frames(allowed / "clip.mp4")]
    assert len(frames) == VIDEO_FRAMES
    model, processor = load_reference(checkpoint)
    expected = {}
    for name, (_, indices) in SAMPLINGS.items():
        video = {"frames": [frames[i] for i in indices], "timestamps": [i / VIDEO_FPS for i in indices]}
        messages = [
            {"role": "user", "content": [{"type": "video", "video": video}, {"type": "text", "text": QUESTION}]}
        ]
        expected[name] = reference_ids(model, processor, messages)
    return expected


# The server reads media only from the allowed directory; URL fetches time out after 2 s; a video of more than 1000
# frames is refused undecoded.
@pytest.fixture(scope="module")
def server(checkpoint, media, reference, server_pool):
    allowed, _ = media
    args = ["--dtype", "float32", "--skip-server-warmup", "--page-size", "128"]
    args += ["--mm-process-config", '{"video": {"max_source_frames": 1000}}']
    env = {"MOSSVL_ALLOWED_LOCAL_MEDIA_PATH": str(allowed), "REQUEST_TIMEOUT": "2"}
    with server_pool.lease(checkpoint, args, env=env, name="test-serving-media") as running:
        yield running


@pytest.fixture(scope="module")
def model_name(server):
    return requests.get(f"{server.base_url}/v1/models", timeout=30).json()["data"][0]["id"]


def chat(server, model_name, content: list[dict], **fields) -> requests.Response:
    body = {"model": model_name, "messages": [{"role": "user", "content": content}], **GREEDY, **TOKEN_IDS, **fields}
    return requests.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=300)


def video_part(url: str, **fields) -> dict:
    return {"type": "video_url", "video_url": {"url": url, **fields}}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_a_video_is_sampled_as_asked_and_equals_the_reference_on_those_frames(
    server, model_name, media, reference, processor, name
):
    allowed, _ = media
    asked, indices = SAMPLINGS[name]
    fields = {key: value for key, value in asked.items() if key != "part"}
    response = chat(
        server, model_name, [video_part(f"file://{allowed}/clip.mp4", **asked.get("part", {})), QUESTION_PART], **fields
    )
    assert response.status_code == 200, response.text[:500]
    choice = response.json()["choices"][0]
    expected_prompt, expected_completion = reference[name]
    prompt_ids = choice["prompt_token_ids"]
    assert prompt_ids == expected_prompt, "another prompt (frames or stamps) than the reference's"
    assert stamped_prompt_text(indices) in processor.tokenizer.decode(prompt_ids, skip_special_tokens=False)
    assert len(choice["response_token_ids"]) == MAX_TOKENS
    assert choice["response_token_ids"] == expected_completion


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"media_io_kwargs": {"video": {"num_frames": 0}}}, "media_io_kwargs.video.num_frames"),
        ({"media_io_kwargs": {"video": {"frames": 8}}}, "media_io_kwargs.video.frames"),
        ({"media_io_kwargs": {"video": {"num_frames": 8, "fps": 1}}}, "mutually exclusive"),
        ({"media_io_kwargs": {"video": {"num_frames": 300}}}, "num_frames=300 is more than max_frames=256"),
        # the server's max_frames (256) is the operator's cap: a request's max_frames may lower it, never lift it
        ({"part": {"max_frames": 300}}, "max_frames=300 is more than this server's max_frames=256"),
        (
            {"mm_processor_kwargs": {"num_frames": 257, "max_frames": 257}},
            "max_frames=257 is more than this server's max_frames=256",
        ),
        ({"video_config": {"stride": 2}}, "video_config.stride"),
        ({"mm_processor_kwargs": {"do_resize": False}}, "mm_processor_kwargs.do_resize"),
        ({"part": {"max_tokens_per_frame": 16}}, "video_url.max_tokens_per_frame"),
    ],
)
def test_a_sampling_field_that_cannot_be_honoured_answers_400_naming_it(server, model_name, media, fields, named):
    allowed, _ = media
    part = video_part(f"file://{allowed}/clip.mp4", **fields.pop("part", {}))
    response = chat(server, model_name, [part, QUESTION_PART], **fields)
    assert response.status_code == 400, response.text[:500]
    assert named in response.json()["message"]


@pytest.fixture(scope="module")
def stalling_url():
    """A loopback URL whose server accepts the connection and never answers."""
    with stalling_port() as port:
        yield f"http://127.0.0.1:{port}/clip.mp4"


BAD_VIDEOS = {
    "missing file": ("file://{allowed}/missing.mp4", "not allowed or not found"),
    "directory": ("file://{allowed}", "not allowed or not found"),
    "text file renamed .mp4": ("file://{allowed}/notes.mp4", "cannot decode video"),
    "truncated mp4": ("file://{allowed}/truncated.mp4", "cannot decode video"),
    "zero frames": ("file://{allowed}/zero_frames.mp4", "no video stream"),
    "ten hours, over the frame budget": ("file://{allowed}/ten_hours.mp4", "max_source_frames=1000"),
    "unreachable url": ("http://127.0.0.1:{closed_port}/clip.mp4", "not allowed or not found"),
    "url stalling past the timeout": ("{stalling_url}", "not allowed or not found"),
}


@pytest.mark.parametrize("case", list(BAD_VIDEOS))
def test_a_bad_video_answers_400_and_the_server_stays_healthy_and_idle(server, model_name, media, stalling_url, case):
    allowed, _ = media
    template, words = BAD_VIDEOS[case]
    url = template.format(allowed=allowed, closed_port=free_port(), stalling_url=stalling_url)
    response = chat(server, model_name, [video_part(url), QUESTION_PART])
    assert response.status_code == 400, response.text[:500]
    assert words in response.json()["message"]
    assert requests.get(f"{server.base_url}/health", timeout=30).status_code == 200
    load = wait_for_load(server, lambda load: load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0)
    assert load["num_running_reqs"] == load["num_waiting_reqs"] == load["num_used_tokens"] == 0


def refusal_text(response: requests.Response, reference: str) -> str:
    assert response.status_code == 400, response.text[:500]
    return response.json()["message"].replace(repr(reference), "<reference>")


def test_local_media_outside_the_allowed_directory_is_refused_as_if_missing(server, model_name, media):
    """Stock prefixes an image's error with where it was loading; within a modality the text is one."""
    allowed, private = media
    missing = f"file://{allowed}/missing.png"
    as_missing_image = refusal_text(chat(server, model_name, [image_part(missing), QUESTION_PART]), missing)
    as_missing_video = refusal_text(chat(server, model_name, [video_part(missing), QUESTION_PART]), missing)
    assert as_missing_video == "media <reference> is not allowed or not found"
    assert as_missing_image.endswith(as_missing_video)
    outside = [
        "file:///etc/hostname",
        "/etc/hostname",
        f"file://{allowed}/../private/secret.png",
        f"file://{allowed}/escape.png",  # a symlink inside the allowed directory to a file outside it
        str(private / "secret.png"),
    ]
    for reference in outside:
        as_image = chat(server, model_name, [image_part(reference), QUESTION_PART])
        as_video = chat(server, model_name, [video_part(reference), QUESTION_PART])
        assert refusal_text(as_image, reference) == as_missing_image, reference
        assert refusal_text(as_video, reference) == as_missing_video, reference
    inside = chat(server, model_name, [image_part(f"file://{allowed}/square.png"), QUESTION_PART])
    assert inside.status_code == 200, inside.text[:500]
    as_data_url = chat(server, model_name, [image_part(file_data_url(allowed / "square.png")), QUESTION_PART])
    assert inside.json()["choices"][0]["response_token_ids"] == as_data_url.json()["choices"][0]["response_token_ids"]
    assert kv_load(server)["num_used_tokens"] == 0


# ---- make eval's evaluator against this server


class StoppingProxy(ThreadingHTTPServer):
    """A loopback stand-in for a server that stops mid-run: it forwards requests to ``target`` and, once it has
    answered ``chats`` chat completions, drops every later connection without a response, as a server killed
    mid-run does. (Closing its port from a thread raced the client's next request, which was sometimes still
    answered.)"""

    def __init__(self, target: str, chats: int):
        self.target, self.chats_left = target, chats
        super().__init__(("127.0.0.1", 0), ForwardingHandler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class ForwardingHandler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.forward(requests.get(f"{self.server.target}{self.path}", timeout=60))

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.server.chats_left == 0:
            self.close_connection = True
            return
        self.server.chats_left -= 1
        headers = {"Content-Type": self.headers["Content-Type"]}
        self.forward(requests.post(f"{self.server.target}{self.path}", data=body, headers=headers, timeout=300))

    def forward(self, response: requests.Response) -> None:
        self.send_response(response.status_code)
        self.send_header("Content-Type", response.headers.get("Content-Type", "application/json"))
        self.send_header("Content-Length", str(len(response.content)))
        self.end_headers()
        self.wfile.write(response.content)

    def log_message(self, *args):
        pass


def test_the_evaluator_scores_every_sample_and_equals_the_transformers_runner(server, media, checkpoint, capsys):
    allowed, _ = media
    out = allowed / "eval"
    assert evaluate.main(["--base-url", server.base_url, "--model-path", str(checkpoint), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| all | 6 |" in printed
    assert "served answers equal to the transformers runner's: 6 of 6" in printed
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [line["question_id"] for line in lines] == [row["question_id"] for row in eval_set.questions()]
    assert all(line["error"] is None and line["response"] == line["runner_response"] for line in lines)


def test_the_evaluator_exits_non_zero_and_counts_the_samples_a_stopped_server_failed(server, media, capsys):
    allowed, _ = media
    proxy = StoppingProxy(server.base_url, chats=2)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    out = allowed / "eval-stopped"
    try:
        status = evaluate.main(["--base-url", proxy.url, "--no-runner", "--out", str(out), "--timeout", "30"])
    finally:
        proxy.shutdown()
        proxy.server_close()
    printed = capsys.readouterr().out
    assert status == 1
    assert "4 of 6 samples failed" in printed
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [line["error"] is None for line in lines] == [True, True, False, False, False, False]
