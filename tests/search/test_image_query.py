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
from PIL import Image, TiffImagePlugin

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
from tvrpipe.worlds.videos import synthesize

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


def _png16(path: Path, values: np.ndarray, colour_type: int, transparent: int | None = None) -> Path:
    """A 16-bit PNG written from the format's definition (zlib, CRCs), not by Pillow: ``colour_type`` 0 (grey,
    values (H, W)) or 2 (RGB, values (H, W, 3)); ``transparent``: a grey value PNG's tRNS marks transparent."""
    import struct
    import zlib

    h, w = values.shape[:2]
    raw = b"".join(b"\0" + values[y].astype(">u2").tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    trns = chunk(b"tRNS", struct.pack(">H", transparent)) if transparent is not None else b""
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, colour_type, 0, 0, 0))
                     + trns + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    return path


def _over_white(rgb: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """The definition of compositing over white, in floats: c a / 255 + 255 (1 - a / 255), rounded."""
    a = alpha.astype(np.float64)[..., None] / 255
    return np.rint(rgb.astype(np.float64) * a + 255 * (1 - a)).astype(np.uint8)


def _grey3(grey: np.ndarray) -> np.ndarray:
    return np.repeat(grey[..., None], 3, axis=-1).astype(np.uint8)


def test_a_mid_grey_16_bit_png_is_mid_grey_not_white(tmp_path):
    """Pillow's own convert("RGB") clips 16-bit values at 255: every grey above 255 of 65535 came out white."""
    _png16(tmp_path / "grey16.png", np.full((8, 8), 32768, np.uint16), 0)
    picture = open_image(tmp_path / "grey16.png")
    assert picture.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(picture), np.full((8, 8, 3), 128, np.uint8))  # round(32768 / 257)
    np.testing.assert_array_equal(frame_of_image(picture, S), np.full((S, S, 3), 128, np.uint8))


def test_mode_i_is_read_by_its_source_a_16_bit_pgm_on_16_bits_a_32_bit_tiff_refused(tmp_path):
    """Pillow opens both a 16-bit PGM and a 32-bit integer TIFF as mode ``I``: the PGM's values are on 0-65535
    (Pillow scales its maxval to 65535), the TIFF's white is unknown, so the same 128 is mid-grey in one and
    refused in the other, never read as the black it is of 65535."""
    Image.fromarray(np.full((4, 4), 128 * 257, np.int32), "I").save(tmp_path / "grey.pgm")
    (tmp_path / "maxval.pgm").write_bytes(b"P5 4 4 1000\n" + np.full((4, 4), 502, ">u2").tobytes())  # 502 / 1000
    Image.fromarray(np.full((4, 4), 128, np.int32), "I").save(tmp_path / "grey.tif")
    for name in ("grey.pgm", "maxval.pgm"):
        with Image.open(tmp_path / name) as im:
            assert im.mode == "I", name
        np.testing.assert_array_equal(np.asarray(open_image(tmp_path / name)), np.full((4, 4, 3), 128, np.uint8))
    with pytest.raises(ConfigError, match=r"grey\.tif: a signed 32-bit integer TIFF \(Pillow mode 'I'\), whose "
                                          "white is unknown"):
        open_image(tmp_path / "grey.tif")


def test_an_animation_or_a_stack_of_pages_is_refused_naming_its_frames(tmp_path):
    """An animated GIF, PNG or WebP and a multi-page TIFF are refused, naming the file and its frames, rather than
    read as a first frame the user may never see; one frame of each is read. A camera's JPEG with previews (MPO) is
    its first picture, as the Multi-Picture format defines it."""
    frames = [Image.new("RGB", (16, 12), (60 * i, 100, 200 - 60 * i)) for i in range(3)]
    for name in ("anim.gif", "anim.png", "anim.webp", "pages.tif"):
        frames[0].save(tmp_path / name, save_all=True, append_images=frames[1:])
        with pytest.raises(ConfigError) as e:
            open_image(tmp_path / name)
        assert str(e.value).startswith(f"{tmp_path / name}: 3 frames (an animation or pages, ") and str(
            e.value).endswith("not one picture: give a still picture, e.g. one frame exported as PNG"), str(e.value)
        still = tmp_path / f"still-{name}"
        frames[1].save(still)
        assert open_image(still).size == (16, 12), name
    frames[0].save(tmp_path / "camera.mpo", save_all=True, append_images=frames[1:])
    with Image.open(tmp_path / "camera.mpo") as im:
        assert (im.format, im.n_frames) == ("MPO", 3)
    np.testing.assert_array_equal(np.asarray(open_image(tmp_path / "camera.mpo")),
                                  np.asarray(Image.open(tmp_path / "camera.mpo").convert("RGB")))


