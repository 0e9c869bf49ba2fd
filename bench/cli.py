"""`vlm-caption bench`'s options and its handler, `cmd_bench` (what they mean is `bench/config.py`
and docs/benchmarks.md). `flows/cli.py` names both as strings and imports them only when
`vlm-caption bench` is used: the product never imports the bench."""

from __future__ import annotations

import argparse
import json


def cmd_bench(args: argparse.Namespace) -> int:
    from vlm_caption.bench import BenchConfig, run_bench
    from vlm_caption.bench.processes import sigterm_raises
    from vlm_caption.flows.cli_job import json_schema_option
    from vlm_caption.flows.params import resolve_json_schema
    from vlm_caption.tasks.errors import UsageError

    if args.scaling:  # the simulation stands alone: stub engines, its own loopback S3 (bench/scaling.py)
        from vlm_caption.bench.scaling import main as scaling

        return scaling(["--partitions", args.scaling, "--dir", args.dir])
    width, _, height = args.size.partition("x")
    if not (width.isdigit() and height.isdigit()):
        raise UsageError(f"--size {args.size}: expected WIDTHxHEIGHT in pixels, e.g. 640x480")
    try:  # checked as a job checks it, before any phase runs
        schema = resolve_json_schema(json_schema_option(args.json_schema))
    except ValueError as exc:
        raise UsageError(f"--json-schema: {exc}") from None
    with sigterm_raises():  # a SIGTERM stops every process the bench started, as Ctrl-C does
        run_bench(BenchConfig(workdir=args.dir, model=args.model, recipe=args.recipe, images=args.images,
                              copies=args.copies, width=int(width), height=int(height), shard_size=args.shard_size,
                              source=args.source, max_tokens=args.max_tokens, shape=args.shape,
                              modality=args.modality, frames=args.frames, flow_env=tuple(args.flow_env),
                              fan_out_env=tuple(args.fan_out_env), also_gpus=tuple(args.also_gpus),
                              profile=args.profile, prefect=args.prefect, gpus=args.gpus, skip_raw=args.skip_raw,
                              processor_device=args.processor_device, warm_up=args.warm_up,
                              start_rounds=args.start_rounds, history=args.history,
                              history_source=args.history_source, history_keep=args.history_keep,
                              history_new=not args.history_nothing_new_only, history_new_at=args.history_new_at,
                              json_schema=json.dumps(schema) if schema is not None else None,
                              engine_args=json.dumps(dict(args.engine_arg)) if args.engine_arg else None))
    return 0


