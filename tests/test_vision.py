"""Vision-language models (common/vision.py): images read and checked in one line, each image's
tokens where the chat template put it and never trained, pixel values packed with their tokens,
trainer log-probs equal to a plain transformers forward, and sft.py end to end with resume."""

import os
import re
import shutil

import pytest
import ray
import torch
from conftest import (
    REPO,
    assert_resume_is_exact,
    engine_flags,
    only_run_dir,
    parity_reward,
    read_jsonl,
    run_script,
)
from safetensors.torch import load_file

import sft
from common import data, vision
from common.engines import Engine, spawn_engines
from common.errors import InputError
from common.placement import (
    Layout,
    call,
    init_distributed,
    make_placement_group,
    rendezvous_address,
    spawn_trainers,
)
from common.weight_sync import init_weight_sync

SHAPES = os.path.join(REPO, "data", "shapes")


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory, tiny_model):
    """The built-in VLM's recipe (common/vision.build) on the 2-layer test model: Idefics3 with a
    random 2-layer vision tower, 16 image tokens a 128-px image."""
    dest = tmp_path_factory.mktemp("vlm") / "model"
    vision.build(tiny_model, str(dest))
    return str(dest)


@pytest.fixture(scope="module")
def eager_vlm(tmp_path_factory, tiny_vlm):
    """The test VLM with its (tied) embedding row for EOS made large (it is the pad token's: zeros),
    so responses end at different lengths (dapo.py leaves truncated ones out of its loss; a random
    model almost never samples EOS)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    dest = str(tmp_path_factory.mktemp("eager_vlm") / "model")
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm, dtype=torch.float32)
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    with torch.no_grad():
        rows = model.get_input_embeddings().weight
        rows[processor.tokenizer.eos_token_id] = 100 * rows[5]
    model.save_pretrained(dest)
    processor.save_pretrained(dest)
    return dest


def shapes_rows(name: str, n: int) -> list[dict]:
    return read_jsonl(os.path.join(SHAPES, name))[:n]


def encode(path, rows):
    """sft.py's sequences of `rows` (messages + images) for the model at `path`."""
    from transformers import AutoTokenizer

    import sft

    args, source = sft.Args(model=path, max_length=256), os.path.join(SHAPES, "sft_train.jsonl")
    images = vision.row_images(rows, source, True, "messages")
    tokenizer, processor = AutoTokenizer.from_pretrained(path), vision.processor(path, True)
    return sft.encode_rows(rows, source, images, tokenizer, processor, args), processor, images


def test_image_tokens_are_the_processors_and_never_carry_loss(tiny_vlm):
    rows = shapes_rows("sft_train.jsonl", 4)
    sequences, processor, images = encode(tiny_vlm, rows)
    image_ids = set(processor.tokenizer.convert_tokens_to_ids(vision.IMAGE_TOKENS))
    for row, seq, imgs in zip(rows, sequences, images):
        # the same tokens as the processor gives the whole rendered conversation
        text = processor.apply_chat_template(row["messages"])
        whole = processor(text=text, images=[imgs], add_special_tokens=False).input_ids[0]
        assert seq["input_ids"] == list(whole)
        assert sum(t in image_ids for t in seq["input_ids"]) == 16 + 3  # 16 <image>, 3 around it
        trained = [seq["labels"][t] for t, m in enumerate(seq["loss_mask"]) if m]
        assert trained and not image_ids & set(trained)  # labels at loss positions: text only
        answer = processor.tokenizer(row["messages"][1]["content"]).input_ids
        assert trained[: len(answer)] == answer  # the assistant's word is what is trained
        assert seq["pixel_values"].shape == (1, 3, 128, 128)


def test_packing_keeps_each_sequences_pixels_with_its_tokens():
    def seq(n, value):
        pixels = {"pixel_values": torch.full((1, 3, 4, 4), float(value))}
        return {"input_ids": [value] * n, "labels": [0] * n, "loss_mask": [1] * n} | pixels

    text_only = {"input_ids": [9] * 3, "labels": [0] * 3, "loss_mask": [1] * 3}
    rows = data.pack([seq(2, 1), text_only, seq(5, 2), seq(4, 3)], max_tokens=8)
    for row in rows:
        order = [t for t in row["input_ids"][0].tolist() if t != 9]
        firsts = [t for i, t in enumerate(order) if i == 0 or order[i - 1] != t]
        # one image per imaged sequence, in the row's order of sequences
        assert row.get("pixel_values", torch.empty(0))[:, 0, 0, 0].tolist() == firsts


