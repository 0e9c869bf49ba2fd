"""`vlm-caption bench`: a tool beside the product, not part of it. The flow against raw vLLM
as the examples run it, on this machine: `driver` runs the phases, `harness` what surrounds them
(GPU sampling, the Prefect server, S3, fan-out workers), `media` the items, `report` the table and
JSON, `config` what a run is, `cli` its command-line options."""

from vlm_caption.bench.config import BenchConfig
from vlm_caption.bench.driver import run_bench

__all__ = ["BenchConfig", "run_bench"]
