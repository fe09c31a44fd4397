"""The memory plans in docs/cluster.md, computed by common/memory.py (the check every script runs
before it starts).

    .venv/bin/python benchmark/memory_plan.py        # prints the markdown table of docs/cluster.md

Model shapes are the published configs (real vocabularies; built on the meta device, no download).
The GPU is an H100 80GB: 81,559 MiB as nvidia-smi reports it. Computed, not measured.
"""

import functools
import os
import sys
from dataclasses import replace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from common.lora import DEFAULT_TARGETS  # noqa: E402
from common.memory import GiB, Job, check, needs, shape_of  # noqa: E402

H100 = 81559 * 2**20
CONFIGS = {
    "Qwen2.5-0.5B": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "Qwen2.5-1.5B": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "Qwen2.5-7B": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "Llama-3.1-70B": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    # a VLM (Idefics3): SmolLM2-135M's 30 layers with an untied head, a SigLIP-base tower on 512-px tiles, and a
    # pixel-shuffle connector (scale 4: 64 image tokens a tile); 256,484,928 parameters as published
    "SmolVLM-256M": dict(model_type="idefics3", scale_factor=4, image_token_id=49190, vocab_size=49280,
                         tie_word_embeddings=False,
                         text_config=dict(model_type="llama", hidden_size=576, intermediate_size=1536,
                                          num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                          head_dim=64, vocab_size=49280, pad_token_id=2, tie_word_embeddings=False),
                         vision_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                            num_attention_heads=12, image_size=512, patch_size=16)),
}  # fmt: skip


@functools.cache
def shape(name: str, head: str = "lm", lora_rank: int = 0):
    """The Shape of a published model; with `lora_rank`, with LoRA adapters on the default targets."""
    from transformers import AutoConfig

    fields = dict(CONFIGS[name])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    return shape_of(config, head, (lora_rank, DEFAULT_TARGETS.split(",")))


def with_lora(job: Job, rank: int = 16) -> Job:
    """The same run with LoRA adapters of this rank (π_ref: the base, no copy)."""
    name = next(n for n in CONFIGS if shape(n) == job.policy)
    critic = shape(name, "score", rank) if job.critic else None
    return replace(job, policy=shape(name, "lm", rank), critic=critic, reference=False)


def cases() -> list[tuple[str, str, Job]]:
    """(run, command's layout flags, Job): the runs docs/cluster.md plans."""
    s05, s15, s7, s70, vlm = (shape(n) for n in CONFIGS)
    grpo = dict(tokens=16384, checkpointing=True, engines=1, engine_memory=0.4, colocate=True)
    ppo = dict(grpo, reference=True)
    split7 = dict(tokens=8192, checkpointing=True, reference=True, engine_memory=0.85)
    return [
        ("grpo.py 0.5B (the reference benchmark)", "1 GPU, colocated", Job(s05, trainers=1, **grpo)),
        ("ppo.py 0.5B + critic + reward model 0.5B", "1 GPU, hybrid engine",
         Job(s05, trainers=1, critic=shape("Qwen2.5-0.5B", "score"), critics=1,
             reward_model=shape("Qwen2.5-0.5B", "score"), **ppo)),
        ("grpo.py 1.5B", "1 GPU, colocated", Job(s15, trainers=1, **grpo)),
        ("ppo.py 1.5B + critic + reward model 1.5B", "1 GPU, hybrid engine",
         Job(s15, trainers=1, critic=shape("Qwen2.5-1.5B", "score"), critics=1,
             reward_model=shape("Qwen2.5-1.5B", "score"), **ppo)),
        ("grpo.py 7B, full fine-tuning", "1 GPU, colocated", Job(s7, trainers=1, **dict(grpo, tokens=8192))),
        ("grpo.py 7B, --lora-rank 16", "1 GPU, colocated",
         with_lora(Job(s7, trainers=1, **dict(grpo, tokens=8192)))),
        ("ppo.py 7B + critic, --lora-rank 16 (both)", "1 GPU, hybrid engine",
         with_lora(Job(s7, trainers=1, critic=shape("Qwen2.5-7B", "score"), critics=1,
                       **dict(ppo, tokens=8192)))),
        ("grpo.py 7B, --kl-coef 0.01", "8 GPUs: --num-trainers 4 --num-engines 4",
         Job(s7, trainers=4, engines=4, **split7)),
        ("grpo.py 7B, --kl-coef 0.01", "8 GPUs: --num-trainers 8 --num-engines 8 --colocate",
         Job(s7, trainers=8, **dict(grpo, tokens=8192, engines=8, reference=True))),
        ("grpo.py 70B, --kl-coef 0.01", "48 GPUs: --num-trainers 32 --num-engines 2 --engine-tp 8",
         Job(s70, trainers=32, engines=2, engine_tp=8, **dict(split7, tokens=4096))),
        ("sft.py SmolVLM-256M (pictures)", "1 GPU", Job(vlm, trainers=1, tokens=16384, checkpointing=True)),
        ("grpo.py SmolVLM-256M (pictures)", "1 GPU, colocated", Job(vlm, trainers=1, **grpo)),
    ]  # fmt: skip


def rows() -> list[str]:
    """The markdown table: per run, each GPU's peak phase, its GiB and what makes it up, and the
    verdict."""
    out = ["| run | layout | per GPU (GiB of 79.6) | verdict |", "| --- | --- | --- | --- |"]
    for run, layout, job in cases():
        try:  # a refusal says whether LoRA would fit (as the scripts' plans say)
            job = check(job, H100, None if job.policy.adapters else with_lora(job))[0]
            verdict = "fits" + (
                " (critic and reward model offloaded when idle)" if job.offload else ""
            )
        except SystemExit as e:
            verdict = "refused: " + str(e.code).split("fit; ", 1)[-1].replace(
                "it would fit with ", "fits with "
            )
        peaks = {}
        for gpu, phase, parts in needs(job, H100):
            total = sum(parts.values())
            if total > peaks.get(gpu, (None, -1))[1]:
                peaks[gpu] = (phase, total)
        where = "; ".join(
            f"{gpu} {phase}: {total / GiB:.1f}" for gpu, (phase, total) in peaks.items()
        )
        out.append(f"| {run} | {layout} | {where} | {verdict} |")
    return out


def detail(run_index: int) -> list[str]:
    """Every phase of one case, part by part (for the worked example in docs/cluster.md)."""
    _, _, job = cases()[run_index]
    job = replace(job, offload=check(job, H100)[0].offload)
    return [
        f"{gpu} {phase}: "
        + ", ".join(f"{k} {v / GiB:.1f}" for k, v in parts.items() if v >= GiB / 20)
        for gpu, phase, parts in needs(job, H100)
    ]


if __name__ == "__main__":
    print("\n".join(rows()))
