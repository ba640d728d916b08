"""Activations in the profiler and checkpointing through hfzero, on one process (no spawn).

The saved-tensor measurement (roles ``activations`` + ``act_checkpoint``) of tiny GPT-2 and Llama
models is compared with the estimator's decoder activation model, which the profiler writes into the
header at the first forward (``activation_prediction``), with and without checkpointing.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import hfzero
from hfzero.planning import estimate as est
from hfzero.config import ConfigError
from hfzero.profiler import ZeroProfiler, load_run
from hfzero.testing.models import tiny_causal_lm

SEQ, BATCH, HIDDEN, LAYERS, VOCAB = 16, 2, 128, 2, 128


def _model(kind: str, attention: str) -> torch.nn.Module:
    model = tiny_causal_lm(kind, hidden=HIDDEN, layers=LAYERS, vocab=VOCAB).train()
    model.set_attn_implementation(attention)
    return model


def _profiled_step(tmp_path, kind: str, attention: str, checkpointing: bool,
                   **options) -> tuple[dict, dict, torch.Tensor]:
    """One profiled training step: the step record's role peaks, the header's activation prediction
    and the parameters after the step."""
    model = _model(kind, attention)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = hfzero.prepare(model, optimizer, hfzero.ZeroConfig(stage=0, **options))
    if checkpointing:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    run_dir = tmp_path / f"{kind}-{attention}-{checkpointing}"
    with ZeroProfiler(model, optimizer, run_dir):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    run = load_run(run_dir)
    step = run.ranks[0].of_kind("step")[0]
    return step["roles"], run.header["activation_prediction"], torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("kind,attention", [("gpt2", "eager"), ("gpt2", "sdpa"), ("llama", "eager")])
def test_measured_activations_match_the_estimator(tmp_path, kind: str, attention: str) -> None:
    plain, predicted, params_plain = _profiled_step(tmp_path, kind, attention, False)
    shape = est.DecoderShape.from_hf_config(_model(kind, attention).config)
    expected = est.decoder_activation_bytes(shape, SEQ, BATCH, dtype="fp32", attention=attention, device="cpu")
    assert predicted == expected.to_dict()  # the header holds the estimator's figures
    assert "act_checkpoint" not in plain
    assert plain["activations"] == pytest.approx(expected.saved, rel=0.10)

    ckpt, predicted, params_ckpt = _profiled_step(tmp_path, kind, attention, True, contiguous_checkpoints=True)
    assert predicted["checkpoints"] > 0 and predicted["recompute"] == expected.per_layer
    measured = ckpt["activations"] + ckpt["act_checkpoint"]
    assert measured == pytest.approx(predicted["saved"], rel=0.10)
    # The layer inputs, e*s*b*h each, are what the checkpoints hold (plus inputs shared by all layers).
    assert ckpt["act_checkpoint"] >= LAYERS * 4 * SEQ * BATCH * HIDDEN
    assert ckpt["activations"] == pytest.approx(predicted["head"], rel=0.10)  # outside the layers
    if (kind, attention) == ("gpt2", "eager"):  # + the (b, 1, s, s) mask all layers share, counted once
        assert ckpt["act_checkpoint"] == LAYERS * 4 * SEQ * BATCH * HIDDEN + 4 * BATCH * SEQ * SEQ
    torch.testing.assert_close(params_ckpt, params_plain, rtol=0, atol=0)


def test_partition_activations_without_tensor_parallelism_is_refused() -> None:
    with pytest.raises(ConfigError, match="nothing to partition"):
        hfzero.ZeroConfig(partition_activations=True)
    with pytest.raises(ConfigError, match="tp_size"):
        hfzero.ZeroConfig(tp_size=0)


def test_reentrant_checkpointing_is_refused() -> None:
    model = _model("gpt2", "eager")
    model, _ = hfzero.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), hfzero.ZeroConfig(stage=0))
    with pytest.raises(ConfigError, match="use_reentrant"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})


def test_estimator_checkpoint_policies() -> None:
    """P_a keeps a ceil(sbh / tp) slice of each layer input; P_a+cpu moves the checkpoints to the host."""
    shape = est.DecoderShape.from_hf_config(_model("llama", "sdpa").config)
    seq, batch = 7, 3  # s*b*h = 2688 elements, not a multiple of tp = 5 (padding)
    plain = est.decoder_activation_bytes(shape, seq, batch, dtype="bf16", checkpointing=True, tp=5)
    part = est.decoder_activation_bytes(shape, seq, batch, dtype="bf16", checkpointing=True, tp=5, partition=True)
    cpu = est.decoder_activation_bytes(shape, seq, batch, dtype="bf16", checkpointing=True, tp=5, partition=True,
                                       cpu=True)
    shared = plain.checkpoints - LAYERS * 2 * seq * batch * HIDDEN
    assert part.checkpoints - shared == LAYERS * 2 * -(-seq * batch * HIDDEN // 5)
    assert (cpu.checkpoints, cpu.checkpoints_host) == (0, part.checkpoints)
    assert cpu.total == part.total - part.checkpoints and plain.layers == 0 and plain.recompute == plain.per_layer
    with pytest.raises(est.EstimateError, match="nothing to partition"):
        est.decoder_activation_bytes(shape, seq, batch, checkpointing=True, partition=True)
    with pytest.raises(est.EstimateError, match="enable checkpointing"):
        est.decoder_activation_bytes(shape, seq, batch, tp=2, cpu=True)


def _tp_worker(rank: int, world: int, root: str) -> dict:
    """tp=2 (dp=1) Llama, stage 2: one profiled step without checkpointing, with, and with P_a."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hfzero.parallel.tensor import prepare_tensor_parallel

    out = {}
    for name, checkpointing, partition in (("plain", False, False), ("ckpt", True, False), ("pa", True, True)):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
        model = LlamaForCausalLM(config).float().train()
        model.config.use_cache = False
        zero = hfzero.ZeroConfig(stage=2, tp_size=2, partition_activations=partition)
        model, optimizer, _ = prepare_tensor_parallel(model, lambda params: torch.optim.SGD(params, lr=0.1), zero)
        if checkpointing:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        with ZeroProfiler(model, optimizer, f"{root}/{name}"):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        torch.distributed.barrier()  # both rank files are complete
        if rank == 0:
            run = load_run(f"{root}/{name}")
            out[name] = {"roles": [log.of_kind("step")[0]["roles"] for log in run.ranks.values()],
                         "predicted": run.header["activation_prediction"]}
    return out


