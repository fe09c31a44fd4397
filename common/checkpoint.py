"""Checkpoints step_N/, final/ (HF folder + trainer_state.pt; LoRA: adapter/); --resume's checks."""

import argparse
import contextlib
import ctypes
import dataclasses
import json
import os
import re
import shutil
import zipfile

import ray
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as sd

from common import lifetime, lora
from common.errors import InputError, RunError
from common.models import check_weights, whole_file
from common.placement import call
from common.tracking import check_output_dir, check_tracking, lock_run_dir, write_json


def save(model, optimizer, tokenizer, path: str, step: int, with_optimizer: bool, **extra) -> None:
    """All ranks gather the full state dict to CPU; rank 0 writes an HF folder + optimizer state
    (with `extra`: the loss scale)."""
    opts = sd.StateDictOptions(full_state_dict=True, cpu_offload=True)
    # An eval (forward, no backward) leaves FSDP2's root unsharded, its params not the optimizer's
    model.reshard()  # as get_model_state_dict would, but LoRA's step_N skips that
    adapters = lora.adapter_tensors(model) if lora.on(model) else None
    # LoRA: the adapters at every save, the merged model in final/ and best/ (also staged)
    whole = adapters is None or os.path.basename(path).strip(".").split(".")[0] in ("final", "best")
    state = sd.get_model_state_dict(model, options=opts) if whole else None
    optim = sd.get_optimizer_state_dict(model, optimizer, options=opts) if with_optimizer else None
    if dist.get_rank() == 0:
        if adapters is not None:
            lora.write_adapter(os.path.join(path, lora.ADAPTER), adapters, lora.config_dict(model))
        if state is not None:
            state = dict(lora.merged(state, model)) if adapters is not None else state
            if model.config.tie_word_embeddings:  # gathered: one copy
                state.pop("lm_head.weight", None)
            model.save_pretrained(path, state_dict=state)
        tokenizer.save_pretrained(path)
        if optim:
            state = {"optimizer": optim, "step": step, **extra}
            torch.save(state, os.path.join(path, "trainer_state.pt"))
    dist.barrier()


@contextlib.contextmanager
def staged(path: str, step: int, **info):
    """Write a checkpoint (every part) into a hidden folder beside `path`, published by one rename:
    a kill leaves `path` whole or absent; a failure removes it once no trainer writes in it."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
        write_json(os.path.join(tmp, "checkpoint.json"), {"step": step, **info})  # last: all there
        for root, _, files in os.walk(tmp):  # on disk before the rename makes the folder visible
            for name in files:
                with open(os.path.join(root, name), "rb") as f:
                    os.fsync(f.fileno())
        if os.path.exists(path):  # a re-save (best; final after --resume): one whole at any time
            exchange(tmp, path)
            shutil.rmtree(tmp, ignore_errors=True)  # now the old one
        else:
            os.replace(tmp, path)
    except BaseException as e:
        free = shutil.disk_usage(os.path.dirname(path)).free  # checkpoints/: there, unlike tmp
        lifetime.after_end(lambda: shutil.rmtree(tmp, ignore_errors=True))
        full = "No space left" in str(e) or free < 64 * 2**20
        if full and not isinstance(e, KeyboardInterrupt):
            where = os.path.relpath(path, os.path.dirname(os.path.dirname(os.path.dirname(path))))
            raise RunError(
                f"no space left on the device to save {where} ({free / 2**20:.0f} MiB "
                "free): the partial checkpoint is removed; the newest whole one stays "
                "resumable"
            ) from None
        raise


def exchange(new: str, path: str) -> None:
    """Folder `new` to `path`, path's old folder to `new`, in one step (Linux's renameat2 with
    RENAME_EXCHANGE); where the file system cannot (NFS), by renames through .<name>.old, which a
    kill between them leaves for the next start to put back (tracking.clean_checkpoints)."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 and renameat2(-100, os.fsencode(new), -100, os.fsencode(path), 2) == 0:
        return  # -100: paths from the working directory; 2: RENAME_EXCHANGE
    old = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.old")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(path, old)
    os.replace(new, path)
    os.replace(old, new)


