"""Engine ready with and without each vLLM start option, one fresh process per row: the product's
engine arguments (tasks/engine/arguments.py) for a LLaVA checkpoint (the bench's `llava-7b`), then
vLLM's AsyncLLM built as the flow builds it and one request answered. One JSON line per row:
import_s (vLLM imported), build_s (from_engine_args until ready), first_s (one short request).

    python -m vlm_caption.bench.start_options <checkpoint>      # on a GPU host, after a bench made the checkpoint
"""
import json, subprocess, sys, time

ROW = r'''
import json, sys, time, asyncio
t0 = time.perf_counter()
from vlm_caption.recipes import get_recipe
from vlm_caption.tasks.engine.arguments import EngineSpec, engine_plan
from vlm_caption.tasks.engine import vllm_api
import vllm  # noqa
t1 = time.perf_counter()
spec = EngineSpec.build(get_recipe("llava"), model=sys.argv[1])
args, _ = engine_plan(spec, on_cpu=False)
args.update(json.loads(sys.argv[2]))
async def main():
    llm = vllm_api.build_async_engine(args)
    t2 = time.perf_counter()
    from vllm import SamplingParams
    async for out in llm.generate("USER: hello\nASSISTANT:", SamplingParams(max_tokens=4), "r0"):
        pass
    t3 = time.perf_counter()
    llm.shutdown()
    return t2, t3
t2, t3 = asyncio.run(main())
print("ROW", json.dumps({"import_s": round(t1 - t0, 2), "build_s": round(t2 - t1, 2), "first_s": round(t3 - t2, 2)}))
'''
VARIANTS = {
    "product defaults": {},
    "mm_processor_cache_gb=0": {"mm_processor_cache_gb": 0},
    "limit_mm_per_prompt image 1, video 0": {"limit_mm_per_prompt": {"image": 1, "video": 0}},
    "max_cudagraph_capture_size=256": {"max_cudagraph_capture_size": 256},
}
if __name__ == "__main__":
    model = sys.argv[1]
    for name, extra in VARIANTS.items():
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", ROW, model, json.dumps(extra)], capture_output=True, text=True)
        line = [l for l in done.stdout.splitlines() if l.startswith("ROW ")]
        row = json.loads(line[0][4:]) if line else {"error": done.stderr[-800:]}
        row.update(variant=name, process_s=round(time.perf_counter() - started, 2))
        print(json.dumps(row), flush=True)
