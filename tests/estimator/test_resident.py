"""issue395.estimator.resident: the corrected peak of a resident run (stream_layers off), held to the committed
resident rows (results/resident-map-*: real peaks measured on an H200), and its refusals, one line each."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, checked_stack

from issue395.errors import UsageError
from issue395.estimator.resident import estimate_resident, refused
from issue395.estimator.arch import arch_from_config
from issue395.model.registry import config_json, stream_mode
from issue395.results.corrected import corrected
from issue395.results.row import Row


def committed_resident_rows() -> list[Row]:
    return [Row.from_json(r) for path in sorted((ROOT / "results").glob("resident-map-*/call-*/*.json"))
            for r in json.loads(path.read_text())["rows"]]


def test_the_resident_estimate_is_never_under_and_tight_on_every_committed_arm_it_models():
    """Issue 51 item 3: every committed resident row the estimator models, bf16 and NF4, dense, phi's parallel
    block (bf16, and NF4 without checkpointing: 0.68x-0.82x, then 1.27x-1.42x, before layer.autocast_casts), DeepSeek-V3's
    latent MoE (Moonlight), the Qwen3.5 hybrids where modelled (the map's corrected
    column, from the family's public config alone) is at or above its real peak, median at most 1.0009x
    (resident.py's docstring; 1.0011x before batched NF4 llama and phi-2 NF4 were replayed), within 1.004x with
    checkpointing, within 1.017x without it (SmolLM2 NF4 512x1, the largest of every gemm_4bit choice); phi-2 NF4
    within 1.004x, its retained blocks' rests replayed (within 1.026x while they were bounded); phi-2 bf16 within
    1.001x, its
    rests replayed (sequence.forward_phi) and its LayerNorms' fp32 weight copies charged (resident.norm_casts;
    within 1.021x bounded), Moonlight within
    1.008x (its bf16 rows without checkpointing within 1.005x: layer.latent_retained, measured on CPU, where the
    kinds' count was 1.010x-1.029x), within 1.007x where its retained blocks' rests are replayed (issue 52 item 1:
    estimator/sequence.py: bf16, and NF4 on llama, mistral, qwen3, phi3 and phi, within 1.002x past 1,536 tokens
    and 1.017x at 1,536 or fewer, the largest of every gemm_4bit choice, where the bound left them up to 1.0237x); the
    ones it does not model (phi NF4 with checkpointing, Qwen3.5 without
    checkpointing, Qwen3.5-MoE with it, past a sliding window without checkpointing) get no figure."""
    import statistics

    rows = [r for r in committed_resident_rows() if r.measured]
    env = {"soup_cli": "0.77.0", "transformers": "5.16.1"}
    got = [(r, corrected(r, env)) for r in rows]
    modelled = [(r, c / r.real_peak) for r, c in got if c is not None]
    assert len(modelled) >= 187 and any(r.quant == "nf4" for r, _ in modelled), len(modelled)
    assert all(1.0 <= v for _, v in modelled), [(r.model_key, r.seq, round(v, 4)) for r, v in modelled if v < 1]
    phi = {"none": 1.001, "nf4": 1.004}

    def batched_llama(r):
        return r.quant == "nf4" and r.batch > 1 and stream_mode(r.model_key)[0] in ("smol", "llama32-1b", "llama31-8b")
    assert all(v <= (phi[r.quant] if r.model_key.startswith("phi-2") else 1.002 if batched_llama(r) else 1.017)
               for r, v in modelled), [
        (r.model_key, r.quant, r.seq, r.batch, round(v, 4)) for r, v in modelled]
    # phi-2 NF4 without checkpointing (issue 51 item 3): every row modelled, never under, its rests replayed
    # (1.00015x-1.00307x; 1.0056x-1.0250x bounded)
    assert len([r for r, _ in modelled if r.model_key == "phi-2+resident" and r.quant == "nf4"]) >= 6
    assert all(v <= 1.004 for r, v in modelled if "+gc" in r.model_key)
    assert all(v <= 1.008 for r, v in modelled if r.model_key.startswith("moonlight"))
    assert all(v <= 1.005 for r, v in modelled if r.model_key == "moonlight+resident" and r.quant == "none")
    # 1.0010 before the norms' fp32 rstd (layer.RMS_RSTD_BYTES) and the larger replay of the two default cuBLAS
    # workspaces (the estimate does not know the card) were charged: 1.0011 with the rstd, 1.0012 with both; 1.0011
    # with Phi-3-mini NF4 past 1,536 tokens replayed; 1.0012 with phi-2 NF4's 6 rows (1.0056x-1.0250x) modelled;
    # 1.0010 with phi-2 bf16's 6 rows replayed (1.0000x-1.0007x; bounded 1.0023x-1.0204x); 1.0011 with batched NF4
    # llama's 8 rows bounded (sequence.NF4_BATCHED_HELD_BACK); 1.0008 with them and phi-2 NF4's 6 replayed
    assert round(statistics.median(v for _, v in modelled), 4) <= 1.0009
    # issue 52 item 1: where the retained blocks' rests are replayed (estimator/sequence.py: the llama-type SFT bf16
    # rows without checkpointing), not bounded, within 1.007x (bounded, up to 1.0237x): the rests charged are the
    # larger of the replays under either default cuBLAS workspace, as the estimate does not know the card; SmolLM2
    # 2048x1 1.0069x, 1.0049x at most under the 32 MiB workspace these rows' H200 held (was within 1.005x)
    replayed = [v for r, v in modelled if "+gc" not in r.model_key and r.quant == "none" and r.task in (None, "sft")
                and stream_mode(r.model_key)[0] in ("smol", "qwen", "llama32-1b", "qwen3-0.6b", "mistral-7b",
                                                    "llama31-8b")]
    assert len(replayed) >= 39 and max(replayed) <= 1.007, max(replayed)
    # batched NF4 llama replayed (its capture was 24.4 MB under SmolLM2 NF4 1024x4's row until the H100 trace named
    # SDPA's cast order and peft's empty_cache: sequence.NF4_BATCHED_HELD_BACK): SmolLM2's three 1.0004x-1.0016x
    # (1.0190x-1.0240x bounded), Llama-3.2-1B's and -3.1-8B's 1.0001x-1.0007x
    held = [v for r, v in modelled if "+gc" not in r.model_key and batched_llama(r)]
    assert len(held) >= 8 and max(held) <= 1.002, max(held)
    nf4 = [v for r, v in modelled if "+gc" not in r.model_key and r.quant == "nf4" and r.seq * r.batch > 1536
           and stream_mode(r.model_key)[0] in ("smol", "llama32-1b", "qwen3-0.6b", "mistral-7b", "llama31-8b",
                                               "phi3-mini")]
    # within 1.003x: the larger replay of the two default cuBLAS workspaces (was within 1.002x under the 32 MiB one);
    # Phi-3-mini NF4 512x4 and 1024x4 1.0007x and 1.0004x replayed (bounded: 1.0057x and 1.0138x)
    # within 1.004x with the capture's CUDA order (SmolLM2 2048x1 1.0035x, 1.0029x before), 12 rows with batched
    # NF4 llama's 8 bounded; within 1.002x, 20 rows, with them replayed (SmolLM2 2048x1 1.0016x)
    assert len(nf4) >= 20 and max(nf4) <= 1.002, max(nf4)
    # issue 51 item 3: at 1,536 tokens or fewer the card's gemm_4bit choice is not known and the largest replay of
    # every choice is charged: within 1.017x (SmolLM2 512x1 1.0166x, 1.0147x before peft's empty_cache ended the
    # load, its H200's own choice replayed 1.0042x; Phi-3-mini 512x1 and 1024x1 1.0110x and 1.0013x, bounded
    # 1.0209x and 1.0237x)
    short = [v for r, v in modelled if "+gc" not in r.model_key and r.quant == "nf4" and r.seq * r.batch <= 1536
             and stream_mode(r.model_key)[0] in ("smol", "llama32-1b", "qwen3-0.6b", "mistral-7b", "llama31-8b",
                                                 "phi3-mini")]
    assert len(short) >= 12 and max(short) <= 1.017, max(short)
    families = {r.model_key for r, _ in modelled}
    assert {"phi-2+resident", "moonlight+resident", "moonlight+resident+gc", "qwen3.5+resident+gc",
            "qwen3.5-moe+resident"} <= families
    assert all(c is None for r, c in got if r.model_key in ("qwen3.5+resident", "qwen3.5-moe+resident+gc"))


@checked_stack
def test_phis_layernorm_fp32_weight_copies_are_the_captures_live_at_its_peak():
    """Issue 51 item 3: under bf16 autocast each nn.LayerNorm's layer_norm runs in fp32 (CUDA's fp32 policy), so
    its bf16 weight and bias are cast to fp32, and native_layer_norm saves the copies for its backward wherever
    its input needs a gradient: resident.norm_casts charges them (without checkpointing), and they are the blocks
    of that shape bench/allocator_replay.py's capture of phi-2 bf16 512x1 holds at its peak (64 of 10,240 B: 31
    decoder layers' and the final LayerNorm's). Under NF4 the norms are fp32 already: none."""
    import importlib.util

    from issue395.estimator.allocator import replaying

    spec = importlib.util.spec_from_file_location("bench_allocator_replay", ROOT / "bench" / "allocator_replay.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    events = mod.capture("phi-2", 512, 1, 8, ("q_proj", "v_proj"), 0.05)
    what = {e[1]: e[3] for e in events if e[0] == "alloc"}
    start, top = None, (-1, 0)
    for j, e, a, held in replaying(events):
        start = j if e[0] == "reset_peak" else start
        if start is not None and a.allocated > top[0]:
            top = (a.allocated, sum(b.size for k, (i, b) in held.items() if i > start
                                    and what[k] == "(2560,) torch.float32"))
    e = estimate_resident(config_json("phi-2"), seq=512)
    assert e.terms["norm_casts"] == top[1] == 64 * 10_240
    assert estimate_resident(config_json("phi-2"), seq=512, quant="nf4").terms.get("norm_casts", 0) == 0
    assert estimate_resident(config_json("llama32-1b"), seq=512).terms.get("norm_casts", 0) == 0


def test_a_layered_models_resident_weights_are_each_layers_own_kind_as_measured_before_its_step():
    """Issue 51 item 3: Moonlight (a dense layer, then MoE layers of 64 fused experts), Qwen3.5 (delta-net and
    full-attention layers) and Qwen3.5-MoE hold before their step what resident_weights charges, within 0.5%
    on every committed row, bf16 and NF4 (under NF4 the fused experts stay unquantised, fp32: Moonlight NF4
    holds more than bf16); charging every layer the union of the kinds' modules was 10-30% off."""
    from issue395.estimator.resident import resident_weights

    seen = set()
    for r in committed_resident_rows():
        family, _ = stream_mode(r.model_key)
        if not r.measured or family not in ("moonlight", "qwen3.5", "qwen3.5-moe"):
            continue
        w = resident_weights(arch_from_config(config_json(family)), r.quant)
        assert abs(w / r.resident - 1) <= 0.005, (r.model_key, r.quant, w, r.resident)
        seen.add((family, r.quant))
    assert len(seen) == 6
    a = arch_from_config(config_json("moonlight"))
    assert resident_weights(a, "nf4") > resident_weights(a, "none")


