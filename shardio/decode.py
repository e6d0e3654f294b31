"""Built-in field decoders, chosen by the field's last extension (WebDataset naming).

=================================  ======================================================
extension                          decoded value
=================================  ======================================================
jpg jpeg png ppm pgm bmp webp gif  ``numpy.uint8`` array, HWC, RGB (Pillow)
tif tiff
cls cls2 index id                  ``int``
json jsn                           parsed JSON
txt text                           ``str``
npy                                ``numpy.ndarray`` (of ``object`` dtype: only with
                                   ``allow_pickle=True``)
pickle pyd pkl                     unpickled object, only with ``allow_pickle=True``
anything else                      unchanged (``bytes``; a read-only ``uint8`` array with zero_copy)
=================================  ======================================================

An image field is decoded from JPEG, PNG, GIF, WebP, TIFF, BMP or PPM/PGM/PBM data, whichever
its extension says; other formats (Pillow's EPS plugin would run Ghostscript on the bytes) are
a :class:`~shardio.errors.DecodeError`.

Unpickling runs arbitrary code, so a pickle field (or an ``npy`` of ``object`` dtype, which
numpy stores pickled) without ``allow_pickle=True`` raises :class:`~shardio.errors.UsageError`
rather than being decoded or silently passed through.
"""

from __future__ import annotations

import io
import json
import sys
from typing import Any

import numpy as np

from .errors import DecodeError, MissingDependencyError, UsageError

__all__ = ["IMAGE_EXTENSIONS", "decode_field", "decode_sample"]

IMAGE_EXTENSIONS = frozenset({"jpg", "jpeg", "png", "ppm", "pgm", "bmp", "webp", "gif", "tif", "tiff"})
# The Pillow formats an image field is decoded from (whatever its extension: a .jpg that is a
# PNG decodes): never Pillow's other plugins, such as EPS, whose load runs Ghostscript (a
# PostScript interpreter) on the field's bytes.  (JPEG covers MPO, DIB is BMP's headerless form.)
_PIL_FORMATS = ("JPEG", "PNG", "GIF", "WEBP", "TIFF", "BMP", "DIB", "PPM")
_INT = frozenset({"cls", "cls2", "index", "id"})
_PICKLE = frozenset({"pickle", "pyd", "pkl"})
_TEXTUAL = frozenset({"json", "jsn", "txt", "text"})
# Pillow's 16-bit modes and the numpy dtypes of their arrays.
_I16_DTYPES = {"I;16": "<u2", "I;16L": "<u2", "I;16B": ">u2", "I;16N": "=u2"}


def _image(data: bytes, mode: str) -> np.ndarray:
    try:
        from PIL import UnidentifiedImageError
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MissingDependencyError("decoding images needs Pillow: pip install pillow") from exc
    try:
        return _pillow_decode(data, mode)
    except UnidentifiedImageError as exc:  # (its message names a BytesIO object)
        raise ValueError(f"not an image in one of the formats {', '.join(_PIL_FORMATS)}") from exc


def _pillow_decode(data: bytes, mode: str) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(data), formats=_PIL_FORMATS) as img:
        img.draft(mode, img.size)  # lets JPEG decode straight into the target mode
        if mode in _I16_DTYPES and img.mode in _I16_DTYPES:
            # Pillow's convert() between two 16-bit modes (I;16 <-> I;16B, ...) clips every
            # value at 255; only the byte order differs, so numpy converts it (a copy).
            return np.asarray(img).astype(_I16_DTYPES[mode])
        if mode not in ("I", "F") and not mode.startswith("I;16") and (
                img.mode.startswith("I;16") or img.mode == "I"):
            # 16-bit images (PNG, TIFF): Pillow's convert() to an 8-bit mode clips at 255,
            # which turns a gradient into a few levels; scale the 16 bits down instead (a
            # 32-bit image whose values fit 8 bits is left to convert()).
            wide = np.asarray(img)
            top = int(wide.max()) if wide.size else 0
            if (img.mode != "I" or top > 0xFF) and top <= 0xFFFF and int(wide.min()) >= 0:
                narrow = (wide.astype(np.uint32) >> 8).astype(np.uint8)
                return np.array(_convert(Image.fromarray(narrow, "L"), mode))
        # np.array, not np.asarray: an array over Pillow's bytes is read-only (torch warns at
        # from_numpy and in-place augmentations fail); one copy, next to the decode itself.
        return np.array(_convert(img, mode))


def _convert(img: Any, mode: str) -> Any:
    try:
        return img.convert(mode)
    except ValueError:
        # Pillow converts some pairs only through another mode (P -> I;16, L -> La, LA ->
        # RGBa: "conversion not supported"); RGBA converts to every mode.
        if img.mode in (mode, "RGBA"):
            raise
        return img.convert("RGBA").convert(mode)


