"""A picture as CLIP's input, preprocessed exactly as extraction preprocesses a decoded frame, for image queries
(``tvrpipe search --image``).

Extraction (:mod:`tvrpipe.features.decode`) turns a frame upright (the video's display rotation), resizes its
short side to S with FFmpeg's swscale **bilinear** filter and the long side to ``int(S * long / short)``
(:func:`~tvrpipe.features.decode.sampling.resize_dims`, torchvision's ``Resize(S)`` rounding), and takes the
centre crop S x S (:func:`~tvrpipe.features.decode.sampling.centre_crop`, torchvision's);
:func:`~tvrpipe.features.clip.encode_frames` then scales it to [0, 1] and normalises it. A picture gets the same
steps: turned upright by its EXIF orientation, made 8-bit RGB (:func:`as_rgb`), resized by swscale's bilinear
filter through PyAV (the call and filter of decode's PyAV reader) and cropped by decode's own centre crop. So a
frame as extraction decoded it (S x S), saved without loss, gives exactly extraction's pixels, and CLIP's
embedding of them is the stored one to the store's float16 rounding (an encoder call over another number of
frames may change the last bit of a float32 sum). A larger picture of a frame comes close but not to the pixel: a
video's frame is scaled from its YUV planes while they are converted to RGB, a picture's RGB pixels are scaled as
they are.

Making a picture 8-bit RGB (Pillow's modes; Pillow's own ``convert("RGB")`` clips 16-bit and float values at
255, so a mid-grey 16-bit PNG would come out white):

- 8-bit colour and grey (``RGB``, ``RGBX``, ``L``, ``1``, ``P``, ``CMYK``, ``YCbCr``, ``LAB``, ``HSV``): Pillow's
  conversion (CMYK by its formula ``R = (255 - C)(255 - K) / 255``, without a colour profile; YCbCr by JFIF's).
- 16-bit grey (``I;16``, ``I;16B``, ``I;16L``, ``I;16N``, as Pillow 13 opens a 16-bit grey PNG or TIFF, and ``I``,
  as it opens a 16-bit PGM (scaled by Pillow from its maxval to 65535) and older versions opened a 16-bit PNG):
  each value v becomes ``round(v / 257)``, so 65535 is 255 and 32768 is 128. Mode ``I`` also holds 32-bit and
  signed integers, whose white tvrpipe cannot know: a TIFF whose samples are not unsigned 16-bit (its
  BitsPerSample and SampleFormat tags) and a FITS picture (Pillow opens its 32-bit integers as ``I``) are refused
  whatever their values (128 read on the 16-bit scale would be black), and so is any mode ``I`` picture holding a
  value outside 0-65535.
  Pillow itself opens 16-bit colour PNGs as 8-bit, keeping each value's high byte (``v >> 8``, within one level of
  ``v / 257``).
- 32-bit float grey (``F``): read as the usual [0, 1] scale, v becoming ``round(255 v)``; a picture with a value
  outside [0, 1] or not a number is refused rather than rescaled by its own range, which would brighten a dark
  picture into another one.
- Transparency (an alpha channel: ``RGBA``, ``LA``, ``PA``, the premultiplied ``RGBa`` and ``La``; a palette's or
  a colour's transparency): composited over white, ``round((c a + 255 (255 - a)) / 255)``. choice: dropping the
  alpha would show whatever colour a transparent pixel happens to store (often black, or a leftover of an edit),
  which no viewer shows; white is what a page or a document shows behind a cut-out picture, where such pictures
  come from. An opaque pixel keeps its colour exactly, so a frame saved with an alpha channel still gives
  extraction's pixels.
- Any other mode is refused, naming the file and the mode: never a picture silently read wrong.

What a file must be, checked before its pixels are decoded (:func:`open_image`), each refusal one line naming it:

- One still picture: an animation or a stack of pages (an animated GIF, PNG or WebP, a multi-page TIFF: Pillow's
  ``n_frames`` over 1) is refused rather than read as its first frame, which may be a blank, a title card or a
  cover page, not what the user meant. choice: refusing says so, where picking a frame would be a silent guess. Two
  formats hold several images and one picture: a JPEG with further images after it (MPO: a camera's previews, a
  stereo pair's other eye, an Ultra HDR gain map), whose first is the picture itself by the CIPA Multi-Picture
  format, and a Photoshop file (PSD), whose first is the flattened picture and the others its layers: both are
  read as that first image.
- A shape the resize can make: no side of 0 px, and the long side at most :data:`MAX_ASPECT` times the short
  one. The short side is resized to S and the long one to ``int(S * long / short)``, of which the centre crop
  keeps S: a 60000 x 1 strip would be resized to 13,440,000 x 224 (more than swscale takes; 20000 x 1 would
  take 3 GB) for a crop of 1/60000 of it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from tvrpipe.errors import ConfigError

BACKGROUND = 255  # choice: a transparent pixel is composited over white (module docstring)
_PILLOW_RGB = frozenset({"RGB", "RGBX", "L", "1", "P", "CMYK", "YCbCr", "LAB", "HSV"})
_ALPHA = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})
_SIXTEEN_BIT = frozenset({"I;16", "I;16B", "I;16L", "I;16N", "I"})
_SAVE_AS = "save it as an 8-bit RGB PNG or JPEG"
# choice: the centre crop keeps 1/aspect of the resized picture, so past 64:1 the query is a sliver of under
# 2% of it, not the picture the user gave (a banner is 8:1, a panorama 4:1 to 10:1); and the resized frame, S x
# 64 S, stays small whatever S a CLIP takes (10 MB at 224 px, 39 MB at 448) and within swscale's bounds
MAX_ASPECT = 64
_ONE_OF_MANY = frozenset({"MPO", "PSD"})  # several images, the first the picture (module docstring)


def open_image(path: str | os.PathLike[str]) -> Any:
    """The picture at ``path`` as an upright 8-bit RGB PIL image (:func:`as_rgb`), decoded in full.

    Raises:
        ConfigError: the file is missing, is a folder, is not a picture Pillow reads, or holds values tvrpipe
            cannot map to 8-bit RGB (naming it and why).
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{p} is a folder, not a picture")
    if not p.is_file():
        raise ConfigError(f"{p}: no such file")
    try:
        with Image.open(p) as im:
            # before the pixels are decoded: a shape or a file refused costs no decode
            check_shape(*im.size, p)
            frames = getattr(im, "n_frames", 1)
            if frames > 1 and im.format not in _ONE_OF_MANY:
                raise ConfigError(f"{p}: {frames} frames (an animation or pages, {im.format}), not one picture: "
                                  "give a still picture, e.g. one frame exported as PNG")
            _check_integer_source(im, p)  # the file's own tags: a copy (the upright one below) has none
            im.load()
            upright = ImageOps.exif_transpose(im)  # as decode turns a phone video upright
            return as_rgb(upright, p)
    except UnidentifiedImageError:
        raise ConfigError(f"{p} is not a picture (Pillow recognises no image format in it; give a JPEG, PNG, "
                          "WebP, ... file)") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise ConfigError(f"{p}: the picture cannot be read ({type(e).__name__}: {e})") from None


