"""Issue 53 through the whole flow (a folder, the Prefect API, a real tiny LLaVA on CPU): a caption
made to loop is flagged in its record, the manifest and the summary, the opt-in re-ask keeps the
better answer, and the run says what it cost (device-seconds, and per 1,000 items at a price)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from vlm_caption.tasks.engine.vllm_engine import CaptionEngine
from vlm_caption.tasks.records import GenerationOutput, sha256_hex
from vlm_caption.tasks.results.report import cost_line, run_cost
from vlm_caption.tasks.settings import get_settings
from tests.images import image_bytes
from tests.result_files import records as _records

LOOP = "a cat and a cat and a cat and a cat and a cat and"
MENDED = "A small coloured square on its own."


@pytest.fixture
def settings_env(monkeypatch):
    def apply(**values: str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(f"VLM_CAPTION_{name.upper()}", value)
        get_settings.cache_clear()

    yield apply
    get_settings.cache_clear()


def test_cost_per_1000_items_from_device_seconds():
    cost = run_cost(7200.0, "cuda", 4000, 1_000_000, hour_price=2.0)
    assert cost["per_1000_items"] == pytest.approx(1.0)  # 2 GPU-hours at 2.0 for 4,000 items
    assert cost["items_per_device_s"] == pytest.approx(0.556) and cost["output_tokens_per_device_s"] == 138.889
    assert cost_line(cost) == ("7200.0 GPU-s: 0.556 items/GPU-s, 138.9 output tokens/GPU-s; "
                               "1 per 1,000 items at 2 per device-hour")
    assert run_cost(30.0, "cpu", 10, 100, None)["per_1000_items"] is None
    assert cost_line(run_cost(30.0, "cpu", 10, 100, None)).startswith("30.0 cpu-s: 0.333 items/cpu-s")


def test_a_copy_waits_for_the_first_answer_and_raises_if_its_shard_failed():
    import threading

    from vlm_caption.tasks.same_media import CopyWithoutAnswer, SameMedia

    same = SameMedia()
    first, is_first = same.claim("run", "h1", "Describe.", "a.jpg")
    copy, copy_first = same.claim("run", "h1", "Describe.", "b.jpg")
    assert is_first and not copy_first and copy.key == "a.jpg"
    assert same.claim("run", "h1", "Other question?", "b.jpg")[1]  # another question is asked
    assert same.claim("other-run", "h1", "Describe.", "b.jpg")[1]  # another run asks again
    got = []
    waiter = threading.Thread(target=lambda: got.append(same.answer(copy)))
    waiter.start()
    first.set_result(GenerationOutput("A cat.", "stop", 5, 2))
    waiter.join(10)
    assert got and got[0].text == "A cat."
    lost, _ = same.claim("run", "h2", "Describe.", "c.jpg")
    lost_copy, _ = same.claim("run", "h2", "Describe.", "d.jpg")
    same.forget("run", [("h2", "Describe.")], RuntimeError("engine died"))
    with pytest.raises(CopyWithoutAnswer, match="c.jpg.*engine died"):
        same.answer(lost_copy)
    assert same.claim("run", "h2", "Describe.", "d.jpg")[1]  # the retry asks itself


def test_the_answers_kept_for_copies_are_bounded(monkeypatch):
    """A run of millions of distinct items keeps the latest answers only: an early one's copy
    is asked again, a recent one's still takes its answer."""
    import vlm_caption.tasks.same_media as same_media

    monkeypatch.setattr(same_media, "KEEP_ANSWERS", 3)
    same = same_media.SameMedia()
    for i in range(5):
        claim, _ = same.claim("run", f"h{i}", "Describe.", f"{i}.jpg")
        claim.set_result(GenerationOutput(f"caption {i}", "stop", 5, 2))
    assert same.claim("run", "h0", "Describe.", "copy-of-0.jpg")[1]  # forgotten: asked again
    recent, first = same.claim("run", "h4", "Describe.", "copy-of-4.jpg")
    assert not first and same.answer(recent).text == "caption 4"


def test_partitions_charge_their_engines_and_the_parent_sums_them():
    from vlm_caption.tasks.results.report import RunStats

    parent, child = RunStats(), RunStats()
    parent.processed, child.processed = 30, 10
    parent.mark_generating(1000.0, 1100.0)
    child.mark_generating(1010.0, 1050.0)
    # From the engine's build (ready_at - startup_s) to the last result: the start is paid too.
    parent.charge({"ready_at": 990.0, "startup_s": 40.0, "engine_args": {"tensor_parallel_size": 2},
                   "sizing": {"device": "cuda"}})
    child.charge({"ready_at": 1000.0, "startup_s": 30.0, "engine_args": {}, "sizing": {"device": "cuda"}})
    assert (parent.device_s, child.device_s) == (300.0, 80.0)  # 150 s x 2 GPUs; 80 s x 1
    report = child.report(1, None)
    assert report.brief()["device_s"] == 80.0
    parent.absorb(report)
    assert parent.cost()["device_s"] == 380.0 and parent.cost()["items_per_device_s"] == pytest.approx(40 / 380, abs=1e-3)
    idle = RunStats()  # nothing generated (every item done already): its engine's start is still paid
    idle.charge({"ready_at": 990.0, "startup_s": 41.0, "engine_args": {}, "sizing": {"device": "cuda"}})
    assert idle.device_s == 41.0
    assert RunStats().cost()["device_s"] == 0 and cost_line(RunStats().cost()) == "no device time (nothing generated)"


