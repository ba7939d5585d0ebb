"""``tvrpipe search --image``: a picture's CLIP image embedding as the query, on a real extracted store (generated
videos, the tiny CLIP). A picture is preprocessed exactly as extraction preprocesses a frame (checked against
decode's PyAV reader), so a frame extraction decoded, saved as a picture, is encoded to its stored embedding; a
picture of a video's frame finds that video first; heads that read word tokens refuse pictures; bad input is one
line and writes nothing."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image

from tvrpipe.data.synth import synthesize
from tvrpipe.errors import ConfigError
from tvrpipe.features.clip import TINY_MODEL
from tvrpipe.features.decode import decode_video
from tvrpipe.features.decode.readers import _pyav_resize_crop
from tvrpipe.features.extract import ExtractConfig, extract
from tvrpipe.features.images import frame_of_image, open_image
from tvrpipe.features.store import FeatureStore, open_store
from tvrpipe.heads.base import TextBatch, create_head, head_class, list_heads
from tvrpipe.search.engine import Searcher, image_heads, open_searcher, search
from tvrpipe.search.index import INDEX_DIR

N_VIDEOS, FRAMES, SIZE, S = 6, 6, 96, 64  # videos 96 px square, resized to the tiny CLIP's 64


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Six one-scene videos, none a near-duplicate of another: the tiny CLIP has random weights, so every image
    embedding is within a cosine of 0.002 of every other, and a frame's own video leads by 2e-4 or more only where
    no other video shows the same scene (measured over four seeds: all ranked first, the least lead 6e-5)."""
    d = tmp_path_factory.mktemp("data")
    synthesize(d, N_VIDEOS, seed=11, size=SIZE, progress=False, multi_scene_fraction=0.0, distractor_fraction=0.0)
    return d


@pytest.fixture(scope="module")
def extracted(data, tmp_path_factory) -> Path:
    """The videos extracted with the tiny CLIP in fp32 (Ray, started here once and stopped)."""
    import ray

    from tvrpipe.cluster import ray_init

    out = tmp_path_factory.mktemp("features")
    ray_init(None, num_cpus=2)
    try:
        cfg = ExtractConfig(model=TINY_MODEL, pretrained="none", frames=FRAMES, video_shard=4, text_shard=16,
                            batch_size=3, progress=False, timeout_s=30.0)
        summary = extract(data / "manifest", data / "videos", out, cfg)
    finally:
        ray.shutdown()
    assert (summary.videos_done, summary.failed) == (N_VIDEOS, 0)
    return out


@pytest.fixture
def store(extracted, tmp_path) -> Path:
    """A private copy: a search writes its index beside the store."""
    shutil.copytree(extracted, tmp_path / "store", ignore=shutil.ignore_patterns(".tvrpipe.lock"))
    return tmp_path / "store"


def _full_frame(video: Path, at: float) -> np.ndarray:
    """The frame shown at ``at`` seconds, decoded by PyAV at the file's own size: uint8 (H, W, 3)."""
    with av.open(str(video)) as c:
        stream = c.streams.video[0]
        for frame in c.decode(stream):
            if abs(float(frame.pts * stream.time_base) - at) < 1e-4:
                return frame.to_ndarray(format="rgb24")
    raise AssertionError(f"no frame at {at} s in {video}")


# ----------------------------------------------------------------------------- preprocessing