def test_phis_resident_layer_keeps_autocasts_fp32_copies_beyond_the_streamed_count():
    """Issue 51 item 3: a resident run trains under bf16 autocast, which runs layer_norm and pow in fp32
    (torch's autocast fp32 list): phi-2's gelu_new keeps pow's fp32 input, tanh and 1 + tanh in fp32 where the
    streamed count has them bf16, and its LayerNorm an fp32 copy of its input: the bf16 rows, 0.71x-0.89x of
    the streamed count alone, are at or above their real peaks with them (2048x4: under without them)."""
    import issue395.estimator.layer as L
    import issue395.estimator.resident as R

    a = arch_from_config(config_json("phi-2"))
    row = next(r for r in committed_resident_rows() if (r.model_key, r.quant, r.seq, r.batch) == (
        "phi-2+resident", "none", 2048, 4))
    e = estimate_resident(config_json("phi-2"), seq=2048, batch=4)
    llama = estimate_resident(config_json("llama32-1b"), seq=2048)
    with pytest.MonkeyPatch.context() as m:  # the same estimates with no autocast copy
        for where in (R, L):  # the retained blocks' rounding reads it in resident, the layer's count in layer
            m.setattr(where, "autocast_upcasts", lambda a, quant, mlp=True: ([], 0))
        plain = estimate_resident(config_json("phi-2"), seq=2048, batch=4)
        assert estimate_resident(config_json("llama32-1b"), seq=2048).terms == llama.terms  # no LayerNorm, no pow
    assert e.corrected_predicted >= row.real_peak > plain.corrected_predicted
    # three fp32 i-wide tensors in place of three bf16 ones, and more, in every layer's kept count but layer 0's
    kept = e.terms["retained_activations"] - plain.terms["retained_activations"]
    assert kept >= row.seq * row.batch * (a.L - 1) * 6 * a.i


ANATOMY = ROOT / "results" / "resident-anatomy-h200-soup0.77.0-2400c0d" / "call-1"


def _peak_blocks(name: str) -> dict:
    """The requested sizes live at an anatomy's peak, by size (the allocator's history)."""
    d = json.loads((ANATOMY / f"{name}.json").read_text())
    return {g["size"]: g["count"] for g in d["groups"]}


def test_a_trainer_that_turns_dropout_off_keeps_no_mask_and_the_estimate_drops_exactly_the_measured_masks():
    """Issue 51 item 3: TRL's DPO, ORPO, CPO and KTO set every nn.Dropout's p to 0, so LoRA's dropout writes no
    mask. Measured: Llama-3.2-1B SFT 2048x1 keeps 30 blocks of 4,194,304 B at its loss peak, DPO at the same
    2048 tokens none; ORPO at batch 1 (2048 tokens) charges exactly those bytes less than SFT at batch 2."""
    sft, dpo = _peak_blocks("res-sft-llama1b-bf16-2048x1"), _peak_blocks("res-dpo-llama1b-bf16-1024x1")
    measured = sft[4194304] * 4194304
    assert sft[4194304] == 30 and 4194304 not in dpo
    c = config_json("llama32-1b")
    one = estimate_resident(c, seq=1024, batch=2, task="sft").terms
    orpo = estimate_resident(c, seq=1024, batch=1, task="orpo").terms
    assert one["retained_activations"] - orpo["retained_activations"] == measured


def test_the_fp32_adapters_bf16_copies_are_charged_as_measured_without_checkpointing_and_not_with_it():
    """Issue 51 item 3: without checkpointing each fp32 LoRA matrix's autocast bf16 copy is saved by its matmul:
    Qwen2.5 2048x1 keeps 70 blocks of 14,336 B and 24 of 2,048 at its loss peak; the estimate charges exactly
    those; none under NF4 (TRL casts the adapter to bf16) and none with checkpointing."""
    blocks = _peak_blocks("res-sft-qwen-bf16-2048x1")
    c = config_json("qwen")
    assert estimate_resident(c, seq=2048).terms["adapter_casts"] == 70 * 14336 + 24 * 2048
    assert blocks[14336] == 70 and blocks[2048] == 24
    assert estimate_resident(c, seq=2048, quant="nf4").terms.get("adapter_casts", 0) == 0
    assert estimate_resident(c, seq=2048, checkpointing=True).terms.get("adapter_casts", 0) == 0


def _rotary_bytes(name: str) -> int:
    """The bytes an anatomy's peak holds from transformers 5.16.1's LlamaRotaryEmbedding.forward: its cos and
    sin lines (124, 125: the fp32 tables) and its return (127: their casts to the hidden states' dtype)."""
    d = json.loads((ANATOMY / f"{name}.json").read_text())
    lines = tuple(f"modeling_llama.py:{n} forward" for n in (124, 125, 127))
    return sum(g["size"] * c for g in d["groups"] for f, c in g["frames"].items() if f in lines)


def test_under_nf4_the_rotary_tables_are_the_residual_streams_fp32_as_measured_and_bf16_otherwise():
    """Issue 52 item 2: the rotary embedding returns cos and sin in the hidden states' dtype, fp32 under a
    resident NF4 run (its embedding is fp32): Llama-3.2-1B NF4 2048x1 keeps 2 blocks of 524,288 B of them at
    its loss peak, bf16 2 of 262,144; the estimate charges exactly those, with and without checkpointing.
    Charged bf16, Gemma-2-2B NF4 4096x1 with checkpointing was 3.2 MB under its real peak, the allowance aside."""
    c = config_json("llama32-1b")
    nf4, bf16 = _rotary_bytes("res-sft-llama1b-nf4-2048x1"), _rotary_bytes("res-sft-llama1b-bf16-2048x1")
    assert (nf4, bf16) == (2 * 524288, 2 * 262144)
    for gc in (False, True):
        assert estimate_resident(c, seq=2048, quant="nf4", checkpointing=gc).terms["rotary_tables"] == nf4
        assert estimate_resident(c, seq=2048, checkpointing=gc).terms["rotary_tables"] == bf16
    row = next(r for r in committed_resident_rows() if (r.model_key, r.quant, r.seq) == ("gemma2-2b+resident+gc",
                                                                                         "nf4", 4096))
    e = estimate_resident(config_json("gemma2-2b"), seq=4096, quant="nf4", checkpointing=True)
    assert e.corrected_predicted - e.terms["allocated_allowance"] >= row.real_peak


