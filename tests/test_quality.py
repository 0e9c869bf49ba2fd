"""Caption checks (issue 53): a caption that loops, is empty, is cut by max_tokens or fails its
schema is flagged in its record and counted in the run's accounting; ordinary prose is not."""

from __future__ import annotations

import pytest

from vlm_caption.recipes import get_recipe
from vlm_caption.tasks.engine.arguments import EngineSpec
from vlm_caption.tasks.engine.steps import GenerateOptions, ask_again, make_record
from vlm_caption.tasks.engine.vllm_engine import Sampling
from vlm_caption.tasks.prepare import PreparedItem
from vlm_caption.tasks.results.gallery import sample_items
from vlm_caption.tasks.results.quality import better, caption_flags, is_looping
from vlm_caption.tasks.records import GenerationOutput, ItemError, Member, ResultRecord
from vlm_caption.tasks.results.report import RunStats
from vlm_caption.tasks.sources.items import ObjectRef, WorkItem

LOOPS = [
    "the the the the the the",
    "A dog on a beach. " + "and a dog and a dog and a dog and a dog",
    "A red car parked by a red car parked by a red car parked by",
    # a long sentence that comes back, other words between
    " ".join(["The photo shows a small kitchen with white cabinets and a window.", "Also,"] * 3),
    "Cute!" + "!" * 60,
    "这是一只猫" + "猫咪" * 30,
    "xqzxqzxqzxqzxqzxqzxqzxqzxqzxqzxqzxqzxqzxqz",
]

PROSE = [
    "A brown dog runs along a sandy beach at sunset, waves breaking behind it.",
    "Two people sit at a wooden table. One of them holds a cup of coffee; the other reads a newspaper. "
    "On the table there is a plate of croissants, a small vase with yellow flowers and a phone. Behind "
    "them, a window shows a rainy street with a red bus passing by and a man with an umbrella.",
    "The image shows a bar chart with five bars. The first bar is blue, the second bar is green, the "
    "third bar is red, the fourth bar is yellow and the fifth bar is purple. The y axis goes from 0 to 100.",
    "Very, very old stone bridge over a river, no, no cars.",
    "A table:\n| a | b |\n|---|---|\n| 1 | 2 |",
    "一只橘色的猫躺在阳光下的窗台上，旁边放着一盆绿色的植物。",
]


@pytest.mark.parametrize("text", LOOPS)
def test_looping_text_is_flagged(text):
    assert is_looping(text)
    assert caption_flags(text, "stop") == ["looping"]


@pytest.mark.parametrize("text", PROSE)
def test_ordinary_captions_are_not(text):
    assert caption_flags(text, "stop") == []


def test_empty_cut_and_schema_flags():
    assert caption_flags("", "stop") == ["empty"]
    assert caption_flags("  \n", "stop") == ["empty"]
    assert caption_flags(None, "stop") == ["empty"]
    assert caption_flags("A dog on a", "length") == ["truncated"]
    assert caption_flags('{"tags": ["c', "length", schema_failed=True) == ["truncated", "schema"]
    assert caption_flags("the " * 40, "length") == ["looping", "truncated"]


def test_the_better_answer_loops_less_then_has_fewer_flags():
    assert better(["looping", "truncated"], ["truncated"])
    assert better(["empty"], [])
    assert not better(["looping"], ["looping"])  # a tie keeps the first
    assert not better([], ["truncated"])


def _item(key: str = "a.jpg", error: ItemError | None = None) -> PreparedItem:
    return PreparedItem(WorkItem(key, (ObjectRef(key, 10, "e"),)), ("Describe.",),
                        members=[Member(key=key, size=10, etag="e", sha256="h")], sha256="h", error=error)


def _record(item: PreparedItem, output: GenerationOutput | None, structured=None, **kw) -> ResultRecord:
    return make_record(item, "Describe.", output, "p", "m", "llava", 0.1, "fp", "run", structured, **kw)


