"""Sharded loading where scripts call from_pretrained, world 2 (one spawn): after ``from_pretrained``
no rank holds a parameter (all on meta), and training equals the ordinary path's exactly (fp32):

- Trainer (stages 3 and 2): ``ZeroTrainingArguments(zero_stage=S)`` built before ``from_pretrained`` switches sharded
  loading on; then ``resize_token_embeddings``, ``gradient_checkpointing_enable``, peft LoRA with
  partitioned ``modules_to_save`` (saving them used to be refused by the stage-3 guard), ZeroTrainer;
  the saved adapters are equal too;
- accelerate: ``with hfzero.sharded_init()`` around ``from_pretrained`` (tied GPT-2), ZeroAccelerator at stage 3;
- custom loop: ``hfzero.prepare`` at stages 3 and 2 from an index-sharded save, ``model.to(device)`` in between;
- saving (issue 20 item 6): ZeroTrainer's save and ``ZeroAccelerator.get_state_dict`` hold a tied matrix once
  (one tensor under both names), so ``save_pretrained`` writes it once; the saved model reloads to the
  trained weights;
- a reference model prepared without an optimizer (TRL's DPO) is partitioned at stage 3 (issue 20 item 6).
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import hfzero
from hfzero.testing.models import micro_batches, tiny_causal_lm, token_batches, train_causal_lm
from hfzero.testing.spawn import run_distributed

pytest.importorskip("peft")
pytestmark = pytest.mark.slow

STEPS = 3
SEQ = 8


def _all_meta(model) -> bool:
    return all(p.device.type == "meta" for p in model.parameters())


def _load(path: str, sharded: bool):
    from transformers import AutoModelForCausalLM

    if not sharded:
        return AutoModelForCausalLM.from_pretrained(path)
    with hfzero.sharded_init():
        model = AutoModelForCausalLM.from_pretrained(path)
    assert _all_meta(model), "sharded loading left a parameter whole"
    return model


def _rows(world: int) -> list[dict]:
    return [{"input_ids": row, "labels": row} for batch in token_batches(STEPS, 2 * world, SEQ) for row in batch]


def _trainer(root: Path, sharded: bool, world: int, stage: int = 3) -> dict:
    """An unmodified Trainer script's order: arguments, from_pretrained, resize, checkpointing, LoRA, train."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    common = dict(output_dir=str(root / f"trainer-{stage}-{sharded}"), max_steps=STEPS, per_device_train_batch_size=2,
                  learning_rate=1e-2, logging_steps=1, report_to="none", disable_tqdm=True, save_strategy="no",
                  seed=0, lr_scheduler_type="constant", dataloader_drop_last=True, use_cpu=True)
    zero = dict(zero_stage=stage, zero_param_persistence_threshold=0, zero_reduce_bucket_size=4096)
    if sharded:
        args = hfzero.ZeroTrainingArguments(**common, **zero)
        model = AutoModelForCausalLM.from_pretrained(str(root / "llama"))
        loaded_meta = _all_meta(model)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(root / "llama"))
        loaded_meta = False
        args = hfzero.ZeroTrainingArguments(**common, **zero)
    torch.manual_seed(1)
    model.resize_token_embeddings(136, mean_resizing=False)
    model.config.use_cache = False
    model.gradient_checkpointing_enable()
    torch.manual_seed(2)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                             target_modules=["q_proj", "v_proj"], modules_to_save=["norm"]))
    trainer = hfzero.ZeroTrainer(model=model, args=args, train_dataset=_rows(world))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    trainer.save_model()
    adapter = _safetensors(Path(args.output_dir) / "adapter_model.safetensors") if dist.get_rank() == 0 else None
    del trainer, args, model
    gc.collect()
    return {"loaded_meta": loaded_meta, "losses": losses, "adapter": adapter}


