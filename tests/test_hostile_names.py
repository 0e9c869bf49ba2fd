"""Killed at any moment, fed any name (issue 65): a name is data, never a crash, and a folder
source's reads stay inside it.

Any key or file name (bytes that are not UTF-8, control characters, 1,000-byte paths, NFC/NFD
twins, `../` in an S3 key) is captioned under its own key, faithfully, or is that item's one
`bad_input` record saying why; a link out of a source folder is such a record, and nothing of its
target is read into any record, page or file. The unit rules are tests/test_storage.py's and the
pixel limit tests/test_media.py's; here the listing's judging, and the whole flow over a folder
and over a bucket (moto S3), one run each (a rerun of the folder's needs no engine).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import unicodedata
from pathlib import Path

import pytest

from vlm_caption.tasks.results.done_rows import result_key
from vlm_caption.tasks.sources.formats import SourceSpec
from vlm_caption.tasks.sources.items import ObjectRef, WorkItem, as_text, text_key
from vlm_caption.tasks.sources.listing import iter_items
from vlm_caption.tasks.sources.storage import LocalStorage
from tests.images import image_bytes
from tests.pages import gallery_items
from tests.result_files import records as _local_records, s3_records

ODD = os.fsdecode(b"odd \xff name x.jpg")  # as Python lists it: the byte 0xff as a lone surrogate
NFC, NFD = unicodedata.normalize("NFC", "café.jpg"), unicodedata.normalize("NFD", "café.jpg")
LONG = "/".join(["d" * 240] * 4 + ["f" * 36 + ".jpg"])  # a 1,004-byte key (a name has at most 255)
SECRET = b"root:x:0:0:SECRET-MARKER-65:/root:/bin/bash\n"


def untext(key: str) -> bytes:
    """The inverse of `text_key` for a rendered name: its exact bytes back."""
    out, i, raw = bytearray(), 0, key.encode()
    while i < len(raw):
        if raw[i:i + 2] == b"\\\\":
            out += b"\\"
            i += 2
        elif raw[i:i + 2] == b"\\x":
            out.append(int(raw[i + 2:i + 4], 16))
            i += 4
        else:
            out.append(raw[i])
            i += 1
    return bytes(out)


@pytest.mark.parametrize("name", [b"odd \xff name x.jpg", b"\\x41 \xc3\x28 back\\slash.jpg", b"\xe9t\xe9.jpg"])
def test_a_name_that_is_not_utf8_is_rendered_reversibly(name):
    key = text_key(os.fsdecode(name))
    key.encode("utf-8")  # text now: hashed, recorded and shown like any key
    assert untext(key) == name
    assert text_key("tab\tnew\nline\x01 café ü.jpg") == "tab\tnew\nline\x01 café ü.jpg"  # text stays itself


def test_the_listing_judges_a_folder_with_a_name_that_is_not_utf8(tmp_path):
    """The crash of issue 65: the listing's judging (`pending_mask`) hashed the key and raised
    UnicodeEncodeError, failing the run. Now the name is one `bad_input` item, the rest as ever."""
    for i in range(3):
        (tmp_path / f"{i}.jpg").write_bytes(image_bytes())
    with open(os.path.join(os.fsencode(tmp_path), os.fsencode(ODD)), "wb") as handle:
        handle.write(image_bytes())
    spec = SourceSpec(str(tmp_path), opened=LocalStorage(tmp_path, follow_links=False))
    items = {item.id: item for item in iter_items(spec)}
    assert all(result_key(key, None) for key in items)  # every key hashes
    odd = items["odd \\xff name x.jpg"]
    assert "not valid UTF-8" in odd.problem and odd.members[0].key == odd.id
    assert [items[f"{i}.jpg"].problem for i in range(3)] == [None] * 3


def test_a_tar_member_named_with_bytes_that_are_not_utf8_is_its_items_error():
    item = WorkItem("shard.tar/\udcffx", (ObjectRef("shard.tar/\udcffx.jpg", 3, "e@1"),), problem="no jpg member")
    text = as_text(item)
    assert text.id == "shard.tar/\\xffx" and text.members[0].key == "shard.tar/\\xffx.jpg"
    assert "not valid UTF-8" in text.problem and text.members[0].size == 3
    assert as_text(WorkItem("fine", (ObjectRef("fine"),))) == WorkItem("fine", (ObjectRef("fine"),))


def test_a_tar_with_such_a_member_lists_it_as_one_bad_input_item(tmp_path):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT, encoding="latin-1") as tar:
        for name, data in ((b"\xff0001.jpg", image_bytes()), (b"0002.jpg", image_bytes())):
            info = tarfile.TarInfo(name.decode("latin-1"))  # written back as the same bytes
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (tmp_path / "shard.tar").write_bytes(buffer.getvalue())
    spec = SourceSpec(str(tmp_path), format="webdataset", opened=LocalStorage(tmp_path, follow_links=False))
    items = list(iter_items(spec))
    assert [item.id for item in items] == ["shard.tar/\\xff0001", "shard.tar/0002"]
    assert "not valid UTF-8" in items[0].problem and items[1].problem is None


def test_a_group_with_a_link_out_of_the_folder_is_one_bad_input_item(tmp_path):
    (tmp_path / "elsewhere.jpg").write_bytes(image_bytes())
    for folder in ("album", "other"):
        (tmp_path / "src" / folder).mkdir(parents=True)
        (tmp_path / "src" / folder / "a.jpg").write_bytes(image_bytes())
    (tmp_path / "src" / "album" / "b.jpg").symlink_to(tmp_path / "elsewhere.jpg")
    spec = SourceSpec(str(tmp_path / "src"), modality="multi-image",
                      opened=LocalStorage(tmp_path / "src", follow_links=False))
    items = {item.id: item for item in iter_items(spec)}
    assert "a link to outside the source folder" in items["album"].problem and items["other"].problem is None


# ---- the whole flow ----------------------------------------------------------------------------
def _files(root: Path, skip: Path | None = None) -> dict[str, tuple[int, int]]:
    """Every file, folder and link under `root` (but `skip` and what is in it), with its size and
    time: what a run must not have written."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            if skip is None or not path.is_relative_to(skip):
                stat = os.lstat(path)
                found[str(path)] = (stat.st_size, stat.st_mtime_ns)
    return found


