"""The engine's steps: start the worker's one engine (a Prefect task run), and caption a prepared
shard with one batched vLLM call (every (item, question) of the shard), one record each (a plain
function, run on its batch's threads: flows/batches.py)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace

from prefect import task
from prefect.cache_policies import NONE

from vlm_caption.tasks.engine.arguments import EngineSpec
from vlm_caption.tasks.engine.vllm_engine import EngineRequest, Sampling, get_engine
from vlm_caption.tasks.prepare import PreparedItem, PreparedShard
from vlm_caption.tasks.media.video import DecodedVideo
from vlm_caption.tasks.observability import get_logger
from vlm_caption.tasks.results.quality import better, caption_flags, wants_retry
from vlm_caption.tasks.records import GenerationOutput, ItemError, ResultRecord, structured_answer
from vlm_caption.tasks.same_media import SAME_MEDIA


@dataclass(frozen=True)
class GenerateOptions:
    """How a shard is run: the engine, the method and the sampling."""

    spec: EngineSpec
    sampling: Sampling
    method: str = "generate"  # or "chat" (the multi-image example's LLM.chat)
    num_frames: int = 16
    retry_looping: float | None = None  # the repetition penalty a looping caption is asked again with
    dedup: bool = True  # the same media captioned once (tasks/same_media.py)


@task(name="start-engine", cache_policy=NONE, persist_result=False)
def start_engine(spec: EngineSpec) -> dict:
    """Load the model once for this worker process (reused by every later shard)."""
    engine = get_engine(spec)
    sizing = engine.sizing()
    get_logger(recipe=spec.recipe.name).info("engine ready", model=engine.model,
                                        startup_s=round(engine.startup_s, 1), **sizing)
    return {"model": engine.model, "startup_s": engine.startup_s, "ready_at": engine.ready_at, "sizing": sizing,
            "engine_args": dict(engine.args)}


def engine_request(item: PreparedItem, question: str, options: GenerateOptions) -> EngineRequest:
    """One question about one item, with its media in the shape vLLM takes for the modality."""
    media = item.media
    if isinstance(media, DecodedVideo):
        needs_metadata = options.spec.recipe.needs_video_metadata
        return EngineRequest(question, media.for_request(needs_metadata), media_id(item, options))
    if isinstance(media, list):
        return EngineRequest(question, media, [m.sha256 or "" for m in item.members], count=len(media))
    return EngineRequest(question, media, item.sha256 or "")


def failed_shard_records(prepared: PreparedShard, error: BaseException, model: str, options: GenerateOptions,
                         fingerprint: str, run_id: str) -> list[ResultRecord]:
    """A record per (item, question) of a shard whose generation failed past its batch's retries, each
    with that failure, retryable (the next run asks again), so the shard's part still says
    what became of every item; an item that failed before (fetch, decode) keeps its own error."""
    failure = ItemError("generate", f"the shard failed: {type(error).__name__}: {error}", retryable=True)
    records = []
    for item in prepared.items:
        failed = item if item.error is not None else replace(item, error=failure)
        records += [make_record(failed, question, None, None, model, options.spec.recipe.name, 0.0, fingerprint,
                                run_id, options.sampling.structured) for question in item.questions]
        item.media = None
    return records


def generate_shard(prepared: PreparedShard, options: GenerateOptions, fingerprint: str,
                  run_id: str) -> list[ResultRecord]:
    """Every (item, question) of a shard in one vLLM call; each gets a record, failed or not.
    A failure of the whole shard (an engine that died) is raised: its batch tries it again
    (flows/batches.py), on a new engine (`get_engine` builds one).
    Each item was fetched and decoded once; its questions share its media and content ids. A
    copy of media asked already takes that answer, with no request (tasks/same_media.py)."""
    engine = get_engine(options.spec)
    retried_for: dict[tuple[int, str], list[str]] = {}
    started, spent = time.perf_counter(), []  # spent: the generate seconds per request asked

    def ask(pairs: list[tuple[PreparedItem, str]]) -> list[GenerationOutput]:
        requests = [engine_request(item, q, options) for item, q in pairs]
        outputs = engine.run(requests, options.sampling, options.method)
        if options.retry_looping is not None:
            retried = ask_again(engine, requests, outputs, options)
            retried_for.update({(id(pairs[i][0]), pairs[i][1]): flags for i, flags in retried.items()})
        spent.append((time.perf_counter() - started) / max(len(pairs), 1))
        return outputs

    pairs = [(item, q) for item in prepared.items for q in item.questions]
    answers = SAME_MEDIA.answers(run_id if options.dedup else None, pairs, ask, lambda item: media_id(item, options),
                                 keep_prompt=options.method == "chat")
    records = []
    for item in prepared.items:
        for question in item.questions:
            output, duplicate_of = answers.get((id(item), question), (None, None))
            prompt = None if options.method == "chat" or item.error else engine.prompt_for(
                question, len(item.members))
            records.append(make_record(item, question, output, prompt, engine.model, options.spec.recipe.name,
                                       spent[0], fingerprint, run_id, options.sampling.structured,
                                       retried_for=retried_for.get((id(item), question)),
                                       duplicate_of=duplicate_of))
        item.media = None  # release the decoded pixels as soon as they are consumed
    return records


def media_id(item: PreparedItem, options: GenerateOptions) -> str:
    """What makes two items' requests the same, the question apart: their bytes (a group's hash
    of its members'), and for a video the frames sampled from them (the same bytes sampled to
    another frame count are other inputs to the processor)."""
    return f"{item.sha256}-f{options.num_frames}" if isinstance(item.media, DecodedVideo) else item.sha256


def ask_again(engine, requests: list[EngineRequest], outputs: list[GenerationOutput],
              options: GenerateOptions) -> dict[int, list[str]]:
    """Ask once more, with a repetition penalty, for each answer that loops or is empty; an
    answer the re-ask betters is replaced in `outputs`. Returns the first answers' flags by
    request index, for every request asked again (its record's `retried_for`)."""
    prose = options.sampling.structured is None
    flagged = {i: flags for i, out in enumerate(outputs) if out.error is None
               and wants_retry(flags := caption_flags(out.text, out.finish_reason, prose=prose))}
    if not flagged:
        return {}
    sampling = replace(options.sampling, repetition_penalty=options.retry_looping)
    again = engine.run([requests[i] for i in flagged], sampling, options.method)
    for (i, flags), out in zip(flagged.items(), again):
        if out.error is None and better(flags, caption_flags(out.text, out.finish_reason, prose=prose)):
            outputs[i] = out
    get_logger(recipe=options.spec.recipe.name).info("asked again for looping or empty captions", requests=len(flagged),
                                                bettered=sum(outputs[i] is out for i, out in zip(flagged, again)))
    return flagged


def make_record(item: PreparedItem, question: str, output: GenerationOutput | None, prompt: str | None,
                model: str, recipe: str, generate_s: float, fingerprint: str, run_id: str,
                structured: dict | None = None, retried_for: list[str] | None = None,
                duplicate_of: str | None = None) -> ResultRecord:
    """One record. A `duplicate_of` record took the answer of the item with that key (the same
    bytes): it made no request, so its tokens and generate time are 0."""
    error = item.error
    if output is not None and output.error is not None:
        error = ItemError("generate", output.error, retryable=False)
    answer = None
    if error is None and output is not None and structured is not None and "json" in structured:
        answer, error = structured_answer(output.text, output.finish_reason, structured["json"])
    # A structured answer that does not parse keeps its raw text, to show where it went wrong.
    keep_text = output is not None and (error is None or error.kind == "structured_output")
    # Only an answer is checked: a fetch, decode or engine error has no caption to judge.
    flags = caption_flags(output.text, output.finish_reason, schema_failed=error is not None,
                          prose=structured is None) if keep_text else None
    single = len(item.item.members) == 1 and item.item.members[0].key == item.item.id
    return ResultRecord(
        key=item.item.id, size=sum(max(m.size, 0) for m in item.members) if item.members else item.item.size,
        etag=item.members[0].etag if single and item.members else "",
        sha256=item.sha256, recipe=recipe, model=model, question=question,
        prompt=(output.prompt if output and output.prompt else prompt) if keep_text else prompt,
        text=output.text if keep_text else None,
        finish_reason=output.finish_reason if keep_text else None,
        structured=answer,
        prompt_tokens=output.prompt_tokens if output and not duplicate_of else 0,
        output_tokens=output.output_tokens if output and not duplicate_of else 0,
        error=asdict(error) if error else None,
        members=None if single else item.members,
        video=item.video_info,
        quality=flags or None, retried_for=retried_for, duplicate_of=duplicate_of,
        timings={"fetch_s": round(item.fetch_s, 4), "decode_s": round(item.decode_s, 4),
                 "generate_s": round(generate_s, 4) if output and not duplicate_of else 0.0},
        fingerprint=fingerprint, run_id=run_id,
    )
