import pytest

from tasks.sources.storage import LocalStorage, S3Storage, StorageError, open_storage


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