def _npy(name: str, data: bytes, allow_pickle: bool) -> Any:
    try:
        value = np.load(io.BytesIO(data), allow_pickle=allow_pickle)
    except ValueError as exc:
        # numpy refuses an object array (its items are pickled) or a pickle in an .npy: a valid
        # file the user did not trust, not a malformed one ("allow_pickle" is in both messages)
        if allow_pickle or "allow_pickle" not in str(exc):
            raise
    else:
        if not isinstance(value, np.lib.npyio.NpzFile):  # (or, trusted, a pickle's object)
            return value
        # np.load opens a zip as a lazy NpzFile (a lock inside: a DataLoader worker could
        # not send it and the loader waited for ever), not the array the field promises
        value.close()
        raise ValueError("it is an .npz archive, not an .npy array")
    raise UsageError(
        f"field {name!r} is an .npy holding pickled data (an array of object dtype); "
        "unpickling runs arbitrary code, so shardio decodes it only with allow_pickle=True "
        "(trust the data first)")


def decode_field(name: str, data: bytes, *, allow_pickle: bool = False,
                 image_mode: str = "RGB") -> Any:
    """Decode one field by its extension (see the module table)."""
    ext = name.rsplit(".", 1)[-1].lower()
    if ext in IMAGE_EXTENSIONS:
        return _image(data, image_mode)
    if not isinstance(data, bytes) and (ext in _INT or ext in _TEXTUAL or ext in _PICKLE):
        data = bytes(data)  # an array viewing shared memory (zero_copy=True): parsers want bytes
    if ext in _INT:
        return int(data)
    if ext in ("json", "jsn"):
        return json.loads(data)
    if ext in ("txt", "text"):
        return bytes(data).decode("utf-8")
    if ext == "npy":
        return _npy(name, data, allow_pickle)
    if ext in _PICKLE:
        if not allow_pickle:
            raise UsageError(
                f"field {name!r} is a pickle; unpickling runs arbitrary code, so shardio decodes it "
                "only with allow_pickle=True (trust the data first)"
            )
        import pickle

        return pickle.loads(data)
    return data


def _pixel_limit(exc: BaseException) -> int | None:
    """``PIL.Image.MAX_IMAGE_PIXELS`` when ``exc`` is Pillow refusing an image over it (the
    warning, past the limit but under twice it, raises under ``-W error``), else None."""
    image = sys.modules.get("PIL.Image")
    if image is None or not isinstance(
            exc, (image.DecompressionBombError, image.DecompressionBombWarning)):
        return None
    return image.MAX_IMAGE_PIXELS  # type: ignore[no-any-return]


def decode_sample(sample: dict[str, Any], *, allow_pickle: bool = False,
                  image_mode: str = "RGB") -> dict[str, Any]:
    """Decode every field of a raw sample; keys starting with ``__`` are left as they are.

    Raises:
        DecodeError: a field does not decode (its checksum passed, so the stored payload
            itself is malformed); the message names the sample and field.
        UsageError: a pickle field without ``allow_pickle``.
    """
    out: dict[str, Any] = {}
    for k, v in sample.items():
        if k.startswith("__"):
            out[k] = v
            continue
        try:
            out[k] = decode_field(k, v, allow_pickle=allow_pickle, image_mode=image_mode)
        except MissingDependencyError:
            raise
        except UsageError as exc:  # (a pickle without allow_pickle): say which sample it is
            raise UsageError(f"sample {sample.get('__key__')!r}: {exc}") from None
        except Exception as exc:
            limit = _pixel_limit(exc)
            if limit is not None:  # (a well-formed image: the setting is the fix)
                raise DecodeError(
                    f"sample {sample.get('__key__')!r} field {k!r} is refused by Pillow as a "
                    f"possible decompression bomb ({exc}); if the data is trusted, raise the "
                    f"limit in every process that decodes (PIL.Image.MAX_IMAGE_PIXELS, now "
                    f"{limit}; None for no limit), or read raw bytes with decode=False"
                ) from exc
            image = k.rsplit(".", 1)[-1].lower() in IMAGE_EXTENSIONS
            raise DecodeError(
                f"sample {sample.get('__key__')!r} field {k!r} does not decode ({exc}); the "
                "source file was malformed when packed" + (
                    f", or Pillow cannot convert this image to image_mode={image_mode!r}"
                    if image else "") + ": fix it and repack, or read raw bytes with "
                "decode=False"
            ) from exc
    return out
