"""verl's TinkerTrainingWorker on a Ray worker group: the real ``Workers`` of the training loop.

GPUs (nccl, bf16) when the device is cuda; CPU gloo workers otherwise, through the platform plugin in
``tinker_exp.runtime.cpu_platform``. The device, precision and attention are chosen in ``tinker_exp.runtime.device``.
The loop talks to :class:`TinkerWorkers` through the ``Workers`` protocol.

Two round trips a step: forward_backward, then optimizer_step (which brings the param groups back too). No
optimizer_zero_grad: verl's optimizer_step zeroes the grads on exit (its train_mode(zero_grad_on_exit=True), on
an error as well), reset() and load_checkpoint() leave none, and infer_batch runs under no_grad; so every
forward_backward starts from no grads, which tests/test_resume.py checks on the live workers.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import threading
import warnings
from contextlib import contextmanager
from functools import cache, partial
from platform import node as platform_node
from pathlib import Path
from typing import Any, Iterator

from tinker_exp.config import BackendConfig, LoraConfig, OptimizerConfig, TrainerConfig
from tinker_exp.optim.convert import OVERRIDE_KEYS
from tinker_exp.optim.optimizers import SCHEDULED_LR, spec_of, verl_optimizer_fields
from tinker_exp.runtime import lora as lora_adapters
from tinker_exp.runtime.device import DeviceChoice, check_gpus, check_placement
from tinker_exp.runtime.ray_cluster import start_ray, wait_for_nodes
from tinker_exp.runtime.worker_output import WorkerOutput
from tinker_exp.train.protocols import StepResult
from tinker_exp.errors import WorkersStartError
from tinker_exp.train.signals import cleanup_wait

log = logging.getLogger(__name__)

CPU_PLATFORM_ENV = {
    "VERL_USE_EXTERNAL_MODULES": "tinker_exp.runtime.cpu_platform",  # verl imports it at `import verl`
    # verl's own override of the engine-registry lookup; the FSDP engine code is device-agnostic.
    "VERL_ENGINE_DEVICE": "cuda",
}
VERL_PLATFORMS = {"cpu": "cpu", "cuda": "nvidia"}
"""backend device -> verl's platform name (VERL_PLATFORM)."""
DEVICE_ENV = "TINKER_EXP_DEVICE"
"""The device each worker must find verl resolved to (checked in the worker)."""