def _trainer_save(root: Path, world: int) -> dict:
    """No adapters, the default persistence threshold (the tied embedding stays whole): the saved model
    holds the tied matrix once, as the ordinary save does, and reloads to the trained weights."""
    from transformers import AutoModelForCausalLM

    out = root / "trainer-save"
    args = hfzero.ZeroTrainingArguments(output_dir=str(out), max_steps=1, per_device_train_batch_size=2,
                                        report_to="none", disable_tqdm=True, save_strategy="no", use_cpu=True,
                                        zero_stage=3)
    model = AutoModelForCausalLM.from_pretrained(str(root / "llama"))
    trainer = hfzero.ZeroTrainer(model=model, args=args, train_dataset=_rows(world))
    trainer.train()
    trainer.save_model()
    from hfzero.runtime.stage3 import full_state_dict

    trained = full_state_dict(trainer.model, rank0_only=False)
    dist.barrier()
    saved = _safetensors(out / "model.safetensors")
    del trainer, args, model
    gc.collect()
    reloaded = AutoModelForCausalLM.from_pretrained(str(out)).state_dict()
    return {"saved_keys": sorted(saved), "reloaded_equal": all(torch.equal(reloaded[k], trained[k]) for k in trained)}


def _trainer_reference_model(root: Path, world: int) -> dict:
    """A DPO-style trainer: a reference model (from_pretrained, sharded) prepared without an optimizer, as
    TRL does (``accelerator.prepare_model(ref, evaluation_mode=True)``), is partitioned at stage 3 and
    computes what the unprepared model computes."""
    from transformers import AutoModelForCausalLM

    from hfzero.integrations.state import is_partitioned
    from hfzero.roles import MemoryRole

    plain = AutoModelForCausalLM.from_pretrained(str(root / "gpt2"))
    args = hfzero.ZeroTrainingArguments(output_dir=str(root / "trainer-ref"), max_steps=2, per_device_train_batch_size=2,
                                        report_to="none", disable_tqdm=True, save_strategy="no", use_cpu=True,
                                        zero_stage=3, zero_param_persistence_threshold=0)
    model = AutoModelForCausalLM.from_pretrained(str(root / "llama"))
    ref = AutoModelForCausalLM.from_pretrained(str(root / "gpt2"))
    seen = {"equal": []}

    class RefTrainer(hfzero.ZeroTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            with torch.no_grad():
                ref_logits = self.ref_model(input_ids=inputs["input_ids"]).logits
                seen["equal"].append(torch.equal(ref_logits, plain(input_ids=inputs["input_ids"]).logits))
            out = model(**inputs)
            return out.loss + 0.01 * (out.logits.log_softmax(-1) - ref_logits.log_softmax(-1)).pow(2).mean()

    trainer = RefTrainer(model=model, args=args, train_dataset=_rows(world))
    trainer.ref_model = trainer.accelerator.prepare_model(ref, evaluation_mode=True)
    trainer.train()
    roles = hfzero.get_engine(trainer.ref_model).memory_by_role()
    whole = sum(p.numel() * p.element_size() for p in plain.parameters())
    out = {"partitioned": is_partitioned(trainer.ref_model), "equal": seen["equal"],
           "shard_fraction": roles.get(MemoryRole.PARAM_SHARD, 0) / whole}
    del trainer, args, model, ref
    gc.collect()
    return out


def _safetensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(path) if path.exists() else {}


def _accelerate(root: Path, sharded: bool, rank: int, world: int) -> list[float]:
    config = hfzero.ZeroConfig(stage=3, param_persistence_threshold=0, reduce_bucket_size=4096)
    accelerator = hfzero.ZeroAccelerator(zero_config=config, cpu=True)
    model = _load(str(root / "gpt2"), sharded)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = []
    for batch in token_batches(STEPS, 2 * world, SEQ):
        (ids,) = micro_batches(batch, rank, world, 1)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:  # tied: one tensor under both names, written once
        assert state["lm_head.weight"] is state["transformer.wte.weight"]
        accelerator.unwrap_model(model).save_pretrained(root / f"accelerate-{sharded}", state_dict=state)
        assert "lm_head.weight" not in _safetensors(root / f"accelerate-{sharded}" / "model.safetensors")
    accelerator.free_memory()
    return losses


def _custom(root: Path, sharded: bool, stage: int, rank: int, world: int) -> list[float]:
    model = _load(str(root / "llama_index"), sharded)
    model.to("cpu")
    model.train()
    model.config.use_cache = False
    model.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = hfzero.prepare(model, optimizer, hfzero.ZeroConfig(stage=stage, param_persistence_threshold=0,
                                                                         reduce_bucket_size=4096))
    return train_causal_lm(model, optimizer, rank, world, STEPS, SEQ)


def _run(rank: int, world: int, root: str) -> dict:
    from hfzero.loading import is_enabled

    root = Path(root)
    out = {}
    for sharded in (False, True):
        out[("trainer", sharded)] = _trainer(root, sharded, world)
        out[("trainer2", sharded)] = _trainer(root, sharded, world, stage=2)
        out[("enabled_after_trainer", sharded)] = is_enabled()
        out[("accelerate", sharded)] = _accelerate(root, sharded, rank, world)
        for stage in (3, 2):
            out[("custom", stage, sharded)] = _custom(root, sharded, stage, rank, world)
    out["trainer_save"] = _trainer_save(root, world)
    out["trainer_ref"] = _trainer_reference_model(root, world)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("loading")
    tiny_causal_lm("llama").save_pretrained(root / "llama")
    tiny_causal_lm("llama", seed=4).save_pretrained(root / "llama_index", max_shard_size="20KB")
    tiny_causal_lm("gpt2").save_pretrained(root / "gpt2")
    return run_distributed(_run, 2, str(root))


def test_trainer_loads_sharded_and_trains_as_the_ordinary_path(results):
    for rank in results:
        ordinary, sharded = rank[("trainer", False)], rank[("trainer", True)]
        assert sharded["loaded_meta"]
        assert len(sharded["losses"]) == STEPS and sharded["losses"] == ordinary["losses"]
        assert rank[("enabled_after_trainer", True)] is False  # switched off with the arguments
    ordinary, sharded = results[0][("trainer", False)]["adapter"], results[0][("trainer", True)]["adapter"]
    assert sharded and sorted(sharded) == sorted(ordinary)  # rank 0 saved the adapters
    assert any("norm" in k for k in sharded), "the partitioned modules_to_save were not saved"
    assert all(torch.equal(sharded[k], ordinary[k]) for k in ordinary)


def test_trainer_at_stage2_loads_through_the_hook_and_trains_as_the_ordinary_path(results):
    for rank in results:
        ordinary, sharded = rank[("trainer2", False)], rank[("trainer2", True)]
        assert sharded["loaded_meta"] and sharded["losses"] == ordinary["losses"]
    ordinary, sharded = results[0][("trainer2", False)]["adapter"], results[0][("trainer2", True)]["adapter"]
    assert sharded and all(torch.equal(sharded[k], ordinary[k]) for k in ordinary)


def test_accelerate_loads_sharded_and_trains_as_the_ordinary_path(results):
    for rank in results:
        assert rank[("accelerate", True)] == rank[("accelerate", False)]


@pytest.mark.parametrize("stage", [3, 2])
def test_custom_loop_loads_sharded_and_trains_as_the_ordinary_path(results, stage):
    for rank in results:
        assert rank[("custom", stage, True)] == rank[("custom", stage, False)]


def test_trainer_save_writes_tied_weights_once_and_reloads(results):
    for rank in results:
        assert "model.embed_tokens.weight" in rank["trainer_save"]["saved_keys"]
        assert "lm_head.weight" not in rank["trainer_save"]["saved_keys"]
        assert rank["trainer_save"]["reloaded_equal"]


def test_reference_model_without_optimizer_is_partitioned(results):
    for rank in results:
        ref = rank["trainer_ref"]
        assert ref["partitioned"] and ref["equal"] and all(ref["equal"])
        assert ref["shard_fraction"] <= 0.5 + 0.05  # 1/N of the weights (+ bucket padding), not the whole model
