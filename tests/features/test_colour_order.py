"""A frame's channels reach CLIP as RGB, in extract and in finetune: a pure red video's frame embedding is a
red image's, made directly (PIL, then CLIP's own normalisation), and not a blue one's (what a decoder handing
over BGR, as OpenCV does, would give)."""

from __future__ import annotations

import av
import numpy as np
import pytest
import torch

from tvrpipe.features.clip import TINY_MODEL, load_clip

COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255)}


def solid_video(path, rgb: tuple[int, int, int], n: int = 8, size: int = 96):
    """An H.264 mp4 of ``n`` frames of one colour, lossless (qp 0; the yuv420p round trip moves a channel by
    at most a few levels)."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=8)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.options = {"preset": "ultrafast", "qp": "0"}
        image = np.empty((size, size, 3), np.uint8)
        image[:] = rgb
        for _ in range(n):
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def direct(bundle, rgb: tuple[int, int, int]) -> torch.Tensor:
    """The embedding of a solid image made with PIL in RGB, normalised with CLIP's mean and std."""
    from PIL import Image

    S = bundle.image_size
    pixels = torch.from_numpy(np.asarray(Image.new("RGB", (S, S), rgb), dtype=np.float32) / 255.0)  # (S, S, 3)
    x = (pixels.permute(2, 0, 1) - torch.tensor(bundle.mean).view(3, 1, 1)) / torch.tensor(bundle.std).view(3, 1, 1)
    with torch.no_grad():
        return bundle.model.encode_image(x.unsqueeze(0))[0]


def assert_is_colour(embedding: torch.Tensor, bundle, colour: str) -> None:
    cos = {c: float(torch.nn.functional.cosine_similarity(embedding.float(), direct(bundle, rgb), dim=0))
           for c, rgb in COLOURS.items()}
    others = [1 - cos[c] for c in COLOURS if c != colour]
    assert 1 - cos[colour] < 0.01 * min(others), (colour, cos)  # far nearer its colour than any other


@pytest.fixture(scope="module")
def colours(tmp_path_factory):
    """A manifest of one solid video per colour, all in train (and one in val / test each, for the splits)."""
    from tvrpipe.data.manifest import make_tables, write_manifest

    root = tmp_path_factory.mktemp("colours")
    (root / "videos").mkdir()
    rows, caps = [], []
    for k, (name, rgb) in enumerate(COLOURS.items()):
        solid_video(root / "videos" / f"{name}.mp4", rgb)
        split = ("train", "val", "test")[k]
        rows.append({"video_id": name, "path": f"{name}.mp4", "split": split})
        caps.append({"caption_id": f"{name}#0", "video_id": name, "text": f"a {name} screen", "split": split})
    v, c = make_tables(rows, caps)
    write_manifest(root / "manifest", v, c, {"dataset": "colours", "split_set": "colours", "frames": 4,
                                             "max_words": 8})
    return root


def test_extract_hands_clip_rgb_frames(colours, tmp_path):
    from tvrpipe.features.extract import ExtractConfig, extract
    from tvrpipe.features.store import open_store

    extract(colours / "manifest", colours / "videos", tmp_path / "store",
            ExtractConfig(model=TINY_MODEL, pretrained="none", progress=False, decoders=1))
    store = open_store(tmp_path / "store")
    bundle = load_clip(TINY_MODEL, "none")
    frames = store.array("videos/frames")[:].astype(np.float32)  # (videos, F, D), float16 in the store
    for row, name in enumerate(store.videos["video_id"]):
        for f in range(frames.shape[1]):
            assert_is_colour(torch.from_numpy(frames[row, f]), bundle, name)


def test_finetune_hands_clip_rgb_frames(colours):
    """finetune's DataLoader path (its decoder, collate and the live CLIP) on the same videos."""
    from tvrpipe.heads.base import clip_head_config, head_class
    from tvrpipe.training.live import LiveModel
    from tvrpipe.training.videodata import Collate, DecodedClips, VideoTable

    bundle = load_clip(TINY_MODEL, "none")
    names = list(COLOURS)
    table = VideoTable(np.array([str(colours / "videos" / f"{n}.mp4") for n in names], dtype=object),
                       np.full(len(names), np.nan), np.full(len(names), np.nan), np.array(["x"], dtype=object))
    data = DecodedClips(table, 4, bundle.image_size, seed=0, timeout_s=60.0)
    batch = Collate(4, bundle.image_size, keep_failed=False)([data[(v, -1, 0)] for v in range(len(names))])
    model = LiveModel(bundle, head_class("meanpool")(clip_head_config("meanpool", bundle.embed_dim,
                                                                         bundle.logit_scale, None)), False, "fp32")
    model.eval()
    with torch.no_grad():
        videos = model.encode_videos(batch.frames, batch.frame_mask)
    assert bool(batch.frame_mask.all())
    for row, name in enumerate(names):
        for f in range(4):
            assert_is_colour(videos.frames[row, f], bundle, name)
