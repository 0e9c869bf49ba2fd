"""Document/OCR models: DeepSeek-OCR, dots.ocr, LightOnOCR, HunyuanOCR."""

from vlm_caption.recipes.base import Prompting, Recipe

RECIPES = (
    Recipe(name="deepseek_ocr", family="ocr", model="deepseek-ai/DeepSeek-OCR",
           engine_args={"logits_processors": [
               "vllm.model_executor.models.deepseek_ocr:NGramPerReqLogitsProcessor"]},
           image=Prompting(template="{media}\n{question}", media="<image>"),
           # From the official DeepSeek-OCR example: keep special tokens, n-gram repeat guard
           # that allows <td>/</td> (ids 128821, 128822).
           sampling={"temperature": 0.0, "max_tokens": 8192, "skip_special_tokens": False,
                     "extra_args": {"ngram_size": 30, "window_size": 90,
                                    "whitelist_token_ids": [128821, 128822]}}),
    Recipe(name="dots_ocr", family="ocr", model="rednote-hilab/dots.ocr",
           engine_args={"trust_remote_code": True},
           image=Prompting(template="{media}{question}", media="<|img|><|imgpad|><|endofimg|>")),
    # LightOnOCR transcribes the page; the example sends no question.
    Recipe(name="lightonocr", family="ocr", model="lightonai/LightOnOCR-1B",
           image=Prompting(template="<|im_start|>system<|im_end|>\n<|im_start|>user\n{media}<|im_end|>\n"
                           "<|im_start|>assistant\n", media="<|image_pad|>"),
           notes="Transcription model: the question is not used."),
    Recipe(name="hunyuan_vl", family="ocr", aliases=("hunyuan_ocr",), model="tencent/HunyuanOCR",
           max_model_len=8192,
           # HunyuanOCR's tokens use full-width bars (U+FF5C), as its tokenizer and vLLM's example do.
           # The image token alone, not the example's start/image/end: vLLM 0.26's engine processes the
           # tokenized prompt and its replacement adds start and end around the image tokens itself, so
           # the example's prompt reaches the model with two image starts for one image (XD-RoPE then
           # indexes past the image grids and the engine dies). Either way the HF processor on the text
           # gives the same tokens, one start and one end.
           image=Prompting(template="<\uff5chy_begin\u2581of\u2581sentence\uff5c>{media}{question}<\uff5chy_User\uff5c>",
                           media="<\uff5chy_place\u2581holder\u2581no\u2581102\uff5c>")),
)
