"""Which media a client may make the server read (``mossvl_ascend.media.access``) and how a request's video sampling
fields reduce to the processor's values (``mossvl_ascend.media.sampling``), without a server.

Oracles: vLLM's rule for local media (refused unless under a directory the operator names; resolved paths, so ``..``
and symlinks cannot leave it), one message for "not allowed" and "not found"; real loopback sockets for the URL
failures; for sampling, the precedence the docs state (part > request > server, the rate whole from one level) and
the published ``calculate_num_frames`` (``num_frames`` and ``fps`` mutually exclusive).
"""

from __future__ import annotations

import time

import pytest
from sglang.srt.utils.common import configure_media_url_security

from mossvl_ascend.media import access, sampling
from serving.launch import free_port
from support.loopback import stalling_port

JPEG_BASE64 = "/9j/4AAQSkZJRgABAQAAAQABAAD/2wBDAAMCAgICAgMCAgIDAwMDBAYEBAQEBAgGBgUGCQgKCgkICQkKDA8MCgsOCwkJDRENDg8QEBEQ"


@pytest.fixture
def allowed(tmp_path, monkeypatch):
    """An allowed directory holding ``clip.mp4``, beside a directory that is not allowed holding ``secret.mp4``."""
    inside, outside = tmp_path / "media", tmp_path / "private"
    inside.mkdir()
    outside.mkdir()
    (inside / "clip.mp4").write_bytes(b"video")
    (outside / "secret.mp4").write_bytes(b"secret")
    monkeypatch.setenv(access.ALLOWED_LOCAL_MEDIA_ENV, str(inside))
    return inside, outside


def refusal(reference: str) -> str:
    with pytest.raises(access.MediaNotAvailable) as refused:
        access.admit_local(access.classify(reference))
    return str(refused.value).replace(repr(reference), "<reference>")


@pytest.mark.parametrize(
    "reference, kind",
    [
        ("file:///etc/hostname", "local"),
        ("/etc/hostname", "local"),
        ("clips/cat.mp4", "local"),
        ("https://example.org/a.mp4", "url"),
        ("HTTP://example.org/a.png", "url"),
        ("data:image/png;base64,iVBORw0KGgo=", "inline"),
        (JPEG_BASE64, "inline"),  # raw base64 of a JPEG starts with "/": not a path
    ],
)
def test_references_are_classified(reference, kind):
    assert access.classify(reference).kind == kind


@pytest.mark.parametrize(
    "reference, path",
    [
        ("file:///data/a b.mp4", "/data/a b.mp4"),  # lmms-eval's form: not percent-encoded
        ("file:///data/a%20b.mp4", "/data/a b.mp4"),
        ("file://localhost/data/a.mp4", "/data/a.mp4"),
        ("file://server/data/a.mp4", "/data/a.mp4"),  # stock reads the path on this machine, so is it checked
        ("/data/a.mp4", "/data/a.mp4"),
    ],
)
def test_a_local_reference_names_the_path_stock_would_read(reference, path):
    assert access.classify(reference).path == path


def test_by_default_no_local_file_is_readable_and_the_text_equals_a_missing_files(allowed, monkeypatch):
    inside, _ = allowed
    missing = refusal(str(inside / "missing.mp4"))
    monkeypatch.delenv(access.ALLOWED_LOCAL_MEDIA_ENV)
    assert refusal("file:///etc/hostname") == refusal("/etc/hostname") == missing
    assert missing == "media <reference> is not allowed or not found"
    assert refusal(str(inside / "clip.mp4")) == missing  # unset: even the formerly allowed file


def test_a_file_inside_an_allowed_directory_is_read_by_its_resolved_path(allowed):
    inside, _ = allowed
    assert access.admit_local(access.classify(f"file://{inside}/clip.mp4")) == str((inside / "clip.mp4").resolve())
    assert access.admit_local(access.classify(f"{inside}/./clip.mp4")) == str((inside / "clip.mp4").resolve())


def test_dot_dot_symlink_and_directory_escapes_are_refused(allowed):
    inside, outside = allowed
    (inside / "link.mp4").symlink_to(outside / "secret.mp4")
    (inside / "inner_link.mp4").symlink_to(inside / "clip.mp4")
    (inside / "linked_dir").symlink_to(outside)
    missing = refusal(str(inside / "missing.mp4"))
    assert refusal(f"{inside}/../private/secret.mp4") == missing
    assert refusal(str(inside / "link.mp4")) == missing
    assert refusal(str(inside / "linked_dir" / "secret.mp4")) == missing
    assert refusal(str(inside)) == missing  # a directory is not a file
    assert access.admit_local(access.classify(str(inside / "inner_link.mp4"))) == str((inside / "clip.mp4").resolve())


def test_several_directories_are_separated_like_path(allowed, monkeypatch):
    inside, outside = allowed
    monkeypatch.setenv(access.ALLOWED_LOCAL_MEDIA_ENV, f"{inside}:{outside}")
    assert access.admit_local(access.classify(str(outside / "secret.mp4"))) == str((outside / "secret.mp4").resolve())


