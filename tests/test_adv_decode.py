"""Adversarial tests of the built-in decoders, the zstd codec, the manifest and ``inspect``."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardio
from shardio.errors import DecodeError, ManifestCorruptError, UsageError
from shardio.manifest import _body_digest


def _pack(src: Path, out: Path, **options: Any) -> Path:
    options.setdefault("samples_per_shard", 4)
    shardio.pack(src, out, fsync=False, progress=False, **options)
    return out


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=True)
    return buf.getvalue()


def test_an_object_npy_needs_allow_pickle_and_decodes_with_it(tmp_path: Path) -> None:
    """An .npy of object dtype (a valid file; numpy pickles its items) was a DecodeError saying
    the source was malformed and to repack, with allow_pickle=True as well: the user's trust was
    not honoured and the message named no real fix."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.npy").write_bytes(_npy(np.array([1, "two", None], dtype=object)))
    (src / "b.npy").write_bytes(_npy(np.arange(3)))
    (src / "c.npy").write_bytes(b"\x93NUMPY\x01\x00")  # cut inside its header: malformed
    ds = _pack(src, tmp_path / "ds")
    with pytest.raises(UsageError, match=r"sample 'a': field 'npy' .*allow_pickle=True"):
        shardio.ShardDataset(ds, decode=True)[0]
    np.testing.assert_array_equal(shardio.ShardDataset(ds, decode=True)[1]["npy"], np.arange(3))
    got = shardio.ShardDataset(ds, decode=True, allow_pickle=True)[0]["npy"]
    assert got.dtype == object and got.tolist() == [1, "two", None]
    for allow in (False, True):
        with pytest.raises(DecodeError, match=r"sample 'c' field 'npy' does not decode"):
            shardio.ShardDataset(ds, decode=True, allow_pickle=allow)[2]


def _reseal(root: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit ``root/manifest.json`` and recompute its own digest (so the edit itself is tested)."""
    path = root / "manifest.json"
    data = json.loads(path.read_bytes())
    edit(data)
    data["manifest_digest"] = _body_digest(data)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def _strict_json(text: str) -> Any:
    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("ratio", [float("nan"), float("inf"), float("-inf"), 10**400],
                         ids=["nan", "inf", "-inf", "huge_int"])
def test_inspect_of_a_ratio_past_the_floats_is_unknown(ratio: float, cli: Any,
                                                       tmp_path: Path) -> None:
    """json reads NaN and Infinity in a manifest's (informative) stats; `inspect --json` then
    printed them as NaN/Infinity, which no strict JSON parser (jq, JSON.parse) accepts; an
    integer past a float's range was an OverflowError traceback."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"s{i}.txt").write_text(f"text {i}")
    ds = _pack(src, tmp_path / "ds", compress="zstd")
    _reseal(ds, lambda d: d["stats"].update(compression_ratio=ratio))
    rc, out, err = cli("inspect", "--json", ds)
    assert rc == 0, err
    assert _strict_json(out)["compression_ratio"] is None
    rc, out, err = cli("inspect", ds)
    assert rc == 0 and "compression zstd:3 (ratio unknown)" in out, out + err


def test_inspect_json_shows_only_the_compression_settings_shardio_knows(cli: Any,
                                                                      tmp_path: Path) -> None:
    """The compression section was printed whole: a key shardio does not know (unchecked,
    digest resealed) holding NaN made `inspect --json` print JSON no strict parser takes."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("text " * 50)
    ds = _pack(src, tmp_path / "ds", compress="zstd:5")
    _reseal(ds, lambda d: d["compression"].update(extra=float("nan")))
    rc, out, err = cli("inspect", "--json", ds)
    assert rc == 0, err
    assert _strict_json(out)["compression"] == {
        "codec": "zstd", "level": 5, "dictionary": None, "dictionary_digest": None}


def test_an_image_past_pillows_pixel_limit_names_the_limit(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A well-formed image over Pillow's decompression-bomb limit was a DecodeError saying the
    source file was malformed and to repack it; the setting to raise (trusted data) is
    PIL.Image.MAX_IMAGE_PIXELS.  Past the limit but under twice it Pillow only warns: under
    -W error that warning was reported the same wrong way."""
    import warnings

    from PIL import Image

    src = tmp_path / "src"
    src.mkdir()
    Image.new("RGB", (100, 30), (1, 2, 3)).save(src / "big.png")
    ds = _pack(src, tmp_path / "ds")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 3000 pixels: over twice the limit
    with pytest.raises(DecodeError, match=r"sample 'big' field 'png' .*decompression bomb.*"
                                          r"PIL\.Image\.MAX_IMAGE_PIXELS, now 1000") as info:
        shardio.ShardDataset(ds, decode=True)[0]
    assert "malformed" not in str(info.value)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2000)  # over the limit, under twice it
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with pytest.raises(DecodeError, match=r"MAX_IMAGE_PIXELS, now 2000"):
            shardio.ShardDataset(ds, decode=True)[0]
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)  # the fix the message names
    assert shardio.ShardDataset(ds, decode=True)[0]["png"].shape == (30, 100, 3)


