"""Deterministic synthetic datasets for demos, tests and benchmarks.

Three kinds of tree, each a pure function of its arguments (same seed, byte-identical files):

``python tools/make_dataset.py images DIR --files 20000 --classes 100`` writes an ImageFolder
tree ``DIR/class_XXX/img_XXXXXXX.jpg`` of real JPEGs between ``--min-kb`` and ``--max-kb``
(default 5-40 KB): smooth gradients plus seeded noise, encoded with Pillow, so sizes and
compressibility look like photos rather than constant bytes.

``python tools/make_dataset.py text DIR --files 20000`` writes caption-style samples
``DIR/part_XXX/doc_XXXXXXX.{txt,json}``: UTF-8 text whose word count is log-normal (median
``--median-words``, default 12, shape ``--sigma``, capped at ``--max-words``), so most samples are
a short caption and a few are documents tens of KB long, as in web-scraped image-text sets;
words come from a Zipf-distributed synthetic vocabulary (about 2% of it non-ASCII).  The JSON is
per-sample metadata of the LAION kind (url, width, height, similarity, language, tags).

``python tools/make_dataset.py arrays DIR --files 20000 --shape 16-256,64 --dtype float32``
writes ``DIR/part_XXX/arr_XXXXXXX.{npy,cls}``: one ``.npy`` array per sample whose shape is drawn
per sample from ``--shape`` (a dimension ``LO-HI`` is drawn log-uniformly in ``[LO, HI]``, so
small arrays are common and large ones rare), float arrays standard normal, integer arrays
token-like ids, and a class label drawn from ``--classes``.

Both new kinds put ``--per-dir`` samples (default 1000) in each ``part_XXX`` folder: parallel
file systems slow down on huge flat directories, and so would the pack scan.  Packed with
``shardio.pack(DIR, OUT)``, the fields decode (``decode=True``) to ``str``, a JSON object, a
``numpy.ndarray`` and an ``int``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from dataclasses import dataclass

import numpy as np


def _jpeg(rng: np.random.Generator, target: int) -> bytes:
    from PIL import Image

    # JPEG size grows with pixel count and noise; pick side from the target then nudge quality.
    side = int(np.clip(np.sqrt(target / 0.9) * 1.2, 32, 512))
    yy, xx = np.mgrid[0:side, 0:side].astype(np.float32) / side
    base = np.stack([np.sin(xx * rng.uniform(2, 9) + rng.uniform(0, 6)) * 100 + 128,
                     np.cos(yy * rng.uniform(2, 9) + rng.uniform(0, 6)) * 100 + 128,
                     (xx + yy) * 60 + rng.uniform(0, 100)], axis=-1)
    img = np.clip(base + rng.normal(0, 28, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=85)
    return buf.getvalue()


def make_images(root: str, files: int = 20000, classes: int = 100, min_kb: int = 5,
                max_kb: int = 40, seed: int = 0, pool: int = 400) -> int:
    """Write an ImageFolder tree; returns total bytes.

    ``pool`` distinct JPEGs are encoded, then each file is one of them with a unique JPEG comment
    segment appended after SOI, so files differ byte-wise and decode as valid JPEGs, and 20,000
    files take seconds rather than minutes to generate.

    Raises:
        ValueError: ``files < 0``, ``classes < 1``, ``pool < 1`` or not ``1 <= min_kb <= max_kb``.
    """
    if isinstance(files, bool) or not isinstance(files, int) or files < 0:
        raise ValueError(f"files must be an integer >= 0, got {files!r} (--files)")
    if isinstance(classes, bool) or not isinstance(classes, int) or classes < 1:
        raise ValueError(f"classes must be an integer >= 1, got {classes!r} (--classes)")
    if not (isinstance(min_kb, int) and isinstance(max_kb, int) and 1 <= min_kb <= max_kb):
        raise ValueError(f"sizes need 1 <= min_kb <= max_kb, got min_kb={min_kb!r}, "
                         f"max_kb={max_kb!r} (--min-kb, --max-kb)")
    if isinstance(pool, bool) or not isinstance(pool, int) or pool < 1:
        raise ValueError(f"pool must be an integer >= 1, got {pool!r}")
    rng = np.random.default_rng(seed)
    # min_kb == max_kb draws that one target (numpy's high bound is exclusive); the other
    # ranges draw as before, so a given seed still writes the same bytes.
    high = max_kb * 1024 + (min_kb == max_kb)
    targets = rng.integers(min_kb * 1024, high, size=pool)
    images = [_jpeg(rng, int(t)) for t in targets]
    total = 0
    per_class = -(-files // classes)
    for c in range(classes):
        d = os.path.join(root, f"class_{c:03d}")
        os.makedirs(d, exist_ok=True)
        for k in range(per_class):
            i = c * per_class + k
            if i >= files:
                break
            img = images[int(rng.integers(pool))]
            note = f"shardio sample {i}".encode()
            com = b"\xff\xfe" + (len(note) + 2).to_bytes(2, "big") + note
            data = img[:2] + com + img[2:]
            with open(os.path.join(d, f"img_{i:07d}.jpg"), "wb") as f:
                f.write(data)
            total += len(data)
    return total


@dataclass(frozen=True)
class TreeSummary:
    """What a generator wrote: samples, files (several per sample) and their total bytes."""

    samples: int
    files: int
    bytes: int


def _sample_dir(root: str, i: int, per_dir: int) -> str:
    d = os.path.join(root, f"part_{i // per_dir:03d}")
    if i % per_dir == 0:
        os.makedirs(d, exist_ok=True)
    return d


def _write(path: str, data: bytes) -> int:
    with open(path, "wb") as f:
        f.write(data)
    return len(data)


_ONSETS = ("", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
           "st", "tr", "ch", "sh", "gr", "pl", "br")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou", "y")
_ACCENTED = ("é", "è", "ü", "ö", "ä", "ñ", "ç", "å", "ø", "ł")


def _vocabulary(rng: np.random.Generator, size: int) -> list[str]:
    """Pseudo-words, shorter at frequent ranks (Zipf's law of abbreviation), ~2% non-ASCII."""
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < size:
        rank = len(words)
        syllables = 1 + min(3, int(rng.exponential(0.4 + rank / size * 1.6)))
        w = "".join(_ONSETS[int(rng.integers(len(_ONSETS)))]
                    + _VOWELS[int(rng.integers(len(_VOWELS)))] for _ in range(syllables))
        if rng.random() < 0.02:
            k = int(rng.integers(len(w)))
            w = w[:k] + _ACCENTED[int(rng.integers(len(_ACCENTED)))] + w[k + 1:]
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


def _sentences(rng: np.random.Generator, words: list[str]) -> str:
    out: list[str] = []
    i = 0
    while i < len(words):
        n = min(len(words) - i, 4 + int(rng.exponential(10)))
        chunk = words[i:i + n]
        chunk[0] = chunk[0].capitalize()
        for j in range(1, len(chunk) - 1):
            if rng.random() < 0.06:
                chunk[j] += ","
        out.append(" ".join(chunk) + ".")
        i += n
    return " ".join(out)


def make_text(root: str, files: int = 20000, median_words: int = 12, sigma: float = 1.1,
              max_words: int = 20000, seed: int = 0, per_dir: int = 1000,
              vocab: int = 20000) -> TreeSummary:
    """Write ``files`` caption samples (``.txt`` + ``.json`` each) under ``root``.

    Word counts are log-normal: ``median_words`` at the median, ``sigma`` the shape (1.1 puts
    the 99th percentile near 13x the median), clipped to ``[1, max_words]``.  Words are drawn from
    a ``vocab``-word synthetic vocabulary with Zipf frequencies (exponent 1.07).

    Returns:
        samples, files (two per sample) and total bytes written.
    """
    if files < 0 or median_words < 1 or max_words < 1 or sigma < 0 or per_dir < 1 or vocab < 1:
        raise ValueError("files >= 0, median_words >= 1, max_words >= 1, sigma >= 0, "
                         "per_dir >= 1 and vocab >= 1 are required")
    rng = np.random.default_rng(seed)
    lexicon = _vocabulary(rng, vocab)
    cdf = np.cumsum(1.0 / np.arange(1, vocab + 1) ** 1.07)
    cdf /= cdf[-1]
    langs = ("en", "en", "en", "en", "de", "fr", "es", "nl", "sv", "pl")
    counts = np.clip(np.rint(rng.lognormal(np.log(median_words), sigma, size=files)), 1,
                     max_words).astype(np.int64)
    total = 0
    for i in range(files):
        d = _sample_dir(root, i, per_dir)
        ids = np.minimum(np.searchsorted(cdf, rng.random(int(counts[i]))), vocab - 1)
        text = _sentences(rng, [lexicon[k] for k in ids.tolist()])
        width, height = (int(x) for x in np.clip(rng.lognormal(6.3, 0.5, size=2), 64, 8192))
        meta = {
            "key": f"doc_{i:07d}",
            "url": f"https://images.example.org/{int(rng.integers(1 << 40)):010x}.jpg",
            "width": width,
            "height": height,
            "similarity": round(float(rng.beta(8, 20)), 4),
            "punsafe": round(float(rng.beta(0.5, 30)), 5),
            "language": langs[int(rng.integers(len(langs)))],
            "words": int(counts[i]),
            "tags": [lexicon[k] for k in rng.integers(0, 200, size=int(rng.integers(0, 6)))],
        }
        total += _write(os.path.join(d, f"doc_{i:07d}.txt"), text.encode("utf-8"))
        total += _write(os.path.join(d, f"doc_{i:07d}.json"),
                        json.dumps(meta, ensure_ascii=False, sort_keys=True).encode("utf-8"))
    return TreeSummary(samples=files, files=2 * files, bytes=total)


ARRAY_DTYPES = ("float32", "float16", "float64", "int64", "int32", "int16", "uint8")


def parse_shape(spec: str) -> list[tuple[int, int]]:
    """``"16-256,64"`` -> ``[(16, 256), (64, 64)]``: each dimension fixed or an inclusive range.

    Raises:
        ValueError: an empty, non-numeric, zero or reversed dimension.
    """
    dims: list[tuple[int, int]] = []
    for part in spec.split(","):
        lo_s, sep, hi_s = part.strip().partition("-")
        try:
            lo = int(lo_s)
            hi = int(hi_s) if sep else lo
        except ValueError:
            raise ValueError(f"shape {spec!r}: dimension {part!r} is not N or LO-HI "
                             "(e.g. --shape 16-256,64)") from None
        if lo < 1 or hi < lo:
            raise ValueError(f"shape {spec!r}: dimension {part!r} needs 1 <= LO <= HI")
        dims.append((lo, hi))
    return dims


def make_arrays(root: str, files: int = 20000, shape: str = "16-256,64", dtype: str = "float32",
                classes: int = 10, seed: int = 0, per_dir: int = 1000) -> TreeSummary:
    """Write ``files`` samples (``.npy`` + ``.cls`` each) under ``root``.

    Each sample's shape is drawn from ``shape`` (see :func:`parse_shape`; ranges log-uniform).
    Float dtypes hold standard-normal values; integer dtypes token-like ids (Zipf-ish, below
    32,000, or the dtype's maximum); labels are uniform in ``[0, classes)``.

    Returns:
        samples, files (two per sample) and total bytes written.
    """
    if dtype not in ARRAY_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(ARRAY_DTYPES)}")
    if files < 0 or classes < 1 or per_dir < 1:
        raise ValueError("files >= 0, classes >= 1 and per_dir >= 1 are required")
    dims = parse_shape(shape)
    dt = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    total = 0
    for i in range(files):
        d = _sample_dir(root, i, per_dir)
        shp = tuple(lo if lo == hi else int(np.exp(rng.uniform(np.log(lo), np.log(hi + 1))))
                    for lo, hi in dims)
        n = int(np.prod(shp))
        if dt.kind == "f":
            arr = rng.standard_normal(n, dtype=np.float32).astype(dt).reshape(shp)
        else:
            top = min(32000, int(np.iinfo(dt).max))
            arr = np.minimum(rng.zipf(1.3, size=n) - 1, top).astype(dt).reshape(shp)
        buf = io.BytesIO()
        np.save(buf, arr, allow_pickle=False)
        total += _write(os.path.join(d, f"arr_{i:07d}.npy"), buf.getvalue())
        total += _write(os.path.join(d, f"arr_{i:07d}.cls"),
                        str(int(rng.integers(classes))).encode())
    return TreeSummary(samples=files, files=2 * files, bytes=total)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="kind", required=True)
    im = sub.add_parser("images", help="ImageFolder tree of JPEGs (class_XXX/img_XXXXXXX.jpg)")
    im.add_argument("root")
    im.add_argument("--files", type=int, default=20000)
    im.add_argument("--classes", type=int, default=100)
    im.add_argument("--min-kb", type=int, default=5)
    im.add_argument("--max-kb", type=int, default=40)
    im.add_argument("--seed", type=int, default=0)
    tx = sub.add_parser("text", help="caption-style .txt + .json samples, heavy-tailed lengths")
    tx.add_argument("root")
    tx.add_argument("--files", type=int, default=20000, help="samples (two files each)")
    tx.add_argument("--median-words", type=int, default=12)
    tx.add_argument("--sigma", type=float, default=1.1, help="log-normal shape of word counts")
    tx.add_argument("--max-words", type=int, default=20000)
    tx.add_argument("--per-dir", type=int, default=1000, help="samples per part_XXX folder")
    tx.add_argument("--seed", type=int, default=0)
    ar = sub.add_parser("arrays", help=".npy arrays of varying shapes + .cls labels")
    ar.add_argument("root")
    ar.add_argument("--files", type=int, default=20000, help="samples (two files each)")
    ar.add_argument("--shape", default="16-256,64",
                    help="comma-separated dimensions, each N or LO-HI (default 16-256,64)")
    ar.add_argument("--dtype", default="float32", choices=ARRAY_DTYPES)
    ar.add_argument("--classes", type=int, default=10)
    ar.add_argument("--per-dir", type=int, default=1000, help="samples per part_XXX folder")
    ar.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.seed < 0:  # numpy's generator takes no negative seed
        p.error(f"--seed {a.seed}: give an integer >= 0")
    try:
        if a.kind == "images":
            total = make_images(a.root, a.files, a.classes, a.min_kb, a.max_kb, a.seed)
            print(f"wrote {a.files} images, {total / 1e6:.1f} MB, under {a.root}",
                  file=sys.stderr)
            return 0
        if a.kind == "text":
            summary = make_text(a.root, a.files, a.median_words, a.sigma, a.max_words, a.seed,
                                a.per_dir)
        else:
            summary = make_arrays(a.root, a.files, a.shape, a.dtype, a.classes, a.seed,
                                  a.per_dir)
    except ValueError as exc:
        p.error(str(exc))
    print(f"wrote {summary.samples} {a.kind} samples ({summary.files} files), "
          f"{summary.bytes / 1e6:.1f} MB, under {a.root}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
