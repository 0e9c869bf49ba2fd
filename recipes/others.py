"""Model families with one or two members each."""

from vlm_caption.recipes.base import Prompting, Recipe

_COHERE = ("<|START_OF_TURN_TOKEN|><|USER_TOKEN|>{media}{question}<|END_OF_TURN_TOKEN|>"
           "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>")
_ARIA = "<|im_start|>user\n{media}{question}<|im_end|>\n<|im_start|>assistant\n"
_OVIS25 = "<|im_start|>user\n\n{media}\n{question}<|im_end|>\n<|im_start|>assistant\n"
_ERNIE = "<|begin_of_sentence|>User: {question}{media}\nAssistant: <think></think>"
_PARTS = Prompting(chat="parts")

RECIPES = (
    Recipe(name="aria", family="aria", model="rhymes-ai/Aria", max_model_len=4096,
           engine_args={"dtype": "bfloat16"},
           image=Prompting(template=_ARIA, media="<fim_prefix><|img|><fim_suffix>"),
           multi_image=Prompting(template=_ARIA, media="<fim_prefix><|img|><fim_suffix>\n",
                                 engine_args={"max_model_len": None, "tokenizer_mode": "slow",
                                              "trust_remote_code": True}),
           stop_token_ids=(93532, 93653, 944, 93421, 1019, 93653, 93519)),
    # crop_to_patches makes up to 12 tiles + a thumbnail of 169 tokens each (~2,230 an image):
    # the example's 2048 cannot hold one image.
    Recipe(name="aya_vision", family="cohere", model_types=("aya_vision",), model="CohereForAI/aya-vision-8b", max_model_len=4096,
           engine_args={"mm_processor_kwargs": {"crop_to_patches": True}},
           image=Prompting(template=_COHERE, media="<image>")),
    Recipe(name="command_a_vision", family="cohere", model="CohereLabs/command-a-vision-07-2025",
           max_model_len=32768, engine_args={"tensor_parallel_size": 4},
           image=Prompting(template=_COHERE, media="<|IMG_PATCH|>")),
    Recipe(name="bee", family="bee", model="Open-Bee/Bee-8B-RL", max_model_len=16384,
           engine_args={"trust_remote_code": True},
           image=Prompting(template="<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                           "<|im_start|>user\n{media}\n{question}<|im_end|><|im_start|>assistant\n<think>\n",
                           media="<image>")),
    # The BLIP-2 format on the model card is inaccurate; this is the one that works.
    Recipe(name="blip-2", family="blip", model_types=("blip-2",), aliases=("blip2",), model="Salesforce/blip2-opt-2.7b",
           image=Prompting(template="Question: {question} Answer:")),
    Recipe(name="chameleon", family="chameleon", model_types=("chameleon",), model="facebook/chameleon-7b", max_model_len=4096,
           image=Prompting(template="{question}{media}", media="<image>")),
    Recipe(name="deepseek_vl_v2", family="deepseek", model="deepseek-ai/deepseek-vl2-tiny", max_model_len=4096,
           engine_args={"hf_overrides": {"architectures": ["DeepseekVLV2ForCausalLM"]}},
           image=Prompting(template="<|User|>: {media}\n{question}\n\n<|Assistant|>:", media="<image>"),
           multi_image=Prompting(template="<|User|>: {media}{question}\n\n<|Assistant|>:",
                                 media="image_{i}:<image>\n")),
    Recipe(name="ernie45_vl", family="ernie", model="baidu/ERNIE-4.5-VL-28B-A3B-PT", max_model_len=4096,
           engine_args={"trust_remote_code": True},
           image=Prompting(template=_ERNIE, media="Picture 1:<|IMAGE_START|><|image@placeholder|><|IMAGE_END|>"),
           video=Prompting(template=_ERNIE, media="Video 1:<|VIDEO_START|><|video@placeholder|><|VIDEO_END|>")),
    Recipe(name="fuyu", family="fuyu", model_types=("fuyu",), model="adept/fuyu-8b", max_model_len=2048,
           image=Prompting(template="{question}\n"),
           removed_from_vllm="vLLM 0.26 no longer implements FuyuForCausalLM (supported until v0.25.0): use vLLM <= 0.25."),
    Recipe(name="hyperclovax_seed_vision", family="hyperclovax",
           model="naver-hyperclovax/HyperCLOVAX-SEED-Vision-Instruct-3B",
           engine_args={"trust_remote_code": True},
           # Empty ocr/lens fields: the chat template can carry OCR words and entity names.
           image=Prompting(chat="parts", engine_args={"max_model_len": 8192},
                           part_extra={"ocr": "", "lens_keywords": "", "lens_local_keywords": ""}),
           video=Prompting(chat="parts", engine_args={"max_model_len": 16384})),
    Recipe(name="kimi_vl", family="kimi", model="moonshotai/Kimi-VL-A3B-Instruct", max_model_len=4096,
           engine_args={"trust_remote_code": True},
           image=Prompting(template="<|im_user|>user<|im_middle|>{media}{question}<|im_end|>"
                           "<|im_assistant|>assistant<|im_middle|>",
                           media="<|media_start|>image<|media_content|><|media_pad|><|media_end|>")),
    Recipe(name="llama4", family="llama", model_types=("llama4",), model="meta-llama/Llama-4-Scout-17B-16E-Instruct",
           max_model_len=8192, engine_args={"tensor_parallel_size": 8}, image=_PARTS),
    Recipe(name="mllama", family="llama", model_types=("mllama",), model="meta-llama/Llama-3.2-11B-Vision-Instruct",
           max_model_len=4096,
           multi_image=Prompting(template="{media}<|begin_of_text|>{question}", media="<|image|>"),
           removed_from_vllm="vLLM 0.26 no longer implements MllamaForConditionalGeneration (encoder-decoder "
                             "models went with the V0 engine; supported until v0.10.2): use vLLM <= 0.10.2."),
    Recipe(name="minimax_vl_01", family="minimax", model="MiniMaxAI/MiniMax-VL-01",
           engine_args={"trust_remote_code": True, "tensor_parallel_size": 8}, image=_PARTS,
           removed_from_vllm="vLLM 0.26 no longer implements MiniMaxVL01ForConditionalGeneration (supported until "
                             "v0.23.0): use vLLM <= 0.23."),
    Recipe(name="molmo", family="molmo", model="allenai/Molmo-7B-D-0924",
           engine_args={"trust_remote_code": True, "dtype": "bfloat16"},
           image=Prompting(template="<|im_start|>user {media}\n{question}<|im_end|><|im_start|>assistant\n",
                           media="<image>")),
    Recipe(name="ovis", family="ovis", model="AIDC-AI/Ovis2-1B", max_model_len=4096,
           engine_args={"trust_remote_code": True, "dtype": "half"},
           image=Prompting(chat="text", template="{media}\n{question}", media="<image>")),
    Recipe(name="ovis2_5", family="ovis", model="AIDC-AI/Ovis2.5-2B", max_model_len=4096,
           engine_args={"trust_remote_code": True, "dtype": "half"},
           image=Prompting(template=_OVIS25, media="<image>"),
           video=Prompting(template=_OVIS25, media="<video>")),
    Recipe(name="step3", family="step", model="stepfun-ai/step3-fp8",
           engine_args={"tensor_parallel_size": 8, "reasoning_parser": "step3"},
           # Full-width bars in the BOS token, as Step3's tokenizer (and vLLM's example) spell it.
           image=Prompting(template="<\uff5cbegin\u2581of\u2581sentence\uff5c> You are a helpful assistant. <|BOT|>user\n "
                           "{media}{question} <|EOT|><|BOT|>assistant\n<think>\n", media="<im_patch>")),
)