def as_rgb(image: Any, name: str | os.PathLike[str] = "the picture") -> Any:
    """A PIL image of any mode Pillow opens as an 8-bit RGB PIL image, its values mapped as the module docstring
    says (16-bit scaled, float read on [0, 1], transparency over white).

    Raises:
        ConfigError: a mode tvrpipe does not convert, or values outside the mode's range (naming ``name``).

    Example:
        >>> from PIL import Image
        >>> as_rgb(Image.new("I;16", (1, 1), 32768)).getpixel((0, 0))
        (128, 128, 128)
    """
    from PIL import Image

    mode = image.mode
    _check_integer_source(image, name)
    if mode in _SIXTEEN_BIT or mode == "F":
        return Image.fromarray(np.repeat(_grey8(image, name)[..., None], 3, axis=-1))
    if mode in _ALPHA or (mode in _PILLOW_RGB and image.has_transparency_data):
        if mode == "La":  # premultiplied: Pillow divides the alpha out only on the way to LA
            image = image.convert("LA")
        rgba = np.asarray(image.convert("RGBA"), dtype=np.uint32)  # (H, W, 4); a palette's transparency as alpha
        a = rgba[..., 3:]
        rgb = (rgba[..., :3] * a + BACKGROUND * (255 - a) + 127) // 255  # round((c a + 255 (255 - a)) / 255)
        return Image.fromarray(rgb.astype(np.uint8))
    if mode in _PILLOW_RGB:
        return image.convert("RGB")
    raise ConfigError(f"{name}: a picture in Pillow mode {mode!r}, which tvrpipe does not convert to RGB; {_SAVE_AS}")


def check_shape(width: int, height: int, name: str | os.PathLike[str] = "the picture") -> None:
    """A picture of ``width`` x ``height`` px that extraction's resize can make a frame of: no side of 0, the
    long side at most :data:`MAX_ASPECT` times the short one (the module docstring says why).

    Raises:
        ConfigError: naming ``name``, its size and what to do.

    Example:
        >>> check_shape(4000, 500)  # a panorama: 8 times as long as it is wide
        >>> check_shape(60000, 1, "wide.png")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        tvrpipe.errors.ConfigError: wide.png: a picture of 60000 x 1 px, 60,000 times as long as it is wide ...
    """
    if width < 1 or height < 1:
        raise ConfigError(f"{name}: a picture of {width} x {height} px has no pixels; give one with some")
    long, short = max(width, height), min(width, height)
    if long > MAX_ASPECT * short:
        ratio = f"{long / short:,.2f}".rstrip("0").rstrip(".")
        raise ConfigError(f"{name}: a picture of {width} x {height} px, {ratio} times as long as it is "
                          f"wide (at most {MAX_ASPECT}): its centre square, all that a query sees of it, would be "
                          "a sliver; crop the part to search with")


