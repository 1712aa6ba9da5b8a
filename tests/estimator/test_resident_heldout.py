"""estimator/resident.py held out (issue 51 item 3, "never under"): the corrected resident estimate of arms no card
has measured, against bench/allocator_replay.py's capture of the same step on the META device (the real
transformers + peft model at its exact shapes; CUDA's autocast, flash SDPA, fused dropout and cuBLAS workspaces
substituted; the sequence replayed through estimator/allocator.py). The capture's allocated peak (its replayed
rests included) is a lower bound of what a real CUDA step allocates, so an estimate below it is an under. Nothing
is measured on a card here: both sides are computed on CPU."""

from __future__ import annotations

import contextlib
import io

import pytest
from conftest import checked_stack
from test_sequence import capture_module

from issue395.errors import UsageError
from issue395.estimator import sequence
from issue395.estimator.arch import arch_from_config, protocol_targets
from issue395.estimator.resident import estimate_resident
from issue395.model.registry import config_json

SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def capture_peak(key: str, quant: str, seq: int, batch: int, r: int, targets: tuple) -> int:
    """The meta capture's allocated-bytes peak in the step's window (resident weights and replayed rests in it)."""
    mod = capture_module()
    with contextlib.redirect_stderr(io.StringIO()):  # bitsandbytes' note on a CPU kernel it does not load
        events = mod.capture(key, seq, batch, r, targets, 0.05, quant)
    return mod.figures(events)["peak_allocated"]


def estimated(key: str, quant: str, seq: int, batch: int, r: int, targets: tuple) -> int:
    return estimate_resident(config_json(key), quant=quant, seq=seq, batch=batch, targets=list(targets), lora_r=r,
                             release="0.77.0", transformers=sequence.SEQUENCE_TRANSFORMERS).corrected_predicted


@checked_stack
def test_smollm2_bf16_with_all_seven_linears_is_not_under_its_meta_capture():
    """Issue 51 item 3: SmolLM2 bf16 777x1, LoRA r 8 on all seven linears (never measured): the estimate is at or
    above the capture's peak (1,577,498,112 B). With the retained blocks' rests bounded it was 1,547,959,884 B,
    29,538,228 B under: a request under 10 MiB served whole from a cached block up to 1 MiB larger keeps its rest,
    one a block, and the capture's blocks kept 56,182,784 B where the bound's 1 MiB a 20 MiB segment charged
    23,003,136. These targets are now replayed (sequence.checked_targets)."""
    peak = capture_peak("smol", "none", 777, 1, 8, SEVEN)
    assert estimated("smol", "none", 777, 1, 8, SEVEN) >= peak


@checked_stack
def test_qwen35_moe_with_a_delta_net_layer_on_the_backwards_path_is_refused_and_the_rest_not_under():
    """Issue 51 item 3: Qwen3.5-MoE (4 layers, three gated delta-net then one full-attention) bf16 without
    checkpointing: where a target puts a delta-net layer on the backward's path (the shared expert's gate_proj, in
    every layer; in_proj_qkv) the capture kept 188-309 MB more in its requests at 300x1 than the estimate counted
    (up to 0.83x its peak with every linear a target), so it is refused in one line; with the full-attention
    layer's four projections (the last layer) the estimate is not under the capture."""
    for targets in (("shared_expert.gate_proj",), ("in_proj_qkv",)):
        with pytest.raises(UsageError, match="delta-net"):
            estimated("qwen3.5-moe", "none", 300, 1, 8, targets)
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    assert estimated("qwen3.5-moe", "none", 300, 1, 8, attention) >= capture_peak(
        "qwen3.5-moe", "none", 300, 1, 8, attention)


#: The sweep's most discriminating arms (the thinnest margin of each family and state, every one held out):
#: (key, quant, seq, batch, r, targets: None the protocol's)
HELD_OUT = [("smol", "none", 300, 1, 64, SEVEN), ("qwen", "none", 300, 3, 8, SEVEN),
            ("qwen3-0.6b", "none", 777, 1, 64, SEVEN), ("llama32-1b", "nf4", 1536, 3, 8, None),
            ("mistral-7b", "nf4", 1536, 1, 8, None), ("llama31-8b", "none", 3000, 3, 8, SEVEN),
            ("phi-2", "none", 300, 1, 8, None), ("phi-2", "nf4", 300, 3, 8, None),
            ("phi3-mini", "none", 300, 1, 8, None), ("phi3-mini", "nf4", 1536, 1, 8, None),
            ("gemma-2b", "nf4", 300, 1, 8, None), ("gemma2-2b", "none", 300, 1, 8, None),
            ("gemma3-1b", "nf4", 300, 1, 8, None), ("qwen", "nf4", 300, 1, 8, None),
            ("smol", "nf4", 300, 1, 8, SEVEN),
            # MLA: v narrower than q and k (flash's output at v's head size; the capture failed on it before)
            ("moonlight", "none", 300, 3, 8, None), ("deepseek-v3", "none", 1536, 1, 8, None)]