@pytest.mark.slow  # one spawn of 2 ranks: ~10 s on 2 cores
def test_tensor_parallel_activations_and_partitioned_checkpoints(tmp_path) -> None:
    """At tp=2 the measured activations follow the estimator's /tp split, and P_a halves the checkpoints."""
    from hfzero.testing.spawn import run_distributed

    out = run_distributed(_tp_worker, 2, str(tmp_path), timeout=300)[0]
    for name, case in out.items():
        assert case["predicted"]["inputs"]["tp"] == 2 and case["predicted"]["inputs"]["partition"] == (name == "pa")
        for roles in case["roles"]:  # both TP ranks
            measured = roles.get("activations", 0) + roles.get("act_checkpoint", 0)
            assert measured == pytest.approx(case["predicted"]["saved"], rel=0.10), (name, roles)
    full, part = out["ckpt"]["roles"][0]["act_checkpoint"], out["pa"]["roles"][0]["act_checkpoint"]
    assert full == LAYERS * 4 * SEQ * BATCH * 64 and part == full // 2


@pytest.mark.parametrize("family", ["bert", "bert-mlm", "roberta", "bart", "t5"])
def test_encoder_activation_model_matches_the_measurement(family: str) -> None:
    """The encoder / encoder-decoder activation model against the saved-tensor accounting, in-process on
    tiny models with dropout on (CPU, fp32): see [Note: encoder activation model]."""
    import transformers

    from hfzero.runtime.activations.accounting import ActivationAccounting

    vocab, small = 1000, dict(vocab_size=1000)
    bert = dict(small, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256)
    seq2seq = dict(small, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                   decoder_attention_heads=4, encoder_ffn_dim=256, decoder_ffn_dim=256)
    t5 = dict(small, d_model=64, num_layers=2, num_decoder_layers=2, num_heads=4, d_kv=16, d_ff=256,
              decoder_start_token_id=0, pad_token_id=0)
    build = {"bert": (transformers.BertConfig(**bert), transformers.BertForSequenceClassification, 0.01),
             "bert-mlm": (transformers.BertConfig(**bert), transformers.BertForMaskedLM, 0.01),
             "roberta": (transformers.RobertaConfig(**bert), transformers.RobertaForSequenceClassification, 0.01),
             "bart": (transformers.BartConfig(**seq2seq), transformers.BartForConditionalGeneration, 0.01),
             "t5": (transformers.T5Config(**t5), transformers.T5ForConditionalGeneration, 0.05)}
    config, cls, tolerance = build[family]
    torch.manual_seed(0)
    model = cls(config).train()
    head = "classifier" if "Classification" in cls.__name__ else "lm"
    shape = est.EncoderShape.from_hf_config(model.config, head=head)
    accounting = ActivationAccounting(model).attach()
    ids = torch.randint(5, vocab, (4, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.zeros(4, dtype=torch.long) if head == "classifier" else ids
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)
    measured = accounting.saved.live
    out.loss.backward()
    accounting.detach()
    predicted = est.encoder_activation_bytes(shape, 16, 4, dtype="fp32", device="cpu").saved
    assert measured == pytest.approx(predicted, rel=tolerance)


def test_header_prediction_follows_the_largest_input_of_an_encoder(tmp_path) -> None:
    """Dynamic padding: the header's activation_prediction is the encoder model's, for the longest batch
    seen (the one whose activations peak), not the first."""
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, num_labels=2)
    model = transformers.BertForSequenceClassification(config).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = hfzero.prepare(model, optimizer, hfzero.ZeroConfig(stage=0))
    with ZeroProfiler(model, optimizer, tmp_path / "run"):
        for seq in (8, 24, 16):
            ids = torch.randint(0, 100, (2, seq))
            model(input_ids=ids, labels=torch.zeros(2, dtype=torch.long)).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    run = load_run(tmp_path / "run")
    predicted = run.header["activation_prediction"]
    assert (predicted["inputs"]["model"], predicted["inputs"]["seq_len"]) == ("encoder", 24)
    measured = max(r["roles"].get("activations", 0) for r in run.ranks[0].of_kind("step"))
    assert measured == pytest.approx(predicted["saved"], rel=0.02)