def platform_env(device: str) -> dict[str, str]:
    """Environment for the driver and every worker; set before verl is imported anywhere.

    The platform is named for cuda too: an earlier CPU run in this process (a test session, an in-process sweep) leaves
    VERL_PLATFORM=cpu in os.environ, which the workers would inherit."""
    env = {**(CPU_PLATFORM_ENV if device == "cpu" else {}), "VERL_PLATFORM": VERL_PLATFORMS[device], DEVICE_ENV: device}
    # Offline W&B must never look anything up, in workers too.
    for key in ("WANDB_MODE", "WANDB_ERROR_REPORTING", "TMPDIR"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def use_platform(device: str) -> None:
    """Make the driver's verl resolve `device`'s platform (the placement groups' bundles follow it).

    verl caches its platform for the life of the process: one resolved for an earlier run is replaced."""
    os.environ.update(platform_env(device))
    if device == "cpu":
        import tinker_exp.runtime.cpu_platform  # noqa: F401  (registers it even if verl was imported earlier)
    from verl.plugin.platform import PlatformRegistry, get_platform, set_platform

    if get_platform().device_name != device:
        set_platform(PlatformRegistry.get(VERL_PLATFORMS[device])())
    check_platform(device)


def check_platform(device: str) -> None:
    from verl.plugin.platform import get_platform

    resolved = get_platform()
    if resolved.device_name != device:
        raise RuntimeError(f"verl resolved the platform {type(resolved).__name__} ({resolved.device_name}), not {device}")


def start_process_group() -> None:
    """In a worker, before verl's: the platform asked for, and on CPU the gloo process group."""
    import torch
    import torch.distributed as dist
    from verl.utils.device import get_device_name

    check_platform(os.environ[DEVICE_ENV])  # the platform asked for, not one inherited from elsewhere
    if get_device_name() == "cpu" and not dist.is_initialized():
        # verl would ask for "cpu:gloo,cpu:gloo" (duplicate device type); it skips its own
        # init when a process group exists.
        dist.init_process_group(backend="gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        torch.set_num_threads(1)  # one core per worker; oversubscription makes gloo crawl


def engine_device_info(engine: Any) -> dict[str, Any]:
    """Where a rank runs: verl's platform, the torch device of its parameters, the visible GPUs."""
    import ray
    import torch
    from verl.utils.device import get_device_name

    parameter = next(engine.module.parameters())
    info = {"platform": get_device_name(), "parameters": str(parameter.device), "pid": os.getpid()}
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.current_device()
        info["visible"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    info["attention"] = getattr(getattr(engine.module, "config", None), "_attn_implementation", None)
    # the Ray node (and, under Slurm, the node's name): each rank of a multi-node run on a node of its own
    info["node"] = (ray.get_runtime_context().get_node_id(), os.environ.get("SLURMD_NODENAME") or platform_node())
    return info


def param_group_values(engine: Any) -> list[dict[str, Any]]:
    """The override keys each of the engine's optimizer param groups holds: the read-back of optimizer_step.

    With the lr its last step applied where the optimizer scales it itself (SCHEDULED_LR: schedule-free's warmup)."""
    from verl.workers.engine_workers_tinker import _iter_optimizer_param_groups

    groups = _iter_optimizer_param_groups(engine.optimizer)
    return [{key: group[key] for key in (*OVERRIDE_KEYS, SCHEDULED_LR) if key in group} for group in groups]


def optimizer_step_with_clip(step: Any, engine: Any, optim_step_params: dict[str, Any] | None) -> dict[str, Any]:
    """verl's optimizer_step (`step`, called with the params) at this step's grad_clip_norm, then the param groups.

    verl's engine clips with its config's clip_grad (fixed when built; a 0 there would zero every gradient): a
    grad_clip_norm sent with the step replaces it for this step only (0, Tinker's "no clipping": inf), so the step is
    the very one an engine built with that clip takes. The clip the engine held during the step joins every group's
    read-back as grad_clip_norm (0.0 for none), for the loop's applied == requested check. Nothing sent: verl's call
    as it is."""
    params = dict(optim_step_params or {})
    clip = params.pop("grad_clip_norm", None)
    if clip is None:
        metrics = step(optim_step_params)
        return {**metrics, "param_groups": param_group_values(engine)}
    config = engine.optimizer_config
    built = config.clip_grad
    config.clip_grad = clip if clip > 0 else math.inf
    try:
        metrics = step(params or None)
        used = config.clip_grad
    finally:
        config.clip_grad = built
    applied = float(used) if math.isfinite(used) else 0.0
    return {**metrics, "param_groups": [{**group, "grad_clip_norm": applied} for group in param_group_values(engine)]}


def engine_tensors(engine: Any) -> list:
    """Every tensor of the engine's model that training or a build sets: parameters (each rank's shards), buffers."""
    return [*engine.module.parameters(), *engine.module.buffers()]


def reshard(module: Any) -> None:
    """Every FSDP2 module of `module` back to its shards; values are unchanged, the gathered copies freed.

    With backend.reshard_after_forward off (the CPU default) FSDP2 keeps a layer's gathered parameters from its forward
    to its backward; a forward with no backward (an evaluation) leaves them gathered, registered in place of the shards:
    what writes the shards then (a pool's fresh start, schedule-free's move to its averaged weights and back) would not
    reach the next forward, which reuses them."""
    from torch.distributed.fsdp import FSDPModule

    for part in module.modules():
        if isinstance(part, FSDPModule):
            part.reshard()  # not recursive: hence every module


def keep_initial_state(engine: Any, seed: int) -> dict[str, Any]:
    """What a cold build with `seed` leaves on this rank: a copy of its weights (on their device) and torch's RNG.

    Kept so that a later run starts from exactly there without building again (`restore_initial_state`)."""
    import torch

    with torch.no_grad():
        tensors = [t.detach().clone() for t in engine_tensors(engine)]
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return {"seed": seed, "tensors": tensors, "rng": torch.get_rng_state(), "cuda_rng": cuda}


def restore_initial_state(engine: Any, kept: dict[str, Any], optimizer_config: Any) -> None:
    """Put this rank back as a cold build left it (`kept`), with a new optimizer and lr scheduler and no gradients.

    The optimizer (zero state) and lr scheduler are built from `optimizer_config` as verl's engine builds them."""
    import torch

    with torch.no_grad():
        for tensor, initial in zip(engine_tensors(engine), kept["tensors"], strict=True):
            tensor.copy_(initial)
    for parameter in engine.module.parameters():
        parameter.grad = None  # a run stopped between forward_backward and optimizer_step leaves some
    engine.optimizer_config = optimizer_config
    engine.optimizer = engine._build_optimizer(engine.module)
    engine.lr_scheduler = engine._build_lr_scheduler(engine.optimizer)
    engine.checkpoint_manager.optimizer, engine.checkpoint_manager.lr_scheduler = engine.optimizer, engine.lr_scheduler
    torch.set_rng_state(kept["rng"])
    if kept["cuda_rng"] is not None:
        torch.cuda.set_rng_state_all(kept["cuda_rng"])


def fresh_engine(engine: Any, kept: dict[str, Any] | None, optimizer_config: Any, seed: int) -> dict[str, Any]:
    """A run's start on a kept engine, exactly a cold one's; returns what is kept now.

    Restored from the copy kept at the build when the seed is the build's, else built again from the model dir (the seed
    draws LoRA's initial matrices)."""
    import torch

    if kept is not None and kept["seed"] == seed:
        restore_initial_state(engine, kept, optimizer_config)
        return kept
    engine.optimizer_config = optimizer_config
    torch.manual_seed(seed)  # as a cold worker's reset
    engine.initialize()
    lora_adapters.start_trial(engine.module, seed)
    return keep_initial_state(engine, seed)


def worker_extras(mesh: str):
    """What every worker class of this project adds to its verl base, in one place.

    `mesh`: the dispatch mesh of the base's forward_backward, "train" or "actor". The extras: gloo start-up on CPU, the
    kept initial state of a pool's group, metrics-only forward_backward results, the optimizer step at the step's clip
    with the param groups read back, the device report, the LoRA and full-weight exports, schedule-free's averaged
    weights, and the slots (runtime/slots.py). A class puts it first among its bases and says where its engine is
    (`_trained_engine`), its build seed (`_build_seed`) and how verl runs a forward_backward
    (`_verl_forward_backward`)."""
    from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
    from verl.utils import tensordict_utils as tu

    from tinker_exp.runtime.slots import WorkerSlots

    class WorkerExtras:
        per_token_losses: tuple = ()
        """The class's own losses that a packed step may sum per slot, besides verl's sft_loss (packed.py `refusal`)."""

        def __init__(self, *args, **kwargs):
            start_process_group()
            super().__init__(*args, **kwargs)
            self.kept = None  # a pool's group: the start every run restores (keep_initial_state)
            self.slots: WorkerSlots | None = None  # a slot group's trials (enable_slots)

        def _trained_engine(self) -> Any:
            raise NotImplementedError

        def _trained_model_config(self) -> Any:
            """verl's model config of the trained engine (its layout: use_remove_padding)."""
            return self.model_config

        def _installed_loss(self) -> Any:
            """The loss its forward_backward calls: what a packed step would sum per slot (packed.py `refusal`)."""
            return getattr(self, "loss_fn", None)

        def _build_seed(self) -> int:
            raise NotImplementedError

        def _verl_forward_backward(self, data):
            raise NotImplementedError

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def keep_initial_state(self) -> None:
            """On a pool's group, right after its build: the start every later run restores (`fresh_state`)."""
            self.kept = keep_initial_state(self._trained_engine(), self._build_seed())

        @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name=mesh), blocking=False)
        def forward_backward(self, data):
            # verl keeps and returns every token's log-prob (its Tinker API hands them to the client); the loop
            # uses only the metrics, so only they travel back to the driver.
            output = self._verl_forward_backward(data)
            if output is None:
                return None
            return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": output.get_non_tensor("metrics")})

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def device_info(self) -> dict[str, Any]:
            return engine_device_info(self._trained_engine())

        def _param_group_values(self) -> list[dict[str, Any]]:
            return param_group_values(self._trained_engine())

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def param_group_values(self) -> list[dict[str, Any]]:
            return self._param_group_values()

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def optimizer_step(self, optim_step_params=None) -> dict:
            # verl's step at this step's clip, then the values the groups hold: one round trip gives both.
            verl_step = super().optimizer_step
            step = lambda params: verl_step(optim_step_params=params)  # noqa: E731
            return optimizer_step_with_clip(step, self._trained_engine(), optim_step_params)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def export_adapter(self, folder: str) -> int | None:
            return lora_adapters.export_adapter(self._trained_engine().module, folder)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def export_weights(self) -> dict[str, Any] | None:
            """The full tensors (every rank joins the all-gathers); rank 0 returns them, the others None."""
            generator, _ = self._trained_engine().get_per_tensor_param()
            full = {name: tensor.detach().to("cpu").clone() for name, tensor in generator}
            return full if self.rank == 0 else None

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def averaged_weights(self, on: bool) -> None:
            """Schedule-free's averaged weights in the parameters (on), or its training point back, bitwise (off)."""
            optimizer = self._trained_engine().optimizer
            optimizer.to_averaged() if on else optimizer.to_training()

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def enable_slots(self) -> str | None:
            """Make this rank hold slots from now on (runtime/slots.py), none filled yet.

            Returns why their steps cannot be packed (runtime/packed.py `refusal`), or None."""
            from tinker_exp.runtime.packed import refusal

            self.slots = WorkerSlots(self._trained_engine())
            padding_free = bool(self._trained_model_config().get("use_remove_padding", False))
            return refusal(self._trained_engine(), self._installed_loss(), padding_free, self.per_token_losses)

        @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name=mesh), blocking=False)
        def slots_forward_backward(self, data):
            """One packed forward and backward of several slots' rows (runtime/packed.py): slot index -> its loss.

            The batch's `slots_forward_only`: their evaluation (verl's infer_batch: eval mode, no gradient);
            `slots_log_probs`: every row's log-probs back too, in the batch's row order (the Tinker server's)."""
            import torch

            forward_only = bool(tu.pop(data, key="slots_forward_only", default=False))
            log_probs = bool(tu.pop(data, key="slots_log_probs", default=False))
            done = self._swapping().packed_forward_backward(self, self.loss_fn, data, forward_only, log_probs)
            reshard(self._trained_engine().module)
            losses = {index: loss for index, (loss, _) in done.items()}
            rows = {"log_probs": torch.nested.as_nested_tensor([row for _, each in done.values() for row in each.unbind()],
                                                               layout=torch.jagged)} if log_probs else {}
            return tu.get_tensordict(tensor_dict=rows, non_tensor_dict={"slot_losses": losses})

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def slots_optimizer_step(self, steps: list) -> list[dict]:
            """Each (slot index, optim_step_params) of `steps` in turn: the slot loaded, then its optimizer step.

            The slot is loaded with its pending gradients; its optimizer step runs at its own values and clip
            (`optimizer_step`'s result)."""
            results = []
            for index, optim_step_params in steps:
                self._swapping().load(index)
                results.append(self.optimizer_step(optim_step_params=optim_step_params))
            return results

        def _swapping(self) -> WorkerSlots:
            reshard(self._trained_engine().module)  # the shards are what a swap reads and writes
            return self.slots

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def slot_fill(self, index: int, optimizer_config, seed: int) -> None:
            self._swapping().fill(index, optimizer_config, seed)

        # Waited for, not sent ahead of the slot's call: the RL worker is an asyncio actor (verl's update_weights is
        # async), whose calls Ray does not run in the order they were sent, so a swap sent ahead could run after that
        # call (an RL trial on slots then sampled from another slot's adapter: seen in CI).
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def slot_load(self, index: int) -> None:
            self._swapping().load(index)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def slot_free(self, index: int) -> None:
            self.slots.free(index)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def slot_copy(self, source: int, target: int, keep_config: bool = False, kept: bool = False) -> None:
            self._swapping().copy(source, target, keep_config, kept)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def slot_keep(self, index: int) -> None:
            self._swapping().keep(index)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def slot_memory(self) -> dict[int, int]:
            return self.slots.memory()

    return WorkerExtras