def test_records_carry_flags_and_errors_none():
    looping = _record(_item(), GenerationOutput("no no no no no no no", "length", 5, 7))
    assert looping.quality == ["looping", "truncated"] and looping.error is None
    fine = _record(_item(), GenerationOutput("A cat on a mat.", "stop", 5, 6))
    assert fine.quality is None
    failed = _record(_item(error=ItemError("decode", "bad")), None)
    assert failed.quality is None  # no answer to judge
    schema = {"json": {"type": "object", "required": ["tags"]}}
    miss = _record(_item(), GenerationOutput('{"x": 1}', "stop", 5, 6), schema)
    assert miss.error["kind"] == "structured_output" and miss.quality == ["schema"]
    # a structured answer repeats its form by design: not a loop
    cars = '[{"label": "car"}, {"label": "car"}, {"label": "car"}]'
    assert caption_flags(cars, "stop") == ["looping"]  # as prose it would be
    assert _record(_item(), GenerationOutput(cars, "stop", 5, 20), {"json": {"type": "array"}}).quality is None
    # an old record, written before the checks, still parses
    old = fine.model_dump()
    old.pop("quality"), old.pop("retried_for")
    assert ResultRecord.model_validate(old).quality is None


def test_run_stats_count_flags_and_the_gallery_lists_flagged_items_first():
    records = [
        _record(_item("a.jpg"), GenerationOutput("the the the the the the", "stop", 5, 6)),
        _record(_item("b.jpg"), GenerationOutput("A cat.", "stop", 5, 2)),
        _record(_item("c.jpg"), GenerationOutput("", "stop", 5, 0), retried_for=["empty"]),
        _record(_item("d.jpg"), GenerationOutput("A cat sits.", "stop", 5, 3), retried_for=["looping"]),
    ]
    stats = RunStats()
    stats.add(4, 0, records)
    assert stats.quality_by_flag == {"looping": 1, "empty": 1} and stats.quality_flagged == 2
    assert (stats.quality_retried, stats.quality_fixed) == (2, 1)
    assert [f["key"] for f in stats.flagged] == ["a.jpg", "c.jpg"]
    manifest = stats.manifest(run_id="r", parameters={}, fingerprint="fp", engine=None)
    assert manifest["counts"]["quality"] == {"looping": 1, "empty": 1} and manifest["counts"]["flagged"] == 2
    assert manifest["counts"]["quality_retried"] == 2 and manifest["counts"]["quality_fixed"] == 1
    assert stats.summary()["quality"] == "2 flagged (empty 1, looping 1); 2 asked again, 1 fixed"
    assert stats.summary()["flagged_items"] == "a.jpg (looping), c.jpg (empty)"
    # a child partition's report adds up in the parent
    parent = RunStats()
    parent.absorb(stats.report(1, None))
    assert parent.quality_by_flag == stats.quality_by_flag and parent.quality_fixed == 1
    assert [item.key for item in sample_items(records, 10)] == ["a.jpg", "c.jpg", "b.jpg", "d.jpg"]
    # a run whose every caption is flagged (cut at max_tokens, say) still fills its page
    cut = [_record(_item(f"{i:02d}.jpg"), GenerationOutput("A cat on a", "length", 5, 4)) for i in range(20)]
    assert len(sample_items(cut, 8)) == 8


class _Engine:
    """Answers the re-ask with a fixed text per question, and counts what it was asked."""

    def __init__(self, answers: list[GenerationOutput]):
        self.answers, self.asked = answers, []

    def run(self, requests, sampling, method):
        self.asked.append((len(requests), sampling.repetition_penalty))
        return self.answers[: len(requests)]


def test_the_re_ask_keeps_the_better_answer(monkeypatch):
    options = GenerateOptions(EngineSpec(recipe=get_recipe("llava"), model="m"), Sampling(), retry_looping=1.3)
    outputs = [GenerationOutput("the the the the the the", "stop", 5, 6),
               GenerationOutput("A cat.", "stop", 5, 2),
               GenerationOutput("", "stop", 5, 0)]
    engine = _Engine([GenerationOutput("A dog on grass.", "stop", 5, 4), GenerationOutput("", "stop", 5, 0)])
    retried = ask_again(engine, [object(), object(), object()], outputs, options)
    assert engine.asked == [(2, 1.3)]
    assert retried == {0: ["looping"], 2: ["empty"]}
    assert outputs[0].text == "A dog on grass." and outputs[1].text == "A cat." and outputs[2].text == ""