def check_start(args, script: str, model: str, num_steps: int) -> tuple[str, str, int] | None:
    """Before anything starts: the wandb login and a new run's --output-dir (None), or --resume
    checked against the script, --model, LoRA flags and --num-steps: (run_dir, checkpoint, step)."""
    getattr(args, "check_together", lambda: None)()  # the shared groups' flags (common/flags.py)
    check_tracking(args.track)
    if not args.resume:
        return check_output_dir(args.output_dir)
    run_dir, checkpoint, step = find_checkpoint(args.resume)
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        why = type(e).__name__
        raise InputError(f"--resume: {run_dir}/config.json is unreadable ({why})") from None
    made_by = config.get("script") or os.path.basename((config.get("argv") or ["?"])[0])
    if made_by != script:
        raise InputError(f"--resume: {run_dir} was made by {made_by}, not {script}")
    if (made_with := config["args"].get("model")) != model:
        raise InputError(f"--resume: the run was made with --model {made_with}, not {model}")
    saved = config["args"]  # LoRA: the same adapters (shape, scale); a full fine-tuning run: none
    if (rank := saved.get("lora_rank", 0) or 0) != getattr(args, "lora_rank", 0):
        lora_run = f"trained LoRA adapters of rank {rank}: pass --lora-rank {rank}"
        what = lora_run if rank else "fine-tuned the full model: leave out --lora-rank"
        raise InputError(f"--resume: the run {what}")
    was, modules = argparse.Namespace(**saved), lambda a: ",".join(sorted(set(lora.targets(a))))
    if rank:  # the same adapters: their scale, their modules (a set: in any order)
        alphas = f"{lora.alpha(was):g}", f"{lora.alpha(args):g}"
        targets = modules(was), modules(args)
        for flag, (theirs, mine) in (("--lora-alpha", alphas), ("--lora-target-modules", targets)):
            if theirs != mine:
                raise InputError(f"--resume: the run was made with {flag} {theirs}, not {mine}")
    lock_run_dir(run_dir)
    if step >= num_steps:
        raise InputError(
            f"--resume: the checkpoint is at step {step}, not before --num-steps "
            f"{num_steps}: pass a larger --num-steps to continue it"
        )
    check(checkpoint)
    check_output_dir(run_dir)
    where = os.path.relpath(checkpoint, os.path.dirname(run_dir))
    print(f"resume: from {where}, step {step} of {num_steps}", flush=True)
    return run_dir, checkpoint, step


def keep_run_settings(args, given: set[str], script: str) -> None:
    """--resume: a flag not given keeps what the run's command lines gave it (config.json's argv,
    then config.resume_N.json's up to the step); what a resume changes is printed (lists: sets)."""
    try:
        run_dir, _, step = find_checkpoint(args.resume)
        found = [re.fullmatch(r"config\.resume_(\d+)\.json", n) for n in os.listdir(run_dir)]
        steps = sorted(int(m[1]) for m in found if m and int(m[1]) <= step)
        names = ["config.json"] + [f"config.resume_{n}.json" for n in steps]
        configs = [json.load(open(os.path.join(run_dir, name))) for name in names]
    except (InputError, OSError, ValueError):
        return
    if configs[0].get("script") not in (None, script):
        return
    saved = configs[-1].get("args", {})
    kept = set().union(*(flag_names(config.get("argv", [])[1:]) for config in configs))
    fields = {f.name for f in dataclasses.fields(args)} - {"resume", "output_dir"}  # the run's dir
    kept = sorted(kept & fields & set(saved) - given)
    for name in kept:
        setattr(args, name, saved[name])

    def shown(name, value):  # as a command line gives it: --lr 0.001, --no-save-final
        flag = ("--no-" if value is False else "--") + name.replace("_", "-")
        return flag if isinstance(value, bool) else f"{flag} {value}"

    norm = lambda v: set(map(str.strip, v.split(","))) if isinstance(v, str) else v  # noqa: E731
    was = lambda n: shown(n, saved[n]) if isinstance(saved[n], bool) else saved[n]  # noqa: E731
    now = {n: json.loads(json.dumps(getattr(args, n))) for n in sorted(given & fields & set(saved))}
    changed = [f"{shown(n, v)} (was {was(n)})" for n, v in now.items() if norm(v) != norm(saved[n])]
    if kept:
        print("resume: keeps the run's own " + ", ".join(shown(n, saved[n]) for n in kept))
    if changed:
        print("resume: changes " + ", ".join(changed))


def flag_names(argv: list[str]) -> set[str]:
    """The Args fields a command line gives (--no-x: x)."""
    names = {a.partition("=")[0][2:].replace("-", "_") for a in argv if a.startswith("--")}
    return {n[3:] if n.startswith("no_") else n for n in names}