def _worker_class():
    import torch
    from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
    from verl.workers.engine_workers_tinker import TinkerTrainingWorker

    class TinkerExpWorker(worker_extras("train"), TinkerTrainingWorker):
        """verl's worker with this project's extras (`worker_extras`).

        Its seeded reset and the evaluation's forward pass too."""

        def _trained_engine(self) -> Any:
            return self.engine

        def _build_seed(self) -> int:
            return self.engine_config.seed

        def _verl_forward_backward(self, data):
            return TinkerTrainingWorker.forward_backward(self, data)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def reset(self):
            # Ray's workers start with a random torch seed, and verl seeds only under full_determinism: the build's
            # own draws (peft's, replaced by start_trial's) agree from run to run.
            torch.manual_seed(self.engine_config.seed)
            built = TinkerTrainingWorker.reset(self)
            lora_adapters.start_trial(self.engine.module, self.engine_config.seed)
            return built

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def fresh_state(self, optimizer_config, seed: int) -> None:
            """A pool's run starts here: the engine as a cold build with `seed` leaves it, a new optimizer."""
            self.kept = fresh_engine(self.engine, self.kept, optimizer_config, seed)
            self.optimizer_config = optimizer_config

        @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="train"), blocking=False)
        def infer_batch(self, data):
            # between calls the parameters are always the shards (`reshard`), evaluations included
            output = TinkerTrainingWorker.infer_batch(self, data)
            reshard(self.engine.module)
            return output

    return TinkerExpWorker