@pytest.fixture
def stalling_server():
    with stalling_port() as port:
        yield port


def url_refusal(url: str) -> str:
    with pytest.raises(access.MediaNotAvailable) as refused:
        access.fetch_url(access.classify(url))
    return str(refused.value)


def test_unreachable_stalled_and_refused_urls_get_one_text(stalling_server, monkeypatch):
    monkeypatch.setenv(access.URL_TIMEOUT_ENV, "1")
    closed = f"http://127.0.0.1:{free_port()}/clip.mp4"
    assert url_refusal(closed) == f"media {closed!r} is not allowed or not found"
    started = time.monotonic()
    stalled = f"http://127.0.0.1:{stalling_server}/clip.mp4"
    assert url_refusal(stalled) == f"media {stalled!r} is not allowed or not found"
    assert time.monotonic() - started < 5
    configure_media_url_security(["media.example.org"])  # what sglang's --allowed-media-domains sets at start-up
    try:
        outside = f"http://127.0.0.1:{stalling_server}/clip.mp4"
        started = time.monotonic()
        assert url_refusal(outside) == f"media {outside!r} is not allowed or not found"
        assert time.monotonic() - started < 0.5  # refused before any connection
    finally:
        configure_media_url_security([])


# ---- sampling


def levels(media_io=None, video_config=None, mm_kwargs=None, part=None, long_side=None) -> dict:
    request = sampling.request_level(
        {**(video_config or {}), **({sampling.MEDIA_IO_KWARGS_KEY: media_io} if media_io is not None else {})},
        mm_kwargs,
    )
    return sampling.video_sampling(sampling.part_level(part, long_side), request)


@pytest.mark.parametrize(
    "asked, chosen",
    [
        ({"media_io": {"video": {"num_frames": 8}}}, {"num_frames": 8}),
        ({"media_io": {"video": {"fps": 2}}}, {"video_fps": 2.0}),
        ({"video_config": {"fps": 0.5, "max_frames": 4, "_question": "why?"}}, {"video_fps": 0.5, "max_frames": 4}),
        ({"mm_kwargs": {"video_fps": 2, "min_frames": 3}}, {"video_fps": 2.0, "min_frames": 3}),
        # the part's rate replaces the request's whole rate; the request's max_frames stays unless the part sets it
        ({"media_io": {"video": {"num_frames": 8}}, "part": {"fps": 2}}, {"video_fps": 2.0}),
        (
            {"video_config": {"num_frames": 8, "max_frames": 16}, "part": {"max_frames": 3}},
            {"num_frames": 8, "max_frames": 3},
        ),
        ({"video_config": {"max_frames": 16}, "part": {"fps": 1.5}}, {"video_fps": 1.5, "max_frames": 16}),
        ({"media_io": {"video": {"num_frames": 8}}, "video_config": {"num_frames": 8}}, {"num_frames": 8}),
        ({}, {}),
    ],
)
def test_sampling_precedence(asked, chosen):
    assert levels(**asked) == chosen


@pytest.mark.parametrize(
    "asked, named",
    [
        ({"media_io": {"video": {"num_frames": 0}}}, "media_io_kwargs.video.num_frames"),
        ({"media_io": {"video": {"num_frames": 2.5}}}, "media_io_kwargs.video.num_frames"),
        ({"media_io": {"video": {"num_frames": True}}}, "media_io_kwargs.video.num_frames"),
        ({"media_io": {"video": {"fps": -1}}}, "media_io_kwargs.video.fps"),
        ({"media_io": {"video": {"fps": float("inf")}}}, "media_io_kwargs.video.fps"),
        ({"media_io": {"video": {"max_frames": 3}}}, "media_io_kwargs.video.max_frames"),
        ({"media_io": {"image": {"size": 3}}}, "media_io_kwargs.image"),
        ({"media_io": {"video": {"num_frames": 4, "fps": 1}}}, "mutually exclusive"),
        ({"video_config": {"frame_stride": 2}}, "video_config.frame_stride"),
        ({"video_config": {"fps": 1, "video_fps": 2}}, "video_config.video_fps"),
        ({"mm_kwargs": {"do_resize": False}}, "mm_processor_kwargs.do_resize"),
        ({"media_io": {"video": {"num_frames": 4}}, "video_config": {"num_frames": 5}}, "disagrees"),
        ({"media_io": {"video": {"num_frames": 4}}, "mm_kwargs": {"fps": 1}}, "mutually exclusive"),
        ({"part": {"max_tokens_per_frame": 64}}, "video_url.max_tokens_per_frame"),
        ({"long_side": 512}, "video_url.max_long_side_pixel"),
    ],
)
def test_fields_that_cannot_be_honoured_are_refused_by_name(asked, named):
    with pytest.raises(sampling.SamplingRefused, match=named.replace(".", r"\.")):
        levels(**asked)