@pytest.mark.slow
@checked_stack
@pytest.mark.parametrize("key,quant,seq,batch,r,targets", HELD_OUT)
def test_the_resident_estimate_is_never_under_the_meta_capture_on_held_out_arms(key, quant, seq, batch, r, targets):
    """Issue 51 item 3: on arms no card has measured (shapes, ranks and targets off the committed grid; replayed
    and bounded rests, bf16 and NF4, every family the capture builds), the corrected resident estimate is at or
    above the meta capture's allocated peak."""
    targets = targets or protocol_targets(arch_from_config(config_json(key)))
    assert estimated(key, quant, seq, batch, r, targets) >= capture_peak(key, quant, seq, batch, r, targets)


@pytest.mark.parametrize("key,targets,transformers,env", [
    ("smol", ("o_proj", "gate_proj", "up_proj", "down_proj"), "5.24.0", {}),
    ("qwen3-0.6b", ("up_proj", "down_proj"), sequence.SEQUENCE_TRANSFORMERS,
     {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"})])
def test_bf16_llama_targets_without_an_attention_input_one_are_refused_where_the_sequence_is_not_replayed(
        key, targets, transformers, env, monkeypatch):
    """Issue 51 item 3 (review): SmolLM2 bf16 777x1 without checkpointing, LoRA on the MLP's linears with o_proj beside
    them: the bound those targets keep where the sequence is not replayed was under the meta capture's peak (0.9814x;
    the MLP's alone 0.9834x at 777x1, 0.9902x at 1024x1). Replayed now on the stack it was checked on
    (sequence.QUIET_ATTENTION_TYPES); under another transformers release or allocator setting (sequence.replayed) it
    is refused in one line (resident.bound_refused), not estimated on that bound. With an attention input target or on
    the checked stack it is estimated."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    run = dict(quant="none", seq=777, lora_r=8, release="0.77.0")
    with pytest.raises(UsageError, match="is not yet modelled"):
        estimate_resident(config_json(key), targets=list(targets), transformers=transformers, **run)
    estimate_resident(config_json(key), targets=["q_proj", *targets], transformers=transformers, **run)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    estimate_resident(config_json(key), targets=list(targets), transformers=sequence.SEQUENCE_TRANSFORMERS, **run)


@checked_stack
@pytest.mark.parametrize("key,quant,seq,batch,targets", [("smol", "none", 777, 1, ("gate_proj", "up_proj", "down_proj")),
                                                         ("smol", "none", 1024, 1, ("gate_proj", "up_proj", "down_proj")),
                                                         ("qwen", "none", 1024, 2, ("up_proj", "down_proj")),
                                                         ("llama32-1b", "none", 512, 1, ("down_proj",)),
                                                         ("smol", "nf4", 777, 1, ("gate_proj", "up_proj", "down_proj")),
                                                         ("llama32-1b", "nf4", 512, 1, ("down_proj",)),
                                                         ("smol", "none", 777, 1, ("o_proj", "gate_proj", "up_proj",
                                                                                   "down_proj")),
                                                         ("qwen", "nf4", 1024, 1, ("o_proj", "up_proj")),
                                                         ("phi-2", "none", 512, 1, ("dense",)),
                                                         ("phi-2", "none", 1024, 2, ("fc1", "fc2"))])
def test_lora_on_o_proj_and_the_mlps_linears_is_estimated_at_or_just_above_the_meta_capture(key, quant, seq, batch,
                                                                                          targets):
    """Issue 52: LoRA on the MLP's linears alone or with o_proj, bf16 once refused (the bound was 0.9814x-0.9902x
    under SmolLM2's capture) and NF4 once bounded, is replayed (sequence.QUIET_ATTENTION_TYPES), and layer 0's count is what it keeps
    (layer.quiet_layer): estimated at or above the capture's peak and within 0.5% of it (1.0012x-1.0039x; 1.005x-1.016x
    while the count charged layer 0's attention). phi-2 bf16 on dense or fc1, fc2 (decoder_phi's quiet attention)
    likewise, though its count still charges layer 0 whole (quiet_layer leaves phi's parallel layer out): 1.0018x and
    1.0032x, 1.021x-1.023x while bounded."""
    estimate, peak = estimated(key, quant, seq, batch, 8, targets), capture_peak(key, quant, seq, batch, 8, targets)
    assert peak <= estimate <= 1.005 * peak, estimate / peak