def _loss(output: Any) -> float:
    """The loss verl reports for a batch: already all-reduced over the ranks (each rank's copy is the same)."""
    metrics = output["metrics"] if isinstance(output, dict) else output.get_non_tensor("metrics")
    loss = metrics["loss"]
    return float(sum(loss) / len(loss)) if isinstance(loss, list) else float(loss)


def worker_config(
    backend: BackendConfig,
    optimizer: OptimizerConfig,
    trainer: TrainerConfig,
    model_path: str,
    optimizer_values: dict[str, Any],
    choice: DeviceChoice,
    lora: LoraConfig | None = None,
):
    """verl's TrainingWorkerConfig for every rank (`lora`: None for full fine-tuning)."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig, TrainingWorkerConfig

    from tinker_exp.runtime.device import throughput

    lora = lora if lora is not None and lora.rank > 0 else None
    knobs = throughput(backend, choice.device, optimizer.name.value, choice.attention)  # docs/devices.md#throughput-knobs
    optimizer_fields = verl_optimizer_fields(optimizer.name.value, optimizer_values)
    if optimizer_fields["optimizer_impl"] == "tinker_exp.runtime.muon":  # it splits the model by parameter name
        from tinker_exp.runtime.muon import parameter_names

        optimizer_fields["override_optimizer_config"]["param_names"] = parameter_names(model_path)
    optimizer_fields["override_optimizer_config"].update(knobs.optimizer_kernel)  # fused / foreach (torch's own keys)
    tokens = knobs.micro_batch_tokens or None
    return TrainingWorkerConfig(
        model_type="language_model",
        model_config=HFModelConfig(
            path=model_path,
            override_config={"attn_implementation": choice.attention},
            enable_gradient_checkpointing=knobs.gradient_checkpointing,
            use_remove_padding=knobs.padding_free,
            use_liger=choice.liger,  # its fused cross-entropy off (verl's own choice)
            use_fused_kernels=knobs.fused_lm_head,  # its torch backend: log-probs 512 tokens at a time
            fused_kernel_options={"impl_backend": "torch"} if knobs.fused_lm_head else {},
            **lora_adapters.model_config_fields(lora),
        ),
        engine_config=FSDPEngineConfig(
            strategy=backend.strategy,
            use_dynamic_bsz=tokens is not None,  # micro batches by tokens
            max_token_len_per_gpu=tokens,
            infer_max_token_len_per_gpu=tokens,
            micro_batch_size_per_gpu=backend.micro_batch_size,
            infer_micro_batch_size_per_gpu=backend.micro_batch_size,  # validation (infer_batch)
            mixed_precision={"param_dtype": choice.precision, "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
            use_torch_compile=knobs.torch_compile,
            reshard_after_forward=knobs.reshard_after_forward,
            seed=trainer.seed,
        ),
        # Built from the converted values: the param groups hold exactly float and tuple, so verl's
        # strict check at the worker agrees with ours.
        optimizer_config=FSDPOptimizerConfig(
            **optimizer_fields,
            clip_grad=optimizer.max_grad_norm,  # 0 or null (no clipping): inf
            lr_scheduler_type="constant",  # the client owns the schedule (optimizer_step never steps it)
            total_training_steps=int(trainer.steps),
        ),
        # LoRA: adapters and their optimizer state only; reset() rebuilds the frozen base from the model dir.
        checkpoint_config=CheckpointConfig(save_lora_only=lora is not None),
    )


def port_taken(error: BaseException) -> bool:
    """Whether a worker's start failed because its rendezvous address was in use.

    Rank 0's TCPStore could not bind (torch's DistNetworkError, EADDRINUSE, as Ray reports the actor's death)."""
    text = str(error)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def free_port() -> str:
    """A port the OS says is free on this machine (bound, read, closed: not held, as verl's own picker)."""
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return str(s.getsockname()[1])


