"""``hfzero consolidate``: the output loads with ``from_pretrained`` and equals the trained parameters
(tied weights stay tied, sharded output has an index), and its peak memory follows the largest tensor,
not the model.

Peak-memory method: a child process imports everything, resets its peak resident set size
(``echo 5 > /proc/self/clear_refs`` resets VmHWM, Linux), records VmRSS, runs the CLI's ``main``
in-process (after one warm-up export of a small checkpoint, so one-time costs such as lazy imports
are not counted), then reads VmHWM. The growth VmHWM - VmRSS(before) is the consolidation's peak extra
resident memory (heap, and mmap'd safetensors pages while a file is open); page cache from
ordinary reads is not counted. glibc's mmap threshold is pinned (MALLOC_MMAP_THRESHOLD_) so freed
large blocks leave the resident set, as they would in a long export. Compared against the model's fp32 size (~43 MB here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hfzero import ZeroConfig, prepare
from hfzero.checkpoint import consolidate, save_checkpoint
from hfzero.testing.models import tiny_causal_lm, token_batches

# glibc raises its mmap threshold after the first large free, after which freed multi-MB blocks stay in the
# heap and VmHWM measures allocator slack rather than live memory; a fixed threshold keeps it honest.
_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072"}
_CHILD = """
import json, sys
from hfzero.cli import main
import hfzero.checkpoint, safetensors.torch, torch

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

# warm-up on a small checkpoint: one-time costs (lazy imports, first-use allocations) are not the export's
assert main(["consolidate", sys.argv[4], sys.argv[2] + "-warmup", "--max-shard-size", sys.argv[3]]) == 0
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
code = main(["consolidate", sys.argv[1], sys.argv[2], "--max-shard-size", sys.argv[3], "--json"])
print("MEASURE " + json.dumps({"before": before, "peak": status("VmHWM"), "code": code}))
"""


def _trained(kind: str, tmp: Path, **shape) -> tuple[Path, dict[str, torch.Tensor], torch.nn.Module]:
    model = tiny_causal_lm(kind, **shape)
    model, opt = prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), ZeroConfig(stage=1))
    for batch in token_batches(1, 2, 16):
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
    save_checkpoint(tmp / "ckpt", model, opt)
    return tmp / "ckpt", {n: p.detach().clone() for n, p in model.named_parameters()}, model


def _assert_same(out: Path, trained: dict[str, torch.Tensor]):
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out)
    params = dict(loaded.named_parameters())
    assert set(params) == set(trained)
    for name, value in trained.items():
        assert torch.equal(params[name].detach(), value), name
    emb = loaded.get_input_embeddings().weight
    assert loaded.get_output_embeddings().weight.data_ptr() == emb.data_ptr(), "tied weights must stay tied"
    return loaded


@pytest.fixture(scope="module")
def medium(tmp_path_factory):
    return _trained("gpt2", tmp_path_factory.mktemp("medium"), hidden=384, layers=6)


def test_cli_consolidate_sharded_with_peak_memory_of_a_tensor(medium, tmp_path):
    ckpt, trained, _ = medium
    model_bytes = sum(v.numel() * 4 for v in trained.values())
    largest = max(v.numel() * 4 for v in trained.values())
    out = tmp_path / "hf"
    small, _, _ = _trained("gpt2", tmp_path)
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(ckpt), str(out), "10MB", str(small)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **_MALLOC})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout[proc.stdout.index("{"): proc.stdout.index("MEASURE")])
    measure = json.loads(proc.stdout.split("MEASURE ", 1)[1])
    growth = measure["peak"] - measure["before"]
    print(f"consolidate peak RSS growth {growth / 1e6:.1f} MB for a {model_bytes / 1e6:.1f} MB model "
          f"(largest tensor {largest / 1e6:.2f} MB)")
    # the largest live set is one tensor read whole (~1x largest) plus small buffers (1 MiB hash chunks, headers);
    # a whole-model load would be >= 1x the model
    assert growth < 3 * largest, f"peak RSS grew {growth / 1e6:.1f} MB; largest tensor {largest / 1e6:.2f} MB"
    assert growth < model_bytes / 4, f"peak RSS grew {growth / 1e6:.1f} MB for a {model_bytes / 1e6:.1f} MB model"

    assert len(result["files"]) > 1 and (out / "model.safetensors.index.json").is_file()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"], "a re-tied weight is not written"
    assert all((out / f).stat().st_size <= 10e6 for f in result["files"])
    _assert_same(out, trained)


def test_llama_tied_single_file_and_dtype(tmp_path):
    ckpt, trained, _ = _trained("llama", tmp_path)
    result = consolidate(ckpt, tmp_path / "hf")
    assert result.files == ["model.safetensors"] and result.has_config
    _assert_same(tmp_path / "hf", trained)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        written = set(f.keys())
    # non-persistent buffers (rotary inv_freq) and the re-tied lm_head are not written
    assert written == set(trained) - {"lm_head.weight"}
    result = consolidate(ckpt, tmp_path / "hf16", dtype="bfloat16")
    config = json.loads((tmp_path / "hf16" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"

    with safe_open(str(tmp_path / "hf16" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
        assert torch.equal(f.get_tensor("model.embed_tokens.weight"),
                           trained["model.embed_tokens.weight"].to(torch.bfloat16))


def test_consolidate_refuses_nonempty_output(medium, tmp_path):
    from hfzero.checkpoint import CheckpointError

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("x")
    with pytest.raises(CheckpointError, match="not empty"):
        consolidate(medium[0], tmp_path / "out")