def test_a_picture_the_resize_cannot_make_a_frame_of_is_refused_before_it_is_resized(tmp_path, monkeypatch):
    """The long side is resized to ``int(S * long / short)``: a strip 60000 x 1 would be 13,440,000 px long
    (swscale refuses it), 20000 x 1 would take 3 GB, for a centre crop of a sliver. Past MAX_ASPECT times the short
    side a picture is refused, naming it and its size, before anything is resized; at the bound it is a frame as
    extraction's reader makes one. A picture of no pixels (made in memory) is refused too."""
    from tvrpipe.features import images

    assert images.MAX_ASPECT == 64
    resized = []
    real = av.VideoFrame.reformat
    monkeypatch.setattr(av.VideoFrame, "reformat", lambda self, *a, **kw: resized.append(kw) or real(self, *a, **kw))
    for w, h, ratio in [(60000, 1, "60,000"), (20000, 1, "20,000"), (1, 20000, "20,000"), (65, 1, "65"),
                        (6500, 100, "65"), (10, 641, "64.1")]:
        Image.new("RGB", (w, h), (10, 20, 30)).save(tmp_path / "long.png")
        with pytest.raises(ConfigError) as e:
            frame_of_image(open_image(tmp_path / "long.png"), S)
        assert str(e.value) == (f"{tmp_path / 'long.png'}: a picture of {w} x {h} px, {ratio} times as long as it "
                                "is wide (at most 64): its centre square, all that a query sees of it, would be a "
                                "sliver; crop the part to search with"), str(e.value)
        with Image.open(tmp_path / "long.png") as raw, pytest.raises(ConfigError, match=r"^the picture: a picture"):
            frame_of_image(raw, S)  # a caller's own image, opened without open_image
    assert resized == []
    for shape in [(1, 64), (64, 1), (3, 192), (100, 6400)]:  # (H, W): at the bound, what extraction makes of it
        rgb = np.random.default_rng(sum(shape)).integers(0, 256, (*shape, 3), dtype=np.uint8)
        Image.fromarray(rgb).save(tmp_path / "edge.png")
        want = _pyav_resize_crop(av.VideoFrame.from_ndarray(rgb, format="rgb24"), S)
        np.testing.assert_array_equal(frame_of_image(open_image(tmp_path / "edge.png"), S), want)
    for size in [(0, 3), (3, 0)]:
        with pytest.raises(ConfigError, match=rf"^the picture: a picture of {size[0]} x {size[1]} px has no pixels"):
            frame_of_image(Image.new("RGB", size), S)