def test_a_step_of_whole_2_mib_blocks_is_charged_no_rest_and_one_that_is_not_keeps_its_bound():
    """Issue 51 item 3: Llama-3.2-1B 2048x1's blocks are whole 2 MiB: its real peak is 1,093,096 B over the
    requested one (its vocab's 1 MiB segment tail, charged with the weights, and small-pool 512 B rounding), and
    the estimate's step keeps 1 MiB of rest (one weight block that is not whole: the replay's, sequence.layer_rests,
    and where the replay does not serve, retained_rounding's); Qwen2.5 2048x1's are not
    (h = 896): it keeps 107.8 MB and the bound charges at least that."""
    from issue395.estimator.resident import retained_rounding, targets_of

    def anatomy_excess(name):
        d = json.loads((ANATOMY / f"{name}.json").read_text())
        return d["real_peak"] - d["requested_peak"]

    assert anatomy_excess("res-sft-llama1b-bf16-2048x1") < 2 ** 21
    c = config_json("llama32-1b")
    a = arch_from_config(c)
    assert retained_rounding(a, targets_of(a, None, c), 8, 2048, "none", 2048) == 2 ** 20
    assert retained_rounding(a, targets_of(a, None, c), 8, 2048, "none") > 100 * 2 ** 20  # no seq: the bound
    q = config_json("qwen")
    qa = arch_from_config(q)
    assert retained_rounding(qa, targets_of(qa, None, q), 8, 2048, "none", 2048) >= anatomy_excess(
        "res-sft-qwen-bf16-2048x1") - 3 * 2 ** 20  # the logits' three 1 MiB tails are allocator_rounding's


def _small_qwen(intermediate: int):
    """Qwen2.5's layer at h 256, four layers: at 1,024 tokens a norm's fp32 input and an i-wide bf16 tensor of
    i 512 are exactly 1 MiB."""
    return arch_from_config(dict(config_json("qwen"), hidden_size=256, intermediate_size=intermediate,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=4))


def test_a_retained_block_of_exactly_1_mib_is_the_small_pools_and_keeps_no_rest():
    """Issue 51 review, item 3: CUDACachingAllocator's get_pool sends a request of kSmallSize (1 MiB) or less to the small
    pool, which splits at 512 B: a resident step whose retained blocks are all 1 MiB or less keeps no rest (it
    was charged as cut from 20 MiB segments, 1 MiB here), under the one rule the streamed step's blocks take."""
    from issue395.constants import MiB, layer_remainders
    from issue395.estimator.resident import retained_rounding

    assert retained_rounding(_small_qwen(512), ("q_proj", "v_proj"), 8, 1024) == 0
    assert layer_remainders([MiB] * 80) == 0 < layer_remainders([MiB + 512] * 80)


def test_a_retained_block_from_10_mib_is_bound_by_a_cached_blocks_rest_not_its_fresh_tail():
    """Issue 51 review, item 3: a retained block of 11.5 MiB has a fresh segment's tail of 0.5 MiB, but made after the
    layer before freed its transients it may be a cached 12.5 MiB block handed over whole (shouldSplit: a rest
    of 1 MiB or less stays): each of the 12 MLP blocks (3 a layer, 4 layers) is charged 1 MiB, not 0.5."""
    from issue395.constants import MiB
    from issue395.estimator.resident import retained_rounding

    a = _small_qwen(int(11.5 * MiB) // 2 // 1024)
    assert retained_rounding(a, ("q_proj", "v_proj"), 8, 1024) == 12 * MiB


@pytest.mark.parametrize("key, quant, words", [
    ("gemma3-1b+resident", "none", "sliding window"),
    ("llama32-1b+resident+gc", "8bit", "8bit"),
    ("phi-2+resident+gc", "nf4", "nf4 phi run with gradient checkpointing"),
    ("qwen3.5+resident", "none", "qwen3_5_text run without gradient checkpointing"),
    ("qwen3.5-moe+resident+gc", "none", "qwen3_5_moe_text run with gradient checkpointing"),
])
def test_a_resident_run_it_does_not_model_is_one_line_naming_why(key, quant, words):
    """Refused, never estimated as if it were modelled: past a window without checkpointing, 8-bit, phi NF4 with
    checkpointing (no row, its recompute not counted), the Qwen3.5 runs whose committed rows the counts leave under."""
    family, modes = stream_mode(key)
    with pytest.raises(UsageError, match=words):
        estimate_resident(config_json(family), quant=quant, seq=1024, checkpointing=bool(modes.get("gradient_checkpointing")))
    assert refused(arch_from_config(config_json(family)), quant, bool(modes.get("gradient_checkpointing")), 1024)


def test_the_resident_weights_replace_the_pool_and_the_extras_and_an_untied_head_is_on_the_card():
    """The resident estimate carries every layer's weights and no streamed pool or extras; for an untied model
    (Llama-3.1-8B) both vocab matrices count (nothing streams them): its weights exceed a tied twin's by V x h x 2."""
    e = estimate_resident(config_json("llama31-8b"), seq=1024, checkpointing=True)
    assert e.terms["pool"] == 0 and e.terms["extras"] == 0 and e.soup_predicted is None
    tied = dict(config_json("llama31-8b"), tie_word_embeddings=True)
    c = config_json("llama31-8b")
    assert (e.terms["resident_weights"] - estimate_resident(tied, seq=1024, checkpointing=True).terms["resident_weights"]
            >= 2 * c["vocab_size"] * c["hidden_size"])


def test_a_resident_runs_steady_state_holds_the_optimizers_states_and_accumulation_the_gradients():
    """From step 2 the adapter's Adam moments are live beside the peak, and with accumulation its gradients are held
    through micro-batch 2's phases: each estimate exceeds the one-step figure by at least those bytes (8 and 4 B a
    fp32 LoRA parameter); r64 on all seven linears makes them large."""
    from issue395.estimator.arch import lora_params

    c = config_json("llama32-1b")
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    n = lora_params(arch_from_config(c), targets, 64)
    one = estimate_resident(c, seq=1024, checkpointing=True, targets=targets, lora_r=64).corrected_predicted
    steady = estimate_resident(c, seq=1024, checkpointing=True, targets=targets, lora_r=64, steps=2)
    held = estimate_resident(c, seq=1024, checkpointing=True, targets=targets, lora_r=64, accumulation=4)
    assert steady.corrected_predicted - one >= 8 * n and steady.terms["adam_moments"] == 8 * n
    assert held.corrected_predicted - one >= 3 * n and held.terms["held_gradients"] == 4 * n


def test_nf4_weights_are_bitsandbytes_packing_and_fp32_for_the_rest():
    """A resident QLoRA run holds far less than bf16 in its layers but its embedding in fp32: Llama-3.2-1B's NF4
    weights are under half its bf16 weights, and more than its fp32 embedding alone (V x h x 4)."""
    from issue395.estimator.resident import resident_weights

    a = arch_from_config(config_json("llama32-1b"))
    nf4, bf16 = resident_weights(a, "nf4"), resident_weights(a, "none")
    assert 4 * a.V * a.h < nf4 < bf16 * 0.7


def test_trls_disable_dropout_removes_one_saved_tensor_per_target_from_layer_1_on_a_real_peft_model():
    """Issue 51 item 3, on the real stack (CPU): a tiny Llama with LoRA on q_proj and v_proj (dropout 0.05) in
    train mode saves one tensor for each dropout whose input carries a gradient (layers 1 and 2, two targets:
    4); after TRL's own disable_dropout_in_model (what DPO, ORPO, CPO and KTO run) it saves those 4 fewer,
    which is what layer.mask_bytes leaves out of a resident (and a streamed) estimate of those tasks."""
    import torch
    import transformers
    import peft
    from trl.trainer.utils import disable_dropout_in_model

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(0)
    m = peft.get_peft_model(transformers.LlamaForCausalLM(cfg), peft.LoraConfig(
        r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.05))
    m.train()

    def saved_count() -> int:
        out = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: out.append(1) or t, lambda t: t):
            ids = torch.arange(40).view(1, 40)
            m(input_ids=ids, labels=ids)
        return len(out)

    before = saved_count()
    disable_dropout_in_model(m)
    assert before - saved_count() == 2 * (cfg.num_hidden_layers - 1)


def test_a_resident_run_at_lora_dropout_0_drops_exactly_the_masks_a_run_without_dropout_keeps_none_of():
    """Issue 50 item 1: a resident arm's adapter at training.lora.dropout 0 (peft's nn.Identity: no Dropout, so no
    mask) reaches the resident estimate through its Arm (estimate_run), as a task whose trainer sets p to 0 does.
    Measured: Llama-3.2-1B SFT 2048x1 without checkpointing keeps 30 mask blocks of 4,194,304 B at its loss peak
    (p 0.05), DPO at p 0 none; the SFT arm at dropout 0 is charged exactly those bytes less through the loss, and
    its Soup's-default arm is the estimate of an arm that names no dropout."""
    from issue395.model.arm import Adapter, Arm
    from issue395.estimator.resident import estimate_run

    sft, dpo = _peak_blocks("res-sft-llama1b-bf16-2048x1"), _peak_blocks("res-dpo-llama1b-bf16-1024x1")
    measured = sft[4194304] * 4194304
    assert 4194304 not in dpo
    at = {p: estimate_run(Arm.at("llama32-1b+resident", 2048, adapter=Adapter(dropout=p))) for p in (0.05, 0.0)}
    assert at[0.05] == estimate_run(Arm.at("llama32-1b+resident", 2048))
    assert at[0.05].terms["retained_activations"] - at[0.0].terms["retained_activations"] == measured
    assert at[0.05].phase == at[0.0].phase == "loss"
    assert at[0.05].corrected_predicted - at[0.0].corrected_predicted == measured


