"""Vision-language models (a config with `vision_config`): images in TRL's columns, each prompt's
image tokens as the model's processor writes them, the pixel values beside their tokens, and the
built-in tiny VLM. Families whose image tokens sit in a plain 1-D RoPE sequence (Idefics3,
SmolVLM) pack like text; M-RoPE ones (Qwen2-VL and later) are refused. docs/vision.md."""

import io
import json
import logging
import os

import torch

from common.errors import InputError

FAMILIES = ("idefics3", "smolvlm")
BUILTIN_VLM = "builtin:SmolLM2-135M-Vision"
SCRIPTS = "sft.py, grpo.py, dapo.py or grpo_async.py"  # those that train a VLM
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>"]  # Idefics3's, in order
# The built-in model's chat template: SmolLM2's, with a message's content a string or a list of
# {"type": "text", "text"} and {"type": "image"} parts (an image part writes one <image>).
TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\\n' }}{% endif %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# transformers builds a default Idefics3 config (Llama's 32k vocabulary, pad token 128002) to
# compare a model's with, and warns about the default's pad token, not the model's: not shown
logging.getLogger("transformers.configuration_utils").addFilter(
    lambda record: "got 128002" not in record.getMessage()
)


def is_vlm(path: str, name: str) -> bool:
    """Whether the model folder's config has a vision tower (one of FAMILIES, else one line)."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    if "vision_config" not in config:
        return False
    if (kind := config.get("model_type")) not in FAMILIES:
        families = ", ".join(FAMILIES)
        raise InputError(
            f"--model {name!r} is a vision-language model of type {kind!r}; posttrain trains "
            f"those of type {families} (docs/vision.md)"
        )
    return True


def check_model(args, path: str, text_only: str = "") -> bool:
    """Whether --model is a VLM, and the flags fit it (`text_only`: the script takes none): one
    line where they do not."""
    vlm = is_vlm(path, args.model)
    if vlm and text_only:
        raise InputError(
            f"{text_only} trains language models only: for a VLM --model use {SCRIPTS}"
        )
    if getattr(args, "train_vision", False) and not vlm:
        raise InputError(f"--train-vision: --model {args.model!r} has no vision tower")
    if vlm and args.sp_size > 1:  # a row's image tokens would be split from their pixels
        raise InputError("--sp-size > 1 is not supported with a vision-language model")
    return vlm


def processor(path: str, vlm: bool):
    """A VLM's processor (its tokenizer, image processor, chat template), or None."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path) if vlm else None


def placeholders(*conversations) -> int:
    """The {"type": "image"} parts of the messages: one image each, in order."""
    messages = [m for c in conversations if isinstance(c, list) for m in c]
    parts = [p for m in messages if isinstance(m.get("content"), list) for p in m["content"]]
    return sum(1 for p in parts if p.get("type") == "image")


def load_images(value, folder: str, where: str) -> list:
    """A row's images as RGB PIL images: paths (relative: to the data file's folder), bytes,
    datasets' {"bytes", "path"} dicts or PIL images; one, or a list. One line on a bad one."""
    from PIL import Image

    images = []
    for i, item in enumerate(value if isinstance(value, list) else [value], 1):
        what = f"{where}: image {i}"
        if isinstance(item, dict):  # datasets' Image feature undecoded
            item = item.get("bytes") or item.get("path")
        if isinstance(item, str) and item:
            path = os.path.join(folder, os.path.expanduser(item))
            if not os.path.isfile(path):
                raise InputError(f"{what}: file {item!r} does not exist")
            item = path
        elif isinstance(item, (bytes, bytearray)):
            item = io.BytesIO(item)
        elif not isinstance(item, Image.Image):
            raise InputError(f"{what} must be a path, bytes or an image (got {item!r:.40})")
        try:
            image = item if isinstance(item, Image.Image) else Image.open(item)
            image.load()  # the whole file decoded now, not at the first step
        except Exception as e:
            raise InputError(f"{what} is not a readable image ({type(e).__name__}: {e})") from None
        images.append(image.convert("RGB"))
    return images


def row_images(rows: list[dict], source: str, vlm: bool, *columns: str) -> list[list]:
    """Every row's images, read and checked before anything starts: as many as its messages' image
    parts (`columns`), and none unless the model is a VLM. [] for a row without images."""
    folder = os.path.dirname(os.path.abspath(source)) if os.path.exists(source) else os.getcwd()
    out = []
    for i, row in enumerate(rows, 1):
        value = row.get("images", row.get("image"))  # TRL's columns: a list, or one
        images = load_images(value, folder, f"{source}: row {i}") if value else []
        wanted = placeholders(*(row.get(c) for c in columns))
        if len(images) != wanted:
            raise InputError(
                f"{source}: row {i} has {len(images)} images for {wanted} image parts "
                '({"type": "image"}) in its messages'
            )
        if images and not vlm:
            raise InputError(
                f"{source}: row {i} has images: a VLM --model takes them, in {SCRIPTS}"
            )
        out.append(images)
    return out