def _pictures(tmp_path: Path) -> list[tuple[str, Path, np.ndarray, int]]:
    """``(case, file, RGB the definition gives, tolerance)`` for a picture of each mode Pillow opens. Tolerance 0
    where the definition is integer arithmetic; 1 for Pillow's fixed-point conversions (YCbCr, CMYK) and the
    rounding of a premultiplied alpha divided out; 2 for CIELAB through LittleCMS (8-bit, D50 adapted to sRGB's
    D65: white comes out (254, 255, 254))."""
    rng = np.random.default_rng(7)
    shape = (6, 10)
    v16 = rng.integers(0, 65536, shape).astype(np.uint16)
    v16[0, :4] = [0, 32768, 65535, 128]  # black, mid-grey, white, a value Pillow's clip kept as 128
    ref16 = _grey3(np.rint(v16 / 257))
    out = [("16-bit grey PNG (I;16)", _png16(tmp_path / "grey16.png", v16, 0), ref16, 0)]
    masked = v16.copy()
    masked[1, 1] = 1234
    grey = np.rint(masked / 257)
    grey[masked == 1234] = 255
    out.append(("16-bit grey PNG, a value transparent (tRNS)", _png16(tmp_path / "trns16.png", masked, 0, 1234),
                _grey3(grey), 0))
    rgb16 = rng.integers(0, 65536, (*shape, 3)).astype(np.uint16)
    out.append(("16-bit RGB PNG (Pillow keeps each high byte)", _png16(tmp_path / "rgb16.png", rgb16, 2),
                np.rint(rgb16 / 257).astype(np.uint8), 1))
    Image.frombytes("I;16B", shape[::-1], v16.astype(">u2").tobytes()).save(tmp_path / "big.tif")
    out.append(("16-bit big-endian TIFF (I;16B)", tmp_path / "big.tif", ref16, 0))
    (tmp_path / "grey16.pgm").write_bytes(f"P5 {shape[1]} {shape[0]} 65535\n".encode() + v16.astype(">u2").tobytes())
    out.append(("16-bit PGM (I)", tmp_path / "grey16.pgm", ref16, 0))
    f = rng.random(shape).astype(np.float32)
    f[0, :2] = [0.0, 1.0]
    Image.fromarray(f).save(tmp_path / "float.tif")
    out.append(("32-bit float TIFF on [0, 1] (F)", tmp_path / "float.tif", _grey3(np.rint(f.astype(np.float64) * 255)),
                0))
    bits = rng.random(shape) < 0.5
    Image.fromarray(bits).save(tmp_path / "bits.png")
    out.append(("1-bit PNG (1)", tmp_path / "bits.png", _grey3(bits * 255), 0))
    palette = rng.integers(0, 256, (256, 3), dtype=np.uint8)
    index = rng.integers(0, 256, shape).astype(np.uint8)
    p = Image.frombytes("P", shape[::-1], index.tobytes())
    p.putpalette(palette.tobytes())
    p.save(tmp_path / "palette.png")
    out.append(("palette PNG (P)", tmp_path / "palette.png", palette[index], 0))
    entry_alpha = rng.integers(0, 256, 256).astype(np.uint8)
    p.save(tmp_path / "palette-alpha.png", transparency=entry_alpha.tobytes())
    out.append(("palette PNG, an alpha per entry (P, tRNS)", tmp_path / "palette-alpha.png",
                _over_white(palette[index], entry_alpha[index]), 0))
    p.save(tmp_path / "palette.gif", transparency=int(index[0, 0]))
    gif = palette[index].copy()
    gif[index == index[0, 0]] = 255
    out.append(("GIF, a palette entry transparent (P)", tmp_path / "palette.gif", gif, 0))
    pa = Image.frombytes("PA", shape[::-1], np.stack([index, entry_alpha[index]], -1).tobytes())
    pa.putpalette(palette.tobytes())
    pa.save(tmp_path / "pa.tif")
    out.append(("palette and alpha TIFF (PA)", tmp_path / "pa.tif", _over_white(palette[index], entry_alpha[index]), 0))
    la = rng.integers(0, 256, (*shape, 2), dtype=np.uint8)
    Image.fromarray(la).save(tmp_path / "la.png")
    out.append(("grey and alpha PNG (LA)", tmp_path / "la.png", _over_white(_grey3(la[..., 0]), la[..., 1]), 0))
    rgba = rng.integers(0, 256, (*shape, 4), dtype=np.uint8)
    rgba[0, :3, 3] = [0, 255, 128]  # transparent, opaque, half
    Image.fromarray(rgba).save(tmp_path / "rgba.png")
    out.append(("RGBA PNG", tmp_path / "rgba.png", _over_white(rgba[..., :3], rgba[..., 3]), 0))
    cmyk = rng.integers(0, 256, (*shape, 4), dtype=np.uint8)
    cmyk[0, :4] = [[0, 0, 0, 0], [255, 0, 0, 0], [0, 255, 255, 0], [0, 0, 0, 255]]  # white, cyan, red, black
    Image.frombytes("CMYK", shape[::-1], cmyk.tobytes()).save(tmp_path / "cmyk.tif")
    c = cmyk.astype(np.float64)
    out.append(("CMYK TIFF", tmp_path / "cmyk.tif",
                np.rint((255 - c[..., :3]) * (255 - c[..., 3:]) / 255).astype(np.uint8), 1))
    ycc = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
    ycc[0, :2] = [[76, 85, 255], [128, 128, 128]]  # red, mid-grey
    Image.frombytes("YCbCr", shape[::-1], ycc.tobytes()).save(tmp_path / "ycc.tif")
    y, cb, cr = (ycc[..., k].astype(np.float64) for k in range(3))
    jfif = np.stack([y + 1.402 * (cr - 128), y - 0.344136 * (cb - 128) - 0.714136 * (cr - 128),
                     y + 1.772 * (cb - 128)], -1)
    out.append(("YCbCr TIFF (JFIF's formula)", tmp_path / "ycc.tif", np.rint(np.clip(jfif, 0, 255)).astype(np.uint8), 1))
    lightness = np.arange(60, dtype=np.uint8).reshape(shape) * 4 + 10  # neutral greys: a = b = 0
    Image.frombytes("LAB", shape[::-1], np.stack([lightness, 0 * lightness, 0 * lightness], -1).tobytes()).save(
        tmp_path / "lab.tif")
    star = lightness.astype(np.float64) * 100 / 255  # L*, then CIE's Y and sRGB's transfer function
    lum = np.where(star > 8, ((star + 16) / 116) ** 3, star / 903.3)
    srgb = np.where(lum <= 0.0031308, 12.92 * lum, 1.055 * lum ** (1 / 2.4) - 0.055)
    out.append(("CIELAB TIFF, greys (LAB)", tmp_path / "lab.tif", _grey3(np.rint(srgb * 255)), 2))
    return out