def test_trainer_logprobs_with_images_equal_a_plain_forward(tiny_vlm, one_rank_group):
    """Three sequences with different pictures packed in one row through sft.py's trainer (FSDP2,
    the packed attention) against each alone through transformers: <= 1e-4. Swapping two
    sequences' pixels in the row moves them: the test sees which picture goes with which tokens."""
    from conftest import trainer_rank
    from transformers import AutoModelForImageTextToText

    import sft

    rows = [shapes_rows("sft_train.jsonl", 40)[i] for i in (0, 7, 13)]
    sequences, processor, images = encode(tiny_vlm, rows)
    args = sft.Args(model=tiny_vlm, num_trainers=1)
    trainer = trainer_rank(sft, args, tiny_vlm, *one_rank_group)
    (mb,) = data.pack(sequences, 1024)
    mb = trainer.local_part(mb)
    inputs = (mb["input_ids"], mb["position_ids"], mb["labels"], mb["loss_mask"])
    with torch.no_grad():
        packed = sft.compute_logprobs(trainer.model, *inputs, **vision.inputs(mb))
        swapped = {**mb, "pixel_values": mb["pixel_values"][[1, 0, 2]]}
        moved = sft.compute_logprobs(trainer.model, *inputs, **vision.inputs(swapped))
    plain = AutoModelForImageTextToText.from_pretrained(tiny_vlm, dtype=torch.float32).eval()
    alone = []
    for seq in sequences:
        ids = torch.tensor([seq["input_ids"]])
        with torch.no_grad():
            logits = plain(input_ids=ids, pixel_values=seq["pixel_values"][None]).logits[0]
        logprobs = logits.log_softmax(-1)
        at = [t for t, m in enumerate(seq["loss_mask"]) if m]
        alone += [logprobs[t, seq["labels"][t]].item() for t in at]
    assert packed.shape == (len(alone),)
    assert torch.allclose(packed, torch.tensor(alone), atol=1e-4), packed - torch.tensor(alone)
    assert (moved - packed).abs().max() > 1e-3


def test_bad_images_stop_in_one_line(tmp_path, tiny_model):
    good = shapes_rows("prompts_train.jsonl", 1)[0]
    picture = os.path.join(SHAPES, good["images"][0])
    (tmp_path / "junk.png").write_bytes(b"not a picture")
    (tmp_path / "p.jsonl").write_text("")  # relative paths: from the data file's folder
    two = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Which is larger?"}]
    cases = {
        "file 'gone.png' does not exist": {"images": ["gone.png"]},
        "image 1 is not a readable image (UnidentifiedImageError": {"images": ["junk.png"]},
        "has 1 images for 2 image parts": {"prompt": [{"role": "user", "content": two}]},
        "has 0 images for 1 image parts": {"images": []},
        "image 1 must be a path, bytes or an image (got 7)": {"images": [7]},
    }
    for expected, change in cases.items():
        rows = [dict(good, images=[picture]), {**good, "images": [picture], **change}]
        where = re.escape(f"error: {tmp_path}/p.jsonl: row 2")
        with pytest.raises(InputError, match=rf"^{where}\b.*{re.escape(expected)}"):
            vision.row_images(rows, str(tmp_path / "p.jsonl"), True, "prompt")
    # a row's pictures are its own: a text row first does not hide the next one's column
    text_row = {"prompt": "plain text", "answer": "red"}
    mixed = vision.row_images([text_row, {**good, "images": [picture]}], "x", True, "prompt")
    assert [len(images) for images in mixed] == [0, 1]
    # bytes and datasets' {"bytes": ...} load as the file does; a language model refuses images
    raw = open(picture, "rb").read()
    for value in (raw, {"bytes": raw, "path": None}):
        (img,) = vision.row_images([{**good, "images": [value]}], "x", True, "prompt")[0]
        assert img.tobytes() == vision.load_images(picture, "", "x")[0].tobytes()
    with pytest.raises(
        InputError,
        match=r"row 1 has images: a VLM --model takes them, in sft.py, grpo.py, dapo.py or grpo_async.py",
    ):
        vision.row_images([{**good, "images": [picture]}], "x", False, "prompt")
    # messages: text, or parts of text and images; anything else in one line
    for content in ([{"type": "video"}], [], [{"type": "text"}]):
        row = {"prompt": [{"role": "user", "content": content}], "answer": "red"}
        with pytest.raises(
            InputError,
            match=r"message 1 .user. has no text content \(a string, or a list of text and image parts\)",
        ):
            data.validate_rows([row], ["prompt", "answer"], "x")
    # the flags a VLM cannot take yet, and --train-vision without one
    import sft

    with pytest.raises(InputError, match="--train-vision: --model .* has no vision tower"):
        vision.check_model(sft.Args(model=tiny_model, train_vision=True), tiny_model)


