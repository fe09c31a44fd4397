"""Checkpoints: a run's step_N folders (an HF model folder, loadable by transformers and vLLM as
is, plus trainer_state.pt for --resume) and final/, written by trainer rank 0 from the FSDP2 shards
of every rank, and the checks that make --resume safe before anything starts."""

import json
import os
import re
import shutil
import zipfile

from common.errors import InputError
from common.models import check_weights
from common.tracking import check_output_dir


def save(model, optimizer, tokenizer, path: str, step: int, with_optimizer: bool) -> None:
    """Called on every rank of an FSDP2 group: all gather the full state dict (a collective, to
    CPU); rank 0 writes an HF folder (model + tokenizer) and, for --resume, the optimizer state."""
    import torch.distributed as dist
    import torch.distributed.checkpoint.state_dict as sd

    opts = sd.StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = sd.get_model_state_dict(model, options=opts)
    optim = sd.get_optimizer_state_dict(model, optimizer, options=opts) if with_optimizer else None
    if dist.get_rank() == 0:
        trainer_state = {"optimizer": optim, "step": step} if optim else None
        _write_hf_folder(model, tokenizer, state, path, trainer_state)
    dist.barrier()


def load_optimizer(model, optimizer, path: str) -> None:
    """On every rank: rank 0 reads the checkpoint's optimizer state, each rank keeps its shard."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    rank0 = dist.get_rank() == 0
    state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False) if rank0 else {}
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_optimizer_state_dict(model, optimizer, state.get("optimizer", {}), options=opts)


def _write_hf_folder(model, tokenizer, state_dict: dict, path: str, trainer_state: dict | None):
    """Write `state_dict` as an HF folder, atomically via a temp folder; `trainer_state` (optimizer,
    step) goes to trainer_state.pt for --resume."""
    if model.config.tie_word_embeddings:  # gathered FSDP shards no longer share storage: one copy
        state_dict.pop("lm_head.weight", None)
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state_dict)
    tokenizer.save_pretrained(tmp)
    if trainer_state is not None:
        import torch

        torch.save(trainer_state, os.path.join(tmp, "trainer_state.pt"))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def check_resume(path: str, args, script: str) -> tuple[str, str, int]:
    """Resolve and check `--resume` before anything starts: (run_dir, checkpoint_dir, step).

    The run must have been made by the same script and --model, end before --num-steps, and its
    checkpoint must be whole (`check`); the run dir must be writable."""
    run_dir, checkpoint, step = find_checkpoint(path)
    if step >= args.num_steps:
        before = f"not before --num-steps {args.num_steps}"
        raise InputError(f"--resume: the checkpoint is at step {step}, {before}")
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        why = type(e).__name__
        raise InputError(f"--resume: {run_dir}/config.json is unreadable ({why})") from None
    made_by = config.get("script") or os.path.basename((config.get("argv") or ["?"])[0])
    if made_by != script:
        raise InputError(f"--resume: {run_dir} was made by {made_by}, not {script}")
    model = config["args"].get("model")
    if model != args.model:
        raise InputError(f"--resume: the run was made with --model {model}, not {args.model}")
    check(checkpoint)
    check_output_dir(run_dir)
    return run_dir, checkpoint, step


def find_checkpoint(path: str) -> tuple[str, str, int]:
    """`--resume` (a run dir or one of its checkpoints/step_N) -> (run_dir, checkpoint, step)."""
    path = os.path.abspath(path.rstrip("/"))
    folder = os.path.join(path, "checkpoints")
    if os.path.isdir(folder):
        steps = [d for d in os.listdir(folder) if re.fullmatch(r"step_\d+", d)]
        if not steps:
            raise InputError(f"--resume: {path} has no checkpoints/step_N to resume from")
        path = os.path.join(folder, max(steps, key=lambda d: int(d[5:])))
    name = os.path.basename(path)
    if not re.fullmatch(r"step_\d+", name) or not os.path.isfile(f"{path}/trainer_state.pt"):
        what = "a run dir or a checkpoints/step_N folder with trainer_state.pt"
        raise InputError(f"--resume: {path} is not {what}")
    return os.path.dirname(os.path.dirname(path)), path, int(name[5:])


def check(checkpoint: str) -> None:
    """A --resume checkpoint is whole: its weights (check_weights) and trainer_state.pt (a zip)."""
    check_weights(checkpoint, "--resume: checkpoint")
    if not zipfile.is_zipfile(os.path.join(checkpoint, "trainer_state.pt")):
        why = "is truncated or not a checkpoint"
        raise InputError(f"--resume: {checkpoint}/trainer_state.pt {why}")