def test_every_mode_pillow_opens_is_made_rgb_as_its_definition_says(tmp_path):
    for case, path, want, tolerance in _pictures(tmp_path):
        got = open_image(path)
        assert got.mode == "RGB" and got.size == want.shape[1::-1], case
        diff = np.abs(np.asarray(got).astype(int) - want.astype(int))
        assert diff.max() <= tolerance, (case, diff.max())
        with Image.open(path) as raw:  # a caller holding the picture in its own mode gets the same frame
            np.testing.assert_array_equal(frame_of_image(raw, S), frame_of_image(got, S))


def test_modes_only_made_in_memory_are_made_rgb_too():
    """Premultiplied alpha (La, RGBa), HSV and RGBX: no file format opens as them, a caller of as_rgb may hold them."""
    from tvrpipe.features.images import as_rgb

    rng = np.random.default_rng(3)
    shape = (4, 8)
    alpha = rng.integers(1, 256, shape).astype(np.uint8)
    straight = rng.integers(0, 256, (*shape, 3)).astype(np.uint8)
    premult = np.rint(straight * (alpha[..., None] / 255)).astype(np.uint8)
    rgba = Image.frombytes("RGBa", shape[::-1], np.concatenate([premult, alpha[..., None]], -1).tobytes())
    la = Image.frombytes("La", shape[::-1], np.stack([premult[..., 0], alpha], -1).tobytes())
    # over white, premultiplied: c' + 255 - a; Pillow divides the alpha out first, rounding to 8 bits: 1 level
    want = np.rint(premult.astype(np.float64) + 255 - alpha[..., None]).astype(int)
    assert np.abs(np.asarray(as_rgb(rgba)).astype(int) - want).max() <= 1
    assert np.abs(np.asarray(as_rgb(la)).astype(int) - want[..., :1]).max() <= 1
    hsv = rng.integers(0, 256, (*shape, 3)).astype(np.uint8)
    hsv[0, :3] = [[0, 255, 255], [85, 255, 255], [0, 0, 128]]  # red, green, mid-grey
    import colorsys

    ref = np.array([[colorsys.hsv_to_rgb(*(px / 255)) for px in row] for row in hsv.astype(np.float64)]) * 255
    got = np.asarray(as_rgb(Image.frombytes("HSV", shape[::-1], hsv.tobytes()))).astype(int)
    assert np.abs(got - np.rint(ref)).max() <= 1
    assert got[0, :3].tolist() == [[255, 0, 0], [0, 255, 0], [128, 128, 128]]
    rgbx = rng.integers(0, 256, (*shape, 4)).astype(np.uint8)
    np.testing.assert_array_equal(np.asarray(as_rgb(Image.frombytes("RGBX", shape[::-1], rgbx.tobytes()))),
                                  rgbx[..., :3])