def _view_keys(files: list[bytes]) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    return sorted(pa.concat_tables(pq.read_table(io.BytesIO(data)) for data in files).column("key").to_pylist())


def _hostile_folder(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """src/: 20 images, hostile names, links in and out, a 10000x10000 PNG. Returns the folder and
    what each listed key must come to: "caption", or the error kind and a phrase of its message."""
    from tests.test_media import big_png

    src, elsewhere = tmp_path / "src", tmp_path / "elsewhere"
    (elsewhere / "dir").mkdir(parents=True)
    src.mkdir()
    expect = {}
    for i in range(20):
        (src / f"{i:02d}.jpg").write_bytes(image_bytes(size=(64 + i, 48), color=(i * 12, 90, 200 - i * 9)))
        expect[f"{i:02d}.jpg"] = "caption"
    with open(os.path.join(os.fsencode(src), os.fsencode(ODD)), "wb") as handle:
        handle.write(image_bytes(color=(1, 2, 3)))
    expect["odd \\xff name x.jpg"] = "bad_input: not valid UTF-8"
    for i, name in enumerate(["tab\there.jpg", "new\nline.jpg", "ctl\x01.jpg", NFC, NFD, LONG, "back\\slash.jpg"]):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(image_bytes("PNG", size=(40 + i, 30), color=(200, i * 30, 10)))
        expect[name] = "caption"
    assert NFC != NFD and (src / NFC).read_bytes() != (src / NFD).read_bytes()  # the twins are two files
    (elsewhere / "photo.jpg").write_bytes(image_bytes(color=(9, 200, 9)))
    (elsewhere / "secret.txt").write_bytes(SECRET)
    (elsewhere / "dir" / "inner.jpg").write_bytes(image_bytes(color=(9, 9, 200)))
    (src / "outside.jpg").symlink_to(elsewhere / "photo.jpg")
    (src / "passwd.jpg").symlink_to(elsewhere / "secret.txt")
    (src / "etc-passwd.jpg").symlink_to("/etc/passwd")
    (src / "outdir").symlink_to(elsewhere / "dir")
    for key in ("outside.jpg", "passwd.jpg", "etc-passwd.jpg", "outdir"):
        expect[key] = "bad_input: a link to outside the source folder"
    (src / "copy.jpg").symlink_to("00.jpg")  # inside: that image again
    expect["copy.jpg"] = "caption"
    (src / "dangling.jpg").symlink_to("gone.jpg")
    expect["dangling.jpg"] = "bad_input: leads to no file"
    (src / "huge.png").write_bytes(big_png(10_000))
    expect["huge.png"] = "too_large: over the limit of 64,000,000 pixels"
    return src, expect


def _check_records(records: list[dict], expect: dict[str, str]) -> None:
    """Each listed key: exactly one record, captioned or the error expected."""
    assert sorted(r["key"] for r in records) == sorted(expect)
    for record in records:
        want, error = expect[record["key"]], record["error"]
        if want == "caption":
            assert error is None and record["text"] is not None, (record["key"], error)
        else:
            kind, phrase = want.split(": ", 1)
            assert error["kind"] == kind and phrase in error["message"], (record["key"], error)
            assert not error["retryable"]


def test_a_folder_of_hostile_names_and_links_is_captioned_or_recorded_item_by_item(prefect_api, tiny_llava,
                                                                                    tmp_path):
    from vlm_caption.flows.caption import vlm_caption
    from vlm_caption.flows.params import CaptionJob

    src, expect = _hostile_folder(tmp_path)
    out = tmp_path / "out"
    before = _files(tmp_path)
    outside_hashes = [hashlib.sha256(data).hexdigest() for data in (
        (tmp_path / "elsewhere" / "photo.jpg").read_bytes(), SECRET, Path("/etc/passwd").read_bytes(),
        (tmp_path / "elsewhere" / "dir" / "inner.jpg").read_bytes())]
    job = CaptionJob(source=str(src), output=str(out), model=str(tiny_llava), shard_size=8,
                     sampling={"max_tokens": 4})

    state = vlm_caption(job, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    records = _local_records(out)
    _check_records(records, expect)
    by_key = {r["key"]: r for r in records}
    assert by_key[NFC]["sha256"] != by_key[NFD]["sha256"]  # two files, two results
    assert by_key[LONG]["sha256"] == hashlib.sha256((src / LONG).read_bytes()).hexdigest()
    assert by_key["copy.jpg"]["sha256"] == by_key["00.jpg"]["sha256"]  # the link inside: that file
    for key in ("outside.jpg", "passwd.jpg", "etc-passwd.jpg", "outdir"):
        assert by_key[key]["sha256"] is None and by_key[key]["size"] == os.lstat(src / key).st_size
    assert summary["listed"] == len(expect) and summary["failed"] == 7

    # Nothing of an outside target anywhere in the output (records, manifest, gallery, Parquet: its
    # records read back too, the files being compressed); nothing written outside the output.
    written = b"".join(path.read_bytes() for path in out.rglob("*") if path.is_file()) + \
        json.dumps(records, ensure_ascii=False).encode()
    assert SECRET.strip() not in written and b"SECRET-MARKER-65" not in written
    assert not [h for h in outside_hashes if h.encode() in written]
    assert _files(tmp_path, skip=out) == before
    page = (out / "manifests" / f"{summary['run_id']}.html").read_text(encoding="utf-8")
    shown = gallery_items(page)
    assert set(shown) == set(expect)
    assert {key for key, picture in shown.items() if picture == "thumb"} == {
        key for key, want in expect.items() if want == "caption"}
    assert _view_keys([p.read_bytes() for p in (out / "parquet").glob("*.parquet")]) == sorted(expect)

    # A rerun finds every item done, the refused ones too: the keys are the same each time.
    again = vlm_caption(job)
    assert again["listed"] == len(expect) and again["skipped_already_done"] == len(expect)
    assert again["processed"] == 0 and len(_local_records(out)) == len(records)

    # With follow_links the operator lets the links out be read (a new job's result set).
    followed = vlm_caption(job.model_copy(update={"follow_links": True, "output": str(tmp_path / "out-followed"),
                                                   "glob": "outside.jpg"}))
    record, = _local_records(tmp_path / "out-followed")
    assert record["key"] == "outside.jpg" and record["error"] is None and followed["succeeded"] == 1
    assert record["sha256"] == outside_hashes[0]


# Keys a path or URL parser would read as something else: `in/../up.jpg`, `in//etc/hostname` and
# `in/s3://hostile-names/up.jpg` are objects under the prefix of those names, read from the bucket.
S3_KEYS = ["tab\there.jpg", "ctl\x01\x1f.jpg", NFC, NFD, "../up.jpg", "./dot.jpg", "/etc/hostname",
           "s3://hostile-names/up.jpg", "back\\slash.jpg", "q?x=1#frag.jpg", "100% plus+space.jpg",
           "k" * 1000 + ".jpg", "😀.jpg"]


def test_a_bucket_of_hostile_keys_is_captioned_under_each_exact_key(prefect_api, s3_client, tiny_llava):
    """S3 keys are UTF-8 text: every one is captioned under its own key, read from its own object,
    never from a path or location its name looks like. (moto refuses a newline in a key.)"""
    from vlm_caption.flows.caption import vlm_caption
    from vlm_caption.flows.params import CaptionJob

    bucket = "hostile-names"
    s3_client.create_bucket(Bucket=bucket)
    bodies = {key: image_bytes("PNG", size=(40 + i, 32), color=(i * 20, 100, 60)) for i, key in enumerate(S3_KEYS)}
    bodies.update({f"plain{i}.jpg": image_bytes(color=(i, i, 200)) for i in range(4)})
    for key, body in bodies.items():
        s3_client.put_object(Bucket=bucket, Key=f"in/{key}", Body=body)
    s3_client.put_object(Bucket=bucket, Key="up.jpg", Body=image_bytes(color=(250, 250, 0)))  # outside the prefix
    job = CaptionJob(source=f"s3://{bucket}/in/", output=f"s3://{bucket}/out/", model=str(tiny_llava),
                     shard_size=6, sampling={"max_tokens": 4})

    state = vlm_caption(job, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()

    def objects(prefix: str) -> dict[str, bytes]:
        pages = s3_client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return {o["Key"]: s3_client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
                for page in pages for o in page.get("Contents", [])}

    written = objects("out/")
    records = s3_records(s3_client, bucket, "out/")
    assert sorted(r["key"] for r in records) == sorted(bodies)
    for record in records:
        assert record["error"] is None, (record["key"], record["error"])
        assert record["sha256"] == hashlib.sha256(bodies[record["key"]]).hexdigest(), record["key"]
    page = written[f"out/manifests/{summary['run_id']}.html"].decode()
    assert set(gallery_items(page)) == set(bodies)
    assert set(gallery_items(page).values()) == {"thumb"}
    assert _view_keys([body for key, body in written.items() if key.startswith("out/parquet/")]) == sorted(bodies)
    assert sorted(k for k in objects("") if not k.startswith("out/")) == sorted(
        ["up.jpg"] + [f"in/{key}" for key in bodies])  # nothing written beside the output
