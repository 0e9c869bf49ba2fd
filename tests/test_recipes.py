"""Recipes against our own table of what vLLM's examples build for the same questions."""

import json
import subprocess
import sys

import pytest

from vlm_caption.recipes import EOS_TOKEN, RecipeError, all_recipes, get_recipe
from vlm_caption.recipes.requests import build_requests

Q = "What is the content of this image?"
SYS = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
QWEN = SYS + "<|im_start|>user\n<|vision_start|>{pad}<|vision_end|>" + Q + "<|im_end|>\n<|im_start|>assistant\n"
GLM41 = ("[gMASK]<sop><|system|>\nYou are a helpful assistant.<|user|>\n{ph}" + Q + "<|assistant|>assistant\n")
ONEVISION = "<|im_start|>user <{m}>\n" + Q + "<|im_end|><|im_start|>assistant\n"
COHERE = "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>{ph}" + Q + "<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"

# (recipe, modality): (model, prompt or ("messages", messages), stop_token_ids, stop_tokens)
EXPECTED = {
    ("aria", "image"): ("rhymes-ai/Aria", f"<|im_start|>user\n<fim_prefix><|img|><fim_suffix>{Q}<|im_end|>\n<|im_start|>assistant\n",
                        [93532, 93653, 944, 93421, 1019, 93653, 93519], None),
    ("aya_vision", "image"): ("CohereForAI/aya-vision-8b", COHERE.format(ph="<image>"), None, None),
    ("bee", "image"): ("Open-Bee/Bee-8B-RL", f"{SYS}<|im_start|>user\n<image>\n{Q}<|im_end|><|im_start|>assistant\n<think>\n", None, None),
    ("blip-2", "image"): ("Salesforce/blip2-opt-2.7b", f"Question: {Q} Answer:", None, None),
    ("chameleon", "image"): ("facebook/chameleon-7b", f"{Q}<image>", None, None),
    ("command_a_vision", "image"): ("CohereLabs/command-a-vision-07-2025", COHERE.format(ph="<|IMG_PATCH|>"), None, None),
    ("deepseek_vl_v2", "image"): ("deepseek-ai/deepseek-vl2-tiny", f"<|User|>: <image>\n{Q}\n\n<|Assistant|>:", None, None),
    ("deepseek_ocr", "image"): ("deepseek-ai/DeepSeek-OCR", f"<image>\n{Q}", None, None),
    ("dots_ocr", "image"): ("rednote-hilab/dots.ocr", f"<|img|><|imgpad|><|endofimg|>{Q}", None, None),
    ("ernie45_vl", "image"): ("baidu/ERNIE-4.5-VL-28B-A3B-PT", f"<|begin_of_sentence|>User: {Q}Picture 1:<|IMAGE_START|><|image@placeholder|><|IMAGE_END|>\nAssistant: <think></think>", None, None),
    ("ernie45_vl", "video"): ("baidu/ERNIE-4.5-VL-28B-A3B-PT", f"<|begin_of_sentence|>User: {Q}Video 1:<|VIDEO_START|><|video@placeholder|><|VIDEO_END|>\nAssistant: <think></think>", None, None),
    ("fuyu", "image"): ("adept/fuyu-8b", f"{Q}\n", None, None),
    ("gemma3", "image"): ("google/gemma-3-4b-it", f"<bos><start_of_turn>user\n<start_of_image>{Q}<end_of_turn>\n<start_of_turn>model\n", None, None),
    ("gemma3n", "image"): ("google/gemma-3n-E2B-it", f"<start_of_turn>user\n<image_soft_token>{Q}<end_of_turn>\n<start_of_turn>model\n", None, None),
    ("glm4v", "image"): ("zai-org/glm-4v-9b", f"<|user|>\n<|begin_of_image|><|endoftext|><|end_of_image|>{Q}<|assistant|>", [151329, 151336, 151338], None),
    ("glm4_1v", "image"): ("zai-org/GLM-4.1V-9B-Thinking", GLM41.format(ph="<|begin_of_image|><|image|><|end_of_image|>"), None, None),
    ("glm4_5v", "video"): ("zai-org/GLM-4.5V", GLM41.format(ph="<|begin_of_video|><|video|><|end_of_video|>"), None, None),
    ("glm4_5v_fp8", "image"): ("zai-org/GLM-4.5V-FP8", GLM41.format(ph="<|begin_of_image|><|image|><|end_of_image|>"), None, None),
    ("h2ovl_chat", "image"): ("h2oai/h2ovl-mississippi-800m", ("messages", [{"role": "user", "content": f"<image>\n{Q}"}]), None, [EOS_TOKEN]),
    # The example's start/end tokens around the image token, left out: vLLM 0.26's engine adds them
    # (tests/recipe_check.py's processing check compares the tokenized prompt with the text).
    ("hunyuan_vl", "image"): ("tencent/HunyuanOCR", "<｜hy_begin▁of▁sentence｜><｜hy_place▁holder▁no▁102｜>" + Q + "<｜hy_User｜>", None, None),
    ("hyperclovax_seed_vision", "image"): ("naver-hyperclovax/HyperCLOVAX-SEED-Vision-Instruct-3B", ("messages", [{"role": "user", "content": [
        {"type": "image", "ocr": "", "lens_keywords": "", "lens_local_keywords": ""}, {"type": "text", "text": Q}]}]), None, None),
    ("hyperclovax_seed_vision", "video"): ("naver-hyperclovax/HyperCLOVAX-SEED-Vision-Instruct-3B", ("messages", [{"role": "user", "content": [
        {"type": "video"}, {"type": "text", "text": Q}]}]), None, None),
    ("idefics3", "image"): ("HuggingFaceM4/Idefics3-8B-Llama3", f"<|begin_of_text|>User:<image>{Q}<end_of_utterance>\nAssistant:", None, None),
    ("interns1", "image"): ("internlm/Intern-S1-mini", ("messages", [{"role": "user", "content": f"<IMG_CONTEXT>\n{Q}"}]), None, None),
    ("interns1", "video"): ("internlm/Intern-S1-mini", ("messages", [{"role": "user", "content": f"<video>\n{Q}"}]), None, None),
    ("internvl_chat", "image"): ("OpenGVLab/InternVL3-2B", ("messages", [{"role": "user", "content": f"<image>\n{Q}"}]), None,
                                 ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|end|>"]),
    ("keye_vl", "video"): ("Kwai-Keye/Keye-VL-8B-Preview", f"<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>{Q}<|im_end|>\n<|im_start|>assistant\n", None, None),
    ("keye_vl1_5", "image"): ("Kwai-Keye/Keye-VL-1.5-8B", f"<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{Q}<|im_end|>\n<|im_start|>assistant\n", None, None),
    ("kimi_vl", "image"): ("moonshotai/Kimi-VL-A3B-Instruct", f"<|im_user|>user<|im_middle|><|media_start|>image<|media_content|><|media_pad|><|media_end|>{Q}<|im_end|><|im_assistant|>assistant<|im_middle|>", None, None),
    ("lightonocr", "image"): ("lightonai/LightOnOCR-1B", "<|im_start|>system<|im_end|>\n<|im_start|>user\n<|image_pad|><|im_end|>\n<|im_start|>assistant\n", None, None),
    ("llama4", "image"): ("meta-llama/Llama-4-Scout-17B-16E-Instruct", ("messages", [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": Q}]}]), None, None),
    ("llava", "image"): ("llava-hf/llava-1.5-7b-hf", f"USER: <image>\n{Q}\nASSISTANT:", None, None),
    ("llava-next", "image"): ("llava-hf/llava-v1.6-mistral-7b-hf", f"[INST] <image>\n{Q} [/INST]", None, None),
    ("llava-next-video", "video"): ("llava-hf/LLaVA-NeXT-Video-7B-hf", f"USER: <video>\n{Q} ASSISTANT:", None, None),
    ("llava-onevision", "image"): ("llava-hf/llava-onevision-qwen2-7b-ov-hf", ONEVISION.format(m="image"), None, None),
    ("llava-onevision", "video"): ("llava-hf/llava-onevision-qwen2-7b-ov-hf", ONEVISION.format(m="video"), None, None),
    # The example's MantisForConditionalGeneration is gone from vLLM 0.26: the checkpoint loads as
    # plain LLaVA, so the prompt carries the wrapping Mantis's processor used to add.
    ("mantis", "image"): ("TIGER-Lab/Mantis-8B-siglip-llama3", f"<|start_header_id|>user<|end_header_id|>\n\n{Q}\n(image 1: <Image><image></Image>)<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n", [128009], None),
    ("minicpmv", "image"): ("openbmb/MiniCPM-V-2_6", ("messages", [{"role": "user", "content": f"(<image>./</image>)\n{Q}"}]), None, ["<|im_end|>", "<|endoftext|>"]),
    ("minicpmo", "video"): ("openbmb/MiniCPM-o-2_6", ("messages", [{"role": "user", "content": f"(<video>./</video>)\n{Q}"}]), None, ["<|im_end|>", "<|endoftext|>"]),
    ("minimax_vl_01", "image"): ("MiniMaxAI/MiniMax-VL-01", ("messages", [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": Q}]}]), None, None),
    ("mistral3", "image"): ("mistralai/Mistral-Small-3.1-24B-Instruct-2503", f"<s>[INST]{Q}\n[IMG][/INST]", None, None),
    ("molmo", "image"): ("allenai/Molmo-7B-D-0924", ONEVISION.format(m="image"), None, None),
    ("nemotron_vl", "image"): ("nvidia/Llama-3.1-Nemotron-Nano-VL-8B-V1", ("messages", [{"role": "user", "content": f"<image>\n{Q}"}]), None,
                               ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|end|>"]),
    ("NVLM_D", "image"): ("nvidia/NVLM-D-72B", ("messages", [{"role": "user", "content": f"<image>\n{Q}"}]), None, None),
    ("ovis", "image"): ("AIDC-AI/Ovis2-1B", ("messages", [{"role": "user", "content": f"<image>\n{Q}"}]), None, None),
    ("ovis2_5", "video"): ("AIDC-AI/Ovis2.5-2B", f"<|im_start|>user\n\n<video>\n{Q}<|im_end|>\n<|im_start|>assistant\n", None, None),
    ("paligemma", "image"): ("google/paligemma-3b-mix-224", "caption en", None, None),
    ("paligemma2", "image"): ("google/paligemma2-3b-ft-docci-448", "caption en", None, None),
    ("phi3_v", "image"): ("microsoft/Phi-3.5-vision-instruct", f"<|user|>\n<|image_1|>\n{Q}<|end|>\n<|assistant|>\n", None, None),
    ("phi4_mm", "image"): ("microsoft/Phi-4-multimodal-instruct", f"<|user|><|image_1|>{Q}<|end|><|assistant|>", None, None),
    ("phi4_multimodal", "image"): ("microsoft/Phi-4-multimodal-instruct", f"<|user|><|image|>{Q}<|end|><|assistant|>", None, None),
    ("pixtral_hf", "image"): ("mistral-community/pixtral-12b", f"<s>[INST]{Q}\n[IMG][/INST]", None, None),
    ("qwen_vl", "image"): ("Qwen/Qwen-VL", f"{Q}Picture 1: <img></img>\n", None, None),
    ("qwen2_vl", "image"): ("Qwen/Qwen2-VL-7B-Instruct", QWEN.format(pad="<|image_pad|>"), None, None),
    ("qwen2_5_vl", "video"): ("Qwen/Qwen2.5-VL-3B-Instruct", QWEN.format(pad="<|video_pad|>"), None, None),
    ("qwen2_5_omni", "image"): ("Qwen/Qwen2.5-Omni-7B", "<|im_start|>system\nYou are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving auditory and visual inputs, as well as generating text and speech.<|im_end|>\n<|im_start|>user\n<|vision_bos|><|IMAGE|><|vision_eos|>" + Q + "<|im_end|>\n<|im_start|>assistant\n", None, None),
    ("qwen3_vl", "image"): ("Qwen/Qwen3-VL-4B-Instruct", QWEN.format(pad="<|image_pad|>"), None, None),
    ("qwen3_vl_moe", "video"): ("Qwen/Qwen3-VL-30B-A3B-Instruct", QWEN.format(pad="<|video_pad|>"), None, None),
    ("rvl", "image"): ("YannQi/R-4B", ONEVISION.format(m="image"), None, None),
    ("skywork_chat", "image"): ("Skywork/Skywork-R1V-38B", ("messages", [{"role": "user", "content": f"<image>\n{Q}"}]), None, ["<|end▁of▁sentence|>", "<|endoftext|>"]),
    ("smolvlm", "image"): ("HuggingFaceTB/SmolVLM2-2.2B-Instruct", f"<|im_start|>User:<image>{Q}<end_of_utterance>\nAssistant:", None, None),
    ("step3", "image"): ("stepfun-ai/step3-fp8", f"<｜begin▁of▁sentence｜> You are a helpful assistant. <|BOT|>user\n <im_patch>{Q} <|EOT|><|BOT|>assistant\n<think>\n", None, None),
    ("tarsier", "image"): ("omni-research/Tarsier-7b", f"USER: <image>\n{Q} ASSISTANT:", None, None),
    ("tarsier2", "video"): ("omni-research/Tarsier2-Recap-7b", QWEN.format(pad="<|video_pad|>"), None, None),
}

MQ = "What is the content of each image?"
PARTS2 = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": MQ}]
# Multi-image with two images, as vision_language_multi_image.py builds them.
EXPECTED_MULTI = {
    "aria": ("rhymes-ai/Aria", "<|im_start|>user\n" + "<fim_prefix><|img|><fim_suffix>\n" * 2 + MQ + "<|im_end|>\n<|im_start|>assistant\n"),
    "deepseek_vl_v2": ("deepseek-ai/deepseek-vl2-tiny", f"<|User|>: image_1:<image>\nimage_2:<image>\n{MQ}\n\n<|Assistant|>:"),
    "gemma3": ("google/gemma-3-4b-it", ("messages", [{"role": "user", "content": PARTS2}])),
    "h2ovl_chat": ("h2oai/h2ovl-mississippi-800m", ("messages", [{"role": "user", "content": f"Image-1: <image>\n\nImage-2: <image>\n\n{MQ}"}])),
    "idefics3": ("HuggingFaceM4/Idefics3-8B-Llama3", f"<|begin_of_text|>User:Image-1: <image>\n\nImage-2: <image>\n\n{MQ}<end_of_utterance>\nAssistant:"),
    "internvl_chat": ("OpenGVLab/InternVL2-2B", ("messages", [{"role": "user", "content": f"Image-1: <image>\n\nImage-2: <image>\n\n{MQ}"}])),
    "llava": ("llava-hf/llava-1.5-7b-hf", ("messages", [{"role": "user", "content": PARTS2}])),
    "llava-onevision": ("llava-hf/llava-onevision-qwen2-7b-ov-hf", ("messages", [{"role": "user", "content": PARTS2}])),
    "mllama": ("meta-llama/Llama-3.2-11B-Vision-Instruct", f"<|image|><|image|><|begin_of_text|>{MQ}"),
    "NVLM_D": ("nvidia/NVLM-D-72B", ("messages", [{"role": "user", "content": f"Image-1: <image>\n\nImage-2: <image>\n\n{MQ}"}])),
    "phi3_v": ("microsoft/Phi-3.5-vision-instruct", f"<|user|>\n<|image_1|>\n<|image_2|>\n{MQ}<|end|>\n<|assistant|>\n"),
    "phi4_mm": ("microsoft/Phi-4-multimodal-instruct", f"<|user|><|image_1|><|image_2|>{MQ}<|end|><|assistant|>"),
    "pixtral_hf": ("mistral-community/pixtral-12b", f"<s>[INST]{MQ}\n[IMG][IMG][/INST]"),
    "qwen_vl_chat": ("Qwen/Qwen-VL-Chat", ("messages", [{"role": "user", "content": f"Picture 1: <img></img>\nPicture 2: <img></img>\n\n{MQ}"}])),
    "qwen2_vl": ("Qwen/Qwen2-VL-7B-Instruct", ("messages", [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": PARTS2}])),
    "qwen2_5_vl": ("Qwen/Qwen2.5-VL-3B-Instruct", ("messages", [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": PARTS2}])),
}


def test_every_example_model_is_a_recipe():
    names = {r.name for r in all_recipes()}
    single = {r.name for r in all_recipes() if r.image or r.video}
    multi = {r.name for r in all_recipes() if r.multi_image}
    assert len(single) == 60 and len(multi) == 16 and len(names) == 62
    assert {name for name, _ in EXPECTED} == single  # the table covers every single-media recipe
    assert set(EXPECTED_MULTI) == multi


@pytest.mark.parametrize("recipe, modality", sorted(EXPECTED, key=str))
def test_single_media_requests_match_the_examples(recipe, modality):
    model, prompt, stop_ids, stop_tokens = EXPECTED[(recipe, modality)]
    built = build_requests(get_recipe(recipe), modality, [Q, "Where is this image taken?"])
    assert built.model == model and built.engine_args["model"] == model
    assert len(built.requests) == 2
    first = built.requests[0]
    if isinstance(prompt, tuple):
        assert first.messages == prompt[1] and first.prompt is None
    else:
        assert first.prompt == prompt
    assert built.stop_token_ids == stop_ids and built.stop_tokens == stop_tokens
    assert built.engine_args["limit_mm_per_prompt"] == {modality: 1}


@pytest.mark.parametrize("recipe", sorted(EXPECTED_MULTI))
def test_multi_image_requests_match_the_examples(recipe):
    model, prompt = EXPECTED_MULTI[recipe]
    built = build_requests(get_recipe(recipe), "multi-image", [MQ], images=2)
    assert built.model == model and len(built.requests) == 1
    if isinstance(prompt, tuple):
        assert built.requests[0].messages == prompt[1]
    else:
        assert built.requests[0].prompt == prompt
    assert built.engine_args["limit_mm_per_prompt"] == {"image": 2}


def test_engine_facts_are_kept_and_sizing_is_not():
    internvl = build_requests(get_recipe("internvl_chat"), "multi-image", [MQ], images=3).engine_args
    assert internvl["mm_processor_kwargs"] == {"max_dynamic_patch": 4} and internvl["max_model_len"] == 4096
    gemma = build_requests(get_recipe("gemma3"), "multi-image", [MQ], images=2).engine_args
    assert "mm_processor_kwargs" not in gemma and gemma["max_model_len"] == 8192
    phi4 = get_recipe("phi4_mm").engine_args_for("image")
    assert phi4["enable_lora"] is True and phi4["max_lora_rank"] == 320
    for recipe in all_recipes():
        for modality in recipe.modalities:
            args = recipe.engine_args_for(modality)
            assert not {"max_num_seqs", "gpu_memory_utilization", "max_num_batched_tokens"} & set(args)
    assert get_recipe("llama4").gpus_needed == 8 and get_recipe("llava").gpus_needed == 1
    assert get_recipe("qwen3_vl").needs_video_metadata and get_recipe("glm4_1v").needs_video_metadata


def test_unsupported_modality_and_unknown_recipe_say_what_exists():
    with pytest.raises(RecipeError, match="does not support modality 'video'; it supports: image, multi-image"):
        build_requests(get_recipe("llava"), "video", [Q])
    with pytest.raises(RecipeError, match="Did you mean: qwen2_vl"):
        get_recipe("qwen2vl")


def test_remote_code_is_refused_unless_opted_in():
    from vlm_caption.tasks.engine.arguments import check_remote_code

    with pytest.raises(RecipeError, match="--trust-remote-code"):
        check_remote_code(get_recipe("internvl_chat"), allowed=False)
    check_remote_code(get_recipe("internvl_chat"), allowed=True)
    check_remote_code(get_recipe("llava"), allowed=False)


def test_the_engine_spec_holds_the_recipes_arguments_with_the_jobs_overrides():
    """The plan's `EngineSpec` is what every step below it reads: the recipe object and its engine
    arguments, resolved once; it crosses into Prefect's task runs and is the key of the process's
    engine, so it survives a pickle and equal jobs give equal specs."""
    import pickle

    from vlm_caption.tasks.engine.arguments import EngineSpec

    llava = get_recipe("llava")
    spec = EngineSpec.build(llava, engine_overrides={"max_model_len": 2048})
    assert spec.recipe is llava and spec.args["model"] == llava.model and spec.args["max_model_len"] == 2048
    copy = pickle.loads(pickle.dumps(spec))
    assert copy == spec and {spec: "engine"}[copy] == "engine"
    assert spec != EngineSpec.build(llava, engine_overrides={"max_model_len": 4096})
    groups = EngineSpec.build(get_recipe("idefics3"), modality="multi-image", images=3)
    assert groups.args["limit_mm_per_prompt"] == {"image": 3}  # the job's group limit
    with pytest.raises(RecipeError, match="--trust-remote-code"):  # no spec runs remote code not asked for
        EngineSpec.build(get_recipe("internvl_chat"))
    assert EngineSpec.build(get_recipe("internvl_chat"), trust_remote_code=True).args["trust_remote_code"] is True


def test_the_recipe_table_says_where_auto_puts_the_processor_as_the_engine_does():
    from vlm_caption.tasks.engine.processor import place_processor

    for recipe in all_recipes():
        placed = place_processor(recipe, "auto", gpu=True).device == "cuda"
        assert recipe.processor_on_gpu_host == placed, recipe.name
    assert get_recipe("qwen2_vl").processor_on_gpu_host and not get_recipe("llava").processor_on_gpu_host


def test_chat_template_renders_offline_with_a_local_tokenizer(tmp_path):
    from vlm_caption.tasks.tiny_checkpoint import save_fast_tokenizer, train_tokenizer

    tok = train_tokenizer(["<unk>", "<s>", "</s>", "<image>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    chatml = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast = save_fast_tokenizer(tok, tmp_path, bos="<s>", eos="</s>", extra={"chat_template": chatml})
    out = subprocess.run(
        [sys.executable, "-m", "vlm_caption.flows.cli", "recipes", "show", "internvl_chat", "--modality", "image",
         "--question", Q, "--model", str(tmp_path), "--json"], capture_output=True, text=True, check=True,
    )
    shown = json.loads(out.stdout)
    assert shown["requests"][0]["prompt"] == f"<|im_start|>user\n<image>\n{Q}<|im_end|>\n<|im_start|>assistant\n"
    assert shown["requests"][0]["messages"] == [{"role": "user", "content": f"<image>\n{Q}"}]
    ids = [fast.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    assert shown["stop_token_ids"] == ids  # "<|end|>" is not in this vocabulary: dropped


def test_recipes_show_imports_no_torch_or_vllm():
    code = ("import sys, io, contextlib; from vlm_caption.flows.cli import main; buf = io.StringIO()\n"
            "with contextlib.redirect_stdout(buf): main(['recipes', 'show', 'qwen2_5_vl', '--json'])\n"
            "assert not {'torch', 'vllm', 'prefect'} & set(sys.modules), sorted(sys.modules)\n"
            "print(buf.getvalue())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["model"] == "Qwen/Qwen2.5-VL-3B-Instruct"


def test_recipes_list_json_has_the_contract_columns():
    out = subprocess.run([sys.executable, "-m", "vlm_caption.flows.cli", "recipes", "list", "--json"],
                         capture_output=True, text=True, check=True)
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert rows["NVLM_D"] == {"name": "NVLM_D", "model": "nvidia/NVLM-D-72B", "modalities": ["image", "multi-image"],
                              "multi_image": True, "needs_remote_code": True, "gpus": 4}