def test_values_with_no_known_white_and_unknown_modes_are_refused_naming_the_file_and_mode(tmp_path):
    from types import SimpleNamespace

    from tvrpipe.features.images import as_rgb

    Image.fromarray(np.array([[0, 70000]], np.int32)).save(tmp_path / "int32.tif")
    Image.fromarray(np.array([[0.0, 2.5]], np.float32)).save(tmp_path / "hdr.tif")
    Image.fromarray(np.array([[0.5, np.nan]], np.float32)).save(tmp_path / "nan.tif")
    Image.fromarray(np.array([[-1, 5]], np.int32)).save(tmp_path / "negative.tif")
    # 32-bit integers within 16 bits: their white is the file's, not 65535 (128 of 255 would read as black)
    Image.fromarray(np.full((4, 4), 128, np.int32), "I").save(tmp_path / "grey128.tif")
    signed = TiffImagePlugin.ImageFileDirectory_v2()
    signed[339] = 2  # SampleFormat: signed integers
    Image.fromarray(np.full((4, 4), 300, np.uint16)).save(tmp_path / "signed16.tif", tiffinfo=signed)
    with Image.open(tmp_path / "signed16.tif") as im:
        assert (im.mode, im.tag_v2[258], im.tag_v2[339]) == ("I", (16,), (2,))  # what other software writes
    white = ("(Pillow mode 'I'), whose white is unknown (tvrpipe reads integer pictures of 16 unsigned bits, 65535 "
             "white)")
    for name, message in [
        ("int32.tif", f"a signed 32-bit integer TIFF {white}; save it as an 8-bit RGB PNG or JPEG, or a 16-bit PNG"),
        ("negative.tif", f"a signed 32-bit integer TIFF {white}"),
        ("grey128.tif", f"a signed 32-bit integer TIFF {white}"),
        ("signed16.tif", f"a signed 16-bit integer TIFF {white}"),
        ("hdr.tif", "a 32-bit float picture (Pillow mode 'F') whose values span 0 to 2.5: tvrpipe reads a float "
                    "picture on [0, 1] (0 black, 1 white); save it as an 8-bit RGB PNG or JPEG"),
        ("nan.tif", "(Pillow mode 'F') whose values span 0.5 to 0.5, some NaN or infinite: tvrpipe reads"),
    ]:
        with pytest.raises(ConfigError) as e:
            open_image(tmp_path / name)
        assert str(e.value).startswith(f"{tmp_path / name}: ") and message in str(e.value), str(e.value)
        with Image.open(tmp_path / name) as raw, pytest.raises(ConfigError, match="Pillow mode"):
            frame_of_image(raw, S)  # a caller holding the file's image is refused alike
    # a mode I picture of no file (made in memory) has no tags to tell: its values outside 16 bits are refused
    for values, span in [([[0, 70000]], "0 to 70000"), ([[-1, 5]], "-1 to 5")]:
        with pytest.raises(ConfigError, match=rf"^odd: a 32-bit integer picture \(Pillow mode 'I'\) whose values "
                                              rf"span {span}, beyond 16 bits, so its white is unknown"):
            as_rgb(Image.fromarray(np.array(values, np.int32), "I"), "odd")
    with pytest.raises(ConfigError, match=r"^odd.raw: a picture in Pillow mode 'BGR;24', which tvrpipe does not "
                                          r"convert to RGB; save it as an 8-bit RGB PNG or JPEG$"):
        as_rgb(SimpleNamespace(mode="BGR;24", has_transparency_data=False), "odd.raw")


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
    Image.fromarray(np.full((64, 64), 4.0, np.float32)).save(tmp_path / "hdr.tif")
    Image.new("RGB", (60000, 1)).save(tmp_path / "wide.png")
    Image.new("RGB", (8, 8)).save(tmp_path / "anim.gif", save_all=True, append_images=[Image.new("RGB", (8, 8), 255)])
    Image.fromarray(np.full((4, 4), 128, np.int32), "I").save(tmp_path / "int32.tif")
    out = tmp_path / "hits.json"
    for args, message in [
        (["--image", tmp_path / "missing.png"], f"error: --image {tmp_path / 'missing.png'}: no such file"),
        (["--image", tmp_path / "folder"], f"error: --image {tmp_path / 'folder'} is a folder, not a picture"),
        (["--image", tmp_path / "notes.txt"], f"error: --image {tmp_path / 'notes.txt'} is not a picture (Pillow "
                                              "recognises no image format in it; give a JPEG, PNG, WebP, ... file)"),
        (["--image", tmp_path / "empty.png"], f"error: --image {tmp_path / 'empty.png'} is not a picture"),
        (["--image", tmp_path / "ok.png", "--image", tmp_path / "half.png"],
         f"error: --image {tmp_path / 'half.png'}: the picture cannot be read (OSError: "),
        (["--image", tmp_path / "hdr.tif"], f"error: --image {tmp_path / 'hdr.tif'}: a 32-bit float picture (Pillow "
                                            "mode 'F') whose values span 4 to 4: tvrpipe reads a float picture on "
                                            "[0, 1]"),
        (["--image", tmp_path / "wide.png"], f"error: --image {tmp_path / 'wide.png'}: a picture of 60000 x 1 px, "
                                             "60,000 times as long as it is wide (at most 64)"),
        (["--image", tmp_path / "anim.gif"], f"error: --image {tmp_path / 'anim.gif'}: 2 frames (an animation or "
                                             "pages, GIF), not one picture: give a still picture"),
        (["--image", tmp_path / "int32.tif"], f"error: --image {tmp_path / 'int32.tif'}: a signed 32-bit integer "
                                              "TIFF (Pillow mode 'I'), whose white is unknown"),
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
    from tvrpipe.worlds.features import GenSpec, generate_store

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
