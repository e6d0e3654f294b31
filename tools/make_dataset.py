"""Deterministic synthetic datasets for demos, tests and benchmarks.

``python tools/make_dataset.py images DIR --files 20000 --classes 100`` writes an ImageFolder
tree ``DIR/class_XXX/img_XXXXXXX.jpg`` of real JPEGs between ``--min-kb`` and ``--max-kb``
(default 5-40 KB): smooth gradients plus seeded noise, encoded with Pillow, so sizes and
compressibility look like photos rather than constant bytes.  Same seed, same bytes.
"""

from __future__ import annotations

import argparse
import io
import os
import sys

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
    """
    rng = np.random.default_rng(seed)
    targets = rng.integers(min_kb * 1024, max_kb * 1024, size=pool)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="kind", required=True)
    im = sub.add_parser("images")
    im.add_argument("root")
    im.add_argument("--files", type=int, default=20000)
    im.add_argument("--classes", type=int, default=100)
    im.add_argument("--min-kb", type=int, default=5)
    im.add_argument("--max-kb", type=int, default=40)
    im.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    total = make_images(a.root, a.files, a.classes, a.min_kb, a.max_kb, a.seed)
    print(f"wrote {a.files} images, {total / 1e6:.1f} MB, under {a.root}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
