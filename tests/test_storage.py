import os

import pytest

from vlm_caption.tasks.sources.items import BadInput
from vlm_caption.tasks.sources.storage import LocalStorage, S3Storage, StorageError, open_storage


def test_local_listing_is_sorted_recursive_and_skips_hidden(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "2.png").write_bytes(b"xx")
    (tmp_path / "a.jpg").write_bytes(b"x")
    (tmp_path / ".hidden.jpg").write_bytes(b"x")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "c.jpg").write_bytes(b"x")
    refs = list(LocalStorage(tmp_path).iter_objects())
    assert [r.key for r in refs] == ["a.jpg", "b/2.png"]
    assert refs[1].size == 2 and refs[1].etag


def test_local_glob_matches_path_or_basename(tmp_path):
    (tmp_path / "sub").mkdir()
    for name in ("x.jpg", "y.png", "sub/z.jpg"):
        (tmp_path / name).write_bytes(b"x")
    # A folder's own files come before its subfolders', each level sorted.
    assert [r.key for r in LocalStorage(tmp_path).iter_objects("*.jpg")] == ["x.jpg", "sub/z.jpg"]
    assert [r.key for r in LocalStorage(tmp_path).iter_objects("sub/*")] == ["sub/z.jpg"]


def test_local_write_is_atomic_and_leaves_no_temp_files(tmp_path):
    store = LocalStorage(tmp_path / "out", create=True)
    store.write("results/a/part.jsonl", b"one\n")
    store.write("results/a/part.jsonl", b"two\n")
    assert store.read("results/a/part.jsonl") == b"two\n"
    assert [p.name for p in (tmp_path / "out" / "results" / "a").iterdir()] == ["part.jsonl"]


@pytest.mark.parametrize("uri, message", [
    ("gs://bucket/x", "unsupported scheme"),
    ("s3:///prefix", "missing bucket"),
    ("", "empty"),
])
def test_bad_uris_fail_with_a_message_that_says_what_to_do(uri, message):
    with pytest.raises(StorageError, match=message):
        open_storage(uri)


def test_missing_local_folder_is_a_clear_error(tmp_path):
    with pytest.raises(StorageError, match="no such folder"):
        open_storage(str(tmp_path / "nope"))


def test_s3_listing_paginates_and_round_trips(s3_client):
    s3_client.create_bucket(Bucket="pages")
    for i in range(1005):  # more than one 1000-key page
        s3_client.put_object(Bucket="pages", Key=f"in/{i:05d}.jpg", Body=b"x")
    s3_client.put_object(Bucket="pages", Key="in/dir/", Body=b"")  # folder marker, skipped
    s3_client.put_object(Bucket="pages", Key="other/a.jpg", Body=b"x")
    store = open_storage("s3://pages/in")
    assert isinstance(store, S3Storage)
    keys = [r.key for r in store.iter_objects()]
    assert len(keys) == 1005 and keys[0] == "00000.jpg" and keys[-1] == "01004.jpg"
    store.write("nested/out.json", b"{}")
    assert store.exists("nested/out.json") and not store.exists("missing.json")
    assert store.read("nested/out.json") == b"{}"
    assert store.describe("nested/out.json") == "s3://pages/in/nested/out.json"


def test_s3_missing_bucket_is_a_clear_error(s3_endpoint):
    with pytest.raises(StorageError, match="does not exist"):
        list(open_storage("s3://no-such-bucket/x/").iter_objects())


def test_prefix_listing_returns_root_relative_keys(tmp_path, s3_client):
    s3_client.create_bucket(Bucket="prefixed")
    local = LocalStorage(tmp_path, create=True)
    remote = open_storage("s3://prefixed/out/")
    for store in (local, remote):
        store.write("results/fp/part-1.jsonl", b"{}\n")
        store.write("manifests/run.json", b"{}")
        keys = [r.key for r in store.iter_objects(prefix="results/fp/")]
        assert keys == ["results/fp/part-1.jsonl"]
        assert store.read(keys[0]) == b"{}\n"


def test_read_range_reads_a_part_of_an_object_in_both_storages(tmp_path, s3_client):
    s3_client.create_bucket(Bucket="ranges")
    data = bytes(range(256)) * 40  # 10,240 bytes
    for store in (LocalStorage(tmp_path, create=True), open_storage("s3://ranges/in/")):
        store.write("sub/blob.bin", data)
        assert store.read_range("sub/blob.bin", 0, 16) == data[:16]
        assert store.read_range("sub/blob.bin", 5000, 300) == data[5000:5300]
        assert store.read_range("sub/blob.bin", len(data) - 10, 100) == data[-10:]  # cut where it ends
        assert store.read_range("sub/blob.bin", len(data) + 5, 10) == b""  # past the end
        assert store.read_range("sub/blob.bin", 7, 0) == b""
        with pytest.raises(FileNotFoundError):
            store.read_range("missing.bin", 0, 10)


