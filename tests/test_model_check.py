"""A model that cannot be loaded, or does not fit the recipe, is one clear error before anything
runs: a missing or incomplete folder, an unknown or gated hub id, no hub and no cache, too little
disk for the download, a checkpoint of another model type than the recipe's. Through the CLI it
is one line `vlm-caption: error: ...`, exit code 2, before Prefect or any engine starts, and
nothing is written. All offline: the hub is a loopback stand-in (HF_ENDPOINT)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlparse

import pytest

from vlm_caption.flows import cli
from vlm_caption.recipes import get_recipe
from vlm_caption.tasks.engine import model_check
from vlm_caption.tasks.engine.model_check import ModelError, check_model, resolve_model
from vlm_caption.tasks.results.report import RunStats
from tests.checkpoints import build_checkpoint

HF_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE",
                "HUGGINGFACE_HUB_CACHE", "HF_HOME", "HF_ENDPOINT", "HF_OIDC_RESOURCE")


# ---- fixtures ---------------------------------------------------------------------------------
@pytest.fixture
def hf_env(monkeypatch, tmp_path):
    """An empty hub cache of this test's own, no token, online (whatever the machine has set)."""
    from huggingface_hub import constants

    for key in HF_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf" / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "hf" / "stored_tokens"))
    model_check.resolve_hub.cache_clear()
    yield tmp_path / "hf"
    model_check.resolve_hub.cache_clear()


