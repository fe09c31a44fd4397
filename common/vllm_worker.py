"""vLLM's side of the weight sync: a "gloo" backend for CPU, and a check that updates are whole.
vLLM only warns if an update leaves a weight unset (the layer keeps its memory: after sleep level 2,
garbage); `Whole` makes it fail, naming the first weight, in every backend: "checked-gloo",
"checked-nccl", "checked-ipc" (vLLM's, CUDA-only). Gloo: trainer rank 0 broadcasts to every engine
worker (ranks 1..), both chunking the same metadata alike (only bytes travel)."""

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import ClassVar

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer import base, factory
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
from vllm.model_executor.model_loader import reload

CHUNK_BYTES = 256 * 2**20
KV_SCALES = ("q_scale", "k_scale", "v_scale", "prob_scale")  # checkpoints may lack them
# vLLM's worker class takes it as a base (`worker_extension_cls`): importing this module is its job
WorkerExtension = type("WorkerExtension", (), {})


class Whole:
    """A WeightTransferEngine mixin: an update must set every parameter (KV_SCALES aside)."""

    def start_weight_update(self) -> None:
        super().start_weight_update()
        self.received, load = set(), self.model.load_weights

        def recording_load_weights(weights):  # the model's own, noting the names it set
            names = load(weights)
            self.received.update(names or ())
            return names

        self.model.load_weights = recording_load_weights

    def finish_weight_update(self) -> None:
        del self.model.load_weights  # the class's method again
        super().finish_weight_update()
        expected = {name.replace(".base_layer.", ".") for name, _ in self.model.named_parameters()}
        if missing := sorted(n for n in expected - self.received if not n.endswith(KV_SCALES)):
            named = f"{missing[0]} and {len(missing) - 1} more" if len(missing) > 1 else missing[0]
            raise RuntimeError(
                f"the weight update set {len(expected) - len(missing)} of the "
                f"engine's {len(expected)} weights; missing: {named}"
            )


def gloo_group(address: str, port: int, rank: int, world_size: int) -> dist.ProcessGroup:
    """A gloo group outside torch.distributed's default group (the trainers have their own)."""
    timeout = timedelta(minutes=10)
    store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout)
    store = dist.PrefixStore("posttrain-weights", store)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def chunks(dtypes: list[str], shapes: list[list[int]]) -> list[list[int]]:
    """Parameter indices in runs of one dtype and at most CHUNK_BYTES (a larger tensor alone)."""
    out, size = [], 0
    for i, (dtype, shape) in enumerate(zip(dtypes, shapes)):
        nbytes = getattr(torch, dtype).itemsize * torch.Size(shape).numel()
        if not out or dtypes[out[-1][0]] != dtype or size + nbytes > CHUNK_BYTES:
            out.append([])
            size = 0
        out[-1].append(i)
        size += nbytes
    return out


@dataclass
class GlooInitInfo(base.WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int


@dataclass
class GlooUpdateInfo(base.WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


class GlooWeightTransferEngine(base.WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Inference side: receive packed chunks by broadcast from rank 0, load by layerwise reload."""

    init_info_cls, update_info_cls = GlooInitInfo, GlooUpdateInfo

    def init_transfer_engine(self, info: GlooInitInfo) -> None:
        rank = info.rank_offset + self.parallel_config.rank
        self.group = gloo_group(info.master_address, info.master_port, rank, info.world_size)

    def start_weight_update(self) -> None:
        reload.initialize_layerwise_reload(self.model)  # redoes vLLM CPU's repacking per layer

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on CPU.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, info: GlooUpdateInfo) -> None:
        for idx in chunks(info.dtype_names, info.shapes):
            sizes = [torch.Size(info.shapes[i]).numel() for i in idx]
            flat = torch.empty(sum(sizes), dtype=getattr(torch, info.dtype_names[idx[0]]))
            self.group.broadcast([flat], dist.BroadcastOptions()).wait()
            parts = zip(idx, flat.split(sizes))
            self.model.load_weights([(info.names[i], p.view(info.shapes[i])) for i, p in parts])

    def finish_weight_update(self) -> None:
        reload.finalize_layerwise_reload(self.model, self.model_config)
        # With tied embeddings vLLM CPU keeps a separately packed copy of the LM head; repack it
        # from the reloaded embedding, or logprobs are off by 0.04-2 nats (measured).
        tied = getattr(self.model_config.hf_config, "tie_word_embeddings", False)
        if tied and (lm_head := getattr(self.model, "lm_head", None)) is not None:
            lm_head.quant_method.process_weights_after_loading(lm_head)

    def shutdown(self) -> None:
        self.group = None


@dataclass
class GlooTrainerInitInfo(base.TrainerInitInfo):
    backend: ClassVar[str] = "gloo"
    master_address: str
    master_port: int
    world_size: int


class GlooTrainerWeightTransferEngine(base.TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer side: every rank iterates the source (FSDP gathers are collectives); rank 0 sends."""

    init_info_cls = GlooTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source=None):
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if engine.is_sender:  # the workers wait in init for the whole group: join meanwhile
            addr, port, size = init_info.master_address, init_info.master_port, init_info.world_size
            with ThreadPoolExecutor(max_workers=1) as pool:
                info = asdict(GlooInitInfo(addr, port, 1, size))
                joined = pool.submit(client.init_weight_transfer_engine, info)
                engine.group = gloo_group(addr, port, 0, size)
                joined.result()
        return engine

    def send_weights(self) -> None:
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:  # join the gathers that materialize each full tensor on rank 0
                pass
            return
        dtypes = [str(m.dtype).split(".")[-1] for m in meta]
        info = GlooUpdateInfo([m.name for m in meta], dtypes, [list(m.shape) for m in meta])
        self.client.start_weight_update()
        tensors = iter(self.source)
        with ThreadPoolExecutor(max_workers=1) as pool:  # the workers receive meanwhile
            received = pool.submit(self.client.update_weights, asdict(info))
            for idx in chunks(info.dtype_names, info.shapes):
                flat = torch.cat([next(tensors)[1].detach().reshape(-1) for _ in idx])
                self.group.broadcast([flat], dist.BroadcastOptions()).wait()
            received.result()
        self.client.finish_weight_update()


# The engines' backends (engines.py): ours for CPU, vLLM's for GPUs apart (nccl) or shared (ipc)
for name, cls in [
    ("gloo", GlooWeightTransferEngine),
    ("nccl", NCCLWeightTransferEngine),
    ("ipc", IPCWeightTransferEngine),
]:
    checked = type(f"Checked{cls.__name__}", (Whole, cls), {})
    factory.WeightTransferEngineFactory.register_engine(f"checked-{name}", checked)
factory.WeightTransferTrainerFactory.register_engine("gloo", GlooTrainerWeightTransferEngine)
