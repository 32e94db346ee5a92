"""Bad input: every kind is converted or skipped-and-counted; never a crash, never garbage."""
import collections
import io
import os
import tarfile

import numpy as np
import pytest
from PIL import Image

from input_pipeline import decode, pipeline, synthetic, tar_source
from input_pipeline.records import SKIP_REASONS, encode_record
from conftest import KeyTokenizer


TOK = KeyTokenizer()
BAD_CAPTIONS = {"empty": (b"", "empty_caption"), "blank": (b" \n\t ", "empty_caption"),
                "nul": (b"\x00\x00", "empty_caption"),
                "latin1": ("caf\xe9 cr\xe8me".encode("latin-1"), "bad_text_encoding")}


# ---------------------------------------------------------------------------------------------
# Unit level: one image or caption at a time.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", synthetic.GOOD_IMAGE_KINDS)
def test_convertible_images_keep_their_colour(kind):
    rgb = (200, 40, 90)
    img = decode.load_rgb(synthetic.image_variant(kind, rgb), 50_000_000, 8)
    assert img.mode == "RGB" and img.size == (20, 20)
    np.testing.assert_allclose(np.asarray(img).reshape(-1, 3).mean(0),
                               synthetic.expected_rgb(kind, rgb), atol=3)


def test_16bit_would_be_garbage_without_scaling():
    data = synthetic.image_variant("gray16_png", (100, 0, 0))
    assert Image.open(io.BytesIO(data)).mode == "I;16"
    assert np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).min() == 255  # PIL clips
    assert np.asarray(decode.load_rgb(data, 10 ** 8, 1)).max() == 100


def test_transparency_is_composited_on_white():
    rgba = np.zeros((10, 10, 4), np.uint8)
    rgba[:, :5] = (255, 0, 0, 255)              # left: opaque red
    rgba[:, 5:] = (0, 0, 0, 0)                  # right: transparent (black underneath)
    rgba[0, 0] = (0, 0, 255, 128)               # half-transparent blue
    out = np.asarray(decode.load_rgb(synthetic.encode_image(rgba, "PNG"), 10 ** 8, 1))
    assert (out[:, 5:] == 255).all() and (out[1:, :5] == (255, 0, 0)).all()
    np.testing.assert_allclose(out[0, 0], (127, 127, 255), atol=2)
    pal = Image.fromarray(rgba[..., :3]).convert("P")
    buf = io.BytesIO()
    pal.save(buf, "PNG", transparency=pal.getpixel((9, 9)))   # black entry transparent
    out = np.asarray(decode.load_rgb(buf.getvalue(), 10 ** 8, 1))
    assert (out[:, 5:] == 255).all()


@pytest.mark.parametrize("kind,reason", sorted(synthetic.BAD_IMAGE_KINDS.items()))
def test_bad_images_are_skipped_with_their_reason(kind, reason):
    assert decode.load_rgb(synthetic.image_variant(kind, (1, 2, 3)), 50_000_000, 8
                           ) == decode.Skip(reason)


def test_captions():
    rng = np.random.default_rng(0)
    assert decode.pick_caption(None, rng) == decode.Skip("missing_caption")
    assert decode.pick_caption([], rng) == decode.Skip("missing_caption")
    for data, reason in BAD_CAPTIONS.values():
        assert decode.pick_caption(data, rng) == decode.Skip(reason)
    assert decode.pick_caption("  a dog \n".encode(), rng) == "a dog"
    picks = collections.Counter(decode.pick_caption(["a", "b", "c"], rng) for _ in range(300))
    assert set(picks) == {"a", "b", "c"} and min(picks.values()) > 70