def test_a_resident_layer_keeps_per_token_what_autograd_saved_on_cpu_under_cudas_autocast_lists():
    """Issue 51 item 3: what each layer of a resident run keeps a token without checkpointing, as autograd's
    saved tensors (deduplicated by storage) measured it on CPU with the real transformers 5.16.1 layers at the
    families' full widths, peft 0.20 LoRA (the protocol's targets, r 8, dropout 0.05), bitsandbytes 0.50.2's
    Linear4bit under NF4, CUDA's bf16 autocast lists applied to each op and CUDA's fused dropout (a bool mask);
    the same method reproduced the committed Qwen2.5 bf16 and Llama-3.2-1B NF4 anatomies block for block.
    Measured: Phi-3-mini NF4 156,824 B a layer (layer 0 141,460), its v autocast's own bf16 copy of the fp32
    fused output (the count's view of the fused qkv was 12,288 B over); phi-2 bf16 189,608 (layer 0 30,880:
    its LayerNorm and parallel MLP record nothing where the input needs no gradient). The estimate charges
    those to the byte, each RMSNorm's fp32 rstd among them (layer.RMS_RSTD_BYTES, 4 B a token a norm: review item 3;
    before it was charged the count was 4 B a token under layer 0's one recorded norm and 8 under each other's two)."""
    def per_token(key, quant, seq):
        one, two = (estimate_resident(config_json(key), quant=quant, seq=s) for s in (seq, 2 * seq))
        return (two.terms["retained_activations"] - one.terms["retained_activations"]) // seq

    a = arch_from_config(config_json("phi3-mini"))
    assert per_token("phi3-mini", "nf4", 512) == 141_460 + (a.L - 1) * 156_824
    assert per_token("phi-2", "none", 512) == 30_880 + 31 * 189_608


def test_the_bound_covers_qwen3s_q_k_norm_blocks_where_the_replay_does_not_serve():
    """Review item 4: Qwen3's (and Gemma-3's) per-head q/k norms keep their fp32 inputs (4 x q width and 4 x k
    width a token) and rstd through the loss; retained_rounding's widths left them out, and at Qwen3-0.6B 512x1
    the bound (25,165,824 B) was under the replay's rests (27,262,976 B under the 32 MiB workspace)."""
    from issue395.constants import CUBLAS_WORKSPACE
    from issue395.estimator.resident import retained_rounding
    from issue395.estimator.sequence import layer_rests

    a, t = arch_from_config(config_json("qwen3-0.6b")), ("q_proj", "v_proj")
    assert layer_rests(a, t, 8, 512, 512, True, "none", CUBLAS_WORKSPACE, unused=0) == 27_262_976
    assert retained_rounding(a, t, 8, 512, "none", 512) >= layer_rests(a, t, 8, 512, 512)


