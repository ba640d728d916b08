"""Placement on fresh machines: which device a group's collectives serve (asked of the group's backend
table, not its name), prepare's check that the model sits where the group and the rank expect it, and
`hfzero run`'s refusal to start more ranks than visible GPUs. In process: a world-1 gloo group, with the
CUDA host faked by patching what torch reports (no GPU needed)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.run

import hfzero
from hfzero.comm.collectives import Communicator, _default_device
from hfzero.config import ConfigError
from hfzero.devices import parse_backend_config, scratch_device, with_index
from hfzero.runtime.placement import Placement, placement_error
from hfzero.testing.models import tiny_causal_lm


@pytest.fixture
def world1():
    """``init_process_group()`` with no backend (torch calls it "undefined"), one rank, in process."""
    dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _fake_cuda_host(monkeypatch: pytest.MonkeyPatch, config: str) -> None:
    """The group reports ``config`` as its backend table and the current accelerator device is 0."""
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)


def test_backend_config_is_parsed() -> None:
    assert parse_backend_config("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert parse_backend_config("cuda:nccl") == {"cuda": "nccl"}
    assert parse_backend_config("gloo") == {"cpu": "gloo"}


def test_undefined_backend_serves_cuda_with_nccl(world1, monkeypatch: pytest.MonkeyPatch) -> None:
    assert str(dist.get_backend()) == "undefined"
    assert Communicator().device == torch.device("cpu")  # this host: "cpu:gloo" only
    # init_process_group() on a CUDA host: "cpu:gloo,cuda:nccl"; the CUDA model's scratch belongs on the GPU
    _fake_cuda_host(monkeypatch, "cpu:gloo,cuda:nccl")
    assert Communicator().device == torch.device("cuda", 0)
    assert _default_device() == torch.device("cuda", 0)
    _fake_cuda_host(monkeypatch, "cpu:gloo,cuda:gloo")  # gloo stages CUDA tensors through the host: CPU scratch
    assert Communicator().device == torch.device("cpu")


def test_scratch_device_follows_the_backend_serving_the_models_device() -> None:
    """[Note: collective device]: scratch on the model's GPU under NCCL, on the CPU under gloo (fewer copies and
    host waits per step, counted in the Note), on the model's device without a process group."""
    cpu, cuda1 = torch.device("cpu"), torch.device("cuda", 1)
    assert scratch_device(cuda1, parse_backend_config("cuda:nccl")) == cuda1
    assert scratch_device(cuda1, parse_backend_config("cpu:gloo,cuda:nccl")) == cuda1
    assert scratch_device(cuda1, parse_backend_config("cpu:gloo,cuda:gloo")) == cpu  # gloo ranks on a GPU
    assert scratch_device(cuda1, {}) == cuda1  # one process: nothing communicated
    assert scratch_device(cpu, parse_backend_config("cpu:gloo,cuda:nccl")) == cpu


def test_with_index_names_the_current_device() -> None:
    """[Note: device index]: an index-less accelerator device becomes the calling thread's current device."""
    current = {"cuda": 2, "xpu": 5}.get

    def never(device_type: str) -> int:
        raise AssertionError(f"asked for the current {device_type} device")

    assert with_index("cuda", current) == torch.device("cuda", 2)
    assert with_index(torch.device("xpu"), current) == torch.device("xpu", 5)
    assert with_index("lazy", current) == torch.device("lazy")  # no current device to ask
    for device in ("cuda:0", "cpu", "meta"):
        assert with_index(device, never) == torch.device(device)