def test_a_looping_caption_is_flagged_asked_again_and_the_run_costed(prefect_api, tiny_llava, tmp_path,
                                                                    monkeypatch, settings_env):
    from vlm_caption.flows.caption import vlm_caption
    from vlm_caption.flows.params import CaptionJob
    from vlm_caption.tasks.terminal import print_run_end

    media = tmp_path / "media"
    media.mkdir()
    pictures = {f"{name}.jpg": image_bytes("JPEG", size=(72 + i, 64), color=(i * 50, 90, 200 - i * 40))
                for i, name in enumerate(["a", "b", "loop", "mend"])}
    for name, data in pictures.items():
        (media / name).write_bytes(data)
    # A recorded output: the engine's answer for loop.jpg loops whatever the sampling; mend.jpg's
    # loops at first and mends when asked again with a repetition penalty.
    loops, mends = sha256_hex(pictures["loop.jpg"]), sha256_hex(pictures["mend.jpg"])
    real_run, asked = CaptionEngine.run, []

    def run(self, requests, sampling, method="generate"):
        outputs = real_run(self, requests, sampling, method)
        asked.append((len(requests), sampling.repetition_penalty))
        for i, request in enumerate(requests):
            if request.uuids == loops or (request.uuids == mends and sampling.repetition_penalty is None):
                outputs[i] = GenerationOutput(LOOP, "stop", outputs[i].prompt_tokens, 13)
            elif request.uuids == mends:
                outputs[i] = GenerationOutput(MENDED, "stop", outputs[i].prompt_tokens, 7)
        return outputs

    monkeypatch.setattr(CaptionEngine, "run", run)
    settings_env(gpu_hour_price="2.5")

    out = tmp_path / "out"
    state = vlm_caption(CaptionJob(source=str(media), output=str(out), model=str(tiny_llava),
                                   sampling={"max_tokens": 8}, retry_looping=1.3), return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    found = {r["key"]: r for r in _records(out)}
    assert sorted(found) == ["a.jpg", "b.jpg", "loop.jpg", "mend.jpg"]
    assert found["loop.jpg"]["text"] == LOOP and "looping" in found["loop.jpg"]["quality"]
    assert found["loop.jpg"]["retried_for"] == ["looping"] and found["loop.jpg"]["error"] is None
    assert found["mend.jpg"]["text"] == MENDED and found["mend.jpg"]["quality"] is None
    assert found["mend.jpg"]["retried_for"] == ["looping"]
    assert any(penalty == 1.3 for _, penalty in asked)

    manifest = json.loads(Path(summary["manifest"]).read_text())
    counts = manifest["counts"]
    assert counts["quality"]["looping"] >= 1 and counts["flagged"] >= 1
    assert counts["quality_retried"] >= 2 and counts["quality_fixed"] >= 1
    assert {"key": "loop.jpg", "question": found["loop.jpg"]["question"],
            "quality": found["loop.jpg"]["quality"]} in manifest["flagged"]
    cost = manifest["cost"]
    assert cost["device"] == "cpu" and cost["device_s"] > 0 and cost["items"] == 4
    assert cost["hour_price"] == 2.5 and cost["per_1000_items"] == pytest.approx(
        2.5 * cost["device_s"] / 3600 / 4 * 1000, rel=1e-3)

    assert "loop.jpg (looping" in summary["flagged_items"]  # a row of the UI's summary artifact
    terminal = io.StringIO()
    print_run_end(summary, str(out), None, None, file=terminal)
    lines = terminal.getvalue()
    assert "  quality  " in lines and "looping" in lines and "asked again" in lines
    assert "  cost     " in lines and "cpu-s" in lines and "per 1,000 items at 2.5 per device-hour" in lines


def test_byte_copies_under_other_names_are_captioned_once(prefect_api, tiny_llava, tmp_path, monkeypatch):
    from vlm_caption.flows.caption import vlm_caption
    from vlm_caption.flows.params import CaptionJob

    media = tmp_path / "media"
    media.mkdir()
    originals = {f"photo{i}.jpg": image_bytes("JPEG", size=(64 + i, 48), color=(i * 40, 100, 220 - i * 40))
                 for i in range(5)}
    copies = {"copy-of-0.jpg": originals["photo0.jpg"], "again-0.jpg": originals["photo0.jpg"],
              "zz-copy-of-3.jpg": originals["photo3.jpg"]}
    for name, data in {**originals, **copies}.items():
        (media / name).write_bytes(data)
    real_run, requests_made = CaptionEngine.run, []

    def run(self, requests, sampling, method="generate"):
        requests_made.extend(r.uuids for r in requests)
        return real_run(self, requests, sampling, method)

    monkeypatch.setattr(CaptionEngine, "run", run)

    out = tmp_path / "out"
    state = vlm_caption(CaptionJob(source=str(media), output=str(out), model=str(tiny_llava), shard_size=3,
                                   sampling={"max_tokens": 6}), return_state=True)
    assert state.is_completed(), state.message
    assert sorted(requests_made) == sorted(sha256_hex(data) for data in originals.values())  # 5 requests
    found = {r["key"]: r for r in _records(out)}
    assert len(found) == 8 and all(r["error"] is None for r in found.values())
    duplicates = {key: r for key, r in found.items() if r["duplicate_of"]}
    assert len(duplicates) == 3
    for key, record in duplicates.items():
        first = found[record["duplicate_of"]]
        assert first["duplicate_of"] is None and first["sha256"] == record["sha256"]
        assert record["text"] == first["text"] and record["output_tokens"] == 0
    manifest = json.loads(Path(state.result()["manifest"]).read_text())
    assert manifest["counts"]["duplicates"] == 3 and manifest["cost"]["copies"] == 3
    assert manifest["counts"]["processed"] == 8 and manifest["counts"]["succeeded"] == 8
