"""Regenerate the small example media the example query files use (deterministic, no downloads).

    python inference/examples/make_media.py

Writes into ``inference/examples/media/``:
- ``shapes.png``      a 96x96 picture: red square, blue circle, green triangle on white;
- ``stop_sign.png``   a 128x96 picture: a red octagonal sign with "STOP" on a post, sky and road;
- ``moving_dot.mp4``  4 s at 4 fps, 96x96 H.264: a black dot moving left to right, with the second
                      counter drawn in a corner (so frames are distinguishable).
The realtime examples (``realtime_inference/examples/``) use the same video.
"""

from pathlib import Path

import av
from PIL import Image, ImageDraw

MEDIA_DIR = Path(__file__).resolve().parent / "media"
VIDEO_FPS = 4
VIDEO_SECONDS = 4
VIDEO_SIZE = 96


def draw_shapes() -> Image.Image:
    image = Image.new("RGB", (96, 96), "white")
    draw = ImageDraw.Draw(image)
    draw.rectangle((8, 8, 40, 40), fill="red")
    draw.ellipse((52, 8, 88, 44), fill="blue")
    draw.polygon([(48, 56), (20, 90), (76, 90)], fill="green")
    return image


def draw_sign() -> Image.Image:
    image = Image.new("RGB", (128, 96), (135, 190, 235))
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 70, 128, 96), fill=(90, 90, 90))
    draw.rectangle((60, 40, 66, 72), fill=(60, 60, 60))
    draw.regular_polygon((63, 30, 24), n_sides=8, fill=(200, 20, 20))
    draw.text((48, 25), "STOP", fill="white")
    return image


def draw_video_frame(index: int) -> Image.Image:
    image = Image.new("RGB", (VIDEO_SIZE, VIDEO_SIZE), (240, 240, 220))
    draw = ImageDraw.Draw(image)
    total = VIDEO_FPS * VIDEO_SECONDS
    x = 8 + (VIDEO_SIZE - 32) * index // max(total - 1, 1)
    draw.ellipse((x, 40, x + 16, 56), fill="black")
    draw.text((4, 4), f"t={index // VIDEO_FPS}", fill="navy")
    return image


def write_video(path: Path) -> None:
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=VIDEO_FPS)
        stream.width = stream.height = VIDEO_SIZE
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "30", "preset": "veryslow"}
        for index in range(VIDEO_FPS * VIDEO_SECONDS):
            frame = av.VideoFrame.from_image(draw_video_frame(index))
            container.mux(stream.encode(frame))
        container.mux(stream.encode())


def main() -> None:
    MEDIA_DIR.mkdir(parents=True, exist_ok=True)
    draw_shapes().save(MEDIA_DIR / "shapes.png", optimize=True)
    draw_sign().save(MEDIA_DIR / "stop_sign.png", optimize=True)
    write_video(MEDIA_DIR / "moving_dot.mp4")
    for path in sorted(MEDIA_DIR.iterdir()):
        print(f"{path} {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