def _check_integer_source(image: Any, name: str | os.PathLike[str]) -> None:
    """Refuse a mode ``I`` picture whose file holds integers of no known white: a TIFF whose samples are not
    unsigned 16-bit, a FITS picture (32-bit). Only an image as Pillow opened it carries its format and tags; a
    copy (or one made in memory) passes, its values checked by :func:`_grey8`."""
    if image.mode != "I":
        return
    fmt = getattr(image, "format", None)
    if fmt == "TIFF":
        tags = getattr(image, "tag_v2", {})
        bits, sample_format = _first(tags.get(258)), _first(tags.get(339))  # BitsPerSample, SampleFormat
        signed = sample_format == 2  # 1 (or none): unsigned, 2: signed
        if bits == 16 and not signed:
            return
        what = f"a {'signed ' if signed else ''}{f'{bits}-bit ' if isinstance(bits, int) else ''}integer TIFF"
    elif fmt == "FITS":
        what = "a 32-bit integer FITS picture"
    else:
        return
    raise ConfigError(f"{name}: {what} (Pillow mode 'I'), whose white is unknown (tvrpipe reads integer pictures "
                      f"of 16 unsigned bits, 65535 white); {_SAVE_AS}, or a 16-bit PNG")


def _first(value: Any) -> Any:
    """A TIFF tag's first value (Pillow gives a tag of one value per sample as a tuple)."""
    return value[0] if isinstance(value, tuple) and value else value


def _grey8(image: Any, name: str | os.PathLike[str]) -> np.ndarray:
    """A 16-bit or float grey picture's values as uint8 (H, W), a transparent value (PNG's tRNS) white."""
    values = np.asarray(image)
    mode = image.mode
    if mode == "F":
        v = values.astype(np.float64)
        finite = v[np.isfinite(v)]
        if finite.size < v.size or (v.size and (finite.min() < 0 or finite.max() > 1)):
            span = (f"span {finite.min():g} to {finite.max():g}" if finite.size else "are none of them numbers") + (
                ", some NaN or infinite" if 0 < finite.size < v.size else "")
            raise ConfigError(f"{name}: a 32-bit float picture (Pillow mode 'F') whose values {span}: tvrpipe reads "
                              f"a float picture on [0, 1] (0 black, 1 white); {_SAVE_AS}")
        grey = np.rint(v * 255)
    else:
        v = values.astype(np.int64)
        if v.size and (v.min() < 0 or v.max() > 65535):
            raise ConfigError(f"{name}: a 32-bit integer picture (Pillow mode {mode!r}) whose values span {v.min()} "
                              f"to {v.max()}, beyond 16 bits, so its white is unknown; {_SAVE_AS}, or a 16-bit PNG")
        grey = np.rint(v / 257)  # 65535 -> 255; no ties: v / 257 is never a half
        if isinstance(image.info.get("transparency"), int):
            grey[v == image.info["transparency"]] = BACKGROUND
    return grey.astype(np.uint8)


def frame_of_image(image: Any, image_size: int) -> np.ndarray:
    """A PIL image as extraction's frame: uint8 ``(S, S, 3)``, S = ``image_size`` (see the module docstring);
    a picture in another mode than RGB is made RGB by :func:`as_rgb` first.

    Raises:
        ConfigError: a shape the resize cannot make a frame of (:func:`check_shape`), a mode or values
            :func:`as_rgb` refuses.

    Example:
        >>> from PIL import Image
        >>> frame_of_image(Image.new("RGB", (320, 240)), 224).shape
        (224, 224, 3)
    """
    import av

    from tvrpipe.features.decode.sampling import centre_crop, resize_dims

    check_shape(*image.size)  # open_image checked a file's, naming it; an image made in memory is checked here
    rgb = np.ascontiguousarray(np.asarray(as_rgb(image), dtype=np.uint8))  # (H, W, 3)
    new_w, new_h = resize_dims(rgb.shape[1], rgb.shape[0], image_size)
    frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
    resized = frame.reformat(width=new_w, height=new_h, format="rgb24", interpolation="BILINEAR").to_ndarray()
    return np.ascontiguousarray(centre_crop(resized[None], image_size)[0])  # (S, S, 3)
