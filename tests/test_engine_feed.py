"""The continuous engine feed's bookkeeping, against a stand-in for vLLM's LLM that finishes
requests out of order, a few per step, and rejects some at enqueue (as vLLM rejects a prompt
that is too long): every request resolves exactly once, rejections stay with their request,
and a dead engine fails everything in flight instead of hanging it."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from tasks.engine.feed import EngineDied, EngineFeed


class StandInLLM:
    def __init__(self, die_after_steps: int | None = None):
        self.pending: list[str] = []
        self.counter = 0
        self.steps = 0
        self.max_in_engine = 0
        self.die_after_steps = die_after_steps
        self.rng = random.Random(7)
        self.owner: set[str] = set()
        self.llm_engine = SimpleNamespace(step=self._step)

    def enqueue(self, prompts, params, lora_request=None, use_tqdm=False):
        self.owner.add(threading.current_thread().name)
        (prompt,) = prompts
        if prompt["prompt"].startswith("bad"):
            raise ValueError(f"prompt {prompt['prompt']!r} is longer than the model's context")
        self.counter += 1
        request_id = f"{self.counter}"  # vLLM's LLM numbers requests; outputs carry that id ...
        self.pending.append(request_id)
        self.max_in_engine = max(self.max_in_engine, len(self.pending))
        return [f"{request_id}-{self.rng.getrandbits(32):08x}"]  # ... enqueue returns it suffixed

    def _step(self):
        self.owner.add(threading.current_thread().name)
        self.steps += 1
        time.sleep(0.002)  # a forward pass takes time; shards hand in requests meanwhile
        if self.die_after_steps is not None and self.steps > self.die_after_steps:
            raise RuntimeError("EngineCore died")
        self.rng.shuffle(self.pending)
        done, self.pending = self.pending[:3], self.pending[3:]
        return [SimpleNamespace(request_id=r, finished=True) for r in done] + \
               [SimpleNamespace(request_id=r, finished=False) for r in self.pending[:1]]


@pytest.mark.parametrize("shard_size", [1, 7, 64])
def test_every_request_resolves_once_across_concurrent_shards(shard_size):
    llm = StandInLLM()
    feed = EngineFeed(llm)
    prompts = [f"{'bad' if i % 11 == 5 else 'ok'}-{i}" for i in range(150)]
    shards = [prompts[i:i + shard_size] for i in range(0, len(prompts), shard_size)]

    def run_shard(shard):
        futures = [feed.submit({"prompt": p}, params=None) for p in shard]
        results = []
        for prompt, future in zip(shard, futures):
            try:
                results.append((prompt, future.result(timeout=30).request_id))
            except ValueError as exc:
                results.append((prompt, f"error: {exc}"))
        return results

    with ThreadPoolExecutor(max_workers=3) as pool:  # shards overlap, as the flow runs them
        results = [r for shard in pool.map(run_shard, shards) for r in shard]
    feed.close()
    assert [p for p, _ in results] == prompts  # every request answered, in its shard's order
    ids = [r for _, r in results if not r.startswith("error")]
    assert len(ids) == len(set(ids)) == sum(1 for p in prompts if p.startswith("ok"))  # none twice
    assert all("longer than the model's context" in r for p, r in results if p.startswith("bad"))
    assert llm.owner == {"vllm-feed"}  # only the feed thread touches the engine
    if shard_size == 1:
        assert llm.max_in_engine > 1  # requests of several shards were in the engine together


def test_a_dead_engine_fails_every_waiting_request_and_later_ones():
    feed = EngineFeed(StandInLLM(die_after_steps=2))
    futures = [feed.submit({"prompt": f"ok-{i}"}, params=None) for i in range(20)]
    outcomes = []
    for future in futures:
        try:
            future.result(timeout=30)
            outcomes.append("done")
        except EngineDied as exc:
            outcomes.append("died")
            assert "EngineCore died" in str(exc)
    assert "died" in outcomes  # nothing hangs
    with pytest.raises(EngineDied):
        feed.submit({"prompt": "ok-late"}, params=None).result(timeout=5)