def test_a_damaged_zstd_frame_header_unverified_is_a_checksum_error_and_repaired(
        tmp_path: Path) -> None:
    """With verify=False a bit flipped in a compressed field's frame header (its content size
    now ~2**62) made zstd allocate that size: a bare MemoryError, past the check the reader
    makes on a field that does not decode and past the repair ladder.  The header's size is
    now compared with the index's before decompressing."""
    import shutil

    from shardio.errors import ChecksumMismatchError, ShardCorruptError

    src = tmp_path / "src"
    src.mkdir()
    texts = {f"s{i}": f"hello world {i} ".encode() * 100 for i in range(3)}
    for key, text in texts.items():
        (src / f"{key}.txt").write_bytes(text)
    ds = _pack(src, tmp_path / "ds", compress="zstd")
    replica = tmp_path / "replica"
    shutil.copytree(ds, replica)
    shard = ds / "shard-000000.tar"
    data = bytearray(shard.read_bytes())
    at = data.index(bytes.fromhex("28b52ffd"))  # the first field's zstd frame
    data[at + 4] ^= 0x80  # frame header descriptor: the content size now takes 8 bytes
    shard.write_bytes(bytes(data))
    with shardio.open_dataset(ds, verify=False) as reader, pytest.raises(
            ShardCorruptError) as info:
        list(reader)
    assert isinstance(info.value, ChecksumMismatchError) or "checksum" in str(info.value)
    with shardio.open_dataset(ds, verify=False, replicas=[str(replica)]) as reader:
        assert {s["__key__"]: bytes(s["txt"]) for s in reader} == texts


@pytest.mark.parametrize("image_mode", ["I;16", "I;16B", "I;16L", "I;16N"])
def test_sixteen_bit_images_keep_their_values_in_every_sixteen_bit_mode(
        image_mode: str, tmp_path: Path) -> None:
    """Pillow's convert() between two 16-bit modes clips at 255: a big-endian 16-bit TIFF read
    with image_mode="I;16", or a 16-bit PNG with "I;16B"/"I;16L"/"I;16N", came out as
    [0, 255, 255, 255] for [0, 1000, 40000, 65535], silently."""
    from PIL import Image

    values = np.array([[0, 1000, 40000, 65535], [1, 256, 4096, 65534]], dtype=np.uint16)
    src = tmp_path / "src"
    src.mkdir()
    Image.fromarray(values).save(src / "little.png")  # Pillow opens it as I;16
    Image.fromarray(values.astype(">u2")).save(src / "big.tif")  # opened as I;16B
    ds = _pack(src, tmp_path / "ds")
    got = {s["__key__"]: s for s in shardio.ShardDataset(ds, decode=True, image_mode=image_mode)}
    want = {"I;16B": ">u2", "I;16N": "=u2"}.get(image_mode, "<u2")  # (Pillow's, for the mode)
    for key, field in (("little", "png"), ("big", "tif")):
        array = got[key][field]
        np.testing.assert_array_equal(array, values, err_msg=f"{key}.{field}")
        assert array.dtype == np.dtype(want) and array.flags.writeable


def _image_bytes(fmt: str, mode: str = "RGB") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, (16, 8), 200 if mode == "L" else (200, 10, 30)).save(buf, fmt)
    return buf.getvalue()