@pytest.mark.parametrize("shape", [(61, 97), (97, 61), (64, 64), (40, 50), (300, 200)])
def test_a_picture_is_preprocessed_as_extraction_preprocesses_a_frame(tmp_path, shape):
    """Short side to S by swscale's bilinear filter, torchvision's rounding, the centre crop: pixel for pixel
    what decode's PyAV reader makes of a frame holding the same RGB pixels (smaller pictures are scaled up)."""
    rgb = np.random.default_rng(sum(shape)).integers(0, 256, (*shape, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "p.png")
    mine = frame_of_image(open_image(tmp_path / "p.png"), S)
    want = _pyav_resize_crop(av.VideoFrame.from_ndarray(rgb, format="rgb24"), S)
    assert mine.shape == (S, S, 3) and mine.dtype == np.uint8
    np.testing.assert_array_equal(mine, want)


def test_a_picture_is_turned_upright_by_its_exif_orientation_and_made_rgb(tmp_path):
    rgb = np.random.default_rng(0).integers(0, 256, (40, 70, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "upright.png")
    exif = Image.Exif()
    exif[0x0112] = 6  # the camera held sideways: shown turned 90 degrees clockwise
    Image.fromarray(np.rot90(rgb, 1)).save(tmp_path / "sideways.png", exif=exif)  # stored counter-clockwise
    np.testing.assert_array_equal(np.asarray(open_image(tmp_path / "sideways.png")), rgb)
    Image.fromarray(rgb).convert("RGBA").save(tmp_path / "alpha.png")
    Image.fromarray(rgb[..., 0]).save(tmp_path / "grey.png")
    assert open_image(tmp_path / "alpha.png").mode == "RGB"
    np.testing.assert_array_equal(np.asarray(open_image(tmp_path / "alpha.png")), rgb)
    np.testing.assert_array_equal(np.asarray(open_image(tmp_path / "grey.png")), np.repeat(rgb[..., :1], 3, -1))


# ----------------------------------------------------------------------------- the query embedding


def test_a_frame_extraction_decoded_is_encoded_to_its_stored_embedding(data, extracted, tmp_path):
    """A frame as extraction decoded it (resized and cropped to S), saved as a PNG and searched with: the picture
    gives extraction's pixels exactly, the query is CLIP's embedding of them exactly, and that is the store's
    embedding of the frame to the float16 rounding the store keeps (the store was extracted in fp32 on a CPU; an
    encoder call over another number of frames may change the last bit of a float32 sum, and so, rarely, the
    rounding)."""
    from tvrpipe.features.clip import encode_frames, load_clip

    s = open_store(extracted)
    searcher = open_searcher(extracted)
    paths, crops, want = [], [], []
    for row in (0, 3, 5):
        video = data / "videos" / s.videos["path"].iat[row]
        decoded = decode_video(video, FRAMES, S)
        stored = s.read("videos/frames", np.array([row]))[0]  # (F, D) float16
        np.testing.assert_array_equal(decoded.timestamps, s.array("videos/timestamps")[row])  # the same frames
        for i in (0, FRAMES - 1):
            paths.append(tmp_path / f"{row}-{i}.png")
            Image.fromarray(decoded.frames[i]).save(paths[-1])
            np.testing.assert_array_equal(frame_of_image(open_image(paths[-1]), S), decoded.frames[i])
            crops.append(decoded.frames[i])
            want.append(stored[i])
    texts = searcher.encode_images(paths)
    assert texts.tokens.shape == (len(paths), 0, 64) and texts.token_mask.shape == (len(paths), 0)
    model, pretrained, seed = searcher.clip
    exact = encode_frames(load_clip(model, pretrained, seed=seed), np.stack(crops), autocast=False)
    np.testing.assert_array_equal(texts.sentence.numpy(), exact.half().float().numpy())
    want = np.stack(want)
    ulp = np.spacing(np.abs(want)).astype(np.float32)  # float16's step at each stored value
    assert (np.abs(texts.sentence.numpy() - want.astype(np.float32)) <= ulp).all()
    assert (texts.sentence.numpy() == want.astype(np.float32)).mean() > 0.98


def test_a_picture_of_a_videos_frame_finds_that_video_first(data, store, tmp_path, cli):
    """A picture PIL wrote from a frame of each video (the file's own 96 px frame, not extraction's 64 px crop,
    as JPEG): zero-shot, exhaustive and with a two-stage shortlist, that video ranks first."""
    s = open_store(store)
    pictures = []
    for row in range(N_VIDEOS):
        t = s.array("videos/timestamps")[row][2]
        pictures.append(tmp_path / f"frame of {row}.jpg")
        Image.fromarray(_full_frame(data / "videos" / s.videos["path"].iat[row], float(t))).save(pictures[-1],
                                                                                                quality=95)
    args = [a for p in pictures for a in ("--image", p)]
    for extra in ([], ["--candidates", "3", "--first-stage", "exact"]):
        out = tmp_path / "hits.json"
        r = cli("search", *args, "--features", store, "--top-k", 3, "--json", out, "--html", tmp_path / "p.html",
                *extra)
        assert r.exit_code == 0, r.output
        hits = json.loads(out.read_text())
        firsts = {h["query"]: h["video_id"] for h in hits if h["rank"] == 1}
        assert firsts == {str(p): s.videos["video_id"].iat[row] for row, p in enumerate(pictures)}, firsts
        assert all(0.9 < h["score"] <= 1 for h in hits if h["rank"] == 1)  # a cosine: the video's own frames
        page = (tmp_path / "p.html").read_text()
        assert page.count("<h2>Picture: &ldquo;") == N_VIDEOS
    assert "the first stage's 3 best of 6 searchable videos" in " ".join(r.output.split())


@pytest.mark.parametrize("name", image_heads())
def test_a_head_that_reads_the_sentence_alone_ranks_a_picture_as_that_embedding(store, tmp_path, name):
    """The picture's embedding is the sentence's: whatever word tokens stand beside it, the hits are the same."""
    s = open_store(store)
    Image.fromarray(decode_video(Path(s.provenance["video_root"]) / s.videos["path"].iat[2], FRAMES, S).frames[1]
                    ).save(tmp_path / "p.png")
    torch.manual_seed(0)
    head = create_head(name, embed_dim=64).eval()
    searcher = open_searcher(store)
    searcher = Searcher(searcher.store, head, name, 8, searcher.clip)
    pic = searcher.encode_images([tmp_path / "p.png"])
    g = torch.Generator().manual_seed(1)
    words = TextBatch(torch.randn(1, 8, 64, generator=g), torch.ones(1, 8, dtype=torch.bool), pic.sentence)
    found = search(searcher, ["p"], k=N_VIDEOS, texts=words, first_stage="exact")
    pictured = search(searcher, [str(tmp_path / "p.png")], k=N_VIDEOS, images=True, first_stage="exact")
    assert pictured.hits == [dataclasses.replace(h, query=str(tmp_path / "p.png")) for h in found.hits]


# ----------------------------------------------------------------------------- refusals


def test_a_head_that_reads_word_tokens_refuses_a_picture_naming_those_that_take_one(store, tmp_path):
    takes = [n for n in list_heads() if not head_class(n).uses_tokens]
    assert image_heads() == takes and "meanpool" in takes and "uatvr" not in takes
    Image.new("RGB", (64, 64)).save(tmp_path / "p.png")
    base = open_searcher(store)
    for name in (n for n in list_heads() if head_class(n).uses_tokens):
        searcher = Searcher(base.store, create_head(name, embed_dim=64).eval(), f"{name} (runs/r)", 8, base.clip)
        with pytest.raises(ConfigError) as e:
            search(searcher, [str(tmp_path / "p.png")], k=2, images=True)
        assert str(e.value) == (f"--image: {name} (runs/r) reads the query's word tokens, which a picture does not "
                                "have; search pictures zero-shot (without --run), or with a run of a head that reads "
                                f"the sentence embedding alone: {', '.join(takes)}")
    assert not (base.store.dir / INDEX_DIR).exists()


def test_bad_pictures_and_mixed_queries_are_one_line_naming_them_and_nothing_is_written(store, tmp_path, cli):
    (tmp_path / "notes.txt").write_text("not a picture\n")
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "folder").mkdir()
    Image.new("RGB", (64, 64)).save(tmp_path / "ok.png")
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(noise).save(tmp_path / "whole.png")
    (tmp_path / "half.png").write_bytes((tmp_path / "whole.png").read_bytes()[:4000])  # a PNG cut short
    (tmp_path / "q.txt").write_text("a dog\n")
    out = tmp_path / "hits.json"
    for args, message in [
        (["--image", tmp_path / "missing.png"], f"error: --image {tmp_path / 'missing.png'}: no such file"),
        (["--image", tmp_path / "folder"], f"error: --image {tmp_path / 'folder'} is a folder, not a picture"),
        (["--image", tmp_path / "notes.txt"], f"error: --image {tmp_path / 'notes.txt'} is not a picture (Pillow "
                                              "recognises no image format in it; give a JPEG, PNG, WebP, ... file)"),
        (["--image", tmp_path / "empty.png"], f"error: --image {tmp_path / 'empty.png'} is not a picture"),
        (["--image", tmp_path / "ok.png", "--image", tmp_path / "half.png"],
         f"error: --image {tmp_path / 'half.png'}: the picture cannot be read (OSError: "),
        (["a dog", "--image", tmp_path / "ok.png"], f"error: --image {tmp_path / 'ok.png'} and a text query ('a dog') "
                                                    "were both given: search with pictures or with sentences, in "
                                                    "separate searches"),
        (["--queries", tmp_path / "q.txt", "--image", tmp_path / "ok.png"],
         f"error: --image {tmp_path / 'ok.png'} and a text query (--queries {tmp_path / 'q.txt'}) were both given"),
    ]:
        r = cli("search", *args, "--features", store, "--json", out)
        text = " ".join(r.output.split())
        assert r.exit_code == 1 and message in text, (args, r.output)
        assert len(r.output.strip().splitlines()) == 1, r.output
        assert not out.exists() and not (store / INDEX_DIR).exists()
    r = cli("search", "--image", tmp_path / "ok.png", "--features", store, "--html", tmp_path / "ok.png")
    assert r.exit_code == 1 and f"--html {tmp_path / 'ok.png'} is inside --image {tmp_path / 'ok.png'}, an input" \
        in " ".join(r.output.split()), r.output
    assert open_image(tmp_path / "ok.png").size == (64, 64)  # the picture is still there


def test_a_generated_store_refuses_a_picture_naming_its_maker(tmp_path):
    from tvrpipe.features.genstore import GenSpec, generate_store

    out = generate_store(tmp_path / "gen", GenSpec(train_videos=4, test_videos=4, captions_per_train_video=1,
                                                    frames=2, max_words=4, embed_dim=8, seed=0),
                         video_shard=4, text_shard=8)
    Image.new("RGB", (8, 8)).save(tmp_path / "p.png")
    searcher = Searcher(open_store(out), create_head("meanpool", embed_dim=8).eval(), "zero-shot", 4, None)
    with pytest.raises(ConfigError, match=r"was generated by `.*`: its features are of no CLIP, so no picture can "
                                          "be encoded to search them"):
        search(searcher, [str(tmp_path / "p.png")], k=2, images=True)
    assert not (out / INDEX_DIR).exists()
    assert isinstance(searcher.store, FeatureStore)
