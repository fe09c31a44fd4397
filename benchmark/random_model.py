"""Build a model with random weights and the shape of a known one, plus the built-in tokenizer: no
hub needed.

    .venv/bin/python benchmark/random_model.py qwen2.5-0.5b /tmp/posttrain-bench/qwen2.5-0.5b-random [--head score]

Shapes: qwen2.5-0.5b and qwen2.5-1.5b (Qwen2.5's configs, vocab cut to the built-in tokenizer's
49152), and llama-1b (1.0B parameters, for the loading benchmark). Weights are saved in bf16, as hub
checkpoints are (the trainers load them into fp32 master weights). Random weights rarely sample EOS,
so generation runs to the length limit: what a throughput benchmark wants. `--head score`: a
one-label sequence classifier of that shape (a reward model or a critic as rm.py writes them).
"""

import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

SHAPES = {
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6),
    "llama-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=5632, num_hidden_layers=20,
                     num_attention_heads=16, num_key_value_heads=4),
}  # fmt: skip


def make_random_model(shape: str, path: str, head: str = "lm") -> str:
    """Write the model to `path` (once: an existing folder is kept) and return `path`."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    from common.models import BUILTIN_MODEL, resolve_model

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(BUILTIN_MODEL))
    fields = dict(SHAPES[shape])
    config = AutoConfig.for_model(
        fields.pop("model_type"), vocab_size=len(tokenizer), tie_word_embeddings=True, max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        num_labels=1, **fields,
    )  # fmt: skip
    torch.manual_seed(0)
    auto = AutoModelForCausalLM if head == "lm" else AutoModelForSequenceClassification
    model = auto.from_config(config, dtype=torch.bfloat16)
    print(
        f"{shape}: {sum(p.numel() for p in model.parameters()) / 1e9:.3f}B parameters -> {path}",
        flush=True,
    )
    model.save_pretrained(path + ".tmp")
    tokenizer.save_pretrained(path + ".tmp")
    os.rename(path + ".tmp", path)
    return path


if __name__ == "__main__":
    print(
        make_random_model(
            sys.argv[1], sys.argv[2], sys.argv[4] if sys.argv[3:4] == ["--head"] else "lm"
        )
    )
