"""A path list (`--source-format paths`): a text file of media locations, one item per line. It
is also the proof that a source format is one module and one registry entry: its reader lists,
checks and reads through the one interface, and nothing else in flows/ or tasks/ names it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from vlm_caption.tasks.sources.formats import SourceSpec
from vlm_caption.tasks.sources.listing import iter_items
from vlm_caption.tasks.sources.reader import BadInput
from vlm_caption.tasks.sources.registry import SOURCE_FORMATS, detect_format, open_reader, reader_class
from vlm_caption.tasks.sources.storage import StorageError
from tests.images import image_bytes
from tests.result_files import records as result_records

ROOT = Path(__file__).resolve().parents[1]


def _write_list(folder: Path) -> Path:
    (folder / "img").mkdir(parents=True)
    (folder / "img" / "a.png").write_bytes(image_bytes("PNG", size=(60, 40), color=(200, 10, 10)))
    (folder / "img" / "b.png").write_bytes(image_bytes("PNG", size=(64, 48), color=(10, 200, 10)))
    elsewhere = folder.parent / f"{folder.name}-elsewhere.png"
    elsewhere.write_bytes(image_bytes("PNG", size=(50, 50), color=(10, 10, 200)))
    listing = folder / "list.txt"
    listing.write_text(f"# made by find\nimg/a.png\n\nimg/b.png\nimg/a.png\n{elsewhere}\n"
                       "ftp://old.example.org/c.png\nimg/missing.png\n")
    return listing


def test_a_path_list_is_listed_checked_and_read_through_its_reader(tmp_path: Path):
    listing = _write_list(tmp_path / "src")
    assert "paths" in SOURCE_FORMATS and detect_format(str(listing), "auto", False) == "paths"
    reader_type = reader_class("paths")
    spec = reader_type(reader_type.spec_for(str(listing))).check()
    items = list(iter_items(spec))
    ids = [item.id for item in items]
    assert ids == ["img/a.png", "img/b.png", str(tmp_path / "src-elsewhere.png"), "ftp://old.example.org/c.png",
                   "img/missing.png"]  # comments, blank lines and a repeated line left out
    reader = open_reader(spec)
    assert reader.read(items[0], items[0].members[0]) == (tmp_path / "src" / "img" / "a.png").read_bytes()
    assert reader.read(items[2], items[2].members[0]) == (tmp_path / "src-elsewhere.png").read_bytes()
    with pytest.raises(BadInput, match="a ftp:// location"):
        reader.read(items[3], items[3].members[0])
    with pytest.raises(FileNotFoundError):  # not damage: a fetch error, retried by the next run
        reader.read(items[4], items[4].members[0])
    assert [i.id for i in iter_items(SourceSpec(str(listing), format="paths", glob="*/b.png",
                                                items_root=str(tmp_path / "src")))] == ["img/b.png"]
    with pytest.raises(StorageError, match="path list not found"):
        reader_type(reader_type.spec_for(str(tmp_path / "src" / "none.txt"))).check()


def test_a_new_format_is_its_module_and_a_registry_entry():
    """Only the format's own module and the registry name it: the listing, pre-flight, fetch,
    gallery, plan, job and CLI reach it through the registry."""
    naming = re.compile(r"PathListReader|path_list|[\"']paths[\"']")
    found = sorted(str(path.relative_to(ROOT)) for folder in ("flows", "tasks") for path in (ROOT / folder).rglob("*.py")
                   if naming.search(path.read_text()))
    assert found == ["tasks/sources/path_list.py", "tasks/sources/registry.py"]


def test_a_path_list_end_to_end_and_rerun(prefect_api, tiny_llava, tmp_path: Path):
    from vlm_caption.flows.caption import vlm_caption
    from vlm_caption.flows.params import CaptionJob

    listing = _write_list(tmp_path / "src")
    job = CaptionJob(source=str(listing), output=str(tmp_path / "out"), model=str(tiny_llava), shard_size=2,
                     sampling={"max_tokens": 4}, gallery_items=10)
    summary = vlm_caption(job)
    records = result_records(tmp_path / "out")
    by_key = {r["key"]: r for r in records}
    assert len(records) == 4 and all(by_key[k]["text"] is not None for k in ("img/a.png", "img/b.png"))
    assert by_key[str(tmp_path / "src-elsewhere.png")]["error"] is None
    bad = by_key["ftp://old.example.org/c.png"]["error"]
    assert bad["kind"] == "bad_input" and not bad["retryable"] and "ftp://" in bad["message"]
    # The retryable error is the manifest's (its failures), not a record kept in the output's files.
    manifest = json.loads((tmp_path / "out" / "manifests" / f"{summary['run_id']}.json").read_text())
    assert "img/missing.png" not in by_key
    (missing,) = [f for f in manifest["failures"] if f["key"] == "img/missing.png"]
    assert missing["kind"] == "fetch" and missing["retryable"]
    assert manifest["parameters"]["source_format"] == "paths"

    again = vlm_caption(job)
    failures = json.loads((tmp_path / "out" / "manifests" / f"{again['run_id']}.json").read_text())["failures"]
    assert again["processed"] == 1 and [f["key"] for f in failures] == ["img/missing.png"]  # only it is tried again
