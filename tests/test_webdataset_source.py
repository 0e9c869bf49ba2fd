"""WebDataset sources: tar shards made by the `webdataset` package, one item per sample, read
from a folder and from the loopback S3 server (brace pattern), end to end through the flow with
the tiny checkpoint; a tar cut short and a corrupt member are error records, the rest captioned;
a rerun recomputes nothing."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from vlm_caption.tasks.sources.formats import BraceError, expand_braces, expansion_count
from vlm_caption.tasks.sources.formats import split_location
from vlm_caption.tasks.sources.items import ObjectRef
from vlm_caption.tasks.sources.registry import detect_format
from vlm_caption.tasks.sources.storage import LocalStorage, open_storage
from vlm_caption.tasks.sources.webdataset import WebDatasetReader, read_member, split_member, tar_items
from tests.images import corrupt_jpeg, image_bytes
from tests.result_files import s3_records

BUCKET = "wds"


def make_shard(path_or_stream, start: int, count: int, corrupt: int | None = None, extra: tuple = ()) -> None:
    import webdataset as wds

    with wds.TarWriter(path_or_stream) as sink:
        for i in range(start, start + count):
            jpg = corrupt_jpeg() if i == corrupt else image_bytes("JPEG", size=(80 + i, 60), color=(i * 20 % 256, 90, 30))
            sink.write({"__key__": f"{i:06d}", "jpg": jpg, "json": {"i": i, "url": f"https://x/{i}.jpg"},
                        "txt": f"alt text {i}"})
        for sample in extra:
            sink.write(sample)


def shard_bytes(start: int, count: int, corrupt: int | None = None, extra: tuple = ()) -> bytes:
    stream = io.BytesIO()
    make_shard(stream, start, count, corrupt, extra)
    return stream.getvalue()


def samples(location: str) -> list:
    return list(WebDatasetReader(WebDatasetReader.spec_for(location)).items())


def test_brace_patterns_expand_as_webdataset_users_write_them():
    assert list(expand_braces("shards/{00000..00002}.tar")) == ["shards/00000.tar", "shards/00001.tar",
                                                               "shards/00002.tar"]
    assert list(expand_braces("{train,val}/{0..4..2}.tar")) == ["train/0.tar", "train/2.tar", "train/4.tar",
                                                               "val/0.tar", "val/2.tar", "val/4.tar"]
    assert expansion_count("s/{00000..99999}.tar") == 100_000
    assert split_location("s3://b/ds/shards/{00000..00099}.tar") == ("s3://b/ds/shards/", "{00000..00099}.tar")
    assert split_location("/data/x/00003.tar") == ("/data/x/", "00003.tar")
    assert split_location("s3://b/prefix/") == ("s3://b/prefix/", None)
    assert detect_format("s3://b/{0..3}.tar", "auto", False) == "webdataset"
    assert detect_format("s3://b/x.parquet", "auto", False) == "parquet"
    assert split_member("a/b/000123.seg.jpg") == ("a/b/000123", "seg.jpg")
    with pytest.raises(BraceError, match="neither a list"):
        list(expand_braces("s/{a..b}.tar"))
    with pytest.raises(BraceError, match="unbalanced"):
        list(expand_braces("s/{000..009.tar"))


def test_samples_from_a_folder_of_shards_with_metadata_and_damage(tmp_path: Path):
    folder = tmp_path / "shards"
    folder.mkdir()
    make_shard(str(folder / "00000.tar"), 0, 4)
    good = shard_bytes(4, 4)
    (folder / "00001.tar").write_bytes(good[:len(good) // 2])  # cut short mid-way
    bad = bytearray(shard_bytes(8, 3))
    second = bad.find(b"000009")  # the second sample's first header: garble its checksum
    header = second - second % 512
    bad[header + 148:header + 156] = b"9999999\0"
    (folder / "00002.tar").write_bytes(bytes(bad))
    (folder / "notes.json").write_text("{}")  # img2dataset writes stats beside its tars

    assert detect_format(str(folder), "auto", False) == "webdataset"
    items = samples(str(folder))
    by_id = {item.id: item for item in items}
    whole = [f"00000.tar/{i:06d}" for i in range(4)]
    assert all(by_id[i].problem is None for i in whole)
    assert json.loads(by_id["00000.tar/000002"].metadata) == {"json": {"i": 2, "url": "https://x/2.jpg"},
                                                               "txt": "alt text 2"}
    storage = open_storage(str(folder))
    member = by_id["00000.tar/000001"].members[0]
    assert read_member(storage, member) == image_bytes("JPEG", size=(81, 60), color=(20, 90, 30))

    cut = [item for item in items if item.id.startswith("00001.tar")]
    assert cut and cut[-1].problem and "cut short" in cut[-1].problem  # the damage is an item, not a gap
    assert all(item.problem is None for item in cut[:-1]) and len(cut) >= 2

    garbled = [item for item in items if item.id.startswith("00002.tar")]
    assert [i.id for i in garbled] == ["00002.tar/000008", "00002.tar"]
    assert "unreadable tar header" in garbled[-1].problem

    # A sample without an image is an item naming what it has; a tar that is not one, one item.
    (tmp_path / "odd").mkdir()
    import webdataset as wds

    with wds.TarWriter(str(tmp_path / "odd" / "a.tar")) as sink:
        sink.write({"__key__": "k1", "txt": "only text"})
    (tmp_path / "odd" / "b.tar").write_bytes(b"not a tar at all" * 40)
    odd = samples(str(tmp_path / "odd"))
    assert [(i.id, bool(i.problem)) for i in odd] == [("a.tar/k1", True), ("b.tar", True)]
    assert "has: txt" in odd[0].problem


def test_a_dotted_extension_is_an_image_by_its_last_part(tmp_path: Path):
    """`000020007.v2.final.jpg` is sample `000020007`'s jpg, as `webdataset` keys and decodes it
    (key to the first dot, decoder by the last part); a plain `jpg` beside a `seg.png` stays the media."""
    import webdataset as wds

    jpg = image_bytes("JPEG", size=(70, 50), color=(10, 200, 30))
    with wds.TarWriter(str(tmp_path / "a.tar")) as sink:
        sink.write({"__key__": "000020007", "v2.final.jpg": jpg, "v2.meta.json": {"w": 70}})
        sink.write({"__key__": "000020008", "jpg": jpg, "seg.png": image_bytes("PNG", size=(5, 5))})
    decoded = next(iter(wds.WebDataset(str(tmp_path / "a.tar"), shardshuffle=False).decode("pil")))
    assert decoded["__key__"] == "000020007" and decoded["v2.final.jpg"].size == (70, 50)

    items = samples(str(tmp_path))
    assert [(i.id, i.problem) for i in items] == [("a.tar/000020007", None), ("a.tar/000020008", None)]
    assert items[0].members[0].key == "a.tar/000020007.v2.final.jpg"
    assert json.loads(items[0].metadata) == {"v2.meta.json": {"w": 70}}
    assert read_member(open_storage(str(tmp_path)), items[0].members[0]) == jpg
    assert items[1].members[0].key == "a.tar/000020008.jpg"


def test_a_single_tar_streams_without_reading_large_members(tmp_path: Path, monkeypatch):
    """Headers are read by ranged reads (as on S3); members bigger than the read-ahead are
    skipped, not read."""
    import webdataset as wds

    from vlm_caption.tasks.sources import webdataset
    from vlm_caption.tasks.sources.storage import RangeFile

    path = tmp_path / "big.tar"
    with wds.TarWriter(str(path)) as sink:
        for i in range(3):
            sink.write({"__key__": f"v{i}", "mp4": bytes(3 << 20), "json": {"i": i}})
    reads: list[int] = []
    real = LocalStorage.read_range

    def counted(storage, key, start, length):
        data = real(storage, key, start, length)
        reads.append(len(data))
        return data

    monkeypatch.setattr(LocalStorage, "read_range", counted)
    monkeypatch.setattr(webdataset, "open_seekable",
                        lambda storage, key, size: io.BufferedReader(RangeFile(storage, key, size), 64 << 10))
    size = path.stat().st_size
    items = list(tar_items(open_storage(str(tmp_path)), ObjectRef("big.tar", size, "e"), "video"))
    assert [i.id for i in items] == ["big.tar/v0", "big.tar/v1", "big.tar/v2"] and not any(i.problem for i in items)
    assert json.loads(items[1].metadata) == {"json": {"i": 1}}
    assert sum(reads) < size / 4, reads


def test_bucket_of_shards_by_brace_pattern_end_to_end_and_rerun(prefect_api, s3_client, tiny_llava):
    from vlm_caption.flows.caption import vlm_caption
    from vlm_caption.flows.params import CaptionJob

    s3_client.create_bucket(Bucket=BUCKET)
    dotted = {"__key__": "000020007", "v2.final.jpg": image_bytes("JPEG", size=(64, 48))}  # an image by its last part
    s3_client.put_object(Bucket=BUCKET, Key="ds/00000.tar", Body=shard_bytes(0, 5, corrupt=3, extra=(dotted,)))
    cut = shard_bytes(5, 4)
    s3_client.put_object(Bucket=BUCKET, Key="ds/00001.tar", Body=cut[:int(len(cut) * 0.6)])
    s3_client.put_object(Bucket=BUCKET, Key="ds/00009.tar", Body=shard_bytes(20, 2))  # not in the pattern
    job = CaptionJob(source=f"s3://{BUCKET}/ds/{{00000..00002}}.tar", output=f"s3://{BUCKET}/out/",
                     model=str(tiny_llava), shard_size=3, sampling={"max_tokens": 4}, gallery_items=50)
    summary = vlm_caption(job)
    records = _records(s3_client, "out/")
    by_key = {r["key"]: r for r in records}
    assert not any(k.startswith("00009.tar") for k in by_key)
    assert all(f"00000.tar/{i:06d}" in by_key for i in range(5))
    assert by_key["00000.tar/000003"]["error"]["kind"] == "decode"  # the corrupt member
    good = [r for r in records if r["error"] is None]
    assert len(good) >= 6 and all(r["text"] is not None for r in good)
    first = by_key["00000.tar/000001"]
    assert first["metadata"] == {"json": {"i": 1, "url": "https://x/1.jpg"}, "txt": "alt text 1"}
    assert first["members"][0]["key"] == "00000.tar/000001.jpg" and first["sha256"]
    dotted = by_key["00000.tar/000020007"]
    assert dotted["error"] is None and dotted["text"] is not None
    assert dotted["members"][0]["key"] == "00000.tar/000020007.v2.final.jpg"
    damaged = [r for r in records if r["error"] and r["error"]["kind"] == "bad_input"]
    assert len(damaged) == 1 and damaged[0]["key"].startswith("00001.tar") and not damaged[0]["error"]["retryable"]
    manifest = json.loads(s3_client.get_object(Bucket=BUCKET, Key=f"out/manifests/{summary['run_id']}.json")
                          ["Body"].read())
    assert manifest["parameters"]["source_format"] == "webdataset"
    assert manifest["gallery"]["path"].endswith(f"{summary['run_id']}.html")
    page = s3_client.get_object(Bucket=BUCKET, Key=f"out/manifests/{summary['run_id']}.html")["Body"].read().decode()
    assert "00000.tar/000001" in page and "data:image/jpeg;base64," in page and "bad_input" in page

    again = vlm_caption(job)
    assert again["processed"] == 0 and again["skipped_already_done"] == len(by_key)
    assert len(_records(s3_client, "out/")) == len(records)


def _records(s3_client, out: str) -> list[dict]:
    return s3_records(s3_client, BUCKET, out)
