"""Two "nodes" on one host (issue 22, item 6): two `hfzero run --nnodes 2 --node_rank {0,1} --nproc_per_node 2
--master_addr 127.0.0.1 --master_port P` launchers started side by side (static rendezvous) train an unmodified
Trainer script (tests/scripts/llama_trainer.py) with HSDP (`--zero_shard_size 2`, stage 3: each node one shard
group, the replicas across the nodes) and match one `--nproc_per_node 4` flat stage-3 run step for step. The
topology is detected from the launcher (LOCAL_WORLD_SIZE=2), not configured: the profile header says 2 ranks per
node on 2 nodes, and the inter-node bytes are what [Note: node traffic] gives (only the replicate all-reduce
crosses nodes) where the single-node run moves none.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_integration_common import LAUNCH_TIMEOUT_S, hfzero_run, launch_env, log_history

pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "llama_trainer.py")
STEPS = 3


def _args(out: Path, profile: Path) -> list[str]:
    return [SCRIPT, "--output_dir", str(out), "--max_steps", str(STEPS), "--per_device_train_batch_size", "2",
            "--gradient_accumulation_steps", "2", "--learning_rate", "1e-3", "--max_grad_norm", "0.5",
            "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true",
            "--seed", "0", "--zero_stage", "3", "--zero_param_persistence_threshold", "0",
            "--zero_profile_dir", str(profile)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(args: list[str]) -> None:
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "hfzero", "run", "--nnodes", "2", "--node_rank", str(node),
                               "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", port, *args],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=launch_env())
             for node in (0, 1)]
    outputs = [p.communicate(timeout=LAUNCH_TIMEOUT_S)[0] for p in procs]
    for node, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"node {node}:\n{out[-6000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("multinode")
    hfzero_run(4, _args(root / "one", root / "one_profile"))
    _two_nodes([*_args(root / "two", root / "two_profile"), "--zero_shard_size", "2"])
    return root


def _losses(out: Path) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in log_history(out) if "loss" in h}


def test_two_nodes_match_one_node(runs: Path) -> None:
    want, got = _losses(runs / "one"), _losses(runs / "two")
    assert sorted(want) == list(range(1, STEPS + 1)) and sorted(got) == sorted(want)
    for step in want:  # the Trainer logs 4 significant digits: equal, or one unit in the last
        assert abs(got[step] - want[step]) <= 1e-4 * abs(want[step]), (step, got, want)


def test_topology_detected_and_bytes_split(runs: Path) -> None:
    from hfzero.profiler.reader import load_run, summarize

    one, two = load_run(runs / "one_profile"), load_run(runs / "two_profile")
    assert one.header["topology"] == {"ranks_per_node": 4, "nodes": 1, "shard_size": 4, "replicate_size": 1}
    assert two.header["topology"] == {"ranks_per_node": 2, "nodes": 2, "shard_size": 2, "replicate_size": 2}
    for rank in summarize(one)["ranks"]:
        assert rank["comm_inter_node_bytes_per_step"] == 0
    for rank in summarize(two)["ranks"]:
        comm = rank["comm_per_step"]
        # the replicate all-reduce of the fp32 gradient shard (2 x shard elements) is all that crosses nodes
        assert comm["reduce_scatter"]["inter_node_bytes"] == 0 and comm["all_gather"]["inter_node_bytes"] == 0
        assert rank["comm_inter_node_bytes_per_step"] == comm["all_reduce"]["inter_node_bytes"] > 0
