"""What one bench run measures: its configuration, and the random-weight checkpoints it builds."""

from __future__ import annotations

from dataclasses import dataclass

RESULT_FILE = "VLM_CAPTION_BENCH_RESULT"  # where a phase's process writes its figures (JSON)


@dataclass(frozen=True)
class BenchConfig:
    workdir: str
    model: str | None = None
    recipe: str = "llava"
    images: int = 64
    # The fraction of the images that are byte copies of others under other names (0: all distinct):
    # what captioning each distinct image once saves (raw vLLM captions every file).
    copies: float = 0.0
    width: int = 640
    height: int = 480
    shard_size: int = 64
    source: str = "folder"  # or "s3" (a loopback moto server), or "webdataset" (the photos in tar shards)
    max_tokens: int = 64
    shape: str = "tiny"  # without --model: a random-weight checkpoint of this shape (see CHECKPOINTS)
    modality: str = "image"  # or "video" (clips of `frames` sampled frames) or "multi-image" (pairs)
    frames: int = 16
    flow_env: tuple[str, ...] = ()  # "NAME=VALUE[,NAME=VALUE]": one more flow phase each
    fan_out_env: tuple[str, ...] = ()  # the same, one more fan-out each (the run's and its workers' settings)
    profile: bool = False  # record each flow phase and its children with py-spy (--gil), if installed
    # "embedded": each flow phase starts Prefect's embedded server, as `vlm-caption run` does;
    # "server": one `prefect server start` for all phases, as a deployment's run sees its server.
    prefect: str = "embedded"
    # >1: the flow once more, fanned out over this many GPUs of this host (fan_out=N: the run on
    # GPU 0, one process worker per other GPU running the partition deployment); needs a server.
    gpus: int = 1
    also_gpus: tuple[int, ...] = ()  # with gpus N: the fan-out again over M < N of them, over the same 1-GPU flow
    skip_raw: bool = False  # leave raw on one GPU out (a fan-out's ratio is over the flow on one GPU)
    # With gpus > 1, "raw, N processes" runs too (N raw scripts at once, one per GPU, each given
    # 1/N of the items: how a person uses N GPUs by hand), unless this is set.
    skip_raw_n: bool = False

    def __post_init__(self):
        # The command line hands both skips over as one value of `skip_raw` (bench/cli.py's
        # SkipRaw: "raw", "raw-n" or "raw,raw-n"), since `vlm-caption bench` passes that field on.
        if isinstance(self.skip_raw, str):
            skipped = set(self.skip_raw.split(","))
            object.__setattr__(self, "skip_raw_n", self.skip_raw_n or "raw-n" in skipped)
            object.__setattr__(self, "skip_raw", "raw" in skipped)

    def check(self) -> None:
        """Options that cannot go together, refused before anything is built."""
        if self.source == "webdataset" and self.modality != "image":
            raise SystemExit("--source webdataset packs the bench's photos in tars: use it with --modality image")
        if self.gpus > 1 and self.source == "webdataset":
            raise SystemExit("--gpus reads the items from a folder or S3, not from tars")
        if any(not 1 < m < self.gpus for m in self.also_gpus):
            raise SystemExit(f"--also-gpus M fans out over fewer GPUs than --gpus {self.gpus}: 1 < M < {self.gpus}")
        if self.runs_raw_n() and self.images < self.gpus:
            raise SystemExit(f"raw, {self.gpus} processes gives each at least one item: --images {self.gpus} or more "
                             "(or --skip-raw-n)")

    def runs_raw_n(self) -> bool:
        """Whether the "raw, N processes" phase runs: on a fan-out bench, unless --skip-raw-n."""
        return self.gpus > 1 and not self.skip_raw_n

    def runs_raw(self) -> bool:
        """Whether any raw phase runs (raw on one GPU, raw on N, or the start rounds' raw): if
        none, the warm-up compiles only the flow's kernels."""
        return not self.skip_raw or self.runs_raw_n() or self.start_rounds > 0
    # Raw vLLM over a few items before the measured phases (WARM_UP_ITEMS), and the flow over as many
    # before the flow's, their figures kept apart: the host's first engine for a set of engine
    # arguments compiles its kernels, so every measured phase finds them cached.
    warm_up: bool = False
    # Where the flow's model processor runs (the job's processor_device). Raw runs it on the CPU
    # as the example does; where the flow's lands on the GPU, raw runs once more with it there
    # too ("raw, same processor"): the best a hand-written script can do.
    processor_device: str = "auto"
    # A JSON Schema (as JSON text) both phases constrain every answer to with vLLM's structured
    # outputs; generation then ends where the schema does (no ignore_eos). None: prose.
    json_schema: str | None = None
    # vLLM engine arguments (as a JSON object) for the flow's phases only (the job's
    # engine_overrides): raw keeps vLLM's defaults, the figure the flow's start is put over.
    engine_args: str | None = None
    # N > 0: `--history N` (bench/history.py): a nightly run over N done results, with
    # nothing new and with 1% new, instead of the raw/flow comparison.
    history: int = 0
    # Where the history's items are listed from: "listing" (the folder or bucket itself) or
    # "inventory" (an S3 Inventory report of the loopback bucket: bench/history_inventory.py).
    history_source: str = "listing"
    history_keep: str | None = None  # a folder that keeps the synthesized history for the next bench
    history_new: bool = True  # False: only the night with nothing new
    history_new_at: str = "spread"  # where the 1% new items sort: "spread" among the done ones, or "end"
    # N > 0: after the compared phases, N rounds of raw (the flow's processor) and the flow over
    # WARM_UP_ITEMS items each, for the median of the engine-ready gap (bench/rounds.py).
    start_rounds: int = 0

    def structured(self) -> dict | None:
        """The schema as a dict, or None for prose."""
        import json

        return json.loads(self.json_schema) if self.json_schema else None

    def sampling(self) -> dict:
        """Both phases' sampling: exactly max_tokens of prose, or up to max_tokens under a schema."""
        return {"max_tokens": self.max_tokens, "ignore_eos": self.json_schema is None}


WARM_UP_ITEMS = 16  # what --warm-up's raw phase captions: enough to run every kernel once

# Random-weight checkpoints the bench builds (recipe -> builder and its shapes).
CHECKPOINTS = {"llava": ("build_tiny_llava", ("tiny", "7b")), "qwen2_vl": ("build_tiny_qwen2_vl", ("tiny", "2b")),
               "qwen2_5_vl": ("build_tiny_qwen2_5_vl", ("tiny", "7b"))}
