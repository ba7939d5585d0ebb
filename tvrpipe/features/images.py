"""A picture as CLIP's input, preprocessed exactly as extraction preprocesses a decoded frame, for image queries
(``tvrpipe search --image``).

Extraction (:mod:`tvrpipe.features.decode`) turns a frame upright (the video's display rotation), resizes its
short side to S with FFmpeg's swscale **bilinear** filter and the long side to ``int(S * long / short)``
(:func:`~tvrpipe.features.decode.sampling.resize_dims`, torchvision's ``Resize(S)`` rounding), and takes the
centre crop S x S (:func:`~tvrpipe.features.decode.sampling.centre_crop`, torchvision's);
:func:`~tvrpipe.features.clip.encode_frames` then scales it to [0, 1] and normalises it. A picture gets the same
steps: turned upright by its EXIF orientation, converted to RGB (an alpha channel is dropped), resized by
swscale's bilinear filter through PyAV (the call and filter of decode's PyAV reader) and cropped by decode's own
centre crop. So a frame as extraction decoded it (S x S), saved without loss, gives exactly extraction's pixels,
and CLIP's embedding of them is the stored one to the store's float16 rounding (an encoder call over another
number of frames may change the last bit of a float32 sum). A larger picture of a frame comes close but not to
the pixel: a video's frame is scaled from its YUV planes while they are converted to RGB, a picture's RGB pixels
are scaled as they are.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from tvrpipe.errors import ConfigError


def open_image(path: str | os.PathLike[str]) -> Any:
    """The picture at ``path`` as an upright RGB PIL image, decoded in full.

    Raises:
        ConfigError: the file is missing, is a folder, or is not a picture Pillow reads (naming it and why).
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{p} is a folder, not a picture")
    if not p.is_file():
        raise ConfigError(f"{p}: no such file")
    try:
        with Image.open(p) as im:
            im.load()
            upright = ImageOps.exif_transpose(im)  # as decode turns a phone video upright
            return upright.convert("RGB")
    except UnidentifiedImageError:
        raise ConfigError(f"{p} is not a picture (Pillow recognises no image format in it; give a JPEG, PNG, "
                          "WebP, ... file)") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise ConfigError(f"{p}: the picture cannot be read ({type(e).__name__}: {e})") from None


def frame_of_image(image: Any, image_size: int) -> np.ndarray:
    """An RGB PIL image as extraction's frame: uint8 ``(S, S, 3)``, S = ``image_size`` (see the module docstring).

    Example:
        >>> from PIL import Image
        >>> frame_of_image(Image.new("RGB", (320, 240)), 224).shape
        (224, 224, 3)
    """
    import av

    from tvrpipe.features.decode.sampling import centre_crop, resize_dims

    rgb = np.ascontiguousarray(np.asarray(image.convert("RGB"), dtype=np.uint8))  # (H, W, 3)
    new_w, new_h = resize_dims(rgb.shape[1], rgb.shape[0], image_size)
    frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
    resized = frame.reformat(width=new_w, height=new_h, format="rgb24", interpolation="BILINEAR").to_ndarray()
    return np.ascontiguousarray(centre_crop(resized[None], image_size)[0])  # (S, S, 3)