def test_read_range_on_s3_retries_cut_and_failed_gets_like_read(s3_client, s3_endpoint, monkeypatch):
    """Through a proxy that fails, resets or cuts short a third of the GETs, every range comes
    back whole: a ranged GET shares `read`'s retries for a body shorter than announced."""
    from vlm_caption.tasks.settings import get_settings
    from tests.fault_proxy import FaultProxy

    s3_client.create_bucket(Bucket="ranges-faulty")
    data = bytes(range(256)) * 4096  # 1 MiB
    s3_client.put_object(Bucket="ranges-faulty", Key="in/blob.bin", Body=data)
    proxy = FaultProxy(s3_endpoint, rate=0.3, seed=3, kinds=("500", "503", "reset", "truncate"))
    try:
        monkeypatch.setenv("VLM_CAPTION_S3_ENDPOINT_URL", proxy.url)
        get_settings.cache_clear()
        store = open_storage("s3://ranges-faulty/in/")
        for i in range(40):
            start, length = i * 26_000, 20_000 + i * 50
            assert store.read_range("blob.bin", start, length) == data[start:start + length], i
    finally:
        proxy.close()
        get_settings.cache_clear()
    assert proxy.injected["truncate"] > 0 and sum(proxy.injected.values()) > 5, proxy.injected


# ---- a folder source's keys and links (issue 65) --------------------------------------------
def _linked_folder(tmp_path):
    """src/ with a file, links into it and out of it; elsewhere/ beside it, with a secret."""
    src, elsewhere = tmp_path / "src", tmp_path / "elsewhere"
    (src / "sub").mkdir(parents=True)
    (elsewhere / "dir").mkdir(parents=True)
    (src / "a.jpg").write_bytes(b"inside")
    (elsewhere / "secret.jpg").write_bytes(b"SECRET-BYTES")
    (elsewhere / "dir" / "y.jpg").write_bytes(b"SECRET-Y")
    (src / "outside.jpg").symlink_to(elsewhere / "secret.jpg")
    (src / "outdir").symlink_to(elsewhere / "dir")
    (src / "copy.jpg").symlink_to("a.jpg")  # a link inside: that file again
    (src / "sub" / "up").symlink_to("..")  # a link to a folder inside (above it): never walked
    (src / "dangling.jpg").symlink_to("nothing-there")
    return src


def test_a_source_lists_links_out_of_its_folder_as_refused_and_never_reads_them(tmp_path):
    from vlm_caption.tasks.sources.items import RefusedRef

    src = _linked_folder(tmp_path)
    store = LocalStorage(src, follow_links=False)
    refs = {ref.key: ref for ref in store.iter_objects()}
    assert sorted(refs) == ["a.jpg", "copy.jpg", "dangling.jpg", "outdir", "outside.jpg"]
    assert not isinstance(refs["copy.jpg"], RefusedRef) and refs["copy.jpg"].size == len(b"inside")
    for key in ("outdir", "outside.jpg"):
        assert isinstance(refs[key], RefusedRef) and "a link to outside the source folder" in refs[key].problem
        assert refs[key].size == os.lstat(src / key).st_size  # the link's own, nothing of its target
    assert isinstance(refs["dangling.jpg"], RefusedRef) and "leads to no file" in refs["dangling.jpg"].problem
    assert store.read("copy.jpg") == b"inside"
    for key in ("outside.jpg", "outdir/y.jpg"):  # through a link out, listed or not
        with pytest.raises(BadInput, match="a link to outside the source folder"):
            store.read(key)
        with pytest.raises(BadInput):
            store.read_range(key, 0, 4)
    assert list(store.iter_objects(prefix="outdir/")) == []


@pytest.mark.parametrize("key", ["../elsewhere/secret.jpg", "sub/../../elsewhere/secret.jpg", "/etc/passwd"])
def test_a_key_that_leads_out_of_the_folder_is_refused_whatever_the_links(tmp_path, key):
    from vlm_caption.tasks.sources.storage import open_seekable

    src = _linked_folder(tmp_path)
    for store in (LocalStorage(src, follow_links=False), LocalStorage(src)):
        with pytest.raises(BadInput, match="leads outside the folder"):
            store.read(key)
        with pytest.raises(BadInput):
            open_seekable(store, key, 4)
        with pytest.raises(BadInput):
            store.write(key, b"x")
    assert (tmp_path / "elsewhere" / "secret.jpg").read_bytes() == b"SECRET-BYTES"


def test_follow_links_reads_links_out_of_the_folder_as_before(tmp_path):
    src = _linked_folder(tmp_path)
    store = LocalStorage(src, follow_links=True)
    refs = {ref.key: ref for ref in store.iter_objects()}
    assert sorted(refs) == ["a.jpg", "copy.jpg", "dangling.jpg", "outdir/y.jpg", "outside.jpg"]
    assert store.read("outside.jpg") == b"SECRET-BYTES" and store.read("outdir/y.jpg") == b"SECRET-Y"


def test_the_jobs_follow_links_reaches_the_source_storage_and_the_cli_sets_it(tmp_path):
    import argparse

    from vlm_caption.flows.cli_job import add_job_options, job_fields
    from vlm_caption.flows.params import CaptionJob
    from vlm_caption.tasks.sources.preflight import resolve_source

    src = _linked_folder(tmp_path)
    parser = argparse.ArgumentParser()
    add_job_options(parser)
    assert job_fields(parser.parse_args(["--follow-links"]))["follow_links"] is True
    assert "follow_links" not in job_fields(parser.parse_args([]))
    for follow in (False, True):
        job = CaptionJob(source=str(src), output=str(tmp_path / "out"), follow_links=follow)
        _, spec = resolve_source(job)
        assert spec.follow_links is follow and spec.storage.follow_links is follow