class SkipRaw(argparse.Action):
    """--skip-raw and --skip-raw-n, gathered in one value of `skip_raw` ("raw", "raw-n" or
    "raw,raw-n"; False: neither), which `vlm-caption bench` hands BenchConfig as it is:
    BenchConfig reads it into its `skip_raw` and `skip_raw_n` (bench/config.py)."""

    def __call__(self, parser, namespace, values, option_string=None):
        skipped = set(namespace.skip_raw.split(",")) if isinstance(namespace.skip_raw, str) else set()
        skipped.add("raw-n" if option_string == "--skip-raw-n" else "raw")
        namespace.skip_raw = ",".join(sorted(skipped))


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from vlm_caption.flows.cli_job import engine_arg  # `run`'s own KEY=VALUE parsing

    parser.add_argument("--dir", default="vlm-caption-bench", help="working folder (default: ./vlm-caption-bench)")
    parser.add_argument("--model", help="model path or id (default: a random-weight checkpoint of --shape)")
    parser.add_argument("--shape", choices=["tiny", "7b", "2b"], default="tiny",
                        help="without --model: a random-weight checkpoint of this shape: tiny or 7b for llava, "
                        "tiny or 2b for qwen2_vl (default tiny)")
    parser.add_argument("--recipe", default="llava",
                        help="llava (default), qwen2_vl or qwen2_5_vl (these two for video too)")
    parser.add_argument("--modality", choices=["image", "video", "multi-image"], default="image",
                        help="JPEGs, MP4 clips, or folders of two JPEGs (default image)")
    parser.add_argument("--frames", type=int, default=16, help="frames sampled per clip (default 16)")
    parser.add_argument("--images", type=int, default=64, help="distinct items to caption (default 64)")
    parser.add_argument("--copies", type=float, default=0.0, metavar="FRACTION",
                        help="images only: this fraction of --images are byte copies of others under other names "
                        "(the flow captions each distinct image once; raw captions every file)")
    parser.add_argument("--size", default="640x480", help="image or frame size WxH (default 640x480)")
    parser.add_argument("--shard-size", type=int, default=64)
    parser.add_argument("--source", choices=["folder", "s3", "webdataset"], default="folder",
                        help="serve the images from a folder, an S3 endpoint (VLM_CAPTION_BENCH_S3, "
                        "else a loopback moto server) or WebDataset tar shards in a folder (the flow reads "
                        "the tars; raw the JPEGs)")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per item (default 64)")
    parser.add_argument("--flow-env", action="append", default=[], metavar="NAME=VALUE[,NAME=VALUE]",
                        help="run the flow once more with these settings, e.g. VLM_CAPTION_PREPARE_AHEAD=4")
    parser.add_argument("--fan-out-env", action="append", default=[], metavar="NAME=VALUE[,NAME=VALUE]",
                        help="with --gpus N: run the fan-out once more with these settings in the run's and its "
                        "workers' environment, e.g. VLM_CAPTION_PREPARE_AHEAD=4")
    parser.add_argument("--profile", action="store_true",
                        help="record what holds the GIL in the flow's process and its children: the engine "
                        "core, the pools (py-spy must be installed)")
    parser.add_argument("--prefect", choices=["embedded", "server"], default="embedded",
                        help="embedded: each flow phase starts Prefect's embedded server, as `vlm-caption run` "
                        "does (default); server: one `prefect server start` for all, as a deployment run sees it")
    parser.add_argument("--gpus", type=int, default=1,
                        help="N > 1: then the flow fanned out over N GPUs of this host (fan_out=N, the run on "
                        "GPU 0, a process worker per other GPU, the partition deployment; implies --prefect "
                        "server; a folder or S3 source), reported over the flow on one GPU; and, before the "
                        "flows, \"raw, N processes\": N raw vLLM scripts at once, one per GPU "
                        "(CUDA_VISIBLE_DEVICES=i), each given 1/N of the items, the fan-out reported over it "
                        "on items/s from the first engine ready to the last result (--skip-raw-n: not run)")
    parser.add_argument("--also-gpus", type=int, action="append", default=[], metavar="M",
                        help="with --gpus N: the fan-out once more over GPUs 0..M-1 (1 < M < N), put over the "
                        "same 1-GPU flow: one bench call for 2 and 4 GPUs (repeatable)")
    parser.add_argument("--processor-device", choices=["auto", "cuda", "cpu"], default="auto",
                        help="where the flow's model processor runs (default auto); raw runs it on the CPU "
                        "as the example does, and once more on the GPU when the flow's is there")
    parser.add_argument("--skip-raw", action=SkipRaw, nargs=0, default=False,
                        help="leave out raw vLLM on one GPU (and raw with the flow's processor device); "
                        "with --gpus N, \"raw, N processes\" still runs")
    parser.add_argument("--skip-raw-n", action=SkipRaw, nargs=0, dest="skip_raw", default=False,
                        help="with --gpus N: leave out \"raw, N processes\" (N raw vLLM scripts started at "
                        "once, one per GPU, each given 1/N of the items), which a --gpus run otherwise "
                        "runs and puts the fan-out over")
    parser.add_argument("--warm-up", action="store_true",
                        help="first run raw vLLM, and the flow before its phases, over a few items, not compared: "
                        "an engine whose arguments a host has not built before compiles its kernels (minutes on a "
                        "fresh GPU host; vLLM caches them by the arguments, and the flow's are not raw's), so "
                        "without it the first phase of each kind pays for that and its engine-ready time is not "
                        "comparable")
    parser.add_argument("--start-rounds", type=int, default=0, metavar="N",
                        help="after the compared phases, N rounds of raw (with the flow's processor device) and the "
                        "flow over 16 items each, alternating which goes first: the engine-ready gap, flow less "
                        "raw, as each round's and the median (a single phase's start moves with the host)")
    parser.add_argument("--engine-arg", action="append", type=engine_arg, default=[], metavar="KEY=VALUE",
                        help="a vLLM engine argument for the flow's phases (repeatable); raw keeps vLLM's defaults")
    parser.add_argument("--json-schema", metavar="FILE|tags",
                        help="both phases answer in JSON matching this schema (vLLM's structured outputs)")
    parser.add_argument("--history", type=int, default=0, metavar="N",
                        help="instead: time a nightly `vlm-caption run` over N done results (synthesized as a run "
                        "writes them), with nothing new and with 1%% new, against the same new items into an "
                        "empty output (--source folder or s3, --shard-size, --max-tokens apply)")
    parser.add_argument("--history-source", choices=["listing", "inventory"], default="listing",
                        help="with --history: list the history from the source itself (default), or from an S3 "
                        "Inventory report of it (--source-format inventory; the report beside the output, the "
                        "new items in the loopback moto bucket); the way to 10M")
    parser.add_argument("--history-keep", metavar="DIR",
                        help="with --history: synthesize the history into DIR and keep it; a later bench with "
                        "the same settings uses it again (what the runs added is removed first); folder output")
    parser.add_argument("--history-new-at", choices=["spread", "end"], default="spread",
                        help="with --history: the 1%% new items spread evenly among the done ones (default), or all "
                             "sorting after them (a bucket whose keys begin with the day)")
    parser.add_argument("--history-nothing-new-only", action="store_true",
                        help="with --history: only the night with nothing new (not the 1%% new nor the empty output)")
    parser.add_argument("--scaling", metavar="N,N,...",
                        help="instead: the scaling simulation over these partition counts, e.g. 1,4,16 (stub engines, "
                        "the product's shard plan, claims and writes on a loopback S3; the first count calibrates "
                        "the model): a table, and scaling.json in --dir (docs/operations.md, \"How a night scales "
                        "with hosts\")")