def expand(processor, ids: list[int], mask: list[int], images: list) -> tuple:
    """The tokens the model sees: each image token of `ids` (one per image, where the chat
    template put it) becomes the processor's tokens for that image, never trained (mask 0).
    Returns (ids, mask, {name: (n, ...) tensor}: the images' pixel values, ...)."""
    if not images:
        return ids, mask, {}
    token = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    if ids.count(token) != len(images):
        raise InputError(f"the chat template wrote {ids.count(token)} images for {len(images)}")
    out_ids, out_mask, pixels, k = [], [], [], 0
    for t, m in zip(ids, mask):
        if t != token:
            out_ids.append(t)
            out_mask.append(m)
            continue
        enc = processor(text=processor.image_token, images=[[images[k]]], return_tensors="pt")
        out_ids += enc.pop("input_ids")[0].tolist()
        out_mask += [0] * (len(out_ids) - len(out_mask))
        pixels.append({key: v[0] for key, v in enc.items() if key != "attention_mask"})
        k += 1
    return out_ids, out_mask, stack(pixels)


def prompt(processor, ids: list[int], images: list) -> tuple:
    """A prompt as the model sees it: (ids with each image's tokens, pixels)."""
    ids, _, pixels = expand(processor, ids, [0] * len(ids), images)
    return ids, pixels


def probe(processor, text: str) -> tuple:
    """weight_sync's probe: (ids, pixels, the engines' request). A VLM's (`processor`) starts with
    a picture (colour gradients): a stale vision tower or cache of image features shows in it."""
    if not hasattr(processor, "image_processor"):  # a tokenizer
        ids = processor(text).input_ids
        return ids, {}, ids
    from PIL import Image

    ramp = Image.linear_gradient("L").resize((128, 128))
    picture = Image.merge("RGB", [ramp, ramp.rotate(90), ramp.rotate(180)])
    request = processor.tokenizer(processor.image_token + text).input_ids
    ids, pixels = prompt(processor, request, [picture])
    return ids, pixels, {"prompt_token_ids": request, "multi_modal_data": {"image": [picture]}}


def stack(pixels: list[dict]) -> dict:
    """The images of several sequences in one: each tensor (n, ...) zero-padded to the largest
    image, then concatenated in order (the model drops all-zero images: the padding)."""
    out, pixels = {}, [p for p in pixels if p]
    for key in pixels[0] if pixels else ():
        size = [max(sizes) for sizes in zip(*(p[key].shape[1:] for p in pixels))]
        out[key] = torch.cat([pad_to(p[key], [len(p[key]), *size]) for p in pixels])
    return out


def batch(pixels: list[dict]) -> dict:
    """Several prompts' images as one batch (b, n, ...) for generate, zero-padded (no image)."""
    if not (present := [p for p in pixels if p]):
        return {}
    out = {}
    for key in present[0]:
        size = [max(sizes) for sizes in zip(*(p[key].shape for p in present))]
        empty = present[0][key][:0]
        out[key] = torch.stack([pad_to(p.get(key, empty), size) for p in pixels])
    return out


def pad_to(tensor: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """`tensor` zero-padded at the end of each dimension to `shape`."""
    widths = [x for n, m in zip(shape[::-1], tensor.shape[::-1]) for x in (0, n - m)]
    return torch.nn.functional.pad(tensor, widths)


def freeze(model, path: str, train_vision: bool):
    """A VLM's vision tower frozen (unless `train_vision`: --train-vision); its processor, which a
    checkpoint saves. None for a language model."""
    if (tower := getattr(getattr(model, "model", None), "vision_model", None)) is None:
        return None
    tower.requires_grad_(train_vision and any(p.requires_grad for p in tower.parameters()))
    return processor(path, True)


def inputs(mb: dict) -> dict:
    """A packed micro-batch's image tensors as the model's forward takes them: (1, n, ...)."""
    return {k: v[None] for k, v in mb.items() if k.startswith("pixel_")}


def build(text_dir: str, dest: str) -> None:
    """The built-in VLM in `dest`: Idefics3 (SmolVLM's architecture) with the built-in SmolLM2-135M
    as its language model, a seeded random 2-layer SigLIP-style vision tower (128-px images in
    16-px patches) and a pixel-shuffle connector: 16 image tokens an image. Neither has learnt
    anything: sft.py's warm start teaches the connector (docs/vision.md)."""
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        Idefics3Config,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )
    from transformers import Idefics3ForConditionalGeneration as Idefics3

    tokenizer = AutoTokenizer.from_pretrained(text_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    tokenizer.chat_template = TEMPLATE
    text = AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    text.config.vocab_size = len(tokenizer)  # + the 3 image tokens
    vision = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2)
    vision |= dict(num_attention_heads=2, image_size=128, patch_size=16)  # head_dim 64
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    config = Idefics3Config(
        text_config=text.config.to_dict(),
        vision_config=vision,
        scale_factor=2,  # (128 / 16)^2 / 2^2 = 16 tokens
        image_token_id=image_token,
        tie_word_embeddings=True,
        pad_token_id=text.config.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Idefics3(config)
    state = {k.removeprefix("model."): v for k, v in text.state_dict().items()}
    embed = state.pop("embed_tokens.weight")  # the new tokens start at the mean embedding
    new = embed.mean(0, keepdim=True).expand(len(tokenizer) - len(embed), -1)
    state["embed_tokens.weight"] = torch.cat([embed, new])
    model.model.text_model.load_state_dict(
        {k: v for k, v in state.items() if k != "lm_head.weight"}
    )
    model.tie_weights()
    images = dict(do_image_splitting=False, size={"longest_edge": 128})
    images = Idefics3ImageProcessorPil(**images, max_image_size={"longest_edge": 128})
    processor = Idefics3Processor(images, tokenizer, image_seq_len=16, chat_template=TEMPLATE)
    model.config.name_or_path = BUILTIN_VLM.split(":")[1]
    model.save_pretrained(dest)
    processor.save_pretrained(dest)