def test_image_fields_decode_only_from_the_image_formats(tmp_path: Path) -> None:
    """Image.open tried every Pillow plugin: a .jpg field holding PostScript went to the EPS
    plugin, whose load runs Ghostscript (a PostScript interpreter) on the dataset's bytes
    ("Unable to locate Ghostscript" here; run, where it is installed), and a .png holding a
    TGA, ICO, SGI, ... decoded.  Now only the formats the image extensions name are tried,
    whatever the extension (a .jpg that is a PNG still decodes)."""
    eps = (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 16 8\n%%EndComments\n"
           b"newpath 0 0 moveto 16 8 lineto stroke\nshowpage\n%%EOF\n")
    src = tmp_path / "src"
    src.mkdir()
    (src / "ps.jpg").write_bytes(eps)
    (src / "tga.png").write_bytes(_image_bytes("TGA"))
    (src / "sgi.png").write_bytes(_image_bytes("SGI"))
    (src / "png.jpg").write_bytes(_image_bytes("PNG"))
    (src / "gray.pgm").write_bytes(_image_bytes("PPM", "L"))
    for fmt, ext in (("GIF", "gif"), ("WEBP", "webp"), ("TIFF", "tif"), ("BMP", "bmp")):
        (src / f"{ext}.{ext}").write_bytes(_image_bytes(fmt))
    ds = _pack(src, tmp_path / "ds")
    dataset = shardio.ShardDataset(ds, decode=True, shuffle=False)
    keys = [s["__key__"] for s in shardio.ShardDataset(ds, shuffle=False)]
    for i, key in enumerate(keys):
        if key in ("ps", "tga", "sgi"):
            with pytest.raises(DecodeError, match=rf"sample '{key}' .*not an image in one of "
                                                  r"the formats JPEG, PNG") as info:
                dataset[i]
            assert "Ghostscript" not in str(info.value)
        else:
            sample = dataset[i]
            image = next(v for k, v in sample.items() if k != "__key__")
            assert image.shape == (8, 16, 3) and image.dtype == np.uint8, key


FILE_CLASHES: dict[str, Callable[[dict[str, Any]], None]] = {
    "index_is_another_shard": lambda d: d["shards"][0].update(index=d["shards"][1]["path"]),
    "index_is_its_own_shard": lambda d: d["shards"][0].update(index=d["shards"][0]["path"]),
    "index_is_another_index": lambda d: d["shards"][0].update(index=d["shards"][1]["index"]),
    "index_is_the_manifest": lambda d: d["shards"][0].update(index="./manifest.json"),
    "dictionary_is_a_shard": lambda d: d.update(compression={
        "codec": "zstd", "level": 3, "dictionary": d["shards"][2]["path"],
        "dictionary_digest": "0"}),
}


@pytest.mark.parametrize("clash", sorted(FILE_CLASHES))
def test_a_manifest_naming_one_file_twice_is_refused_before_repair_writes(
        clash: str, cli: Any, tmp_path: Path) -> None:
    """A manifest (edited, digest resealed) whose shard index path named another shard or the
    manifest itself loaded; `shardio repair` then found "the index damaged" and wrote an index
    over that file, destroying a good shard (or the manifest)."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"s{i}.txt").write_text(f"text {i} " * 20)
    ds = _pack(src, tmp_path / "ds", samples_per_shard=2)
    _reseal(ds, FILE_CLASHES[clash])
    before = {p.name: p.read_bytes() for p in ds.iterdir()}
    with pytest.raises(ManifestCorruptError, match=r"names \S+ twice"):
        shardio.Manifest.load(ds)
    rc, _out, err = cli("repair", ds)
    assert rc == 1 and "ManifestCorruptError" in err and "twice" in err, err
    assert {p.name: p.read_bytes() for p in ds.iterdir()} == before


@pytest.mark.parametrize("field", ["samples", "bytes"])
def test_shard_counts_whose_total_overflows_int64_are_refused(field: str, tmp_path: Path) -> None:
    """Each shard's count was bounded (below 2**60) but not their sum: nine shards of 2**60 - 1
    samples (digest resealed) loaded, and every reader died of numpy's int64 cumsum wrapping
    negative: "ValueError: __len__() should return >= 0"."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(18):
        (src / f"s{i:02d}.txt").write_text(f"t{i}")
    ds = _pack(src, tmp_path / "ds", samples_per_shard=2)

    def edit(d: dict[str, Any]) -> None:
        assert len(d["shards"]) == 9
        for shard in d["shards"]:
            shard[field] = (1 << 60) - 1

    _reseal(ds, edit)
    with pytest.raises(ManifestCorruptError, match=rf"shards' {field} add up to"):
        shardio.Manifest.load(ds)
    with pytest.raises(ManifestCorruptError, match=rf"shards' {field} add up to"):
        len(shardio.ShardDataset(ds))


