"""Engine ready with and without each vLLM start option, one fresh process per row: the product's
engine arguments (tasks/engine/arguments.py) for a LLaVA checkpoint (the bench's `llava-7b`), then
vLLM's AsyncLLM built as the flow builds it and one request answered. Every variant runs once per
round; round 1 builds each variant's compile cache (an option that changes the compiled graphs
misses the cache once), the later rounds are the figures. One JSON line per row: import_s (vLLM
imported), build_s (from_engine_args until ready), first_s (one short request), and the phases vLLM
logs (weights, compile, profile and KV cache, graph capture).

    python -m vlm_caption.bench.start_options <checkpoint> [rounds]   # on a GPU host
"""
import json, re, subprocess, sys, time

ROW = r'''
import json, sys, time, asyncio
t0 = time.perf_counter()
from vlm_caption.recipes import get_recipe
from vlm_caption.tasks.engine.arguments import EngineSpec, engine_plan
from vlm_caption.tasks.engine import vllm_api
import vllm  # noqa
t1 = time.perf_counter()
extra = json.loads(sys.argv[2])
if extra.pop("vllm defaults", False):  # raw's engine: vLLM's own defaults, the model only
    args = {"model": sys.argv[1]}
else:
    args, _ = engine_plan(EngineSpec.build(get_recipe("llava"), model=sys.argv[1]), on_cpu=False)
args.update(extra)
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
    "vLLM defaults (raw's engine)": {"vllm defaults": True},
    # vLLM captures 51 sizes (every 8 to 256, every 16 to 512); every 16 and every 32 is 28
    "28 CUDA graph sizes": {"cudagraph_capture_sizes": [1, 2, 4, 8, *range(16, 257, 16), *range(288, 513, 32)]},
    "optimization_level=1 (piecewise graphs only)": {"optimization_level": 1},
}
# What vLLM logs about its own start, seconds each (vLLM 0.26's wording).
PHASES = {
    "weights_s": r"Loading weights took ([\d.]+) seconds",
    "model_load_s": r"Model loading took [\d.]+ Gi?B(?: memory)? and ([\d.]+) seconds",
    "compile_s": r"torch\.compile takes ([\d.]+) s in total",
    "graphs_s": r"Graph capturing finished in ([\d.]+) secs",
    "engine_init_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) seconds",
}

def run_variant(model: str, extra: dict) -> dict:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", ROW, model, json.dumps(extra)], capture_output=True, text=True)
    line = [l for l in done.stdout.splitlines() if l.startswith("ROW ")]
    row = json.loads(line[0][4:]) if line else {"error": done.stderr[-800:]}
    for name, pattern in PHASES.items():
        found = re.findall(pattern, done.stderr + done.stdout)
        if found:
            row[name] = float(found[-1])
    row["process_s"] = round(time.perf_counter() - started, 2)
    return row

if __name__ == "__main__":
    model, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2
    for round_ in range(1, rounds + 1):
        for name, extra in VARIANTS.items():
            print(json.dumps({"round": round_, "variant": name, **run_variant(model, extra)}), flush=True)