@pytest.mark.parametrize("setting", [{"transformers": "5.24.0"}, {"env": ("CUBLAS_WORKSPACE_CONFIG", ":4096:8")},
                                     {"env": ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:256")}])
def test_a_replayed_arm_off_the_checked_stack_or_allocator_is_charged_the_bound(setting, monkeypatch):
    """Review items 1, 2: Llama-3.2-1B 1000x2 SFT bf16 without checkpointing is charged the replayed rests under
    the pinned transformers and the default allocator and workspaces, and retained_rounding's bound under another
    transformers, a CUBLAS_WORKSPACE_CONFIG or an allocator setting the replay does not model; the rest of the
    estimate is the same."""
    from issue395.estimator.resident import retained_rounding
    from issue395.estimator.sequence import layer_rests

    c = config_json("llama32-1b")
    a = arch_from_config(c)
    for var in ("CUBLAS_WORKSPACE_CONFIG", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    replay = estimate_resident(c, seq=1000, batch=2, transformers="5.16.1")
    if "env" in setting:
        monkeypatch.setenv(*setting["env"])
    bound = estimate_resident(c, seq=1000, batch=2, transformers=setting.get("transformers", "5.16.1"))
    rests, bounded = layer_rests(a, ("q_proj", "v_proj"), 8, 2000, 1000), retained_rounding(
        a, ("q_proj", "v_proj"), 8, 2000, "none", 1000)
    assert rests != bounded
    assert (bound.terms["retained_remainders"], replay.terms["retained_remainders"]) == (bounded, rests)
    assert {k: v for k, v in bound.terms.items() if k != "retained_remainders"} == {
        k: v for k, v in replay.terms.items() if k != "retained_remainders"}


def test_a_full_fine_tuning_charges_its_own_layers_rests_in_place_of_its_r1_bases():
    """Review item 8: a full fine-tuning (lora.r 0) on a replayed arm (SmolLM2 1024x1 bf16, no checkpointing) starts
    from the r 1 LoRA run's estimate, whose retained blocks' rests are replayed under the pinned transformers and
    bounded under another; the full run's retained_remainders are its own layers' in place of them, never beside
    them: the same figure whichever its base had."""
    smol = config_json("smol")
    base = {t: estimate_resident(smol, seq=1024, lora_r=1, transformers=t) for t in ("5.16.1", "5.24.0")}
    full = {t: estimate_resident(smol, seq=1024, lora_r=0, transformers=t) for t in ("5.16.1", "5.24.0")}
    assert base["5.16.1"].terms["retained_remainders"] != base["5.24.0"].terms["retained_remainders"]
    assert full["5.16.1"].terms["retained_remainders"] == full["5.24.0"].terms["retained_remainders"]


@checked_stack
def test_phi_nf4s_layer_phase_is_at_or_above_the_meta_captures_peak_with_a_small_vocabulary(monkeypatch):
    """Issue 51 item 3 (review: phi NF4's layer term): under phi NF4's fp32 residual the layer the backward runs
    holds its count at 4 B an activation (resident.fp32_over), not the bf16 count the streamed terms charge
    (163,976 B a token at phi-2's widths, under one layer's kept 210,088; now 343,208). With a 2,048-token
    vocabulary the loss's tensors shrink and the backward's layer holds the step's peak: bench/allocator_replay.py's
    meta capture of phi-2 NF4 512x1 (the real transformers, peft and bitsandbytes' Python, vocab_size 2048) peaks at
    4,843,772,928 B; the estimate's layer phase alone (the resident terms, the layer phase, the allowance) must be
    at or above it (it was 28.9 MB under with the bf16 term). Only the CUDA peak is not run: the meta capture stands
    for it."""
    import importlib.util

    import issue395.model.registry as registry
    from issue395.estimator.terms import Phase, phase_sum

    spec = importlib.util.spec_from_file_location("bench_allocator_replay", ROOT / "bench" / "allocator_replay.py")
    replay = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(replay)
    small = dict(config_json("phi-2"), vocab_size=2048)
    monkeypatch.setattr(registry, "config_json", lambda key: small)  # the capture reads its model's config here
    peak = replay.figures(replay.capture("phi-2", 512, 1, 8, ("q_proj", "v_proj"), 0.05, "nf4"))["peak_allocated"]
    e = estimate_resident(small, quant="nf4", seq=512)
    layer = phase_sum(e.terms, Phase.RESIDENT) + phase_sum(e.terms, Phase.LAYER) + phase_sum(e.terms, Phase.ALLOWANCE)
    assert layer >= peak, (layer, peak)
    assert e.corrected_predicted >= layer


def test_phi_with_qk_layernorm_or_embd_dropout_under_checkpointing_is_refused_and_no_dropout_config_is_replayed():
    """Review of issue 51 item 3: phi's qk_layernorm (per-head q and k LayerNorms, whose saved tensors no count
    has: phi-2 bf16 512x1's meta capture with it peaks 3.7% over the estimate as if off) is refused in one line,
    resident and streamed, never estimated as if off; embd_pdrop with gradient checkpointing likewise (its mask,
    kept where checkpointing makes the embedding's output need a gradient). A config that turns on any of phi's own
    dropouts (microsoft/phi-2's resid_pdrop 0.1) is never replayed (no capture ran one): its rests are bounded
    (resid_pdrop's masks are charged in the count: tests/test_bench.py holds it to the CPU count); a p no
    nn.Dropout takes is one line."""
    from issue395.estimator import sequence
    from issue395.estimator.arch import protocol_targets
    from issue395.estimator.estimate import estimate

    phi = config_json("phi-2")
    for quant in ("none", "nf4"):
        with pytest.raises(UsageError, match="qk_layernorm") as got:
            estimate_resident({**phi, "qk_layernorm": True}, quant=quant, seq=512)
        assert "\n" not in str(got.value)
        with pytest.raises(UsageError, match="qk_layernorm"):
            estimate({**phi, "qk_layernorm": True}, quant=quant, seq=512)
    with pytest.raises(UsageError, match="embd_pdrop"):
        estimate_resident({**phi, "embd_pdrop": 0.1}, seq=512, checkpointing=True)
    estimate_resident({**phi, "embd_pdrop": 0.1}, seq=512)  # without checkpointing its input needs no gradient
    kw = dict(transformers="5.16.1", environ={})
    a = arch_from_config(phi)
    assert sequence.replayed(a, "none", protocol_targets(a), "sft", **kw)
    for key in ("resid_pdrop", "embd_pdrop", "attention_dropout"):
        assert not sequence.replayed(arch_from_config({**phi, key: 0.1}), "none", protocol_targets(a), "sft", **kw)
        assert sequence.replayed(arch_from_config({**phi, key: 0.0}), "none", protocol_targets(a), "sft", **kw)
    with pytest.raises(UsageError, match="resid_pdrop"):
        arch_from_config({**phi, "resid_pdrop": 1.5})


@checked_stack
def test_a_replayed_checkpointed_run_on_expandable_segments_charges_the_replays_reserve(monkeypatch):
    """Issue 51 item 4 (the charge): Phi-3-mini bf16 SFT with gradient checkpointing, r16 on qkv_proj and o_proj,
    2 steps (the 10GB search's soup.yaml) on expandable segments: needs_free is the allocated peak plus
    gc_sequence.charge's reserve (its replay's, never under the reserve measured on that arm), not the 230.7 MB
    bound, and split_allocated is derived from it, the estimate's words saying "replayed" (fits.reserve_words);
    on the default allocator (expandable_segments:False) and
    at one step (not the replayed two) it keeps the bound."""
    from issue395.estimator import gc_sequence
    from issue395.estimator.estimate import EXPANDABLE_RESERVE_BYTES
    from issue395.estimator.fits import reserve_words

    config, kw = config_json("phi3-mini"), dict(targets=["qkv_proj", "o_proj"], lora_r=16, checkpointing=True)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    e = estimate_resident(config, seq=2048, steps=2, **kw)
    charge = gc_sequence.charge(arch_from_config(config), ("qkv_proj", "o_proj"), 16, 2048)
    assert e.reserve == charge < EXPANDABLE_RESERVE_BYTES and e.needs_free == e.corrected_predicted + charge
    assert e.split_allocated == e.needs_free - charge and e.to_json()["reserve"] == charge
    assert estimate_resident(config, seq=2048, steps=1, **kw).reserve == EXPANDABLE_RESERVE_BYTES
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    bound = estimate_resident(config, seq=2048, steps=2, **kw)
    assert bound.reserve == EXPANDABLE_RESERVE_BYTES and "reserve" not in bound.to_json()
    assert bound.needs_free - e.needs_free == EXPANDABLE_RESERVE_BYTES - charge
    assert reserve_words(e).startswith("the allocator's reserve replayed") and f"{charge / 1e6:.1f} MB" in \
        reserve_words(e) and reserve_words(bound) == ""


RESIDENT_TRACES = ROOT / "results" / "resident-gemma2-qwen-traces-h100-soup0.77.0-328540f"


def test_orpo_simpo_dpo_and_kto_take_the_sft_sequence_kto_after_its_kl_forward_where_it_was_checked():
    """ORPO, SimPO and DPO run the policy once over the chosen and rejected rows stacked before anything else of the
    step (DPO's reference after it): the resident forward's rests are replayed as SFT's at those rows
    (sequence.SEQUENCE_TASKS). KTO's KL forward runs before its policy's, without grad: replayed first where it was
    checked (sequence.KL_FORWARD_TYPES: Qwen2.5 and phi-2 yes). Under NF4 all five, KTO on NF4_KL_FORWARD_TYPES alone
    (Qwen2.5: yes; Mistral-7B and phi-2: no)."""
    from issue395.estimator import sequence
    a = arch_from_config(config_json("qwen"))
    for task in ("orpo", "simpo", "dpo", "kto"):
        assert sequence.replayed(a, "none", ("q_proj", "v_proj"), task, transformers="5.16.1", environ={})
    assert sequence.replayed(arch_from_config(config_json("phi-2")), "none", ("q_proj", "v_proj"), "kto",
                             transformers="5.16.1", environ={})
    assert not sequence.replayed(arch_from_config(config_json("phi-2")), "nf4", ("q_proj", "v_proj"), "kto",
                                 transformers="5.16.1", environ={})
    for task in ("sft", "orpo", "simpo", "dpo"):
        assert sequence.replayed(a, "nf4", ("q_proj", "v_proj"), task, transformers="5.16.1", environ={})
    assert sequence.replayed(a, "nf4", ("q_proj", "v_proj"), "kto", transformers="5.16.1", environ={})
    assert not sequence.replayed(arch_from_config(config_json("mistral-7b")), "nf4", ("q_proj", "v_proj"), "kto",
                                 transformers="5.16.1", environ={})


#: Resident ORPO, SimPO and DPO histories (bf16, H100) and their registry keys.
PREFERENCE_HISTORIES = {
    "resident-gemma2-qwen-traces-h100-soup0.77.0-328540f/res-orpo-qwen-bf16-1024x2": "qwen",
    "heldout-orpo-simpo-setup-traces-h100-soup0.77.0-27f5f40/res-orpo-llama32-1b-bf16-1024x2": "llama32-1b",
    "heldout-orpo-simpo-setup-traces-h100-soup0.77.0-27f5f40/res-simpo-smol-bf16-2048x2": "smol",
    "heldout-orpo-simpo-setup-traces-h100-soup0.77.0-27f5f40/res-simpo-qwen3-0.6b-bf16-512x4": "qwen3-0.6b",
    "resident-dpo-traces-h100-soup0.77.0-8165548/res-dpo-qwen-bf16-1024x2": "qwen",
    "resident-dpo-traces-h100-soup0.77.0-8165548/res-dpo-smol-bf16-2048x2": "smol",
    "resident-dpo-traces-h100-soup0.77.0-8165548/res-dpo-qwen3-0.6b-bf16-512x4": "qwen3-0.6b"}


@pytest.mark.parametrize("path", PREFERENCE_HISTORIES)
def test_resident_preference_runs_forward_blocks_keep_the_replays_rests_and_the_estimate_is_never_under(path):
    """Resident ORPO, SimPO and DPO (bf16, H100): at each history's real peak the blocks its forward made (after the
    setup, before the first logits) keep what the replay of the SFT forward at the stacked rows keeps
    (sequence.layer_rests: none on five; on SmolLM2's two at 8,192 tokens one block's 131,072 B, which the replay keeps
    where the warmup's block is one 2 MiB granule short, sequence.WARMUP_UNUSED, and the fresh warmup's does not);
    the corrected estimate is at or above the measured peak (the committed JSON's) and within 1.002x of it. Qwen2.5
    ORPO was the history ORPO and SimPO were admitted on (the bound charged 161,981,440 B there, 1.0118x), the other ORPO and
    SimPO ones were measured after; DPO was admitted on its three (the bound 1.0101x and 1.0185x on Qwen2.5 and
    SmolLM2)."""
    import gzip
    from issue395.estimator.sequence import layer_rests
    from issue395.measure.trace import held_at, replay_trace
    key = PREFERENCE_HISTORIES[path]
    d = json.loads((ROOT / "results" / f"{path}.json").read_text())
    trace = json.loads(gzip.open(ROOT / "results" / f"{path}.trace.json.gz", "rt").read())
    r = replay_trace(trace)
    a = arch_from_config(config_json(key))
    T = d["seq"] * d["batch"] * 2
    logits = next(i for i, e in enumerate(trace["events"]) if e[0] == "alloc" and int(e[2]) >= T * a.V)
    made = sum(h.rest for h in held_at(trace, r.peak_at) if 0 <= h.born < logits)
    targets = tuple(d["targets"].split(","))
    assert made == layer_rests(a, targets, d["r"], T, d["seq"], dropout=False)  # TRL turns dropout off
    e = estimate_resident(config_json(key), quant="none", seq=d["seq"], batch=d["batch"], task=d["task"],
                          targets=targets, lora_r=d["r"], release="0.77.0", transformers="5.16.1")
    assert r.peak == d["real_peak"] <= e.corrected_predicted <= 1.002 * d["real_peak"]


@pytest.mark.parametrize("path", [f"resident-kto-{p}-h100-soup0.77.0-{sha}/res-kto-{n}" for p, sha, n in (
    ("phi-nf4-traces", "99bfc6a", "qwen-bf16-1024x2"), ("phi-nf4-traces", "99bfc6a", "qwen-bf16-512x2"),
    ("phi-nf4-traces", "99bfc6a", "smol-bf16-2048x2"), ("phi-nf4-traces", "99bfc6a", "llama32-1b-bf16-1024x2"),
    ("heldout-traces", "99bfc6a", "smol-bf16-1024x4"), ("heldout-traces", "99bfc6a", "qwen3-0.6b-bf16-1024x2"),
    ("heldout-traces", "99bfc6a", "phi3-mini-bf16-1024x2"), ("heldout-traces", "99bfc6a", "mistral-7b-bf16-512x2"),
    ("nf4-phi2-traces", "aa06824", "phi-2-bf16-1024x2"))])
def test_resident_kto_is_estimated_at_or_above_its_measured_peak_and_within_1_002x(path):
    """Resident KTO (bf16, H100): with its KL batch's forward replayed before the policy's (sequence.kl_forward), the
    corrected estimate is at or above the measured peak (the committed JSON's) and within 1.002x of it. The bound
    charged before it was 1.0129x and 1.0114x on Qwen2.5 1024x2 and 512x2, 1.0259x on SmolLM2 2048x2; on the untied
    Mistral-7B and Phi-3-mini the streamed run's private head copy was charged too (1.0135x, 1.0122x): a resident
    head keeps none. phi-2 1024x2 (its layer's no-grad path) had the bound's 1.0195x."""
    d = json.loads((ROOT / "results" / f"{path}.json").read_text())
    name = path.rsplit("/", 1)[1].split("-")
    key = {"qwen": "qwen", "smol": "smol", "llama32": "llama32-1b", "qwen3": "qwen3-0.6b", "phi3": "phi3-mini",
           "mistral": "mistral-7b", "phi": "phi-2"}[name[2]]
    e = estimate_resident(config_json(key), quant="none", seq=d["seq"], batch=d["batch"], task="kto",
                          targets=tuple(d["targets"].split(",")), lora_r=d["r"], release="0.77.0",
                          transformers="5.16.1")
    assert d["real_peak"] <= e.corrected_predicted <= 1.002 * d["real_peak"]


@pytest.mark.parametrize("name,key", [("nf4-preference-traces-h100-soup0.77.0-9889170/res-dpo-smol-nf4-1024x2", "smol"),
                                      ("nf4-preference-traces-h100-soup0.77.0-9889170/res-orpo-smol-nf4-1024x2", "smol"),
                                      ("nf4-preference-traces-h100-soup0.77.0-9889170/res-kto-smol-nf4-1024x2", "smol"),
                                      ("nf4-preference-traces-h100-soup0.77.0-9889170/res-dpo-qwen-nf4-1024x2", "qwen"),
                                      ("nf4-preference-traces-h100-soup0.77.0-9889170/res-simpo-qwen-nf4-512x2", "qwen"),
                                      ("kto-nf4-phi2-traces-h100-soup0.77.0-aa06824/res-kto-qwen-nf4-1024x2", "qwen"),
                                      ("kto-nf4-phi2-traces-h100-soup0.77.0-aa06824/res-kto-qwen3-0.6b-nf4-1024x2",
                                       "qwen3-0.6b"),
                                      ("kto-nf4-phi2-traces-h100-soup0.77.0-aa06824/res-kto-phi3-mini-nf4-1024x2",
                                       "phi3-mini")])
def test_resident_nf4_preference_runs_are_estimated_at_or_above_their_peak_and_within_1_003x(name, key):
    """Resident NF4 DPO, ORPO, SimPO and KTO (H100): with their forward replayed (sequence.NF4_SEQUENCE_TASKS; KTO's
    after its KL forward) and the H100's gemm_4bit choice, the corrected estimate is at or above the measured peak
    (the committed JSON's) and within 1.003x of it (KTO 1.0020x: the pre-Hopper workspace's replay, the larger, is
    charged); the bound had SmolLM2's and the first Qwen2.5 ones at 1.0086x-1.0308x; the held-out NF4 KTO ones
    (Qwen2.5, Qwen3-0.6B, Phi-3-mini) are 1.0005x, 1.0014x and 1.0003x."""
    from issue395.estimator.cards import CARDS

    d = json.loads((ROOT / "results" / f"resident-{name}.json").read_text())
    e = estimate_resident(config_json(key), quant="nf4", seq=d["seq"], batch=d["batch"], task=d["task"],
                          targets=tuple(d["targets"].split(",")), lora_r=d["r"], release="0.77.0",
                          transformers="5.16.1", dispatch=CARDS["h100"].dispatch)
    assert d["real_peak"] <= e.corrected_predicted <= 1.003 * d["real_peak"]


def test_a_resident_untied_preference_run_charges_no_private_head_copy_where_the_streamed_one_does():
    """0.77.0's private copy of an untied head (estimate.head_copy) is its streaming's: the runtime refills the vocab
    slot the head's autograd view points at. With every layer resident the bf16 head is its own weight: none charged
    (the Mistral-7B KTO 512x2 and Phi-3-mini KTO 1024x2 histories keep none; DPO's resident head is the same weight,
    unmeasured). Under NF4 the term is autocast's bf16 cast of the fp32 head instead, charged."""
    from issue395.estimator.estimate import estimate

    c = config_json("mistral-7b")
    for task in ("dpo", "kto"):
        streamed = estimate(c, seq=512, batch=2, task=task, release="0.77.0", soup=False)
        assert streamed.terms["head_copy"] == 2 * 32768 * 4096
        assert not estimate_resident(c, seq=512, batch=2, task=task, release="0.77.0").terms["head_copy"]
        assert estimate_resident(c, quant="nf4", seq=512, batch=2, task=task, release="0.77.0").terms["head_copy"]


SURVEY = "resident-heldout-survey-traces-h100-soup0.77.0-99a3b19"
#: The held-out survey (H100): each arm, its family, and the most its estimate may be over its real peak: 1.002x where
#: the run's retained blocks' rests are replayed (sequence.replayed), the bound's headroom where they are not (Gemma-2
#: and Gemma-3 are never replayed). Phi-3 on qkv_proj and o_proj kept the bound, 1.0132x, until its sequence was
#: checked on any targets with qkv_proj among them (1.0001x). NF4 DPO on all seven linears was 1.0132x while its count
#: charged a copy of SDPA's output for o_proj's bf16 adapter (resident.SHARED_ATTENTION_OUTPUT), 1.0011x since.
SURVEY_ARMS = [("dpo-mistral-7b-bf16-512x1", "mistral-7b", 1.002), ("kto-mistral-7b-nf4-512x2", "mistral-7b", 1.002),
               ("orpo-llama31-8b-nf4-1024x1", "llama31-8b", 1.002), ("simpo-phi-2-bf16-1024x2", "phi-2", 1.002),
               ("sft-qwen3-0.6b-bf16-2048x2-r32-all-s2", "qwen3-0.6b", 1.002),
               ("sft-smol-bf16-1024x2-a2-s2", "smol", 1.005), ("dpo-gemma2-2b-bf16-1024x1", "gemma2-2b", 1.02),
               ("orpo-gemma3-1b-bf16-384x2", "gemma3-1b", 1.02),
               ("simpo-phi3-mini-bf16-1024x2-r16", "phi3-mini", 1.002),
               ("dpo-llama32-1b-nf4-2048x1-r16-all", "llama32-1b", 1.002)]


#: ...and held out from the reference phase's and the load's change that the first survey led to (H100): where the
#: reference forward binds (NF4 DPO and KTO on untied 7-8B models and Phi-3-mini, checkpointed or not), the
#: preference tasks under checkpointing, Gemma-2 KTO (bounded) and NF4 loads of the Gemma types.
SURVEY2 = "resident-heldout-survey2-traces-h100-soup0.77.0-8448805"
SURVEY2_ARMS = [("dpo-mistral-7b-nf4-512x1", "mistral-7b", 1.002), ("dpo-llama31-8b-nf4-512x1", "llama31-8b", 1.002),
                ("kto-llama31-8b-nf4-512x2", "llama31-8b", 1.002), ("kto-mistral-7b-nf4-gc-512x2", "mistral-7b", 1.004),
                ("kto-phi3-mini-nf4-512x2", "phi3-mini", 1.002), ("dpo-qwen3-0.6b-nf4-gc-1024x2", "qwen3-0.6b", 1.002),
                ("kto-qwen-bf16-gc-1024x2", "qwen", 1.002), ("kto-gemma2-2b-bf16-1024x2", "gemma2-2b", 1.02),
                ("sft-gemma2-2b-nf4-512x1", "gemma2-2b", 1.02), ("sft-gemma-2b-nf4-512x1", "gemma-2b", 1.002)]
#: ...and held out from SHARED_ATTENTION_OUTPUT: NF4 DPO on all seven linears (1.0212x and 1.0262x before, with the
#: count's copy of SDPA's output for o_proj; 1.0040x and 1.0051x with the retained rests' bound; Qwen3 1.0011x replayed)
SURVEY3 = "resident-heldout-survey3-traces-h100-soup0.77.0-68b9965"
SURVEY3_ARMS = [("dpo-mistral-7b-nf4-512x1-r16-all", "mistral-7b", 1.006),
                ("dpo-qwen3-0.6b-nf4-1024x2-r16-all", "qwen3-0.6b", 1.002)]
#: ...and held out from the any-target sequence (sequence.checked_targets under NF4, Phi-3 and phi): the LoRA target
#: sets a soup.yaml names (all linears, q/k/v/o, v/o, an MLP mix; the protocol's nowhere), the five tasks, NF4 and
#: phi-2 bf16, r 8-64. Before, on the bound: 1.0007x-1.0409x (phi-2 bf16 all six 1.0264x, Qwen2.5 NF4 r32 all seven
#: 1.0208x, SmolLM2 NF4 ORPO q/k/v/o 1.0409x). SmolLM2 NF4 on the MLP's linears alone kept the bound (1.0287x) until
#: layer 0's quiet attention was built (sequence.QUIET_ATTENTION_TYPES, layer.quiet_layer): 1.00004x.
#: The NF4 SFT policy adapter is charged bf16 as TRL casts it (steady.adapter_bytes; Llama-3.1-8B r64 1.0200x when it
#: was charged fp32, Mistral-7B r16 1.0053x). KTO's and ORPO's fp32 adapter on o_proj saves SDPA's output as it is
#: (resident.SHARED_ATTENTION_OUTPUT, once held to a bf16 adapter): 1.0215x and 1.0218x with the count's copy.
ANYLORA = "resident-anylora-traces-h100-soup0.77.0-d463cba"
ANYLORA_ARMS = [("sft-llama32-1b-nf4-1024x2-r16-all", "llama32-1b", 1.002),
                ("kto-qwen3-0.6b-nf4-1024x2-r16-all", "qwen3-0.6b", 1.002),
                ("sft-mistral-7b-nf4-1024x1-r16-all", "mistral-7b", 1.002),
                ("sft-phi3-mini-nf4-1024x2-r16-all", "phi3-mini", 1.002),
                ("sft-phi-2-bf16-1024x2-r16-all", "phi-2", 1.002),
                ("sft-qwen-nf4-2048x1-r32-all", "qwen", 1.002),
                ("orpo-smol-nf4-2048x2-qkvo", "smol", 1.002),
                ("simpo-qwen-nf4-1024x2-r16-qud", "qwen", 1.002),
                ("dpo-llama32-1b-nf4-1024x1-r16-vo", "llama32-1b", 1.002),
                ("sft-llama31-8b-nf4-512x2-r64-all", "llama31-8b", 1.006),
                ("sft-qwen3-0.6b-nf4-4096x1-r16-all", "qwen3-0.6b", 1.002),
                ("sft-smol-nf4-1024x4-r16-mlp", "smol", 1.002)]
#: ...and held out from the NF4 policy adapter's bf16, the reference adapter's casts and SHARED_ATTENTION_OUTPUT's fp32
#: adapter (H100): large adapters (r32-r64), DPO checkpointed, KTO and SimPO off the protocol's targets; before those
#: three changes 1.0069x-1.0460x. Phi-3-mini DPO binds its reference phase, whose NF4 no-grad layer is the op-sum bound.
HELDADAPTER = "resident-heldout-adapter-traces-h100-soup0.77.0-62412e3"
HELDADAPTER_ARMS = [("dpo-qwen-nf4-1024x2-r64-all", "qwen", 1.005),
                    ("simpo-llama32-1b-nf4-1024x2-r16-qkvo", "llama32-1b", 1.002),
                    ("dpo-llama32-1b-nf4-gc-512x2-r32-all", "llama32-1b", 1.002),
                    ("kto-smol-nf4-2048x2-r16-all", "smol", 1.002),
                    ("sft-qwen3-0.6b-nf4-2048x2-r64-qkvo", "qwen3-0.6b", 1.002),
                    ("dpo-phi3-mini-nf4-512x1-r32-all", "phi3-mini", 1.01)]

#: ...and held out from layer 0's quiet attention (sequence.QUIET_ATTENTION_TYPES, layer.quiet_layer; H100): o_proj and
#: the MLP's linears alone, bf16 and NF4, SFT, ORPO and DPO. Before it the bf16 ones were refused and the NF4 ones kept
#: the bound (Qwen3-0.6B NF4 1.0097x); Qwen3 was admitted on these arms' histories.
QUIET = "resident-quiet-traces-h100-soup0.77.0-19fa471"
QUIET_ARMS = [("sft-smol-bf16-1024x2-mlp", "smol", 1.006), ("sft-smol-bf16-1024x2-omlp", "smol", 1.003),
              ("dpo-qwen-nf4-1024x1-omlp", "qwen", 1.002), ("sft-qwen3-0.6b-nf4-1024x2-mlp", "qwen3-0.6b", 1.002),
              ("sft-qwen3-0.6b-bf16-1024x1-mlp", "qwen3-0.6b", 1.002),
              ("orpo-llama32-1b-bf16-1024x2-gate", "llama32-1b", 1.002),
              ("sft-llama31-8b-nf4-1024x1-r32-o", "llama31-8b", 1.002),
              ("dpo-mistral-7b-bf16-512x1-mlp", "mistral-7b", 1.002), ("sft-qwen-bf16-2048x1-updown", "qwen", 1.002)]
#: ...and the second set held out from it (H100, after the sequence split; estimator unchanged since the first): KTO,
#: SimPO, checkpointing, two steps at accumulation 2, o_proj alone, Mistral-7B NF4 DPO (its reference's NF4 layer
#: still the op-sum bound: 1.0036x).
QUIET2 = "resident-quiet2-traces-h100-soup0.77.0-e11ec87"
QUIET2_ARMS = [("kto-smol-bf16-1024x2-mlp", "smol", 1.002), ("simpo-qwen-nf4-1024x2-omlp", "qwen", 1.002),
               ("sft-llama32-1b-bf16-gc-1024x2-mlp", "llama32-1b", 1.002),
               ("sft-qwen3-0.6b-nf4-1024x2-r32-s2a2-updown", "qwen3-0.6b", 1.002),
               ("kto-llama32-1b-nf4-1024x2-omlp", "llama32-1b", 1.002),
               ("dpo-mistral-7b-nf4-512x2-od", "mistral-7b", 1.004),
               ("sft-llama32-1b-bf16-2048x1-r8-o", "llama32-1b", 1.002),
               ("orpo-qwen3-0.6b-nf4-1024x2-oup", "qwen3-0.6b", 1.002)]
#: ...and phi's and Phi-3's (H100, measured before phi's bf16 quiet layer 0 was built: decoder_phi.phi_attention's
#: ``quiet``, sequence.QUIET_BF16_TYPES): phi-2 bf16 fc1,fc2 1.0229x -> 1.0032x; Phi-3 on down_proj alone keeps the
#: bound (its quiet attention and fused gate_up are not built): bf16 1.0121x, NF4 1.0238x.
PHIQUIET = "phi-quiet-and-walk-traces-h100-soup0.77.0-35fa47a"
PHIQUIET_ARMS = [("sft-phi-2-bf16-1024x2-fc", "phi-2", 1.004), ("sft-phi3-mini-bf16-1024x2-down", "phi3-mini", 1.013),
                 ("sft-phi3-mini-nf4-1024x2-down", "phi3-mini", 1.025)]


@pytest.mark.parametrize("folder,name,key,most", [(SURVEY, *arm) for arm in SURVEY_ARMS]
                         + [(SURVEY2, *arm) for arm in SURVEY2_ARMS] + [(SURVEY3, *arm) for arm in SURVEY3_ARMS]
                         + [(ANYLORA, *arm) for arm in ANYLORA_ARMS]
                         + [(HELDADAPTER, *arm) for arm in HELDADAPTER_ARMS] + [(QUIET, *arm) for arm in QUIET_ARMS]
                         + [(QUIET2, *arm) for arm in QUIET2_ARMS] + [(PHIQUIET, *arm) for arm in PHIQUIET_ARMS])
def test_a_held_out_resident_arm_is_estimated_at_or_above_its_measured_peak(folder, name, key, most):
    """Resident arms nobody had measured (results/resident-heldout-survey-traces-h100-*: preference tasks, NF4 and
    bf16, untied heads, large adapters past step 1, accumulation, families no resident trace had): the corrected
    estimate is at or above each real peak (the committed JSON's), within ``most`` of it. Two were under before the
    reference phase held the policy's graph and the NF4 load's rests were replayed: Mistral-7B NF4 KTO 512x2 at 0.9932x
    (its peak is in the reference's forward, at its head) and Llama-3.1-8B NF4 ORPO 1024x1 at 0.99985x. The second
    survey, held out from that change, would have been under on five of its arms (0.9849x-0.9987x: Mistral-7B and
    Llama-3.1-8B NF4 DPO 512x1, Llama-3.1-8B NF4 KTO 512x2, Mistral-7B NF4 KTO 512x2 checkpointed, Phi-3-mini NF4 KTO
    512x2); with it each is 1.0002x-1.0031x. The any-target arms (ANYLORA), held out from the NF4, Phi-3 and phi
    sequence on any targets with an attention input one and from the NF4 policy adapter's bf16, are 1.0002x-1.0048x
    where those are what they lacked (SmolLM2 NF4 on the MLP alone 1.00004x, held out from layer 0's quiet attention);
    the six held out from the adapter's changes (HELDADAPTER) 1.0002x-1.0074x; the nine held out from the quiet
    layer 0 (QUIET) 1.0002x-1.0055x, and eight more held out from it (QUIET2: KTO, SimPO, checkpointing, accumulation)
    1.0002x-1.0036x; phi-2 bf16 on fc1 and fc2 1.0032x (PHIQUIET; Phi-3 on down_proj alone keeps the bound,
    1.0121x bf16, 1.0238x NF4)."""
    from issue395.estimator.cards import CARDS

    d = json.loads((ROOT / "results" / folder / f"res-{name}.json").read_text())
    e = estimate_resident(config_json(key), quant=d["quant"], seq=d["seq"], batch=d["batch"], task=d["task"],
                          targets=tuple(d["targets"].split(",")), lora_r=d["r"], steps=d["steps"],
                          accumulation=d["accum"], release="0.77.0", transformers="5.16.1",
                          checkpointing=str(d["train"].get("gradient_checkpointing")).lower() == "true",
                          dispatch=CARDS["h100"].dispatch)
    assert d["real_peak"] <= e.corrected_predicted <= most * d["real_peak"]


def test_a_resident_reference_forward_binds_beside_the_policys_graph_where_its_head_outweighs_the_loss():
    """TRL's reference forward runs after the policy's and before its backward: without checkpointing the policy's
    whole graph is held through it. Resident Mistral-7B NF4 KTO 512x2's real peak is in that forward (the anatomy's
    phases: a no-grad forward after the policy's grad one), at its head (the fp32 head's bf16 cast beside the policy's
    own); the estimate binds in the reference phase there, and the loss phase alone would be under the real peak."""
    from issue395.estimator.cards import CARDS
    from issue395.estimator.terms import Phase, phase_sum

    d = json.loads((ROOT / "results" / SURVEY / "res-kto-mistral-7b-nf4-512x2.json").read_text())
    phases = [p["from"] for p in d["phases"]]
    binding = max(d["phases"], key=lambda p: p["max"])["from"]
    assert "(no grad)" in binding and phases.index(binding) > phases.index("forward 2 (grad) end")
    e = estimate_resident(config_json("mistral-7b"), quant="nf4", seq=512, batch=2, task="kto", release="0.77.0",
                          transformers="5.16.1", dispatch=CARDS["h100"].dispatch)
    assert e.phase == Phase.REFERENCE.value
    loss = e.corrected_predicted - phase_sum(e.terms, Phase.REFERENCE) + phase_sum(e.terms, Phase.LOSS)
    assert loss < d["real_peak"] <= e.corrected_predicted


def test_the_no_grad_heads_moment_is_the_blocks_the_reference_forward_made_live_at_the_kto_peak():
    """estimate.reference_head for a resident NF4 run (fp32 normed hidden and head, each cast to bf16 for the
    matmul, and the bf16 logits) is, byte for byte, what the reference's forward had made and still held at resident
    Mistral-7B NF4 KTO 512x2's real peak (its allocator history replayed: the blocks born after that forward's event
    marker, bench/task_peak_anatomy.py's MARK)."""
    import gzip

    from issue395.estimator.estimate import reference_head
    from issue395.measure.trace import held_at, replay_trace

    trace = json.loads(gzip.open(ROOT / "results" / SURVEY / "res-kto-mistral-7b-nf4-512x2.trace.json.gz", "rt",
                                 encoding="utf-8").read())
    mark = 512 * 10_007
    marks = {size: i for i, (action, _, size, *_) in enumerate(trace["events"])
             if action == "alloc" and mark <= size < mark + 1024 * 32}
    peak = replay_trace(trace).peak_at
    started = max(i for i in marks.values() if i < peak)  # the forward the peak is in
    made = sum(h.size for h in held_at(trace, peak) if h.born > started)
    assert made == reference_head(arch_from_config(config_json("mistral-7b")), 2 * 512, fp32_norm=True,
                                  fp32_head=True)


def _history(folder: str, name: str) -> tuple:
    """A committed H100 history (its JSON, its trace's events), the index of each of its event markers (bench/
    task_peak_anatomy.py's MARK: a block of MARK + 1024 k bytes at its k-th event), and its real peak's event."""
    import gzip

    from issue395.measure.trace import replay_trace

    d = json.loads((ROOT / "results" / folder / f"res-{name}.json").read_text())
    trace = json.loads(gzip.open(ROOT / "results" / folder / f"res-{name}.trace.json.gz", "rt",
                                 encoding="utf-8").read())
    mark = 512 * 10_007
    marks = sorted(i for i, (action, _, size, *_) in enumerate(trace["events"])
                   if action == "alloc" and mark <= size < mark + 1024 * 32)
    return d, trace, marks, replay_trace(trace).peak_at


def _resident(key: str, d: dict):
    return estimate_resident(config_json(key), quant=d["quant"], seq=d["seq"], batch=d["batch"], task=d["task"],
                             targets=tuple(d["targets"].split(",")), lora_r=d["r"], release="0.77.0",
                             transformers="5.16.1")


def test_a_resident_nf4_sft_adapter_is_charged_at_the_bf16_the_trainer_casts_it_to():
    """Under a 4-bit model TRL casts the SFT and DPO policy's LoRA weights to bf16 (steady.adapter_bytes), resident
    as streamed: resident Llama-3.1-8B NF4 SFT r64 on all seven linears holds, before its step, 96 blocks of
    1,835,008 B (gate's and up's B and down's A, 14,336 x 64 x 2) and none at fp32's 3,670,016; the estimate charges
    the bf16 adapter (it charged fp32 and was 1.0200x; 1.0048x now)."""
    from issue395.estimator.arch import lora_params
    from issue395.measure.trace import held_at

    d, trace, marks, _ = _history(ANYLORA, "sft-llama31-8b-nf4-512x2-r64-all")
    sizes = [h.requested for h in held_at(trace, marks[0])]
    assert (sizes.count(1_835_008), sizes.count(3_670_016)) == (96, 0)
    a = arch_from_config(config_json("llama31-8b"))
    e = _resident("llama31-8b", d)
    assert e.terms["lora_weights"] == 2 * lora_params(a, tuple(d["targets"].split(",")), 64)
    assert d["real_peak"] <= e.corrected_predicted <= 1.006 * d["real_peak"]


@pytest.mark.parametrize("folder,name,key", [(SURVEY3, "dpo-mistral-7b-nf4-512x1-r16-all", "mistral-7b"),
                                             (SURVEY2, "dpo-llama31-8b-nf4-512x1", "llama31-8b")])
def test_dpos_fp32_reference_adapters_bf16_casts_are_what_its_forward_made_of_adapter_shape_at_the_real_peak(
        folder, name, key):
    """TRL's DPO "ref" adapter is fp32 (made before the policy's bf16 cast) and its parameters need a gradient, so
    autocast caches a bf16 copy of each of its LoRA matrices through the reference's no-grad forward: at resident NF4
    DPO's real peak (in that forward) the blocks it made of the adapter's bf16 shapes (r x fan-in, fan-out x r) are
    resident.reference_adapter_casts, byte for byte, and the estimate, which charges them in the reference phase
    beside the bf16 policy adapter, is at or above the peak (with the policy bf16 and no casts it was under: Mistral
    all seven 0.99862x, Llama-8B q,v 0.99983x)."""
    from issue395.estimator.resident import reference_adapter_casts
    from issue395.measure.trace import held_at

    d, trace, marks, peak = _history(folder, name)
    a, targets = arch_from_config(config_json(key)), tuple(d["targets"].split(","))
    shapes = {2 * d["r"] * a.modules[t][k] for t in targets for k in (0, 1)}
    started = max(i for i in marks if i < peak)  # the no-grad forward the peak is in
    made = sum(h.size for h in held_at(trace, peak) if h.born > started and h.requested in shapes)
    assert made == reference_adapter_casts(a, targets, d["r"])
    e = _resident(key, d)
    assert e.phase == "reference" and e.terms["reference_adapter_casts"] == made
    assert d["real_peak"] <= e.corrected_predicted