@pytest.mark.parametrize(("source", "image_mode", "want"), [
    ("P", "I;16", [[100, 100]]),
    ("L", "La", [[[77, 255], [77, 255]]]),
    ("L", "RGBa", [[[77, 77, 77, 255], [77, 77, 77, 255]]]),
    ("LA", "RGBa", [[[77, 77, 77, 255], [77, 77, 77, 255]]]),
    ("I;16", "La", [[[156, 255], [156, 255]]]),
])
def test_image_modes_pillow_converts_only_indirectly(source: str, image_mode: str,
                                                     want: list[Any], tmp_path: Path) -> None:
    """ReadOptions accepts every Pillow mode, but Pillow has no direct conversion for some
    pairs: a palette PNG among 16-bit ones read with image_mode="I;16", or a grayscale image
    with "La"/"RGBa", was a DecodeError ("conversion not supported") mid-epoch."""
    from PIL import Image

    if source == "P":
        image = Image.new("P", (2, 1))
        image.putpalette([100, 100, 100] * 256)
    elif source == "I;16":
        image = Image.fromarray(np.full((1, 2), 40000, dtype=np.uint16))
    else:
        image = Image.new(source, (2, 1), 77 if source == "L" else (77, 255))
    src = tmp_path / "src"
    src.mkdir()
    image.save(src / "a.png")
    ds = _pack(src, tmp_path / "ds")
    got = shardio.ShardDataset(ds, decode=True, image_mode=image_mode)[0]["png"]
    assert got.tolist() == want


@pytest.mark.parametrize("allow_pickle", [False, True])
def test_an_npz_in_an_npy_field_is_a_decode_error_not_a_lazy_archive(
        allow_pickle: bool, tmp_path: Path) -> None:
    """np.load opens a zip as a lazy NpzFile: an .npz named .npy was delivered as one (not an
    array), and under DataLoader workers, which cannot pickle it (it holds a lock), the loader
    waited for ever (until its timeout)."""
    from torch.utils.data import DataLoader

    src = tmp_path / "src"
    src.mkdir()
    for i in range(2):
        buf = io.BytesIO()
        np.savez(buf, a=np.arange(3))
        (src / f"s{i}.npy").write_bytes(buf.getvalue())
    ds = _pack(src, tmp_path / "ds")
    dataset = shardio.ShardDataset(ds, decode=True, allow_pickle=allow_pickle)
    with pytest.raises(DecodeError, match=r"field 'npy' does not decode \(it is an \.npz "):
        dataset[0]
    loader = DataLoader(dataset, batch_size=1, num_workers=1, collate_fn=list, timeout=60)
    with pytest.raises(DecodeError, match=r"\.npz archive"):
        list(loader)


def test_a_dataset_directory_named_like_a_json_file_is_read(cli: Any, tmp_path: Path) -> None:
    """Manifest.load took any path ending in .json for the manifest itself: `shardio pack SRC
    data.json` wrote a dataset no reader, `inspect` or `verify` could open ("data.json is a
    directory, not a manifest")."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("hello")
    ds = _pack(src, tmp_path / "data.json")
    assert shardio.Manifest.load(ds).num_samples == 1
    assert shardio.Manifest.load(ds / "manifest.json").num_samples == 1
    assert shardio.ShardDataset(ds, decode=True)[0]["txt"] == "hello"
    with shardio.open_dataset(ds) as reader:
        assert [bytes(s["txt"]) for s in reader] == [b"hello"]
    rc, out, err = cli("inspect", "--json", ds)
    assert rc == 0 and json.loads(out)["samples"] == 1, err
    rc, out, err = cli("verify", ds)
    assert rc == 0, out + err
