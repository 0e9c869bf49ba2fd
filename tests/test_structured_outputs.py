"""Structured outputs (issue 27): a job's JSON schema, regex or choice list reaches vLLM's
SamplingParams, records carry the parsed JSON, and bad constraints are refused up front."""

import json
from pathlib import Path

import jsonschema
import pytest
from pydantic import ValidationError

from vlm_caption.flows.plan import fingerprint_of
from vlm_caption.flows.cli import main
from vlm_caption.flows.params import TAGS_SCHEMA, CaptionJob
from vlm_caption.recipes import get_recipe
from vlm_caption.tasks.records import structured_answer
from tests.images import image_bytes
from tests.result_files import records as _records

SCHEMA = {  # closed choices, so that random weights can finish an answer within max_tokens
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"enum": ["cat", "dog", "sky"]}, "maxItems": 3},
                   "count": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["tags", "count"],
    "additionalProperties": False,
}


def _job(**fields) -> CaptionJob:
    return CaptionJob(source="/media", output="/out", **fields)


def test_constraints_are_checked_up_front():
    assert _job(json_schema="tags").json_schema == TAGS_SCHEMA
    assert _job(json_schema="tags").structured_output == {"json": TAGS_SCHEMA}
    assert _job(regex=r"\d+").structured_output == {"regex": r"\d+"}
    assert _job(choice=["cat", "dog", "cat"]).structured_output == {"choice": ["cat", "dog"]}
    assert _job().structured_output is None
    for fields, message in [({"json_schema": {"type": "arrayy"}}, "not a valid JSON Schema"),
                            ({"json_schema": "nope"}, "not a built-in schema"),
                            ({"regex": "("}, "not a valid regular expression"),
                            ({"choice": []}, "at least one"),
                            ({"regex": "a", "choice": ["a"]}, "at most one of")]:
        with pytest.raises(ValidationError, match=message):
            _job(**fields)


def test_the_constraint_is_part_of_the_fingerprint_and_plain_jobs_keep_theirs():
    recipe = get_recipe("llava")
    plain = fingerprint_of(_job(), recipe, "m")
    tags = fingerprint_of(_job(json_schema="tags"), recipe, "m")
    choice = fingerprint_of(_job(choice=["a", "b"]), recipe, "m")
    assert len({plain, tags, choice}) == 3
    from vlm_caption.tasks.records import job_fingerprint
    assert plain == job_fingerprint(source="/media", recipe="llava", model="m", modality="image",
                                    method="generate", media={}, sampling=_job().sampling.model_dump())


def test_structured_answer_parses_validates_and_names_a_cut():
    assert structured_answer('{"tags": ["cat"], "count": 2}', "stop", SCHEMA) == ({"tags": ["cat"], "count": 2}, None)
    value, error = structured_answer('{"tags": ["cat", "d', "length", SCHEMA)
    assert value is None and error.kind == "structured_output" and "max_tokens" in error.message
    value, error = structured_answer('{"tags": []}', "stop", SCHEMA)
    assert error.kind == "structured_output" and "'count' is a required property" in error.message
    assert "max_tokens" not in error.message


def test_cli_refuses_a_bad_schema_in_one_line(tmp_path, capsys):
    schema = tmp_path / "bad.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"tags": {"type": "arrayy"}}}))
    assert main(["run", str(tmp_path), "--out", str(tmp_path / "out"), "--json-schema", str(schema)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vlm-caption: error: json_schema: not a valid JSON Schema") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
    assert main(["run", str(tmp_path), "--out", str(tmp_path / "out"), "--json-schema", str(tmp_path / "no.json")]) == 2
    assert capsys.readouterr().err.startswith("vlm-caption: error: --json-schema")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("structured-media")
    for i in range(4):
        (root / f"{i}.jpg").write_bytes(image_bytes("JPEG", size=(80 + i, 64), color=(i * 60, 90, 200 - i * 40)))
    return root


# Compact JSON: a grammar that allows whitespace anywhere lets random weights spend every token
# on tabs and newlines (vLLM 0.26 takes this per engine, not per request). One engine for both jobs.
COMPACT = {"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}}


def test_json_schema_and_choice_jobs_on_a_real_engine(prefect_api, tiny_llava, folder, tmp_path):
    from vlm_caption.flows.caption import vlm_caption

    # Random weights + the grammar: each answer is valid JSON of the schema, or (cut by max_tokens)
    # an error record that says so and keeps the raw text.
    out = tmp_path / "json"
    state = vlm_caption(CaptionJob(source=str(folder), output=str(out), model=str(tiny_llava), json_schema=SCHEMA,
                                   engine_overrides=COMPACT,
                                   questions=["Tag this image.", "Count the objects."], sampling={"max_tokens": 64}),
                        return_state=True)
    assert state.is_completed(), state.message
    records = _records(out)
    assert len(records) == 8
    for r in records:
        assert r["text"] is not None
        if r["error"] is None:
            jsonschema.validate(r["structured"], SCHEMA)
            assert json.loads(r["text"]) == r["structured"]
        else:
            assert r["error"]["kind"] == "structured_output" and r["structured"] is None
            assert r["finish_reason"] == "length" and "max_tokens" in r["error"]["message"]
            assert r["text"].lstrip().startswith("{")  # the structure holds as far as it got
    assert any(r["error"] is None for r in records)  # compact JSON of closed choices fits 64 tokens (8 of 8)

    out = tmp_path / "choice"
    state = vlm_caption(CaptionJob(source=str(folder), output=str(out), model=str(tiny_llava),
                                   choice=["cat", "dog", "other"], sampling={"max_tokens": 8},
                                   engine_overrides=COMPACT), return_state=True)
    assert state.is_completed(), state.message
    records = _records(out)
    assert len(records) == 4
    assert all(r["error"] is None and r["text"] in ("cat", "dog", "other") and r["structured"] is None
               for r in records)
    assert records[0]["fingerprint"] != _records(tmp_path / "json")[0]["fingerprint"]