class _HubStandIn(BaseHTTPRequestHandler):
    """`GET /api/models/<repo>`: what the server's `answers` say, else 404 RepoNotFound."""

    def do_GET(self):  # noqa: N802 - http.server's name
        path = urlparse(self.path).path
        repo = path.removeprefix("/api/models/").split("/revision/")[0]
        self.server.asked.append(repo)
        status, headers, body = self.server.answers.get(
            repo, (404, {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"},
                   {"error": "Repository not found"}))
        data = json.dumps(body).encode()
        self.send_response(status)
        for key, value in {"Content-Type": "application/json", **headers}.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def model_json(repo: str, model_type: str, files: dict[str, int]) -> dict:
    return {"id": repo, "sha": "0" * 40, "private": False,
            "config": {"model_type": model_type, "architectures": ["SomeForConditionalGeneration"]},
            "siblings": [{"rfilename": name, "size": size} for name, size in files.items()]}


@pytest.fixture
def hub(hf_env, monkeypatch):
    """The hub API on loopback: unknown ids are 404 RepoNotFound; `answers` adds others."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _HubStandIn)
    server.asked, server.answers = [], {
        "gated-org/gated-model": (401, {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access restricted"},
                                  {"error": "Access to model gated-org/gated-model is restricted."}),
        "qwen-org/some-qwen": (200, {}, model_json("qwen-org/some-qwen", "qwen2_vl", {
            "config.json": 1_000, "model.safetensors": 2_000_000})),
        "big-org/big-llava": (200, {}, model_json("big-org/big-llava", "llava", {
            "config.json": 1_000, "model-00001-of-00002.safetensors": 30_000_000,
            "model-00002-of-00002.safetensors": 20_000_000, "model.safetensors.index.json": 2_000,
            "pytorch_model.bin": 50_000_000, "tokenizer.json": 3_000, "original/consolidated.pth": 90_000_000})),
    }
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def small_disk(hf_env, monkeypatch, tmp_path):
    """HF_HOME on a 1 MiB disk: a real tmpfs where this user may mount one, else the free space
    the check reads is made 1 MiB."""
    folder = tmp_path / "small-disk"
    folder.mkdir()
    mounted = (os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True).returncode == 0)
    if not mounted:
        real = shutil.disk_usage

        def one_mib_free(path):
            usage = real(path)
            return type(usage)(usage.total, usage.total - 2**20, 2**20)

        monkeypatch.setattr(shutil, "disk_usage", one_mib_free)
    monkeypatch.setenv("HF_HOME", str(folder / "hf"))
    yield folder
    if mounted:
        subprocess.run(["umount", str(folder)], check=False)


@pytest.fixture(scope="module")
def tiny_qwen2_vl(checkpoints_root) -> Path:
    return build_checkpoint("qwen2_vl", checkpoints_root)


def fake_checkpoint(folder: Path, model_type: str = "llava", weights: tuple[str, ...] = ("model.safetensors",),
                    index: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": ["X"]}))
    for name in weights:
        (folder / name).write_bytes(b"\0" * 16)
    if index is not None:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return folder


def cache_snapshot(hf_home: Path, repo: str, files: dict[str, str]) -> Path:
    """A model in the hub cache's layout: refs/main -> snapshots/<commit>/<files>."""
    commit = "a" * 40
    root = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    return snapshot


@pytest.fixture
def no_flow(monkeypatch):
    """The flow and vLLM's import as stand-ins: a refused job must not reach them."""
    calls = []
    caption = types.ModuleType("vlm_caption.flows.caption")
    # A summary shaped like the flow's (an empty run), so the CLI's end-of-run summary is exercised too.
    caption.vlm_caption = lambda job: calls.append(job) or {**RunStats().summary(), "fingerprint": "f" * 12}
    monkeypatch.setattr("vlm_caption.flows.plan.start_engine_first", lambda plan, **how: False)  # no engine either
    engine = types.ModuleType("vlm_caption.tasks.engine.vllm_import")
    engine.ensure_vllm_imported = lambda: None
    monkeypatch.setitem(sys.modules, "vlm_caption.flows.caption", caption)
    monkeypatch.setitem(sys.modules, "vlm_caption.tasks.engine.vllm_import", engine)
    return calls


def run_cli(capsys, tmp_path, *options) -> tuple[int, str]:
    (tmp_path / "imgs").mkdir(exist_ok=True)
    code = cli.main(["run", str(tmp_path / "imgs"), "--out", str(tmp_path / "caps"), *options])
    return code, capsys.readouterr().err


def assert_one_line_refusal(code: int, err: str, tmp_path: Path, no_flow: list, *needles: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vlm-caption: error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not (tmp_path / "caps").exists()  # nothing written
    assert no_flow == []  # neither Prefect's flow nor an engine started


# ---- through the CLI --------------------------------------------------------------------------
def test_cli_a_missing_model_folder(capsys, tmp_path, hf_env, no_flow):
    code, err = run_cli(capsys, tmp_path, "--model", str(tmp_path / "no-such-model"))
    assert_one_line_refusal(code, err, tmp_path, no_flow, f"model folder {tmp_path / 'no-such-model'} does not exist",
                            "--model")


def test_cli_a_folder_without_weights(capsys, tmp_path, hf_env, no_flow):
    folder = fake_checkpoint(tmp_path / "half", weights=())
    code, err = run_cli(capsys, tmp_path, "--model", str(folder))
    assert_one_line_refusal(code, err, tmp_path, no_flow, "has no weights (*.safetensors, *.bin, *.pt",
                            "hf download")


def test_cli_an_unknown_hub_id_with_close_matches(capsys, tmp_path, hub, no_flow):
    code, err = run_cli(capsys, tmp_path, "--model", "llava-hf/llava-1.5-7b-hff")
    assert_one_line_refusal(code, err, tmp_path, no_flow, "llava-hf/llava-1.5-7b-hff is not a folder here and "
                            "not a model on the hub", "Did you mean: llava-hf/llava-1.5-7b-hf")
    assert hub.asked == ["llava-hf/llava-1.5-7b-hff"]


def test_cli_a_gated_model_without_a_token(capsys, tmp_path, hub, no_flow):
    code, err = run_cli(capsys, tmp_path, "--model", "gated-org/gated-model")
    assert_one_line_refusal(code, err, tmp_path, no_flow, "gated", "no HF_TOKEN is set",
                            f"{os.environ['HF_ENDPOINT']}/gated-org/gated-model", "accept its licence")


def test_cli_a_qwen2_vl_checkpoint_with_the_llava_recipe(capsys, tmp_path, hf_env, no_flow, tiny_qwen2_vl):
    code, err = run_cli(capsys, tmp_path, "--model", str(tiny_qwen2_vl), "--recipe", "llava")
    assert_one_line_refusal(code, err, tmp_path, no_flow, "is a 'qwen2_vl' model (Qwen2VLForConditionalGeneration)",
                            "recipe 'llava' is for 'llava' models", "Use --recipe qwen2_vl", "--skip-model-check")


def test_cli_skip_model_check_lets_such_a_model_through(capsys, tmp_path, hf_env, no_flow, tiny_qwen2_vl):
    code, _ = run_cli(capsys, tmp_path, "--model", str(tiny_qwen2_vl), "--recipe", "llava", "--skip-model-check")
    assert code == 0 and len(no_flow) == 1 and no_flow[0].skip_model_check is True


def test_cli_too_little_disk_for_the_download(capsys, tmp_path, hub, small_disk, no_flow):
    code, err = run_cli(capsys, tmp_path, "--model", "big-org/big-llava")
    assert_one_line_refusal(code, err, tmp_path, no_flow, "needs about 50.0 MB in the hub cache",
                            "only 1.0 MB are free", "HF_HOME")


def test_cli_the_issue_offline_and_not_cached_is_one_line_in_seconds(tmp_path):
    """`vlm-caption run ./imgs --recipe qwen2_5_vl --out ./caps` with no hub: was 414 lines."""
    (tmp_path / "imgs").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in HF_VARIABLES}
    env.update({"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    began = time.monotonic()
    done = subprocess.run([str(Path(sys.executable).with_name("vlm-caption")), "run", str(tmp_path / "imgs"),
                           "--recipe", "qwen2_5_vl", "--out", str(tmp_path / "caps")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert done.stderr.startswith("vlm-caption: error: model Qwen/Qwen2.5-VL-3B-Instruct: the hub is off "
                                  "(HF_HUB_OFFLINE=1) and the model is not in the cache")
    assert "hf download Qwen/Qwen2.5-VL-3B-Instruct" in done.stderr and "--model" in done.stderr
    assert not (tmp_path / "caps").exists() and time.monotonic() - began < 60


# ---- the function -----------------------------------------------------------------------------
def test_the_tiny_checkpoints_pass_their_recipes(tiny_llava, tiny_qwen2_vl):
    found = check_model(get_recipe("llava"), "image", str(tiny_llava))
    assert (found.where, found.model_type) == ("folder", "llava")
    assert check_model(get_recipe("qwen2_vl"), "video", str(tiny_qwen2_vl)).model_type == "qwen2_vl"
    with pytest.raises(ModelError, match="is a 'llava' model.*recipe 'qwen2_vl' is for 'qwen2_vl'.*--recipe llava"):
        check_model(get_recipe("qwen2_vl"), "image", str(tiny_llava))


def test_folders_that_are_not_checkpoints(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model("./relative/nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelError, match="is a file, not a folder"):
        resolve_model(str(tmp_path / "file"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="has no config.json and no weights"):
        resolve_model(str(tmp_path / "empty"))
    fake_checkpoint(tmp_path / "no-config")
    (tmp_path / "no-config" / "config.json").unlink()
    with pytest.raises(ModelError, match="has no config.json: it is not a complete checkpoint"):
        resolve_model(str(tmp_path / "no-config"))
    shards = {"a": "model-00001-of-00003.safetensors", "b": "model-00002-of-00003.safetensors",
              "c": "model-00003-of-00003.safetensors"}
    fake_checkpoint(tmp_path / "partial", weights=("model-00001-of-00003.safetensors",), index=shards)
    with pytest.raises(ModelError, match="2 of the 3 weight files model.safetensors.index.json names missing"):
        resolve_model(str(tmp_path / "partial"))
    (tmp_path / "bad-config").mkdir()
    (tmp_path / "bad-config" / "config.json").write_text("{not json")
    (tmp_path / "bad-config" / "pytorch_model.bin").write_bytes(b"\0")
    with pytest.raises(ModelError, match="config.json cannot be read"):
        resolve_model(str(tmp_path / "bad-config"))
    for weights in (("pytorch_model.bin",), ("model.pt",), ("consolidated.safetensors",)):
        assert resolve_model(str(fake_checkpoint(tmp_path / weights[0], weights=weights))).where == "folder"


def test_a_model_in_the_cache_needs_no_hub(hf_env, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: any call would fail
    snapshot = cache_snapshot(hf_env, "org/cached-qwen", {
        "config.json": json.dumps({"model_type": "qwen2_vl", "architectures": ["Qwen2VLForConditionalGeneration"]}),
        "model.safetensors": "weights"})
    found = check_model(get_recipe("qwen2_vl"), "image", "org/cached-qwen")
    assert (found.where, found.path, found.model_type) == ("cache", str(snapshot), "qwen2_vl")
    with pytest.raises(ModelError, match="'qwen2_vl' model.*recipe 'llava'"):  # the cached config is read
        check_model(get_recipe("llava"), "image", "org/cached-qwen")


def test_offline_and_not_cached_or_only_in_part(hf_env, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match=r"HF_HUB_OFFLINE=1\) and the model is not in the cache at .*hf/hub: "
                       "download it first with `hf download org/absent`"):
        resolve_model("org/absent")
    cache_snapshot(hf_env, "org/half", {"config.json": "{}"})
    with pytest.raises(ModelError, match=r"only partly in the cache \(.* has no weights"):
        resolve_model("org/half")


def test_an_unreachable_hub_says_to_download_first(hf_env, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: connection refused
    with pytest.raises(ModelError, match=r"cannot reach the hub \(http://127.0.0.1:9: ConnectError\) and the model "
                       "is not in the cache.*hf download org/model.*point --model at a folder"):
        resolve_model("org/model")


def test_the_hub_answers_unknown_gated_mismatch_and_is_asked_once(hub, monkeypatch, tmp_path):
    cache_snapshot(Path(os.environ["HF_HOME"]), "someone/my-llava-finetune",
                   {"config.json": "{}", "model.safetensors": "w"})
    with pytest.raises(ModelError, match="Did you mean: someone/my-llava-finetune"):
        check_model(get_recipe("llava"), "image", "someone/my-llava-finetun")
    with pytest.raises(ModelError, match="The recipe's default model is llava-hf/llava-1.5-7b-hf"):
        check_model(get_recipe("llava"), "image", "zzz/qqq")
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    with pytest.raises(ModelError, match="gated and the token in HF_TOKEN has no access to it yet"):
        resolve_model("gated-org/gated-model")
    with pytest.raises(ModelError, match="is a 'qwen2_vl' model.*Use --recipe qwen2_vl"):  # from the hub's config
        check_model(get_recipe("llava"), "image", "qwen-org/some-qwen")
    hub.asked.clear()
    first = check_model(get_recipe("qwen2_vl"), "image", "qwen-org/some-qwen")
    again = check_model(get_recipe("qwen2_vl"), "image", "qwen-org/some-qwen")  # the CLI's plan, then the flow's
    assert first == again and (first.where, first.download_bytes) == ("hub", 2_001_000)
    assert hub.asked == ["qwen-org/some-qwen"]


def test_an_unreadable_hub_cache_is_logged_with_what_it_costs(tmp_path, monkeypatch):
    """The cache scan for "did you mean" fails: the message still comes, and the log says that its
    suggestions leave out the cached models (no silent pass)."""
    import huggingface_hub

    import vlm_caption.tasks.observability as _loaded  # noqa: F401 - binds no name `vlm_caption` (the flow has it)

    from vlm_caption import tasks
    warned = []
    logger = types.SimpleNamespace(warning=lambda event, **fields: warned.append((event, fields)))
    monkeypatch.setattr(tasks.observability, "get_logger", lambda **context: logger)

    def unreadable(cache_dir):
        raise PermissionError(f"{cache_dir}: permission denied")

    monkeypatch.setattr(huggingface_hub, "scan_cache_dir", unreadable)
    message = model_check._unknown_id("llava-hf/llava-1.5-7b-hff", None, str(tmp_path), "https://hub/x")
    assert "Did you mean: llava-hf/llava-1.5-7b-hf" in message
    assert warned == [("hub cache unreadable for its models; suggestions leave out the cached models",
                       {"cache": str(tmp_path), "error": f"PermissionError: {tmp_path}: permission denied"})]
    warned.clear()
    model_check._unknown_id("x/y", None, str(tmp_path / "none-yet"), "https://hub/x")  # no cache: nothing to say
    assert warned == []


def test_the_download_counts_the_weights_vllm_fetches(hub):
    found = resolve_model("big-org/big-llava")
    # the indexed safetensors and small files; not the .bin twin nor a subfolder's copy
    assert found.download_bytes == 30_000_000 + 20_000_000 + 1_000 + 2_000 + 3_000


def test_every_declared_model_type_is_one_transformers_knows():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from vlm_caption.recipes import all_recipes

    declared = {t for r in all_recipes() for t in r.model_types}
    assert declared and declared <= set(CONFIG_MAPPING_NAMES)
    assert get_recipe("llava").model_types == ("llava",) and get_recipe("qwen2_5_vl").model_types == ("qwen2_5_vl",)


# ---- a run started any other way (a deployment): the flow refuses it ----------------------------
def test_the_flow_fails_early_with_the_message_as_its_state(prefect_api, tmp_path, hf_env, tiny_qwen2_vl,
                                                             monkeypatch):
    import vlm_caption.flows.pipeline as _loaded  # noqa: F401 - binds no name `vlm_caption` (the flow has it)
    from vlm_caption import flows
    from vlm_caption.flows.caption import vlm_caption
    from vlm_caption.flows.params import CaptionJob

    def refuse(*args, **kwargs):
        raise AssertionError("a shard or an engine was started for a job that should have been refused")

    monkeypatch.setattr(flows.feed_schedule, "start_engine", refuse)
    monkeypatch.setattr(flows.pipeline, "ShardStream", refuse)
    (tmp_path / "imgs").mkdir()
    state = vlm_caption(CaptionJob(source=str(tmp_path / "imgs"), output=str(tmp_path / "caps"),
                                   model=str(tiny_qwen2_vl)), return_state=True)
    # The UI shows the problem as one line, what to do included, not an exception's type and traceback.
    assert state.is_failed() and state.message.startswith(f"model {tiny_qwen2_vl} is a 'qwen2_vl' model")
    assert "\n" not in state.message and "--skip-model-check" in state.message
    assert not (tmp_path / "caps" / "parquet").exists()
