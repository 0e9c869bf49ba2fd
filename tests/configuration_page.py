"""docs/configuration.md, generated from tasks/settings.py's `Settings` (every field, its variable,
default and description) and the variables read elsewhere, listed below; tests/test_docs.py checks
that the page is what this writes and that it names every `VLM_CAPTION_*` variable the code reads."""

from vlm_caption.tasks.settings import Settings

# Variables read outside `Settings`, each where it is used.
OTHER_VARIABLES: dict[str, tuple[str, str]] = {
    "VLM_CAPTION_HOME": (
        "unset", "Where a process worker's flow runs find the checked-out code (the pull step of "
        "`deployments/prefect.yaml`; the same path on every GPU host). The Docker image and the Kubernetes "
        "template set `/opt/vlm-caption`."),
    "VLM_CAPTION_HUB_TIMEOUT_S": (
        "`10`", "Seconds the model check (`tasks/engine/model_check.py`) waits for the Hugging Face hub."),
    "VLM_CAPTION_BENCH_S3": (
        "unset", "`vlm-caption bench --source s3`: an `s3://bucket/prefix` on a real endpoint to serve the "
        "bench's items from (credentials and `VLM_CAPTION_S3_ENDPOINT_URL` from the environment). Unset: a "
        "loopback moto server in a process of its own."),
    "VLM_CAPTION_BENCH_RESULT": (
        "unset", "Set by `vlm-caption bench` for each phase's process (not by users): the file the phase writes "
        "its figures to (JSON), read back by the bench."),
    "VLM_CAPTION_TEST_SERVER_START_S": (
        "`300`", "Tests only: how long `tests/test_prefect_ui.py` waits for `vlm-caption server` to answer."),
}

REGENERATE = "uv run python -m tests.configuration_page > docs/configuration.md"


def _default_text(name: str, value: object) -> str:
    """A default as the page shows it: byte sizes also in GiB, durations also in hours."""
    if value is None:
        return "unset"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = f"`{value}`"
    if isinstance(value, int) and name.endswith("_bytes"):
        return f"{text} ({value / 1024**3:g} GiB)" if value >= 1024**3 else text
    if isinstance(value, int) and name.endswith("_s") and value >= 3600:
        return f"{text} ({value / 3600:g} h)"
    return text


def settings_markdown() -> str:
    """docs/configuration.md: every setting of `Settings`, its variable, default and description
    (from the fields, so the page cannot drift from the code), then the variables read elsewhere."""
    env_prefix = Settings.model_config["env_prefix"]
    lines = [
        "# Configuration",
        "",
        f"<!-- Generated from tasks/settings.py; do not edit. Regenerate: {REGENERATE} -->",
        "",
        "Process-wide settings, read from the environment once per process (`tasks/settings.py`). Set them",
        "where the flow runs: the shell of `vlm-caption run`, a worker's environment (its flow runs inherit it),",
        "or a deployment's `job_variables.env` in `deployments/prefect.yaml`. What one job does (recipe, model,",
        "questions, shard size, sampling, `processor_device`, ...) is a job field instead: `vlm-caption run",
        "--help`, or the flow's parameter form in the Prefect UI.",
        "",
        "| variable | default | what it does |",
        "| --- | --- | --- |",
    ]
    for name, field in Settings.model_fields.items():
        description = (field.description or "").replace("|", "\\|")
        lines.append(f"| `{env_prefix}{name.upper()}` | {_default_text(name, field.default)} | {description} |")
    lines += ["", "## Read elsewhere", "", "| variable | default | what it does |", "| --- | --- | --- |"]
    lines += [f"| `{name}` | {default} | {text} |" for name, (default, text) in OTHER_VARIABLES.items()]
    lines += ["", "vLLM's, Prefect's, boto3's and Hugging Face's own variables apply as usual (`VLLM_*`,",
              "`PREFECT_*`, `AWS_*`, `HF_*`); see [operations](operations.md) for the ones a deployment sets."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(settings_markdown(), end="")