def test_sft_learns_on_pictures_and_resumes_exactly(tiny_vlm, tmp_path):
    """sft.py with a VLM --model, 3 steps on the shapes task (a quarter of the rows): the loss
    falls, the final folder is a VLM with its processor, greedy accuracy ran on pictures, and a
    resume from step 1 repeats steps 2-3 exactly."""
    flags = (
        "--model", tiny_vlm, "--dataset", os.path.join(SHAPES, "sft_train.jsonl"),
        "--eval-dataset", "", "--accuracy-dataset", os.path.join(SHAPES, "prompts_test.jsonl"),
        "--num-steps", "3", "--batch-size", "8", "--learning-rate", "1e-3", "--eval-every", "3",
        "--save-every", "1", "--max-new-tokens", "4", "--output-dir", str(tmp_path / "runs"),
    )  # fmt: skip
    result = run_script("sft.py", *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = only_run_dir(tmp_path / "runs")
    metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    losses = [m["train/loss"] for m in metrics if "train/loss" in m]
    assert len(losses) == 3 and losses[-1] < losses[0]
    final = os.path.join(run_dir, "checkpoints", "final")
    assert vision.is_vlm(final, final) and os.path.isfile(f"{final}/processor_config.json")
    samples = read_jsonl(os.path.join(run_dir, "samples.jsonl"))
    assert {s["step"] for s in samples} == {0, 3} and samples[0]["prompt"][0]["content"][0] == {
        "type": "image"
    }
    shutil.rmtree(final)
    assert_resume_is_exact("sft.py", flags, run_dir)


@ray.remote
class VisionSyncTrainer:
    """One trainer rank of a VLM (sft.py's loader) and its end of the weight sync."""

    def __init__(self, path, rank, world_size, addr, port):
        self.device = init_distributed(rank, world_size, addr, port)
        self.model = sft.load_policy(path, self.device, gradient_checkpointing=False)
        self.processor = vision.processor(path, True)

    def init_sync(self, engines, backend, addr, port):
        args = (engines, backend, 0, (addr, port), 1, torch.float32)
        self.sync = init_weight_sync(self.model, self.processor, *args)

    @torch.no_grad()
    def perturb_vision(self, scale):
        """Move the vision tower alone: only the pictures' features change."""
        gen = torch.Generator().manual_seed(0)
        self.model.reshard()  # the probe's forward left the root's weights gathered
        for name, p in self.model.named_parameters():
            if ".vision_model." in name:
                local = p.to_local()
                local.add_(torch.randn(local.shape, generator=gen) * scale)

    def push_and_check(self):
        self.sync.push()
        return self.sync.check()


@ray.remote
class ForgetfulEngine(Engine.__ray_actor_class__):
    """An engine whose weight updates leave its cache of image features as it was."""

    def forget_encoder_reset(self):
        self.llm.llm_engine.reset_encoder_cache = lambda: None


@pytest.mark.cpu_engine("CPU engines by design (gloo weight sync); vLLM serves the VLM on the CPU")
def test_a_push_reaches_the_pictures_only_with_the_encoder_cache_reset(ray_cpu, tiny_vlm):
    """The probe after every push holds a picture. With the engine's cache of image features reset
    (as Engine.finish_weight_update does) a push of a new vision tower passes it; without, the
    engine answers with the old tower's features and the probe stops the run."""
    layout = Layout(False, trainers=1, engines=1)
    pg = make_placement_group(layout.bundles, use_gpu=False)
    trainers = spawn_trainers(VisionSyncTrainer, pg, layout.trainers, tiny_vlm)
    flags = engine_flags()
    engines = spawn_engines(pg, layout.engines, flags, tiny_vlm, "gloo", False, ForgetfulEngine)
    call(trainers, "init_sync", engines, "gloo", *rendezvous_address(pg, 0))
    for _ in range(2):  # the first probe fills the cache with the picture's features
        call(trainers, "perturb_vision", 0.05)
        assert call(trainers, "push_and_check")[0] < 1e-4
    ray.get(engines[0].forget_encoder_reset.remote())
    call(trainers, "perturb_vision", 0.05)
    stale = r"Engine#0 does not serve the weights just pushed: its log-probabilities of a probe"
    with pytest.raises(SystemExit, match=stale):
        call(trainers, "push_and_check")


@pytest.mark.parametrize(
    "script, lora",
    [("grpo.py", False), ("grpo.py", True), ("dapo.py", False), ("grpo_async.py", True)],
    ids=["grpo-full", "grpo-lora", "dapo-full", "async-lora"],
)
def test_the_grpo_family_runs_on_pictures(request, tmp_path, script, lora):
    """grpo.py, dapo.py and grpo_async.py with a VLM --model, 2 steps on the shapes prompts (a
    length-parity reward, so every step has advantages and the weights move): vLLM samples with the
    pictures (grpo_async.py: its AsyncEngine, weights pushed while it runs), the trainer's log-probs
    of those tokens equal the engine's (both saw the same image tokens and features), and every push
    passes the probe with a picture. LoRA: adapters on the language model's layers only, loaded by
    the engines after each step. grpo-full trains the vision tower too (--train-vision: the pushed
    tower meets the probe's picture), and resumes from step 1 exactly."""
    model = request.getfixturevalue("eager_vlm" if script == "dapo.py" else "tiny_vlm")
    flags = (
        "--model", model, "--dataset", os.path.join(SHAPES, "prompts_train.jsonl"),
        "--eval-dataset", os.path.join(SHAPES, "prompts_test.jsonl"), "--num-steps", "2",
        "--eval-every", "2", "--prompts-per-step", "2", "--num-generations", "4",
        "--max-response-length", "6", "--reward-fn", parity_reward(tmp_path),
        "--output-dir", str(tmp_path / "runs"),
    )  # fmt: skip
    flags += (
        ("--lora-rank", "8", "--learning-rate", "1e-2") if lora else ("--learning-rate", "1e-3")
    )
    # grpo_async.py on-policy: every token sampled by the weights it trains; dapo.py: a buffer
    # shorter than the 6 tokens a response may take
    flags += {"grpo_async.py": ("--max-lag", "0"), "dapo.py": ("--overlong-buffer", "2")}.get(
        script, ()
    )
    tower = script == "grpo.py" and not lora
    flags += ("--train-vision", "--save-every", "1") if tower else ()
    result = run_script(script, *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = only_run_dir(tmp_path / "runs")
    metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    steps = [m for m in metrics if "train/loss" in m]
    assert len(metrics) == 3 and "eval/accuracy" in metrics[-1]  # steps 0, 1, 2
    # dapo.py trains on responses that ended only: the random model's at step 2 may not (seen: none
    # did); its step 1 trains, pushes and probes with pictures, step 2 samples with what it pushed
    assert len(steps) == 2 or (script == "dapo.py" and len(steps) == 1)
    for m in steps:
        assert m["train/grad_norm"] > 0
        assert m["train/logprob_diff_max"] < 1e-4 and m["perf/sync_probe_gap"] < 1e-4  # fp32
    if lora:  # the adapters moved, and none is on the vision tower
        adapter = os.path.join(
            run_dir, "checkpoints", "final", "adapter", "adapter_model.safetensors"
        )
        tensors = load_file(adapter)
        assert tensors and all(".text_model.layers." in k for k in tensors)
        assert max(v.abs().max().item() for k, v in tensors.items() if "lora_B" in k) > 1e-3
    if tower:  # the tower moved, and the run resumes from step 1 as it ran
        final, start = (load_file(os.path.join(p, "model.safetensors")) for p in (
            os.path.join(run_dir, "checkpoints", "final"), model))  # fmt: skip
        towers = [k for k in start if ".vision_model.encoder." in k]
        assert towers and any(not torch.equal(final[k], start[k]) for k in towers)
        assert_resume_is_exact(script, flags, run_dir)