def test_a_cpu_clip_coefficient_scales_tensors_of_any_device_without_a_copy() -> None:
    """Under gloo the clip coefficient is on the CPU (the scratch device); it scales the gradients as a kernel
    argument: never copied to their device (the old code copied it once per gradient, each a blocking copy)."""
    from hfzero.runtime.tensors import scale_

    moved = []

    class Record(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.to and any(isinstance(a, (torch.device, str)) for a in (*args[1:], *kwargs.values())):
                moved.append(args[1:])
            return func(*args, **kwargs)

    grads = [torch.ones(3), torch.full((2,), 2.0, dtype=torch.bfloat16), torch.empty(4, device="meta")]
    with Record():
        scale_(grads, torch.tensor(0.25))
    assert moved == []
    assert grads[0].tolist() == [0.25] * 3 and grads[1].tolist() == [0.5] * 2 and grads[1].dtype == torch.bfloat16
    assert grads[2].device.type == "meta"


def _where(backends: str = "cuda:nccl", current: int | None = 0, local_rank: int | None = 0,
           local_world: int | None = 1, count: int = 1) -> Placement:
    return Placement(parse_backend_config(backends), current, local_rank, local_world, count)


def test_placement_errors_name_the_fix() -> None:
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert placement_error(cuda0, _where()) is None
    assert placement_error(torch.device("cpu"), _where("cpu:gloo", current=None)) is None
    assert placement_error(torch.device("cpu"), Placement({}, None, None, None, 0)) is None  # no process group
    assert "gloo for cpu" in placement_error(torch.device("cpu"), _where("cuda:nccl"))
    assert "nccl for cuda" in placement_error(cuda0, _where("cpu:gloo"))
    error = placement_error(cuda1, _where(local_rank=1, local_world=2, count=2))
    assert "current device is cuda:0" in error and "set_device_index" in error
    # every rank left on cuda:0 of a 2-GPU host: NCCL's "Duplicate GPU detected" at the first collective
    assert "each rank needs its own device" in placement_error(cuda0, _where(local_rank=1, local_world=2, count=2))
    # one GPU per rank through CUDA_VISIBLE_DEVICES: LOCAL_RANK 1 sees its GPU as cuda:0
    assert placement_error(cuda0, _where(local_rank=1, local_world=2, count=1)) is None
    # gloo ranks sharing one GPU (the CUDA tests' layout) are allowed
    assert placement_error(cuda0, _where("cpu:gloo,cuda:gloo", local_rank=1, local_world=2, count=2)) is None


def test_prepare_checks_placement(world1, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_causal_lm("gpt2")
    hfzero.prepare(model, torch.optim.AdamW(model.parameters()), hfzero.ZeroConfig(stage=1))  # gloo, CPU: fine
    model = tiny_causal_lm("gpt2")
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl")
    with pytest.raises(ConfigError, match=r"model is on cpu but the process group serves cuda:nccl.*gloo for cpu"):
        hfzero.prepare(model, torch.optim.AdamW(model.parameters()), hfzero.ZeroConfig(stage=1))


SCRIPT = str(Path(__file__).resolve().parents[1] / "examples" / "train_clm.py")


@pytest.fixture
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host with one visible GPU, no CPU run requested, and torchrun never actually started."""
    from hfzero.integrations import gpus

    monkeypatch.setattr(gpus, "accelerator_count", lambda: 1)
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)

    def started(*args, **kwargs):
        raise AssertionError("torchrun started")

    monkeypatch.setattr(torch.distributed.run, "run", started)


def test_hfzero_run_refuses_more_ranks_than_gpus(one_gpu, monkeypatch: pytest.MonkeyPatch) -> None:
    from hfzero.integrations.launch import launch

    with pytest.raises(ConfigError, match=r"2 ranks on this host.*only 1 .*--nproc_per_node 1.*CUDA_VISIBLE_DEVICES"):
        launch(["--nproc_per_node", "2", SCRIPT, "--output_dir", "o", "--zero_stage", "2"])
    with pytest.raises(ConfigError, match="only 1"):
        launch(["--nproc_per_node", "2", SCRIPT, "--output_dir", "o"])  # plain torchrun through hfzero run too
    for cpu_run in (["--use_cpu"], ["--use_cpu", "true"], ["--use_cpu=true"]):
        with pytest.raises(AssertionError, match="torchrun started"):  # a CPU run needs no GPU
            launch(["--nproc_per_node", "2", SCRIPT, "--output_dir", "o", *cpu_run])
        # and its workers are told so: the accelerator the Trainer builds reads ACCELERATE_USE_CPU, not --use_cpu
        assert os.environ.pop("ACCELERATE_USE_CPU") == "true"
    with pytest.raises(ConfigError, match="only 1"):
        launch(["--nproc_per_node", "2", SCRIPT, "--output_dir", "o", "--use_cpu", "false"])
    with pytest.raises(AssertionError, match="torchrun started"):  # one rank per GPU
        launch(["--nproc_per_node", "1", SCRIPT, "--output_dir", "o"])
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    with pytest.raises(AssertionError, match="torchrun started"):
        launch(["--nproc_per_node", "2", SCRIPT, "--output_dir", "o"])


def test_the_main_job_runs_on_every_gpu_or_on_two_cpu_ranks(one_gpu, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 33 item 9: examples/main_job.sh asks ``python -m hfzero.integrations.gpus`` where to run: one rank per
    GPU with two or more, else 2 CPU ranks (``--use_cpu true``), which `hfzero run` then starts on a 1-GPU host
    (it refused ``--nproc_per_node 2`` there) with its workers told it is a CPU run."""
    from hfzero.integrations import gpus
    from hfzero.integrations.launch import launch

    assert gpus.job_placement(0) == gpus.JobPlacement(2, True, "2 CPU ranks, gloo (no GPU is visible)")
    assert gpus.job_placement(1) == gpus.JobPlacement(
        2, True, "2 CPU ranks, gloo (1 GPU is visible and two ranks cannot share it)")
    assert gpus.job_placement(4) == gpus.JobPlacement(4, False, "4 ranks, one per visible GPU (cuda:0-cuda:3), NCCL")
    assert gpus.job_placement(4, cpu=True).cpu and gpus.job_placement(1, cpu_ranks=3).nproc == 3
    gpus.main([])  # this host: one GPU (the fixture)
    assert capsys.readouterr().out == "2 cpu 2 CPU ranks, gloo (1 GPU is visible and two ranks cannot share it)\n"
    with pytest.raises(AssertionError, match="torchrun started"):  # what main_job.sh then runs
        launch(["--nproc_per_node", "2", "examples/finetune_classifier.py", "--output_dir", "o", "--use_cpu", "true"])
    assert os.environ.pop("ACCELERATE_USE_CPU") == "true"
    monkeypatch.setattr(gpus, "accelerator_count", lambda: 2)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda"))
    gpus.main([])
    assert capsys.readouterr().out == "2 gpu 2 ranks, one per visible GPU (cuda:0-cuda:1), NCCL\n"
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    gpus.main(["--cpu-ranks", "3"])
    assert capsys.readouterr().out == "3 cpu 3 CPU ranks, gloo (ACCELERATE_USE_CPU asks for a CPU run)\n"


def test_trainer_and_accelerator_refuse_more_ranks_than_gpus(one_gpu, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain torchrun of a Trainer / accelerate script: refused when its arguments or accelerator are built."""
    from hfzero.integrations.gpus import check_ranks_fit_devices, local_world_size

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert local_world_size() == 2
    with pytest.raises(ConfigError, match=r"ZeroAccelerator: 2 ranks on this host \(LOCAL_WORLD_SIZE 2\)"):
        check_ranks_fit_devices(local_world_size(), what="ZeroAccelerator", option="LOCAL_WORLD_SIZE")
    check_ranks_fit_devices(2, what="ZeroAccelerator", cpu=True)
    from hfzero.integrations.trainer import ZeroTrainingArguments

    with pytest.raises(ConfigError, match="ZeroTrainingArguments: 2 ranks on this host"):
        ZeroTrainingArguments(output_dir="o", report_to="none")