def find_checkpoint(path: str) -> tuple[str, str, int]:
    """`--resume` (a run dir, its step_N or final) -> (run_dir, checkpoint, step). A run dir resumes
    from its newest checkpoint: one without optimizer state is never rewound to an older one."""
    path = os.path.abspath(path.rstrip("/"))
    if os.path.isdir(folder := os.path.join(path, "checkpoints")):
        names = [n for n in os.listdir(folder) if n[0] != "." and n != "best"]  # not partial
        found = {n: s for n in names if (s := checkpoint_step(os.path.join(folder, n))) is not None}
        if not found:
            raise InputError(f"--resume: {path} has no checkpoint to resume from")
        newest = max(found, key=lambda name: (found[name], name == "final"))
        resumable = [n for n in found if os.path.isfile(f"{folder}/{n}/trainer_state.pt")]
        if newest not in resumable:
            why = f"its newest checkpoint, {newest} (step {found[newest]}), has no optimizer state"
            if (older := max(resumable, key=found.get, default=None)) is None:
                raise InputError(f"--resume: {path}: {why} (save with --save-every to resume)")
            redo = f"resuming from {older} would redo steps {found[older] + 1}-{found[newest]}"
            raise InputError(
                f"--resume: {path}: {why}; {redo} and replace it: pass {folder}/{older} to do that"
            )
        path = os.path.join(folder, newest)
    if (step := checkpoint_step(path)) is None or not os.path.isfile(f"{path}/trainer_state.pt"):
        what = "a run dir or a checkpoint folder with trainer_state.pt"
        raise InputError(f"--resume: {path} is not {what}")
    return os.path.dirname(os.path.dirname(path)), path, step


def checkpoint_step(folder: str) -> int | None:
    """A folder's step: its checkpoint.json (written last, by `staged`), a step_N name, or None."""
    try:
        with open(os.path.join(folder, "checkpoint.json")) as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        name = os.path.basename(folder)
        return int(name[5:]) if re.fullmatch(r"step_\d+", name) else None


def check(folder: str) -> None:
    """A --resume checkpoint is whole: its weights or LoRA adapters, and trainer_state.pt (zip)."""
    adapter = os.path.join(folder, lora.ADAPTER, "adapter_model.safetensors")
    if not os.path.isdir(os.path.dirname(adapter)):
        check_weights(folder, "--resume: checkpoint")
    elif not os.path.isfile(adapter) or not whole_file(adapter):
        raise InputError(f"--resume: {adapter} is missing or truncated")
    if not zipfile.is_zipfile(os.path.join(folder, "trainer_state.pt")):
        raise InputError(f"--resume: {folder}/trainer_state.pt is truncated or not a checkpoint")


# ---- --best-metric ----
def keep_best(args, run, metrics: dict, step: int, trainers: list) -> None:
    """An evaluation better than checkpoints/best's (its checkpoint.json) replaces it by the
    trainers' weights (θ_ema in ema/ with --ema-beta), swapped in whole (checkpoint.staged): a
    kill at any moment leaves the old best or the new one."""
    if not args.best_metric or not any(k.startswith("eval/") for k in metrics):
        return
    if (value := metrics.get(args.best_metric)) is None:
        given = ", ".join(sorted(k for k in metrics if k.startswith("eval/")))
        raise InputError(f"--best-metric {args.best_metric}: this run evaluates {given}")
    path = run.checkpoint_dir("best")
    try:
        with open(os.path.join(path, "checkpoint.json")) as f:
            held = json.load(f)["value"]
    except (OSError, ValueError, KeyError):
        held = None
    worse = held is not None and (value <= held if args.best_mode == "max" else value >= held)
    if worse or value != value:  # a tie keeps the earlier one; NaN is never the best
        return
    with staged(path, step, metric=args.best_metric, value=value) as folder:
        call(trainers, "save", folder, step, with_optimizer=False)
    run.print(f"best: {args.best_metric} {value:.4g} at step {step}, in checkpoints/best")


def finish(args, run, trainers, first: dict, last: dict, lines: dict[str, str], save=None) -> None:
    """The end of every script's main: checkpoints/final in HF format (resumable too with
    --save-every: a finished run can be extended with a larger --num-steps), a line for each metric
    of `lines` from the first evaluation to the last, the run's logs closed, Ray shut down.
    `save(step, name, with_optimizer)`: a script's own (ppo.py's: the critic too)."""
    if args.save_final:
        resumable = args.save_every > 0
        if save:
            save(args.num_steps, "final", resumable)
        else:
            with staged(run.checkpoint_dir("final"), args.num_steps) as folder:
                call(trainers, "save", folder, args.num_steps, with_optimizer=resumable)
        run.print(f"final model: {run.checkpoint_dir('final')}")
    for key, what in lines.items():
        if first and key in first and key in last:
            run.print(f"{what}: {first[key]:.3f} -> {last[key]:.3f}")
    run.close()
    ray.shutdown()
