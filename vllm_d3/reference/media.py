"""Media of a D3 request: data URLs decoded and turned into vision inputs.

Contract:
- Only ``data:`` URLs are read (the reference runtime never fetches).
- ``load_image`` opens an image, applies its EXIF orientation and converts it to
  RGB, painting transparent pixels white.
- ``load_video`` decodes a video with OpenCV and keeps frames sampled at 2 per
  second: ``n = int(total / fps * 2)`` clamped to 4..32 and to the frame count,
  at ``linspace(0, total - 1, n)`` rounded. An unknown source fps counts as 24.
- ``configure_processor`` sets the Qwen3-VL processor to the D3 media budgets:
  images resized to 65,536..1,638,400 pixels; video frames at most 200,704
  pixels each (at least 4,096), no further frame sampling.
- ``process_media`` runs the processor on the prompt's media prefix and returns
  its token ids with every placeholder expanded, plus the vision tensors.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import os
import tempfile
from dataclasses import dataclass
from io import BytesIO
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps
from transformers.video_utils import VideoMetadata

IMAGE_SIZE = {"shortest_edge": 65_536, "longest_edge": 1_638_400}
VIDEO_FPS = 2
VIDEO_MIN_FRAMES = 4
VIDEO_MAX_FRAMES = 32
VIDEO_FRAME_MIN_PIXELS = 4_096
VIDEO_FRAME_MAX_PIXELS = 200_704
#: The fps assumed for a video whose container does not say.
UNKNOWN_FPS = 24.0


@dataclass(frozen=True)
class Video:
    """Sampled RGB frames ``[T, H, W, 3]`` and where they came from."""

    frames: np.ndarray
    metadata: VideoMetadata


@dataclass(frozen=True)
class MediaInputs:
    """The vision encoder inputs of one request (shared by its questions)."""

    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None


def data_url_bytes(url: Any) -> bytes:
    """The payload of a ``data:`` URL."""
    if not isinstance(url, str) or not url.startswith("data:") or "," not in url:
        raise ValueError("media must be given as data: URLs")
    header, payload = url[len("data:") :].split(",", 1)
    if header.endswith(";base64"):
        try:
            return base64.b64decode(payload, validate=True)
        except binascii.Error as e:
            raise ValueError(f"media: bad base64 payload: {e}") from e
    raise ValueError("media: only base64 data: URLs are supported")


def load_image(url: Any) -> Image.Image:
    try:
        image: Image.Image = Image.open(BytesIO(data_url_bytes(url)))
        with contextlib.suppress(Exception):
            image = ImageOps.exif_transpose(image)
        image.load()
    except (OSError, SyntaxError) as e:
        raise ValueError(f"media: cannot read image: {e}") from e
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        flat = Image.new("RGB", rgba.size, (255, 255, 255))
        flat.paste(rgba, mask=rgba.getchannel("A"))
        return flat
    return image.convert("RGB")


def sample_frame_indices(total_frames: int, fps: float) -> list[int]:
    wanted = int(total_frames / fps * VIDEO_FPS)
    count = min(max(wanted, VIDEO_MIN_FRAMES), VIDEO_MAX_FRAMES, total_frames)
    return np.linspace(0, total_frames - 1, count).round().astype(int).tolist()


def load_video(url: Any) -> Video:
    import cv2

    data = data_url_bytes(url)
    fd, path = tempfile.mkstemp(suffix=".video")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        capture = cv2.VideoCapture(path)
        if not capture.isOpened():
            raise ValueError("media: cannot open video")
        total = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
        fps = float(capture.get(cv2.CAP_PROP_FPS)) or UNKNOWN_FPS
        if total <= 0:
            raise ValueError("media: video has no frames")
        indices = sample_frame_indices(total, fps)
        wanted = set(indices)
        frames = []
        for index in range(indices[-1] + 1):
            if not capture.grab():
                raise ValueError(f"media: video ends before frame {index}")
            if index in wanted:
                ok, frame = capture.retrieve()
                if not ok:
                    raise ValueError(f"media: cannot decode video frame {index}")
                frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
        capture.release()
    finally:
        os.unlink(path)
    stacked = np.stack(frames)
    metadata = VideoMetadata(
        total_num_frames=total,
        fps=fps,
        width=stacked.shape[2],
        height=stacked.shape[1],
        duration=total / fps,
        frames_indices=indices,
    )
    return Video(stacked, metadata)


def configure_processor(processor: Any) -> None:
    """Apply the D3 media budgets to a Qwen3-VL processor, in place."""
    processor.image_processor.size = dict(IMAGE_SIZE)
    video = processor.video_processor
    factor = video.patch_size * video.merge_size
    video.size = {
        "shortest_edge": VIDEO_FRAME_MIN_PIXELS,
        "longest_edge": VIDEO_FRAME_MAX_PIXELS * VIDEO_MAX_FRAMES,
    }
    video.cap_pixels_per_frame = True
    video.max_video_tokens = VIDEO_FRAME_MAX_PIXELS // factor**2
    video.do_sample_frames = False


def process_media(
    processor: Any, prefix: str, images: list[Image.Image], videos: list[Video]
) -> tuple[list[int], MediaInputs]:
    """Expanded token ids of ``prefix`` (the prompt up to its last media
    placeholder) and the vision tensors of ``images`` and ``videos``."""
    kwargs: dict[str, Any] = {}
    if images:
        kwargs["images"] = images
    if videos:
        kwargs["videos"] = [v.frames for v in videos]
        kwargs["video_metadata"] = [v.metadata for v in videos]
        kwargs["do_sample_frames"] = False
    out = processor(
        text=[prefix], add_special_tokens=False, return_tensors="pt", **kwargs
    )
    media = MediaInputs(
        pixel_values=out.get("pixel_values"),
        image_grid_thw=out.get("image_grid_thw"),
        pixel_values_videos=out.get("pixel_values_videos"),
        video_grid_thw=out.get("video_grid_thw"),
    )
    return out["input_ids"][0].tolist(), media