# ---------------------------------------------------------------------------------------------
# Fuzz: >= 1,000 mixed records through the whole pipeline.
# ---------------------------------------------------------------------------------------------
def _write_fuzz_shards(directory, num_shards=10, per_shard=110, seed=0):
    """Returns (shard paths, {good key: expected rgb}, Counter of planted skip reasons)."""
    rng = np.random.default_rng(seed)
    good, planted, paths = {}, collections.Counter(), []
    bad_kinds = sorted(synthetic.BAD_IMAGE_KINDS)
    for s in range(num_shards):
        members = []
        for i in range(per_shard):
            key = f"{s * 1000 + i:06d}"
            rgb = tuple(int(v) for v in rng.integers(30, 226, 3))
            caption = f"{int(key)} a caption".encode()
            roll = rng.uniform()
            if roll < 0.6:
                kind = synthetic.GOOD_IMAGE_KINDS[i % len(synthetic.GOOD_IMAGE_KINDS)]
                parts = {"jpg" if "jpeg" in kind else kind.split("_")[-1]:
                         synthetic.image_variant(kind, rgb), "txt": caption}
                if i % 3 == 0:   # optional json and an unknown extension are fine
                    parts.update({"json": b'{"w": 20}', "cls": b"7"})
                good[int(key)] = synthetic.expected_rgb(kind, rgb)
            elif roll < 0.8:
                kind = bad_kinds[i % len(bad_kinds)]
                parts = {"png": synthetic.image_variant(kind, rgb), "txt": caption}
                planted[synthetic.BAD_IMAGE_KINDS[kind]] += 1
            elif roll < 0.92:
                name = sorted(BAD_CAPTIONS)[i % len(BAD_CAPTIONS)]
                parts = {"jpg": synthetic.image_variant("jpeg", rgb),
                         "txt": BAD_CAPTIONS[name][0]}
                planted[BAD_CAPTIONS[name][1]] += 1
            else:
                which = i % 3
                parts = [{"jpg": synthetic.image_variant("jpeg", rgb)},   # no caption
                         {"txt": caption},                                # no image
                         {"json": b"{}"}][which]                          # neither
                planted[["missing_caption", "missing_image", "unpaired_member"][which]] += 1
            members += synthetic.record_members(key, parts)
        paths.append(synthetic.write_tar(os.path.join(directory, f"{s:05d}.tar"), members))
    # A shard cut in the middle of record 12's image: records 0..11 survive.
    members = []
    for i in range(20):
        key = f"{90_000 + i:06d}"
        members += synthetic.record_members(key, {"jpg": synthetic.image_variant(
            "jpeg", (50, 60, 70)), "txt": f"{int(key)} cut".encode()})
    cut = synthetic.write_tar(os.path.join(directory, "cut.tar"), members)
    with tarfile.open(cut) as tar:
        offset = tar.getmember(f"{90_012:06d}.jpg").offset_data + 10
    with open(cut, "r+b") as f:
        f.truncate(offset)
    good.update({90_000 + i: (50, 60, 70) for i in range(12)})
    planted["corrupt_shard"] += 2
    empty = os.path.join(directory, "empty.tar")
    open(empty, "wb").close()   # a zero-byte shard
    return paths + [cut, empty], good, planted


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fuzz")
    paths, good, planted = _write_fuzz_shards(str(directory))
    return paths, good, planted


def test_fuzz_has_enough_mixed_records(fuzz):
    _, good, planted = fuzz
    total = len(good) + sum(planted.values()) - planted["corrupt_shard"]
    assert total >= 1000 and 0.5 < len(good) / total < 0.7
    assert set(planted) == set(SKIP_REASONS) - {"corrupt_record"}


def test_fuzz_eval_pipeline_keeps_every_good_record_and_counts_every_bad_one(fuzz):
    paths, good, planted = fuzz
    cfg = dict(source="tar", path=paths, batch_size=32, image_size=16, image_dtype="uint8",
               num_workers=2)
    seen = {}
    with pipeline.build_eval_iterator(cfg, TOK, process_index=0, process_count=1) as it:
        for batch in it:
            for key, image in zip(batch["text"][batch["mask"], 0], batch["image"][batch["mask"]]):
                assert int(key) not in seen
                seen[int(key)] = image.reshape(-1, 3).mean(0)
        stats = it.skip_counts
    assert seen.keys() == good.keys()
    for key, colour in seen.items():   # the right pixels, not garbage
        np.testing.assert_allclose(colour, good[key], atol=4, err_msg=str(key))
    assert stats == {r: planted.get(r, 0) for r in SKIP_REASONS}


