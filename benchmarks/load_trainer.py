"""Loading a ~1B Llama through an unmodified Trainer script: hfzero ZeRO-3 (and ZeRO-3 x pp 2) vs torchrun DDP.

    python benchmarks/load_trainer.py [--runs zero3,pp2,ddp] [--nproc 4] [--layers 22] [--hidden 2048] [--json]

Builds a Llama (TinyLlama's shape with the defaults: 22 blocks, hidden 2048, MLP 5632, 32 heads, 4 KV heads,
vocab 32000, untied: 1.10B parameters) with random weights once, saved with ``save_pretrained`` in bf16 as
several safetensors shards under ``--cache`` (default ~/.cache/hfzero-bench, outside the repository). Then
launches tests/scripts/pretrained_trainer.py, a plain Trainer script (``from_pretrained`` then
``Trainer(...).train()``, no hfzero import), under benchmarks/trainer_probe.py (which records, per rank, peak
RSS and time from process start to the end of the first optimizer step; see there), one run at a time:

- ``zero3``: ``python -m hfzero run --nproc_per_node N ... --zero_stage 3 --zero_dtype bf16`` (bf16 parameters
  and gradients as DDP trains this bf16 model, fp32 master weights of the shard);
- ``pp2``: the same with ``--zero_pp_size 2`` (pp 2 x dp N/2);
- ``ddp``: plain ``torchrun --nproc_per_node N`` (DDP);
- ``ddp2``: plain torchrun on 2 ranks (DDP at this size may not fit N ranks on the host).

Every run: one optimizer step (``--max_steps 1``), one 16-token row per rank (``pp2``: two, its two
micro-batches), ``--optim sgd`` (no optimizer state, so that the runs fit a small host; the optimizer is
built after loading, so it does not change what loading holds), the model's own dtype (bf16). Each rank
stops itself if the host's available memory falls under ``--min_free_gib`` (default 1.5 GiB; ``ran_out``:
the phase it was in). Prints per rank: the baseline after ``import torch, transformers``, the peak while
``from_pretrained`` runs above it, RSS and peak when training begins, the peak and time to the end of the
first step, and issue 20's bounds. Figures and commands: docs/loading.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "scripts" / "pretrained_trainer.py"
PROBE = REPO / "benchmarks" / "trainer_probe.py"
REFERENCE_ENV = REPO / "tests" / "reference_env"  # plain torchrun's gloo teardown hook (as the tests use)


def _build(path: Path, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int,
           shard_size: str) -> None:
    """Save a random-weight Llama in bf16 as safetensors shards into ``path`` (once: kept as a cache)."""
    if (path / "config.json").is_file():
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)
    # (non-persistent buffers such as the rotary inv_freq are not saved: from_pretrained recomputes them)
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size=shard_size)
    tmp.rename(path)


def _launch(kind: str, nproc: int, model: Path, out: Path, log: Path, min_free_gib: float) -> int:
    args = [str(PROBE), str(SCRIPT), "--model_name_or_path", str(model), "--output_dir", str(out / "trainer"),
            "--max_steps", "1", "--per_device_train_batch_size", "2" if kind == "pp2" else "1",
            "--examples", "64", "--seq_len", "16",
            "--optim", "sgd", "--learning_rate", "1e-4", "--save_strategy", "no", "--report_to", "none",
            "--disable_tqdm", "true", "--logging_steps", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "ACCELERATE_USE_CPU": "true",
           "TRAINER_PROBE_OUT": str(out / "probe"), "TRAINER_PROBE_MIN_FREE_GIB": str(min_free_gib)}
    launcher = ["--standalone", "--nproc_per_node", str(nproc if kind != "ddp2" else 2)]
    if kind.startswith("ddp"):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REFERENCE_ENV), env.get("PYTHONPATH")]))
        cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, *args]
    else:
        zero = ["--zero_stage", "3", "--zero_dtype", "bf16"] + (["--zero_pp_size", "2"] if kind == "pp2" else [])
        cmd = [sys.executable, "-m", "hfzero", "run", *launcher, *args, *zero]
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=3600).returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="zero3,pp2,ddp")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv_heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard_size", default="500MB", help="save_pretrained's max_shard_size")
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "hfzero-bench"))
    parser.add_argument("--out", default=None, help="where run outputs and logs go (default: a new temp dir)")
    parser.add_argument("--min_free_gib", type=float, default=1.5,
                        help="each rank stops itself when the host's available memory falls under this")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    shape = (args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads, args.vocab)
    model = Path(args.cache) / ("llama-" + "-".join(map(str, shape)))
    started = time.perf_counter()
    _build(model, *shape, args.shard_size)
    from safetensors import safe_open
    sizes = []
    files = sorted(model.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), "pt") as f:
            sizes += [f.get_slice(k).get_shape() for k in f.keys()]
    numels = [int(__import__("math").prod(s)) for s in sizes]
    model_bytes, largest = 2 * sum(numels), 2 * max(numels)
    out_root = Path(args.out or __import__("tempfile").mkdtemp(prefix="hfzero-load-trainer-"))
    out_root.mkdir(parents=True, exist_ok=True)
    report = {"model": str(model), "params": sum(numels), "model_bytes": model_bytes, "largest_tensor_bytes": largest,
              "files": len(files), "nproc": args.nproc,
              "build_seconds": time.perf_counter() - started, "runs": {}}
    for kind in args.runs.split(","):
        out = out_root / kind
        rc = _launch(kind, args.nproc, model, out, out_root / f"{kind}.log", args.min_free_gib)
        ranks = [json.loads(p.read_text()) for p in sorted((out / "probe").glob("rank*.json"))]
        report["runs"][kind] = {"returncode": rc, "ranks": ranks}
    print(json.dumps(report, indent=1) if args.json else _table(report))


def _table(report: dict) -> str:
    mib, gib = 1 << 20, 1 << 30
    n = report["nproc"]
    load_bound = 1.25 * report["model_bytes"] / n + report["largest_tensor_bytes"]
    lines = [f"Llama {report['params'] / 1e9:.3f}B params, bf16, {report['files']} safetensors files, "
             f"{report['model_bytes'] / gib:.2f} GiB; N={n}; bounds: from_pretrained peak above baseline <= "
             f"{load_bound / mib:.0f} MiB, peak - RSS at training start <= "
             f"{0.25 * report['model_bytes'] / mib:.0f} MiB"]
    for kind, run in report["runs"].items():
        lines.append(f"{kind}: exit status {run['returncode']}")
        for r in run["ranks"]:
            get = lambda k: r.get(k, float("nan"))  # noqa: E731
            line = (f"  baseline {get('baseline_rss') / mib:7.0f} MiB | from_pretrained peak +"
                    f"{(get('from_pretrained_peak') - get('baseline_rss')) / mib:7.0f} MiB in "
                    f"{get('from_pretrained_seconds'):5.1f} s | at train begin RSS "
                    f"{get('rss_at_train_begin') / mib:6.0f}"
                    f" MiB, peak {get('peak_at_train_begin') / mib:6.0f} MiB (peak - RSS "
                    f"{(get('peak_at_train_begin') - get('rss_at_train_begin')) / mib:5.0f}) | to the end of step 1: "
                    f"peak {get('peak_to_first_step') / mib:6.0f} MiB, {get('seconds_to_first_step'):6.1f} s")
            if "ran_out" in r:
                line += (f" | RAN OUT of host memory in {r['ran_out']} at {r['seconds_when_out']:.1f} s, peak "
                         f"{r['peak_when_out'] / mib:.0f} MiB")
            lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