def local_rendezvous(ray) -> dict[str, str]:
    """Rank 0's rendezvous (master_addr, master_port) picked here, where the cluster is this machine alone; else {}.

    verl otherwise asks a Ray task on rank 0's node for them (`get_master_addr_port`), which takes a Ray worker
    process of its own for each group started (about 1.3 CPU-s and a second of a 2-core machine's cold start). On one
    node that node is this one: the same answer, without the task. Several nodes: verl's task, on rank 0's."""
    nodes = [node for node in ray.nodes() if node["Alive"]]
    here = ray.util.get_node_ip_address()
    if len(nodes) != 1 or nodes[0]["NodeManagerAddress"] != here:
        return {}
    return {"master_addr": here.strip("[]"), "master_port": free_port()}


@cache
def with_rendezvous(group_class: type) -> type:
    """verl's worker group class, taking rank 0's rendezvous as `rendezvous` ({}: verl's own task picks it).

    verl 0.9.1's RayWorkerGroup takes master_addr/master_port but its base class's constructor sets them back to None
    before the group is built: given here where verl asks for them, instead."""

    class GivenRendezvous(group_class):
        def __init__(self, *args: Any, rendezvous: dict[str, str], **kwargs: Any) -> None:
            self._rendezvous = rendezvous
            super().__init__(*args, **kwargs)

        def _get_master_addr_port(self, *args: Any, **kwargs: Any) -> Any:
            if self._rendezvous and self._master_addr is None:
                self._master_addr, self._master_port = self._rendezvous["master_addr"], self._rendezvous["master_port"]
            return super()._get_master_addr_port(*args, **kwargs)

    return GivenRendezvous