def test_fuzz_train_pipeline_never_crashes_or_passes_garbage(fuzz):
    paths, good, _ = fuzz
    cfg = dict(source="tar", path=paths, batch_size=32, image_size=16, num_epochs=1,
               shuffle_buffer_size=64)
    it = pipeline.build_train_iterator(cfg, TOK, process_index=0, process_count=1)
    keys = []
    for batch in it:
        assert batch["image"].shape == (32, 16, 16, 3) and np.isfinite(batch["image"]).all()
        assert -1.8 < batch["image"].min() and batch["image"].max() < 2.2
        keys += batch["text"][:, 0].tolist()
    assert len(keys) == len(set(keys)) == (len(good) // 32) * 32 and set(keys) <= good.keys()
    assert it.stats["skipped"] > 0.3 * len(good)


def test_corrupt_array_record_records_are_skipped(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter
    path = str(tmp_path / "x.array_record")
    w = ArrayRecordWriter(path, "group_size:1")
    for i in range(6):
        if i in (2, 4):
            w.write(b"garbage" if i == 2 else b"PLR1\xff\xff\x00\x00{}")   # bad magic/length
        else:
            w.write(encode_record(synthetic.image_variant("png", (9, 9, 9)), f"{i} cap", str(i)))
    w.close()
    cfg = dict(source="array_record", path=path, batch_size=4, image_size=16)
    it = pipeline.build_eval_iterator(cfg, TOK, process_index=0, process_count=1)
    keys = [k for b in it for k in b["text"][b["mask"], 0]]
    assert sorted(keys) == [0, 1, 3, 5] and it.skip_counts["corrupt_record"] == 2


# ---------------------------------------------------------------------------------------------
# A shard cut inside or right before a header (tarfile's stream mode took that for the end).
# ---------------------------------------------------------------------------------------------
def _cut_positions(path):
    """{where: (byte offset to cut at, records whose image and caption lie before the cut,
    whether the record at the cut has its image but not its caption)} for a generated shard."""
    with tarfile.open(path) as tar:
        members = tar.getmembers()
    end = members[-1].offset_data + -(-members[-1].size // 512) * 512   # end-of-archive block
    cuts = {"in a record's first header": members[6].offset + 100,
            "in a record's caption header": members[7].offset + 300,
            "at a header's first byte": members[10].offset,
            "in the last member's header": members[-1].offset + 511,
            "right after the last member": end,
            "in the end-of-archive block": end + 100}
    out = {}
    for where, offset in cuts.items():
        whole = {m.name for m in members if m.offset_data + m.size <= offset}
        kept = sum(f"{k}.jpg" in whole and f"{k}.txt" in whole for k in _keys_of(members))
        half = any(f"{k}.jpg" in whole and f"{k}.txt" not in whole for k in _keys_of(members))
        out[where] = offset, kept, half
    return out


def _keys_of(members):
    return sorted({m.name.split(".")[0] for m in members})


def test_shard_cut_in_a_header_is_counted_and_named(tmp_path, caplog):
    [path] = synthetic.make_jpeg_shards(str(tmp_path), 1, 6, 20, 20, seed=3)   # jpg, txt, json
    full = open(path, "rb").read()
    cfg = dict(source="tar", batch_size=1, image_size=16, image_dtype="uint8")

    def read(p):
        with pipeline.build_eval_iterator(dict(cfg, path=p), TOK, process_index=0,
                                          process_count=1) as it:
            keys = [int(k) for b in it for k in b["text"][b["mask"], 0]]
            return keys, it.skip_counts

    keys, counts = read(path)   # the intact shard, with its normal zero padding: no skip
    assert keys == list(range(6)) and sum(counts.values()) == 0
    # Past the first zero block nothing is lost: a cut there is no damage.
    for extra in (512 + 100, 1024):
        cut = str(tmp_path / f"end{extra}.tar")
        end = _cut_positions(path)["right after the last member"][0]
        open(cut, "wb").write(full[:end + extra])
        assert read(cut) == (list(range(6)), counts)
    for name, (offset, kept, half) in _cut_positions(path).items():
        cut = str(tmp_path / f"cut{offset}.tar")
        open(cut, "wb").write(full[:offset])
        caplog.clear()
        keys, counts = read(cut)
        assert keys == list(range(kept)), name   # every record before the cut, none after
        assert counts["corrupt_shard"] == 1, (name, counts)
        assert sum(counts.values()) == 1 + counts["missing_caption"] == 1 + half, (name, counts)
        assert any(cut in r.getMessage() and r.levelname == "WARNING"
                   for r in caplog.records), name
    # A garbled header (bad checksum) mid-shard: the same.
    garbled = bytearray(full)
    with tarfile.open(path) as tar:
        offset = tar.getmembers()[9].offset
    garbled[offset:offset + 100] = b"\xff" * 100
    cut = str(tmp_path / "garbled.tar")
    open(cut, "wb").write(bytes(garbled))
    keys, counts = read(cut)
    assert keys == [0, 1, 2] and counts["corrupt_shard"] == 1


# ---------------------------------------------------------------------------------------------
# The tar reader's own header parser against tarfile's stream mode.
# ---------------------------------------------------------------------------------------------
def _members_and_failure(read, data):
    out = []
    try:
        out.extend(read(io.BytesIO(data)))
    except tar_source._SHARD_ERRORS:
        return out, True
    return out, False


def _tar_of(names, fmt, compression=""):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w" + (":" + compression if compression else ""),
                      format=fmt) as tar:
        for name in names:
            info = tarfile.TarInfo(name.rstrip("/"))
            if name.endswith("/"):
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif name.startswith("->"):
                info.name, info.type, info.linkname = name[2:], tarfile.SYMTYPE, "target"
                tar.addfile(info)
            else:
                data = name.encode() * 3
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_tar_reader_matches_tarfile_stream_mode(tmp_path):
    """iter_tar_files yields the members tarfile's stream mode yields and fails where it fails
    (with a missing end-of-archive block a failure too): every cut, garbled bytes, every tar
    format, long and prefixed names, directories, links, compression."""
    reference, fast = tar_source._tarfile_files, tar_source.iter_tar_files
    [path] = synthetic.make_jpeg_shards(str(tmp_path), 1, 3, 16, 16, seed=5)
    full = open(path, "rb").read()
    cases = [full[:cut] for cut in range(0, len(full) + 1, 7)] + [b"", b"not a tar" * 99]
    rng = np.random.default_rng(0)
    for _ in range(400):
        garbled = bytearray(full)
        for pos in rng.integers(0, len(full), rng.integers(1, 4)):
            garbled[pos:pos + int(rng.integers(1, 16))] = rng.choice(
                [0, 32, 48, 55, 255, int(rng.integers(256))], 1).tobytes()
        cases.append(bytes(garbled[:len(full)]))
    names = ["a.jpg", "a.txt", "d/", "d/b.jpg", "->d/c.jpg", "d/b.txt", "x" * 120 + ".jpg",
             "p" * 90 + "/" + "q" * 60 + ".jpg", "\xe9.txt", "z.jpg"]
    for fmt in (tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        usable = [n for n in names if fmt != tarfile.USTAR_FORMAT or len(n) < 100 or "/" in n]
        for compression in ("", "gz"):
            data = _tar_of(usable, fmt, compression)
            members, failed = _members_and_failure(fast, data)
            assert not failed and [n for n, _ in members] == [
                n for n in usable if not n.endswith("/") and not n.startswith("->")]
            cases += [data] + [data[:cut] for cut in range(0, len(data), 97)]
    for case in cases:
        assert _members_and_failure(fast, case) == _members_and_failure(reference, case)