class TinkerWorkers:
    """A Ray worker group of TinkerTrainingWorkers with one FSDP2 engine over all ranks.

    Built in two parts, so that the driver's own start-up work overlaps the workers': the constructor returns once
    every worker is asked to build its model; `ready()` waits for them."""

    def __init__(
        self,
        backend: BackendConfig,
        optimizer: OptimizerConfig,
        trainer: TrainerConfig,
        model_path: str,
        optimizer_values: dict[str, Any],
        device: str | DeviceChoice,
        output: WorkerOutput | None = None,
        lora: LoraConfig | None = None,
    ):
        """Ask every worker to build its model (`ready()` waits for them).

        `device`: the resolved choice, or a device name (its precision and attention resolved here); `output`: where
        what the workers print goes (None: the terminal, as Ray prints it); `lora`: None or rank 0 for full
        fine-tuning."""
        if isinstance(device, str):
            from dataclasses import replace

            from tinker_exp.config.schema import Device
            from tinker_exp.runtime.device import resolve

            device = resolve(replace(backend, device=Device(device)))
        self.choice = device
        self.device = device.device
        self.backend, self.model_path = backend, model_path
        self.nodes = backend.nodes
        self.lora = lora if lora is not None and lora.rank > 0 else None
        self.output = output
        self.averaged = spec_of(optimizer.name.value).averaged  # evaluations and exports at averaged weights
        self.pending: list = []  # reset and set_loss_fn, under way until ready()
        env = platform_env(self.device)
        use_platform(self.device)  # the driver's verl too: it sizes the placement groups' bundles
        # verl's worker modules and the model config, before ray.init: once Ray's daemons and prestarted workers
        # are up they compete with this import for the CPU (about 1.5 s later on 2 cores).
        worker_cls = self.worker_class()
        worker_config = self._worker_config(backend, optimizer, trainer, model_path, optimizer_values)
        import ray

        # A cluster we start is ours to stop; one we join (address, or already initialized) is shared.
        self.owns_ray = not ray.is_initialized() and not backend.ray_address
        if not ray.is_initialized():
            start_ray(backend.ray_address, env)
        self.pool = self.group = None
        self._start_args = (ray, backend, worker_cls, worker_config, env)  # a start again on a new port (ready())
        if output is not None:
            output.start()
        try:
            wait_for_nodes(backend.nodes, backend.nodes_timeout_s)
            if self.device == "cuda":  # before any placement group: one the cluster cannot hold would wait forever
                check_gpus([node["Resources"].get("GPU", 0) for node in ray.nodes() if node["Alive"]], backend.num_workers, backend.nodes)
            self._start(*self._start_args)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, ray, backend: BackendConfig, worker_cls: type, worker_config: Any, env: dict[str, str]) -> None:
        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

        on_gpu = self.device == "cuda"
        self.pool = pool = RayResourcePool(
            process_on_nodes=[backend.num_workers] * backend.nodes,  # one placement group per node
            use_gpu=on_gpu,
            max_colocate_count=1,  # the default (10) makes each bundle ask for 10 CPUs: it hangs
        )
        init = RayClassWithInitArgs(cls=ray.remote(worker_cls), **self._init_args(worker_config))
        # worker_env reaches the workers even when we join a cluster someone else started.
        self.group = with_rendezvous(RayWorkerGroup)(resource_pool=pool, ray_cls_with_init=init, device_name=self.device,
                                                     worker_env=env, rendezvous=local_rendezvous(ray))  # fmt: skip
        # Each rank builds model, FSDP2 and optimizer; asked now, awaited in ready() (this synchronous actor runs its
        # calls in order; the RL worker, an asyncio actor, is asked one call: rl_workers.py).
        self.pending = self._build_model()

    def _init_args(self, worker_config: Any) -> dict[str, Any]:
        """The keyword arguments each rank's worker is built with."""
        return {"config": worker_config}

    def _build_model(self) -> list:
        """Ask every rank to build its model, optimizer and loss; returns the Ray refs ready() waits on."""
        from verl.workers.utils.losses import sft_loss

        return [
            *self.group.execute_all_async("reset"),
            *self.group.execute_all_async("set_loss_fn", partial(sft_loss, config=None)),
        ]

    def ready(self) -> None:
        """Wait until every worker has built its model, then check where each rank's model sits.

        A worker's start-up error is raised here. Each rank's model must sit where it was asked to (its own GPU on
        cuda).

        The rendezvous port picked (local_rendezvous, or verl's get_master_addr_port on several nodes: one the OS says
        is free on rank 0's node, closed again) is
        not held: on a busy machine another process may take it before rank 0 binds it (EADDRINUSE). The group is then
        started once more, on a new port; a second clash is one line (WorkersStartError) saying so."""
        import ray

        pending, self.pending = self.pending, []
        if not pending:
            return
        try:
            ray.get(pending)
        except Exception as e:
            if not port_taken(e):
                raise
            port = getattr(self.group, "master_port", None)
            log.warning(f"workers: the rendezvous port {port} was taken by another process before rank 0 bound it "
                        "(EADDRINUSE); starting the worker group again on a new port")  # fmt: skip
            self._free_group()
            self._start(*self._start_args)
            pending, self.pending = self.pending, []
            try:
                ray.get(pending)
            except Exception as again:
                if port_taken(again):
                    raise WorkersStartError(
                        f"the workers' rendezvous port was taken by another process twice (EADDRINUSE, ports {port} and "
                        f"{getattr(self.group, 'master_port', None)}): a busy machine; the same command starts again"
                    ) from again
                raise
        self.placement = check_placement(self.device, self.group.device_info(), self.nodes)
        log.info(f"workers: {self.placement}")

    def say_installed(self) -> None:
        """Say what the workers hold for this run beyond their placement, as they report it (RL: the loss).

        A group lent by a warm pool says it for each run it is lent to."""

    def _free_group(self) -> None:
        """The group's actors and placement groups freed, Ray left running (a start again follows)."""
        import ray

        for worker in self.group.workers if self.group is not None else []:
            ray.kill(worker)
        for placement_group in (self.pool.pgs if self.pool is not None else None) or []:
            ray.util.remove_placement_group(placement_group)
        self.pool = self.group = None

    def worker_class(self) -> type:
        """The Ray actor class of each rank (a test plants an applied/requested mismatch in a subclass)."""
        return _worker_class()

    @property
    def lora_rank(self) -> int:
        return self.lora.rank if self.lora is not None else 0

    def keep_initial_state(self) -> None:
        """A pool's group, once built (after ready()): every rank keeps the start each later run restores."""
        self.group.keep_initial_state()

    def for_run(self, cfg: Any) -> None:
        """Take what another run sets beyond the group's key, for a pool's group lent to it.

        An RL run's loss, taken by the fresh start that follows; an SFT run sets nothing more."""

    def start_fresh(self, optimizer: OptimizerConfig, trainer: TrainerConfig, optimizer_values: dict[str, Any], output: WorkerOutput) -> None:
        """Start a new run on these workers (a pool's), as a cold start with this run's optimizer and seed.

        What they print from now on goes to `output`; each rank's engine is left as a cold start with this run's
        optimizer and seed leaves it (runtime/workers.py `fresh_engine`)."""
        import ray

        if output is not self.output:
            self.output = output
            output.start()
        config = self._worker_config(self.backend, optimizer, trainer, self.model_path, optimizer_values)
        ray.get(self._fresh_state(config, trainer.seed))  # a new optimizer: schedule-free's in train mode
        self.averaged = spec_of(optimizer.name.value).averaged

    def _fresh_state(self, worker_config: Any, seed: int) -> list:
        return self.group.execute_all_async("fresh_state", worker_config.optimizer_config, seed)

    def _worker_config(
        self,
        backend: BackendConfig,
        optimizer: OptimizerConfig,
        trainer: TrainerConfig,
        model_path: str,
        optimizer_values: dict[str, Any],
    ):
        return worker_config(backend, optimizer, trainer, model_path, optimizer_values, self.choice, self.lora)

    def param_group_values(self) -> list[list[dict[str, Any]]]:
        return self.group.param_group_values()

    def optimizer_config_of(self, worker_config: Any) -> Any:
        """verl's optimizer config in a worker config of this group's (`_worker_config`): what a slot's trial is built with."""
        return worker_config.optimizer_config

    def save_checkpoint(self, folder: Path, step: int) -> None:
        """Every rank writes its model, optimizer and extra state (lr scheduler, RNG) into `folder`."""
        self.group.save_checkpoint(local_path=str(folder), global_step=step, max_ckpt_to_keep=None)

    def load_checkpoint(self, folder: Path) -> None:
        """After reset() (done in __init__): a reset after loading would throw the loaded state away."""
        self.group.load_checkpoint(local_path=str(folder))

    def export_adapter(self, folder: Path) -> int:
        """Export the trained adapter in peft's format into `folder`; returns its number of parameters.

        Written aside, then renamed into place."""
        partial = folder.with_name(f".{folder.name}.partial")
        if partial.exists():
            shutil.rmtree(partial)
        with self.averaged_weights():
            parameters = self.group.export_adapter(str(partial))[0]  # returns when every rank is done
        if folder.exists():  # a resumed run that had finished exports again
            shutil.rmtree(folder)
        partial.rename(folder)
        return parameters

    def train_step(self, examples: list, optim_step_params: dict[str, Any] | None) -> StepResult:
        """forward_backward, then optimizer_step(override), which zeroes the grads on its way out.

        verl splits forward_backward into micro batches. The next step starts from no gradients (see the module's
        docstring)."""
        output = self.group.forward_backward(self._batch(examples)).get()
        per_rank = self.group.optimizer_step(optim_step_params=optim_step_params or None)
        loss = _loss(output)
        grad_norm = next((float(r["grad_norm"]) for r in per_rank if "grad_norm" in r), float("nan"))
        return StepResult(loss=loss, grad_norm=grad_norm, applied=[r["param_groups"] for r in per_rank])

    def evaluate(self, examples: list) -> float:
        """The batch's loss, token-weighted (verl's sft_loss), by verl's forward-only path (eval mode, no_grad).

        A schedule-free optimizer's at its averaged weights."""
        with self.averaged_weights():
            return _loss(self.group.infer_batch(self._batch(examples)).get())

    def evaluate_batches(self, batches: list[list]) -> list[float]:
        return [self.evaluate(batch) for batch in batches]

    @contextmanager
    def averaged_weights(self) -> Iterator[None]:
        """Within, a schedule-free optimizer's averaged weights in the parameters.

        The training point is restored bitwise after (an error too); with any other optimizer, nothing."""
        if not self.averaged:
            yield
            return
        self.group.averaged_weights(True)
        try:
            yield
        finally:
            self.group.averaged_weights(False)

    def _batch(self, examples: list):
        import torch
        from verl.utils import tensordict_utils as tu

        def nested(rows: list[list[int]]):
            return torch.nested.as_nested_tensor([torch.tensor(r, dtype=torch.long) for r in rows], layout=torch.jagged)

        ids = [e.input_ids for e in examples]
        return tu.get_tensordict(
            tensor_dict={
                "input_ids": nested(ids),
                "position_ids": nested([list(range(len(r))) for r in ids]),
                "loss_mask": nested([e.loss_mask for e in examples]),
            },
            non_tensor_dict={"temperature": 1.0, "global_token_num": [len(r) for r in ids]},
        )

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Free the workers, within `timeout_s`.

        Bounded: under Slurm, scancel and requeue SIGTERM Ray's own daemons too, and a call to a dead GCS would block
        until Slurm's SIGKILL (then no exit code, no closed logs)."""
        try:
            self._free(timeout_s)
        finally:
            if self.output is not None:
                self.output.stop()

    def _free(self, timeout_s: float) -> None:
        import ray

        if self.owns_ray:
            ray.shutdown()  # stops the daemons we started, and with them the actors: no call to the GCS
            return

        # On a shared cluster: free our actors and placement groups for the next job.
        freeing = threading.Thread(target=self._free_group, name="free-ray-workers", daemon=True)
        freeing.start()
        timeout_s = cleanup_wait(timeout_s)
        freeing.join(timeout_s)
        if freeing.is_alive():
            warnings.warn(f"Ray did not free the workers within {timeout_s:.0f} s (is its cluster gone?)", stacklevel=2)
