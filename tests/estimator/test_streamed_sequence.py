"""estimator/streamed_sequence.py (issue 52 item 1): the streamed step's optimizer steps, built from the estimator's
own shapes, are the committed H100 histories' (soup-cli 0.77.0, torch's own requests, bench/task_peak_anatomy.py
--trace) block for block from the pool each history leaves at the step's start; the adapter replayed into fresh
segments alone is under two histories' rests, so the estimate keeps its bound. No CUDA is faked: both sides are
replays of request sequences through estimator/allocator.py."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path
from unittest.mock import patch

import pytest
from conftest import canonical_runs

from issue395.constants import CUBLAS_WORKSPACE, K_SMALL_SIZE, MiB, block_bytes
from issue395.estimator.allocator import DESCENDING_TOP, CachingAllocator, _chain, allocation_size
from issue395.estimator.arch import arch_from_config, registration_order
from issue395.estimator.cards import CARDS
from issue395.estimator.estimate import ADAPTER_RESTS, checked_arguments, estimate_key
from issue395.estimator.recorder import Requests
from issue395.estimator.decoder import layer, layer_parameters
from issue395.estimator.steady import adapter_bytes, lora_tensors
from issue395.estimator.streamed_sequence import (MATERIALISED, adamw_step, adapter_elements, fresh_rests,
                                                  dpo_step, layer_backward, layers_forward, nf4_step_replayed,
                                                  nf4_step_rests, placed_rests, walk_replayed, walked_rests,
                                                  setup, setup_replayed, sft_step, step_replayed, step_rests)
from issue395.estimator.terms import Phase
from issue395.measure.trace import held_at, replay_trace, replaying_trace, seeded
from issue395.model.registry import config_json

ROOT = Path(__file__).resolve().parents[2] / "results"
#: bench/task_peak_anatomy.py's event markers every history holds (its MARK, 5,123,584 B, then 1,024 B more each
#: event; made and freed at once: the tool's, not the step's), left out of the comparison: each goes back to the
#: free block it was cut from.
TRANSIENTS = (5_000_000, 5_200_000)
TRACES = {"qwen": "anatomy-and-segments52-h100-soup0.77.0-96b7b97/seg-dpo-qwen-bf16-2048x1-r64-all-s3-a1",
          "llama32-1b": "anatomy-and-segments52-h100-soup0.77.0-96b7b97/seg-sft-llama32-1b-bf16-2048x1-r64-all-s3-a1",
          "phi3-mini": "segments52-and-anatomy-h100-soup0.77.0-96b7b97/seg-sft-phi3-nf4-2048x1-r64-fused-s3-a4",
          "phi3-mini-a1": "resident-gc-traces-phi2-llama-smol-phi3nf4-h100-soup0.77.0-07712a8/"
                          "seg-sft-phi3-nf4-2048x1-r64-fused-s3-a1",
          "mistral-7b": "segments52-mistral-r256-h100-soup0.77.0-927f7a2/seg-sft-mistral-nf4-1024x1-r256-all-s3-a1"}


def _model(key: str) -> str:
    """The registry key of a history's model (a key past the first on one model names its arm)."""
    return "phi3-mini" if key.startswith("phi3-mini") else key


def _history(key: str) -> tuple[dict, dict]:
    return _history_at(TRACES[key])


def _history_at(path: str) -> tuple[dict, dict]:
    stem = ROOT / path
    return (json.loads(gzip.open(f"{stem}.trace.json.gz", "rt").read()),
            json.loads(Path(f"{stem}.json").read_text()))


def _adapter(key: str, row: dict) -> tuple:
    """The row's Arch, its LoRA targets as the estimate resolves them (all-linear), and bytes an adapter element."""
    cfg = config_json(_model(key))
    a = arch_from_config(cfg)
    targets, _ = checked_arguments(cfg, a, quant=row["quant"], seq=row["seq"], batch=row["batch"],
                                   targets=tuple(row["targets"].split(",")), lora_r=row["r"], steps=row["steps"],
                                   accumulation=row["accum"], buffers=2, task=row["task"])
    return a, targets, adapter_bytes(row["task"], row["quant"])


class Logged(Requests):
    """Requests on a given allocator (a history's, where it stands), each large block's (request, size) logged."""

    def __init__(self, alloc):
        super().__init__()
        self.alloc, self.log = alloc, []

    def get(self, nbytes: int):
        k = super().get(nbytes)
        if k is not None:
            self.log.append((nbytes, self.held[k].size))
        return k


def _windows(trace: dict, sizes: list) -> list:
    """Each (first, last) event index where the history's large-pool requests run exactly ``sizes``, in order."""
    large = [(i, int(row[2])) for i, row in enumerate(trace["events"])
             if row[0] == "alloc" and block_bytes(int(row[2])) > K_SMALL_SIZE]
    got = [s for _, s in large]
    return [(large[j][0], large[j + len(sizes) - 1][0]) for j in range(len(got) - len(sizes) + 1)
            if got[j:j + len(sizes)] == sizes]


def _from(trace: dict, start: int, n: int) -> tuple:
    """The history's allocator just before event ``start`` (a Logged on it), and the (request, block size) of its
    next ``n`` large-pool requests from there."""
    q = next(Logged(ev.alloc) for ev in replaying_trace(trace) if ev.index == start - 1)
    real = []
    for ev in replaying_trace(trace):
        if ev.index >= start and ev.row[0] == "alloc" and block_bytes(int(ev.row[2])) > K_SMALL_SIZE:
            real.append((int(ev.row[2]), ev.block.size))
            if len(real) == n:
                return q, real
    raise AssertionError("the history ends first")


@pytest.mark.parametrize("key", TRACES)
def test_each_optimizer_step_from_the_pool_its_history_leaves_is_the_historys_block_for_block(key):
    """Issue 52 item 1: in each committed streamed history (3 steps) step 1's foreach AdamW step is one run of the
    large requests adamw_step makes (each parameter's two states in model.parameters()'s order, then a square-root
    temporary each), and steps 2 and 3 two runs of its temporaries alone; replayed from the allocator the history
    leaves just before each, every block adamw_step gets is the history's own size, so the same rest (Mistral-7B
    NF4 r256's step 1: 88,080,384 B kept, Llama-3.2-1B's none; Phi-3-mini NF4 at 1 micro-batch as at 4)."""
    trace, row = _history(key)
    a, targets, per = _adapter(key, row)
    elements = adapter_elements(a, targets, row["r"])
    first = [b for n in elements for b in (per * n, per * n) if block_bytes(b) > K_SMALL_SIZE]
    temporaries = [per * n for n in elements if block_bytes(per * n) > K_SMALL_SIZE]
    step1 = _windows(trace, first + temporaries)
    assert len(step1) == 1
    later = [i for i, _ in _windows(trace, temporaries) if i > step1[0][1]]
    assert len(later) == 2
    rests = []
    for start, made, is_first in [(step1[0][0], first + temporaries, True)] + [(i, temporaries, False) for i in later]:
        q, real = _from(trace, start, len(made))
        adamw_step(q, elements, per, "adamw_torch", first=is_first)
        assert q.log == real
        rests.append(sum(size - block_bytes(req) for req, size in real))
    assert (rests[0] == 0) == (key == "llama32-1b") and rests[1] == rests[2] <= rests[0]


def test_adapter_elements_follow_the_layers_registration_order_whatever_order_the_targets_are_named_in():
    """The optimizer's parameter order is model.parameters()'s: each layer's targets in the layer's module order,
    lora_A then lora_B; the same matrices lora_tensors counts."""
    a = arch_from_config(config_json("qwen"))
    named = ("down_proj", "q_proj", "v_proj")
    e = adapter_elements(a, named, 8)
    assert e == adapter_elements(a, tuple(reversed(named)), 8)
    assert e[:6] == [8 * a.modules["q_proj"][0], 8 * a.modules["q_proj"][1], 8 * a.modules["v_proj"][0],
                     8 * a.modules["v_proj"][1], 8 * a.modules["down_proj"][0], 8 * a.modules["down_proj"][1]]
    assert sorted(e) == sorted(lora_tensors(a, named, 8))
    phi3 = arch_from_config(config_json("phi3-mini"))  # Phi3Attention registers o_proj before qkv_proj
    assert adapter_elements(phi3, ("qkv_proj", "o_proj"), 8) == [8 * w for _ in range(phi3.L) for m in (
        "o_proj", "qkv_proj") for w in phi3.modules[m][:2]]


def test_an_optimizer_whose_step_is_not_built_is_refused_and_the_fused_one_makes_no_temporary():
    """adamw_step builds torch's AdamW only: bitsandbytes' 8-bit one is refused; the fused kernel makes the states
    alone, so nothing is freed and the allocator holds exactly the states."""
    a = arch_from_config(config_json("mistral-7b"))
    elements = adapter_elements(a, ("gate_proj", "down_proj"), 256)
    with pytest.raises(ValueError, match="not built"):
        adamw_step(Requests(), elements, 2, "adamw_8bit")
    q = Requests()
    states = adamw_step(q, elements, 2, "adamw_torch_fused")
    assert len(states) == 2 * len(elements) and set(q.held) == set(states)


@pytest.mark.parametrize("key", ("phi3-mini", "mistral-7b"))
def test_the_adapter_replayed_into_fresh_segments_is_under_the_historys_rests_so_the_estimate_keeps_the_bound(key):
    """What is left of issue 52 item 1: without the step's own history (the streamed layers' backward deciding the
    pool), the adapter's parameters, gradients, states and temporaries replayed into fresh segments keep less than
    the adapter-shaped blocks keep at the history's real peak (Phi-3-mini NF4 at 4 micro-batches: 19,660,800 B
    against 30,408,704 B; Mistral-7B NF4 r256: 187,695,104 B against 244,318,208 B), so charged in place of the
    bound the estimate would be under: it charges the bound, at or above the history's rests."""
    trace, row = _history(key)
    a, targets, per = _adapter(key, row)
    fresh = sum(fresh_rests(a, targets, row["r"], per, recast=per == 2).values())
    r = replay_trace(trace)
    sizes = {per * n for n in adapter_elements(a, targets, row["r"])}
    real = sum(h.rest for h in held_at(trace, r.peak_at) if h.requested in sizes)
    e = estimate_key(key, quant=row["quant"], seq=row["seq"], batch=row["batch"], release="0.77.0", task=row["task"],
                     targets=tuple(row["targets"].split(",")), lora_r=row["r"], steps=row["steps"],
                     accumulation=row["accum"], soup=False, transformers="5.16.1")
    charged = sum(e.terms.get(t.key, 0) for t in ADAPTER_RESTS if Phase(e.phase) in t.phases)
    assert r.peak == row["real_peak"] and fresh < real <= charged


def _layout(alloc) -> Counter:
    """The large pool's segments that hold a live block, each as its blocks in address order (size, and the
    request or None where free): a multiset, so the cudaMalloc addresses that order the segments do not count."""
    out = Counter()
    for head in alloc.blocks():
        if head.prev is not None:
            continue
        blocks = list(_chain(head))
        if not head.small and any(b.allocated for b in blocks):
            out[tuple((b.size, b.requested if b.allocated else None) for b in blocks)] += 1
    return out


@pytest.mark.parametrize("key", ("qwen", "llama32-1b", "mistral-7b"))
def test_the_setup_built_from_the_arch_is_each_historys_start_segment_for_segment(key):
    """Issue 52 item 1, where the parameters sit: soup-cli 0.77.0's streamed setup built from the Arch (a tied
    model's embedding, the adapter fp32 in the layers' module order, two pool slots of one layer's tensors, an
    untied model's one LargeLayerBufferPool slot, DPO's reference copy, under NF4 the adapter recast to bf16 matrix
    by matrix, the workspace), each new segment below the earlier ones, lays out the large pool as the history's
    start segments (the layout the window opened on, torch's snapshot): every segment the same blocks, requests and
    free rests (Qwen2.5-0.5B DPO: 144 adapter blocks packed into 20 MiB segments beside the pool's q, o and MLP
    slots; Mistral-7B NF4 r256: the packed 8 and 28 MiB shards, the 7 and 2 MiB bf16 matrices in the 20 and 14 MiB
    segments their fp32 forms left, 7 MiB in 8 MiB and 2 MiB in 3 MiB blocks). The rests it leaves the adapter's
    blocks are those the history's setup blocks keep at its real peak (9,764,864 B; Llama-3.2-1B's 2 MiB blocks
    none; Mistral-7B 57,671,680 B); the layer spec taken in the checkpoint's sorted key order lays Qwen's out
    otherwise, and Mistral's recast adapter placed by the allocator's default (new segments after the old) too."""
    trace, row = _history(key)
    a, targets, per = _adapter(key, row)
    dpo = row["task"] == "dpo"

    def built(descending: bool = True) -> Requests:
        q = Requests()
        q.alloc = CachingAllocator(descending=descending)
        setup(q, a, targets, row["r"], reference=dpo, quant=row["quant"])
        return q

    start, _ = seeded(trace["start_segments"])
    assert _layout(built().alloc) == _layout(start)
    r = replay_trace(trace)
    sizes = {per * n for n in adapter_elements(a, targets, row["r"])}
    at_setup = [h for h in held_at(trace, r.peak_at) if h.born < 0 and h.requested in sizes]
    placed = placed_rests(a, targets, row["r"], dpo, row["quant"])
    assert placed == sum(h.rest for h in at_setup) == {"qwen": 9_764_864, "llama32-1b": 0,
                                                       "mistral-7b": 57_671_680}[key]
    if key == "qwen":
        with patch("issue395.estimator.streamed_sequence.layer_parameters",
                   lambda a, k: sorted(layer_parameters(a, k))):
            assert _layout(built().alloc) != _layout(start)
    if key == "mistral-7b":
        assert _layout(built(descending=False).alloc) != _layout(start)


#: Phi-3-mini NF4 r64 fused SFT 2048x1 streamed histories (H100, soup-cli 0.77.0, --segments), at 1 and 4
#: micro-batches: the same setup, so the same start segments.
PHI3_NF4 = {"a1": TRACES["phi3-mini-a1"], "a4": TRACES["phi3-mini"]}


class FirstBelow(CachingAllocator):
    """The descending placement, but the first ``n`` large segments go in address order below every later one (the
    driver's placement read off a history's addresses, not a rule this module has)."""

    def __init__(self, n: int):
        super().__init__(descending=True)
        self.n, self.below, self.top = n, 0, DESCENDING_TOP

    def _new_segment(self, size, small, stream, at):
        if at is None and not small:
            seg = allocation_size(size)
            if self.n:
                self.n, at, self.below = self.n - 1, self.below, self.below + seg
            else:
                self.top = at = self.top - seg
        return super()._new_segment(size, small, stream, at)


@pytest.mark.parametrize("arm", PHI3_NF4)
def test_phi3s_nf4_setup_is_its_historys_start_but_for_where_the_driver_put_its_first_two_segments(arm):
    """Issue 52, Phi-3-mini NF4: its streamed setup (the adapter fp32, two slots of packed shards, the large-layer
    slot, the adapter recast to bf16 one matrix at a time) in the layer's registration order (Phi3Attention makes
    o_proj before qkv_proj: registration_order) lays out the history's start segment for segment once each new segment
    sits where the driver put the history's: its first two adapter segments (made before the slots) lie below the
    slots, the rest below one another. The Arch's order (qkv_proj first) misses even then: a qkv slot in an adapter
    segment's tail. Under the descending placement alone the adapter's segments depart, so the setup is not charged
    for Phi-3 (NF4_SETUPS; placed_rests, the larger of both placements, keeps 9,568,256 B against the history's
    8,781,824 B at its real peak)."""
    trace, row = _history_at(PHI3_NF4[arm])
    a, targets, per = _adapter("phi3-mini", row)
    start, _ = seeded(trace["start_segments"])

    def built(alloc) -> Requests:
        q = Requests()
        q.alloc = alloc
        setup(q, a, targets, row["r"], reference=False, quant="nf4")
        return q

    adapter_segments = sorted(int(s["address"]) for s in trace["start_segments"] if s["total_size"] == 20 * MiB)
    slot_segments = [int(s["address"]) for s in trace["start_segments"] if s["total_size"] == 24 * MiB]
    assert adapter_segments[1] < min(slot_segments) < adapter_segments[2]  # the driver's, read off the history
    q = built(FirstBelow(2))
    assert _layout(q.alloc) == _layout(start)
    with patch("issue395.estimator.streamed_sequence.registration_order", lambda a: tuple(a.modules)):
        assert _layout(built(FirstBelow(2)).alloc) != _layout(start)
    assert _layout(built(CachingAllocator(descending=True)).alloc) != _layout(start)
    r = replay_trace(trace)
    sizes = {per * n for n in adapter_elements(a, targets, row["r"])}
    at_setup = sum(h.rest for h in held_at(trace, r.peak_at) if h.born < 0 and h.requested in sizes)
    made = [k for k in q.held if q.held[k].requested in sizes]
    assert q.rests(made) == at_setup == 8_781_824 < placed_rests(a, targets, row["r"], False, "nf4") == 9_568_256
    assert registration_order(a)[:2] == ("o_proj", "qkv_proj")
    assert not setup_replayed(a, "nf4", "sft", release="0.77.0", transformers="5.16.1", stream={}, probed=False,
                              buffers=2, environ={})


def test_the_setup_is_charged_only_where_it_was_checked():
    """The replayed setup's rests replace the parameters' bound only on what the histories ran: in bf16 a tied
    llama, qwen2 or gemma2 or an untied llama, mistral, phi or phi3, SFT or DPO, soup-cli 0.77.0 with its
    default streaming and two slots, transformers 5.16.1, the default allocator's cutting (expandable segments' split
    peak drops the rest terms anyway), and under NF4 Mistral's untied SFT (its history). A tied NF4 model, an untied
    qwen2, a qwen3 (no rests its history could show), a gemma or gemma3 in bf16, NF4 DPO (its copy beside the
    recast), another release, a probe's step at setup, ORPO, another split size: the bound."""
    qwen, mistral = arch_from_config(config_json("qwen")), arch_from_config(config_json("mistral-7b"))
    ok = dict(release="0.77.0", transformers="5.16.1", stream={}, probed=False, buffers=2, environ={})
    assert setup_replayed(qwen, "none", "dpo", **ok) and setup_replayed(qwen, "none", "sft", **ok)
    assert not setup_replayed(qwen, "nf4", "sft", **ok) and not setup_replayed(qwen, "none", "orpo", **ok)
    assert setup_replayed(mistral, "none", "sft", **ok) and setup_replayed(mistral, "none", "dpo", **ok)
    assert setup_replayed(arch_from_config(config_json("phi-2")), "none", "sft", **ok)
    untied_qwen = arch_from_config({**config_json("qwen"), "tie_word_embeddings": False})
    assert not untied_qwen.tied and not setup_replayed(untied_qwen, "none", "sft", **ok)
    for key in ("gemma-2b", "gemma3-1b", "qwen3-0.6b"):
        assert not setup_replayed(arch_from_config(config_json(key)), "none", "sft", **ok)
    assert setup_replayed(mistral, "nf4", "sft", **ok) and not setup_replayed(mistral, "nf4", "dpo", **ok)
    for change in ({"release": "0.73.3"}, {"probed": True}, {"buffers": 3}):
        assert not setup_replayed(mistral, "nf4", "sft", **{**ok, **change})
    for change in ({"release": "0.73.3"}, {"probed": True}, {"transformers": "5.25.0"}, {"buffers": 3},
                   {"stream": {"stream_loss_chunk": 512}},
                   {"environ": {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}}):
        assert not setup_replayed(qwen, "none", "sft", **{**ok, **change})


#: Held-out H100 histories of bf16 large adapters (all linears, 2 steps) made after the setup was built, then six
#: more after the first seven admitted their types, then DPO on the two types those six admitted: the registry key.
#: Untied Mistral-7B, Llama-3.1-8B, phi-2 and Phi-3-mini (its fused linears), Qwen3's q and k norms, Gemma-2's four
#: norms; SFT and DPO; r32-r64, 512-2048 tokens.
BF16_LARGE = {f"bf16-large-adapter-traces-h100-soup0.77.0-d1ab762/seg-{arm}-s2-a1": key for arm, key in (
    ("sft-mistral-bf16-1024x1-r32-all", "mistral-7b"), ("dpo-mistral-bf16-512x1-r32-all", "mistral-7b"),
    ("sft-llama31-8b-bf16-512x1-r64-all", "llama31-8b"), ("sft-phi-2-bf16-2048x1-r32-all", "phi-2"),
    ("sft-qwen-bf16-1024x1-r64-all", "qwen"), ("dpo-llama32-1b-bf16-1024x1-r64-all", "llama32-1b"),
    ("sft-qwen3-0.6b-bf16-1024x1-r64-all", "qwen3-0.6b"))} | {
    f"bf16-setup-heldout-traces-h100-soup0.77.0-ba1cd82/seg-{arm}-s2-a1": key for arm, key in (
        ("sft-phi-2-bf16-1024x1-r64-all", "phi-2"), ("dpo-phi-2-bf16-512x1-r32-all", "phi-2"),
        ("sft-mistral-bf16-512x1-r64-all", "mistral-7b"), ("dpo-llama31-8b-bf16-512x1-r32-all", "llama31-8b"),
        ("sft-gemma2-2b-bf16-1024x1-r64-all", "gemma2-2b"), ("sft-phi3-mini-bf16-1024x1-r64-fused", "phi3-mini"))} | {
    f"heldout-orpo-simpo-setup-traces-h100-soup0.77.0-27f5f40/seg-{arm}-s2-a1": key for arm, key in (
        ("dpo-phi3-mini-bf16-1024x1-r32-fused", "phi3-mini"), ("dpo-gemma2-2b-bf16-512x1-r64-all", "gemma2-2b"))}


@pytest.mark.parametrize("path", BF16_LARGE)
def test_the_bf16_setup_is_each_held_out_historys_start_and_its_parameters_rests_to_the_byte(path):
    """Issue 52 item 1, held out: soup-cli 0.77.0's bf16 setup (setup: the embedding or, untied, the head's slot after
    the layers', the adapter fp32, two slots, DPO's copy) built from the Arch lays out each history's start segment
    for segment under both placements of new segments, so the parameters' rests placed_rests charges are the
    history's to the byte (six keep 2.1-14.4 MB; the 1 MiB-a-block bound they replace is 48-192 MiB). Each is
    admitted but Qwen3-0.6B's, whose adapter has no block over 1 MiB (its rests could not be told)."""
    trace, row = _history_at(path)
    a, targets, per = _adapter(BF16_LARGE[path], row)
    start, _ = seeded(trace["start_segments"])
    for descending in (True, False):
        q = Requests()
        q.alloc = CachingAllocator(descending=descending)
        setup(q, a, targets, row["r"], reference=row["task"] == "dpo")
        assert _layout(q.alloc) == _layout(start)
    sizes = {per * n for n in adapter_elements(a, targets, row["r"])}
    history = sum(b.size - block_bytes(b.requested) for b in next(replaying_trace(trace)).alloc.live()
                  if b.requested in sizes)
    assert placed_rests(a, targets, row["r"], row["task"] == "dpo") == history
    assert setup_replayed(a, "none", row["task"], release="0.77.0", transformers="5.16.1", stream={}, probed=False,
                          buffers=2, environ={}) is (a.model_type != "qwen3")


def test_the_held_out_setups_keep_rests_where_any_does():
    """The check above is not vacuous: six of the held-out histories' parameters keep rests (Mistral-7B's SFT and
    DPO, Qwen2.5's SFT, phi-2's, Llama-3.1-8B's and Phi-3-mini's DPO), and every one but Qwen3-0.6B's has adapter
    blocks over 1 MiB."""
    kept, large = 0, 0
    for path, key in BF16_LARGE.items():
        trace, row = _history_at(path)
        a, targets, per = _adapter(key, row)
        kept += placed_rests(a, targets, row["r"], row["task"] == "dpo") > 0
        large += any(block_bytes(per * n) > K_SMALL_SIZE for n in adapter_elements(a, targets, row["r"]))
    assert (kept, large) == (6, 14)


@pytest.mark.parametrize("path", BF16_LARGE)
def test_held_out_bf16_large_adapters_are_never_under_and_the_setups_charge_only_lowers_them(path):
    """Issue 52 item 1, held out: each history's corrected estimate (its card's dispatch, the stack it ran on) is at
    or above its real max_memory_allocated (the committed JSON's, measured), and where the setup is replayed the
    estimate is at or below the one the 1 MiB-a-block bound gives (setup_replayed refused)."""
    d = json.loads((ROOT / f"{path}.json").read_text())
    kw = dict(quant=d["quant"], seq=d["seq"], batch=d["batch"], release="0.77.0", task=d["task"],
              targets=tuple(d["targets"].split(",")), lora_r=d["r"], steps=d["steps"], accumulation=d["accum"],
              soup=False, transformers="5.16.1", dispatch=CARDS["h100"].dispatch)
    e = estimate_key(BF16_LARGE[path], **kw)
    assert d["real_peak"] <= e.corrected_predicted
    with patch("issue395.estimator.estimate.setup_replayed", lambda *a, **k: False):
        bound = estimate_key(BF16_LARGE[path], **kw)
    assert e.corrected_predicted <= bound.corrected_predicted


@pytest.mark.parametrize("path, key", [
    ("bf16-large-adapter-traces-h100-soup0.77.0-d1ab762/seg-sft-llama31-8b-bf16-512x1-r64-all-s2-a1", "llama31-8b"),
    ("bf16-setup-heldout-traces-h100-soup0.77.0-ba1cd82/seg-sft-mistral-bf16-512x1-r64-all-s2-a1", "mistral-7b")])
def test_the_untied_step_departs_from_its_history_so_only_its_setup_is_charged(path, key):
    """Llama-3.1-8B and Mistral-7B bf16 SFT r64 512x1 (untied, llama's layer as STEP_CHECKED's Llama-3.2-1B): step 1
    replayed (step_rests) keeps the parameters' rests but less in the states than each history's own, so the step
    is not charged for them (Llama-3.1-8B: step_replayed admits tied models only; Mistral-7B is not in STEP_CHECKED)
    while the tied Llama-3.2-1B's is; their setup (above) holds and is charged."""
    trace, row = _history_at(path)
    a, targets, per = _adapter(key, row)
    sizes = [per * n for n in adapter_elements(a, targets, row["r"]) if block_bytes(per * n) > K_SMALL_SIZE]
    history = _adapter_sets(trace, row, sizes)
    replay = step_rests(a, targets, row["r"], row["task"], row["seq"], row["batch"])
    assert replay["parameters"] == history["parameters"] and replay["states"] < history["states"]
    ok = dict(dropout=True, accumulation=1, optimizer="adamw_torch", steps=2, release="0.77.0",
              transformers="5.16.1", stream={}, probed=False, buffers=2, environ={})
    assert not step_replayed(a, "none", "sft", **ok)
    assert step_replayed(arch_from_config(config_json("llama32-1b")), "none", "sft", **ok)


@pytest.mark.parametrize("key", TRACES)
def test_each_traced_arm_is_charged_at_or_above_its_real_peak_and_its_adapter_rests(key):
    """Never under (issue 52 item 1): on each committed streamed history the corrected estimate is at or above
    the real peak (max_memory_allocated) and the adapter rest terms of its binding phase at or above what the
    adapter-shaped blocks keep there; where the setup and step 1 are replayed (the bf16 two: step_replayed) the
    term is the parameters' and step 1's AdamW states' rests the replay leaves, the history's at its real peak to
    the byte (Qwen2.5 DPO 15,859,712 B, 1.00024x; Llama-3.2-1B none, 1.00108x); where the setup alone is (Mistral-7B
    NF4 r256) its parameters' rests, the rest the bound; Phi-3-mini NF4 (a1 and a4) the bound."""
    trace, row = _history(key)
    a, targets, per = _adapter(key, row)
    r = replay_trace(trace)
    sizes = {per * n for n in adapter_elements(a, targets, row["r"])}
    held = [h for h in held_at(trace, r.peak_at) if h.requested in sizes and block_bytes(h.requested) > K_SMALL_SIZE]
    e = estimate_key(_model(key), quant=row["quant"], seq=row["seq"], batch=row["batch"], release="0.77.0",
                     task=row["task"], targets=tuple(row["targets"].split(",")), lora_r=row["r"], steps=row["steps"],
                     accumulation=row["accum"], soup=False, transformers="5.16.1")
    charged = sum(e.terms.get(t.key, 0) for t in ADAPTER_RESTS if Phase(e.phase) in t.phases)
    assert e.corrected_predicted >= r.peak == row["real_peak"] and charged >= sum(h.rest for h in held)
    if row["quant"] == "none":  # the parameters' and the states' rests replayed: the history's to the byte
        assert charged == sum(h.rest for h in held) == {"qwen": 15_859_712, "llama32-1b": 0}[key]
        assert e.corrected_predicted / r.peak < 1.002


def _large(trace: dict) -> list:
    """The history's large-pool requests and frees in order, as recorder.Requests' trace writes them."""
    out = []
    for row in trace["events"]:
        nbytes = int(row[2] or 0)
        if block_bytes(nbytes) > K_SMALL_SIZE and row[0] in ("alloc", "free_requested"):
            out.append(("alloc" if row[0] == "alloc" else "free", nbytes))
    return out


@pytest.mark.parametrize("key", ("qwen", "llama32-1b", "mistral-7b"))
def test_the_streamed_layers_checkpointed_forward_is_each_historys_request_for_request(key):
    """Issue 52 item 1, the streamed step's own requests, trace first: step 1's forward through every streamed layer
    (no graph kept under Soup's recompute) built from the Arch is the history's large-pool requests and frees in
    order, the first thing after the embedding's output, layer for layer (Llama-3.2-1B SFT with LoRA dropout's
    masks: 16 layers, 2,544 events; Qwen2.5-0.5B DPO's policy forward, TRL having turned dropout off, at the paired
    batch's 4,096 tokens: 24 layers, 2,568 events, q, k and v biases in their outputs; Mistral-7B NF4 r256 SFT:
    32 layers, 5,280 events, each base Soup's dequantising NF4 forward, its fp32 absmax the large pool's on the MLP's
    weights alone, peft's bnb clone, the bf16 adapter uncast). Built over a bf16 base, Mistral's departs within its
    first layer."""
    trace, row = _history(key)
    a, targets, _ = _adapter(key, row)
    T = row["seq"] * row["batch"] * (2 if row["task"] == "dpo" else 1)
    lora = (targets, row["r"], row["task"] != "dpo")
    q = Requests(trace=True)
    layers_forward(q, a, T, lora, nf4=row["quant"] == "nf4")
    real = _large(trace)
    embedded = real.index(("alloc", 2 * T * a.h))
    assert real[embedded + 1:embedded + 1 + len(q.trace)] == q.trace
    assert len(q.trace) == {"qwen": 2568, "llama32-1b": 2544, "mistral-7b": 5280}[key]
    if row["quant"] == "nf4":
        q = Requests(trace=True)
        layers_forward(q, a, T, lora)
        departs = next(i for i, e in enumerate(q.trace) if real[embedded + 1 + i] != e)
        assert departs < len(q.trace) // a.L  # within the first layer


def test_each_streamed_layers_recompute_is_the_resident_forward_stopped_at_down_projs_lora_a():
    """What the next builder starts from (issue 52 item 1, trace first): in the Llama-3.2-1B bf16 history every layer
    but the first, in each of the 3 steps, recomputes its forward as decoder.layer builds a resident layer's with
    its graph (the first 124 large-pool events, 40 identifying it) and stops where the last tensor its backward needs
    is made (down_proj's lora_A output: torch's non-reentrant checkpoint stops early, lora_B's output never made),
    one such layer every 312
    events (the other 188: the early stop's frees and the layer's backward, its gradients among them: not built)."""
    trace, row = _history("llama32-1b")
    a, targets, _ = _adapter("llama32-1b", row)
    T = row["seq"] * row["batch"]
    q = Requests(trace=True)
    x = q.get(2 * T * a.h)
    q.trace.clear()
    layer(q, a, T, x, False, (targets, row["r"], True))
    made = q.trace
    real = _large(trace)
    starts = [i for i in range(len(real) - 40) if real[i:i + 40] == made[:40]]
    assert len(starts) == 3 * (a.L - 1)
    assert all(real[i:i + 124] == made[:124] and real[i + 124] != made[124] for i in starts)
    # the last two: down_proj's bf16 cast for lora_A (its saved input), then dropout's fp32 output freed
    assert made[122:124] == [("alloc", 2 * T * a.i), ("free", 4 * T * a.i)] and made[124] == ("alloc", 2 * T * a.h)
    assert {j - i for i, j in zip(starts, starts[1:]) if j - i < 1000} == {312}


@pytest.mark.parametrize("key", ("qwen", "llama32-1b", "mistral-7b"))
def test_each_streamed_layers_backward_is_the_historys_request_for_request(key):
    """Issue 52 item 1, the streamed step's backward, trace first: every layer's backward but the first's (its input
    needs no gradient), in each of the 3 steps of both bf16 histories, built from the Arch (down_proj's scaling
    gradient, the recompute stopped early and the frames' frees, each LoRA target's chain: lora_B, B's fp32
    gradient, lora_A, the casts, dropout's where kept, the base's share accumulated in place; the gated MLP, the two
    RMSNorms in fp32, SDPA's workspace, the two rotaries, k's and q's contiguous copies), is the history's large-pool
    requests, and between each two requests the same frees (Llama-3.2-1B: 45 layers of 312 events; Qwen2.5-0.5B
    DPO at 4,096 tokens, no dropout: 69 of 228; Mistral-7B NF4 r256 SFT, each base Soup's dequantising forward
    recomputed with its bf16 weight saved, freed after its input's gradient, the bf16 adapter's gradients made in
    bf16: 93 of 299). The gradients over 1 MiB among them are the adapter's."""
    trace, row = _history(key)
    a, targets, per = _adapter(key, row)
    T = row["seq"] * row["batch"] * (2 if row["task"] == "dpo" else 1)
    q = Requests(trace=True)
    x, g = q.get(2 * T * a.h), q.get(2 * T * a.h)
    q.trace.clear()
    grads = layer_backward(q, a, T, x, g, (targets, row["r"], row["task"] != "dpo"), nf4=row["quant"] == "nf4")
    made = canonical_runs(q.trace)
    real = _large(trace)
    starts = [i for i in range(len(real) - 40) if real[i:i + 40] == made[:40]]
    assert len(starts) == 3 * (a.L - 1) and len(made) == {"qwen": 228, "llama32-1b": 312, "mistral-7b": 299}[key]
    assert all(canonical_runs(real[i:i + len(made)]) == made for i in starts)
    one_layer = [(per if row["quant"] == "nf4" else MATERIALISED) * n
                 for n in adapter_elements(a, targets, row["r"])][:len(grads)]
    assert sorted(q.held[k].requested for k in grads if k is not None) == sorted(
        b for b in one_layer if block_bytes(b) > K_SMALL_SIZE)



@pytest.mark.parametrize("key", ("qwen", "llama32-1b"))
def test_the_whole_step_from_the_built_setup_is_each_bf16_historys_block_for_block_through_its_optimizer(key):
    """Issue 52 item 1, the pool the streamed step leaves, built: Soup's setup (no history read), step 1 (sft_step /
    dpo_step) and its AdamW step replayed on an allocator placing each new segment below the earlier ones (as the
    driver placed the histories') hand out the history's block sizes to every large request up to the optimizer
    step's last temporary (Llama-3.2-1B SFT 3,985 requests, Qwen2.5-0.5B DPO 5,688), so its rests: step 1's states
    keep 6,094,848 B (Qwen) and 0 (Llama), step_rests' figures. The history's requests left out are the anatomy
    tool's markers of 5,123,584 B and up (made and freed at once: TRANSIENTS), each cut from a free block it goes back
    to (the first makes the segment the embedding's output takes next). With the new segments placed after the
    earlier ones the history's own requests depart from its blocks at Qwen's first backward's first gradient."""
    trace, row = _history(key)
    a, targets, per = _adapter(key, row)
    elements = adapter_elements(a, targets, row["r"])
    first = [b for n in elements for b in (per * n, per * n) if block_bytes(b) > K_SMALL_SIZE]
    temporaries = [per * n for n in elements if block_bytes(per * n) > K_SMALL_SIZE]
    end = _windows(trace, first + temporaries)[0][1]
    real = [(int(ev.row[2]), ev.block.size) for ev in replaying_trace(trace) if ev.index <= end
            and ev.row[0] == "alloc" and block_bytes(int(ev.row[2])) > K_SMALL_SIZE]
    made = [x for x in real if not TRANSIENTS[0] <= x[0] < TRANSIENTS[1]]
    q = Logged(CachingAllocator(descending=True))
    dpo = row["task"] == "dpo"
    setup(q, a, targets, row["r"], reference=dpo)
    q.log.clear()
    lora = (targets, row["r"], not dpo)
    if dpo:
        dpo_step(q, a, row["seq"] * 2, 2, lora)
    else:
        sft_step(q, a, row["seq"], lora)
    adamw_step(q, elements, per, "adamw_torch")
    assert q.log == made and len(made) == {"qwen": 5688, "llama32-1b": 3985}[key] and len(real) > len(made)
    states = sum(size - block_bytes(req) for req, size in made[-len(first + temporaries):][:len(first)])
    assert states == step_rests(a, targets, row["r"], row["task"], row["seq"], 1)["states"] == \
        {"qwen": 6_094_848, "llama32-1b": 0}[key]
    if dpo:  # the allocator's default placement, on the history's own requests
        alloc, held = seeded(trace["start_segments"])
        blocks, got = {}, []
        for ev in replaying_trace(trace):
            if ev.row[0] == "alloc":
                blocks[ev.row[1]] = b = alloc.malloc(int(ev.row[2]))
                if block_bytes(int(ev.row[2])) > K_SMALL_SIZE:
                    got.append((int(ev.row[2]), b.size, ev.block.size))
            elif ev.row[0] == "free_requested":
                alloc.free(blocks.pop(ev.row[1], None) or held.pop(int(ev.row[1])))
            if len(got) > 3000:
                break
        departs = next(i for i, (req, model, torch) in enumerate(got) if model != torch)
        assert got[departs][0] == per * row["r"] * a.i and got[departs][1] < got[departs][2]  # an MLP gradient


HELD_OUT = Path(__file__).resolve().parents[2] / "results" / "heldout52-bf16-h100-soup0.77.0-6f7ab1f"


@pytest.mark.parametrize("name, key", [("seg-sft-llama-bf16-1024x1-r32-all-s3-a1", "llama32-1b"),
                                       ("seg-dpo-qwen-bf16-1024x1-r128-all-s3-a1", "qwen")])
def test_held_out_arms_inside_the_replays_gate_are_never_under_and_within_one_percent(name, key):
    """Issue 52 item 1, held out: two streamed bf16 arms measured on an H100 after the steady-state replay was built
    (another r, another seq: r32 SFT and r128 DPO at 1024x1, all seven linears, 3 steps) are at or above their real
    max_memory_allocated and within 1.010x of it. The real peak is the committed JSON's (measured); nothing here
    is fitted to it. Before the replay the DPO arm's bound put it at 1.039x."""
    d = json.loads((HELD_OUT / f"{name}.json").read_text())
    e = estimate_key(key, quant=d["quant"], seq=d["seq"], batch=d["batch"], release="0.77.0", task=d["task"],
                     targets=tuple(d["targets"].split(",")), lora_r=d["r"], steps=d["steps"],
                     accumulation=d["accum"], soup=False, transformers="5.16.1")
    assert d["real_peak"] <= e.corrected_predicted <= 1.010 * d["real_peak"], e.corrected_predicted / d["real_peak"]


def test_the_nf4_step_is_mistrals_event_for_event_but_its_blocks_depart_so_it_is_not_charged():
    """Issue 52 item 1, NF4 trace first (Mistral-7B NF4 r256 all-linear SFT 1024x1, H100): step 1 built from the
    Arch (sft_step over streamed NF4 bases: each layer's checkpointed forward, the loss with the untied head in the
    large pool's slot, each layer's backward, the first's q, k and v bases out of the graph) is the history's
    large-pool requests and frees from the embedding's output to the first layer's backward, each run of frees in
    one order (14,909 events; the 5.12 MB transients left out). Replayed from the built setup with new segments
    below the earlier ones, the blocks depart from the history's in the backward (request 4,939: the driver put
    some of the window's new segments in the address ranges the setup's empty_cache released, which this
    placement does not model), and step 1's states keep less than the history's (53,477,376 B against 54,525,952):
    charged, it would be under, so step_replayed does not admit NF4 and the states keep the bound (nf4_step_rests
    charges the parameters' and step 1's gradients' rests, each at or above the histories' own: below)."""
    trace, row = _history("mistral-7b")
    a, targets, per = _adapter("mistral-7b", row)
    T, lora = row["seq"], (targets, row["r"], True)
    q = Requests(trace=True)
    sft_step(q, a, T, lora, nf4=True)
    made = canonical_runs(q.trace)
    real = [e for e in _large(trace) if not TRANSIENTS[0] <= e[1] < TRANSIENTS[1]]
    start = real.index(("alloc", 2 * T * a.h))
    assert canonical_runs(real[start:start + len(made)]) == made and len(made) == 14_909
    elements = adapter_elements(a, targets, row["r"])
    first = [b for n in elements for b in (per * n, per * n) if block_bytes(b) > K_SMALL_SIZE]
    temporaries = [per * n for n in elements if block_bytes(per * n) > K_SMALL_SIZE]
    end = _windows(trace, first + temporaries)[0][1]
    history = [(int(ev.row[2]), ev.block.size) for ev in replaying_trace(trace) if ev.index <= end
               and ev.row[0] == "alloc" and block_bytes(int(ev.row[2])) > K_SMALL_SIZE
               and not TRANSIENTS[0] <= int(ev.row[2]) < TRANSIENTS[1]]
    q = Logged(CachingAllocator(descending=True))
    setup(q, a, targets, row["r"], reference=False, quant="nf4")
    q.log.clear()
    sft_step(q, a, T, lora, nf4=True)
    states = adamw_step(q, elements, per, "adamw_torch")
    assert [r for r, _ in q.log] == [r for r, _ in history]
    assert next(i for i, (m, h) in enumerate(zip(q.log, history)) if m != h) == 4939
    real_states = sum(size - block_bytes(req) for req, size in history[-len(first + temporaries):][:len(first)])
    assert q.rests(states) == 53_477_376 < real_states == 54_525_952
    assert not step_replayed(a, "nf4", "sft", dropout=True, accumulation=1, optimizer="adamw_torch", steps=3,
                             release="0.77.0", transformers="5.16.1", stream={}, probed=False, buffers=2, environ={})


# -- the layer walk (walked_rests): the binding layer's rests replayed, in place of layer_remainders' bound --
#: The committed histories of streamed llama-type steps on which the walk was held (nf4-layer-traces-*: NF4, one
#: step, r8-r16; the bf16 three-step ones above): the model's registry key, the walk's figure, the history's own most
#: in its layers' backward (_backward_most), and whether walk_replayed admits the arm on the card they ran on (an
#: H100: at 64 and 512 tokens no Mistral-7B or Llama-3.1-8B shape runs the fused gemm_4bit there).
_NF4 = "nf4-layer-traces-h100-soup0.77.0-3a30b5a/"
WALK_TRACES = {_NF4 + "call-1/lay-sft-llama31-8b-nf4-1024x1-r8": ("llama31-8b", 524_288, 524_288, True),
               _NF4 + "call-2/lay-sft-mistral-nf4-1024x2-r8": ("mistral-7b", 524_288, 524_288, True),
               _NF4 + "call-2/lay-dpo-mistral-nf4-512x1-r8": ("mistral-7b", 524_288, 0, True),
               _NF4 + "call-2/lay-sft-llama31-8b-nf4-512x1-r16-all": ("llama31-8b", MiB, MiB, True),
               _NF4 + "call-1/lay-sft-mistral-nf4-512x1-r8": ("mistral-7b", MiB, 0, True),
               "walk-heldout-traces-h100-soup0.77.0-c6b8a76/lay-sft-mistral-nf4-64x1-r8": ("mistral-7b", 0, 0, True),
               TRACES["qwen"]: ("qwen", 983_040, 983_040, False), TRACES["llama32-1b"]: ("llama32-1b", 0, 0, False)}
#: ...and the two where adapter blocks over 1 MiB share the layers' segments: the walk is under their histories.
UNWALKED = {"heldout52-bf16-h100-soup0.77.0-6f7ab1f/seg-dpo-qwen-bf16-1024x1-r128-all-s3-a1": "qwen",
            "nf4-layer-traces-h100-soup0.77.0-3a30b5a/call-1/seg-sft-mistral-nf4-1024x1-r64-all-s3-a1": "mistral-7b"}


def _backward_most(trace: dict, T: int, V: int, adapter: set) -> int:
    """The most the blocks a history made hold past their requests at once in its layers' backward windows, the
    adapter-shaped ones (``adapter``: their request sizes) left out. A window opens when the loss's last logits-sized
    block (T x V bf16 and up) goes and closes at the window's last adapter-shaped request (the optimizer's step's
    temporaries where one runs; the next forward makes none)."""
    live, big, window, most = {}, 0, [], 0

    def close():
        last = max((j for j, (_, made) in enumerate(window) if made), default=-1)
        return max([most] + [s for s, _ in window[:last + 1]])

    opened = False
    for ev in replaying_trace(trace):
        kind, nbytes = ev.row[0], int(ev.row[2] or 0)
        if kind not in ("alloc", "free_requested"):
            continue
        big += (1 if kind == "alloc" else -1) * (nbytes >= 2 * T * V)
        if kind == "alloc" and nbytes not in adapter and ev.block.size > block_bytes(nbytes):
            live[id(ev.block)] = ev.block.size - block_bytes(nbytes)
        elif kind == "free_requested":
            live.pop(id(ev.block), None)
        if big:
            most, window, opened = (close() if window else most), [], True
        elif opened and kind == "alloc":
            window.append((sum(live.values()), nbytes in adapter))
    return close() if window else most


def _walk_arm(path: str, key: str) -> tuple:
    trace, row = _history_at(path)
    a, targets, per = _adapter(key, row)
    T = row["seq"] * row["batch"] * (2 if row["task"] == "dpo" else 1)
    adapter = {m * n for n in adapter_elements(a, targets, row["r"]) for m in (per, MATERIALISED)}
    walked = walked_rests(a, targets, row["r"], row["task"], row["seq"], row["batch"], row["quant"],
                          dropout=row["task"] == "sft", steps=row["steps"], accumulation=row["accum"])
    admitted = walk_replayed(a, row["quant"], row["task"], T, targets, row["r"], optimizer="adamw_torch",
                             steps=row["steps"], workspace=CUBLAS_WORKSPACE, card=CARDS["h100"].dispatch,
                             release="0.77.0",
                             transformers="5.16.1", stream={}, probed=False, buffers=2, environ={})
    return trace, row, a, T, adapter, walked, admitted


@pytest.mark.parametrize("path", WALK_TRACES)
def test_the_walked_layer_rests_are_at_or_above_each_historys_most_in_its_layers_backward(path):
    """Issue 52 item 1, the layer phase: on each committed streamed history of a llama-type model the walk's figure
    (the setup and up to two steps replayed under both placements of new segments, the larger) is at or above the
    most the history's own non-adapter blocks held past their requests at once in any layers' backward: equal on
    six of the eight (the layers' 8 MiB-and-up blocks keep none; a rest is a 3.5 MiB fp32 absmax's 512 KiB or a 1
    MiB one), 0.5-1 MiB over on Mistral-7B NF4 at 512 tokens. On the H100 walk_replayed admits the six untied NF4
    arms (no shape of theirs runs the fused gemm_4bit there, gemm4bit.fused_shapes); the two bf16 r64 arms' adapters
    are large-pool."""
    trace, row, a, T, adapter, walked, admitted = _walk_arm(path, WALK_TRACES[path][0])
    assert (walked, _backward_most(trace, T, a.V, adapter), admitted) == WALK_TRACES[path][1:]


@pytest.mark.parametrize("path", UNWALKED)
def test_where_adapter_blocks_share_the_layers_segments_the_walk_is_under_and_not_charged(path):
    """Why walk_replayed asks for a small-pool adapter: on the two histories whose adapter's gradients and states are
    large-pool blocks (Qwen2.5-0.5B DPO bf16 r128 all-linear, Mistral-7B NF4 r64 all-linear, 3 steps), where the
    driver puts them moves the layers' blocks, and the walk comes out 0.25 and 0.5 MiB under the history's backward
    (so they keep layer_remainders' bound). On the other two such histories it is exact (the bf16 arms above)."""
    trace, row, a, T, adapter, walked, admitted = _walk_arm(path, UNWALKED[path])
    assert walked < _backward_most(trace, T, a.V, adapter) <= walked + MiB // 2 and not admitted


def test_the_estimate_charges_the_walk_only_where_it_is_admitted():
    """The binding layer's rests are the walk's on a small-pool adapter past the fused gemm_4bit's window (Mistral-7B
    NF4 1024x2: 0.5 MiB where the bound charges 21 MiB, so 1.0015x of its H100 peak, not 1.0123x; the same under
    accumulation: its gradients never reach the large pool; at 512x1 on a card known to dequantise there, an H100 or
    an H200: 1.0028x of its H100 peak, not 1.0128x), and the bound's where some card may fuse and the card is not
    known (512x1), the adapter is large-pool (r64 all-linear), or on another model type or release."""
    mistral = arch_from_config(config_json("mistral-7b"))
    kw = dict(quant="nf4", release="0.77.0", soup=False, transformers="5.16.1")
    e = estimate_key("mistral-7b", seq=1024, batch=2, **kw)
    walked = walked_rests(mistral, ("q_proj", "v_proj"), 8, "sft", 1024, 2, "nf4", dropout=True)
    assert e.terms["layer_remainders"] == walked == 524_288
    _, row = _history_at("nf4-layer-traces-h100-soup0.77.0-3a30b5a/call-2/lay-sft-mistral-nf4-1024x2-r8")
    assert row["real_peak"] <= e.corrected_predicted < 1.002 * row["real_peak"]
    everything = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert estimate_key("mistral-7b", seq=1024, batch=2, accumulation=4, **kw).terms["layer_remainders"] == walked
    for other in (dict(seq=512, batch=1), dict(seq=1024, r=64, targets=everything), dict(seq=1024, release="0.73.3")):
        args = {"batch": 2, **kw, **other}
        if "r" in args:
            args["lora_r"] = args.pop("r")
        bounded = estimate_key("mistral-7b", **args)
        assert bounded.terms["layer_remainders"] > 4 * MiB
    phi3 = estimate_key("phi3-mini", seq=2048, **kw)
    assert phi3.terms["layer_remainders"] > 4 * MiB
    _, row = _history_at("nf4-layer-traces-h100-soup0.77.0-3a30b5a/call-1/lay-sft-mistral-nf4-512x1-r8")
    for card in ("h100", "h200"):
        known = estimate_key("mistral-7b", seq=512, dispatch=CARDS[card].dispatch, **kw)
        assert known.terms["layer_remainders"] == MiB
    assert row["real_peak"] <= known.corrected_predicted < 1.003 * row["real_peak"]


# -- accumulation: the gradients held between micro-batches, replayed (step_rests' ``accumulation``) --
FIT4 = "fit4-anatomy-findmax-h200-soup0.77.0-2de65db-and-f2319d3/call-1-2/"


class KeyLog(Requests):
    """Requests that log each large request's key and each free's, in order (a small-pool block's as None: a free
    all the same, which opens a run of frees)."""

    def __init__(self):
        super().__init__()
        self.log = []

    def get(self, nbytes: int):
        k = super().get(nbytes)
        if k is not None:
            self.log.append(("alloc", k))
        return k

    def put(self, *keys) -> None:
        super().put(*keys)
        self.log += [("free", k) for k in keys]


def _layer_backward_logged(accumulating: bool) -> tuple:
    a = arch_from_config(config_json("llama32-1b"))
    everything = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    q = KeyLog()
    q.accumulating = accumulating
    x, g = q.get(2 * 2048 * a.h), q.get(2 * 2048 * a.h)
    grads = [k for k in layer_backward(q, a, 2048, x, g, (everything, 64, True)) if k is not None]
    return q, grads


def test_from_the_second_micro_batch_each_new_gradient_is_freed_with_the_next_run_of_frees():
    """AccumulateGrad under accumulation: micro-batch 1's backward leaves each LoRA matrix's gradient live (.grad
    itself: Llama-3.2-1B r64 all-linear's three 2 MiB ones in the large pool); from micro-batch 2 on it adds each new
    one in place as soon as it is made (its sequence number is the highest) and the engine frees it with the next run
    of frees: the same requests, each gradient freed right after the first free that follows it, nothing left."""
    first, grads = _layer_backward_logged(False)
    assert len(grads) == 3 and all(k in first.held for k in grads)
    later, left = _layer_backward_logged(True)
    want, pending = [], []
    for event in first.log:
        want.append(event)
        if event[0] == "alloc" and event[1] in grads:
            pending.append(event[1])
        elif event[0] == "free" and pending:
            want += [("free", k) for k in pending]
            pending = []
    large = [e for e in later.log if e != ("free", None)]  # the small-pool frees only mark where a run is
    assert left == [] and large == [e for e in want if e != ("free", None)] != first.log


FIT4 = "fit4-anatomy-findmax-h200-soup0.77.0-2de65db-and-f2319d3/call-1-2/"


@pytest.mark.parametrize("arm,key,rests", (("anatomy-sft-llama32-1b-bf16-2048x1-r64-all-s3-a4", "llama32-1b", 0),
                                           ("anatomy-dpo-qwen-bf16-2048x1-r64-all-s3-a4", "qwen", 22_413_312)))
def test_accumulations_held_gradients_charge_their_replayed_rests_not_the_bound(arm, key, rests):
    """Issue 52 item 1, accumulation > 1 (the H200 fit4 anatomies, 4 micro-batches, r64 all-linear, 3 steps; no
    history of their own): where the step is replayed (step_replayed: Llama-3.2-1B SFT, Qwen2.5-0.5B DPO) the
    adapter's rests beside every phase are the replay's, the parameters' and step 1's states' and step 2's first
    micro-batch's gradients' (Qwen: 9,764,864 + 7,405,568 + 5,242,880 B; Llama none), not 1 MiB a block
    (151.0 and 236.3 MB), and the corrected estimate stays at or above the measured peak, within 0.2% of it (it
    was 1.0321x and 1.0176x with only the setup's parameter rests replayed)."""
    row = json.loads((ROOT / f"{FIT4}{arm}.json").read_text())
    e = estimate_key(key, quant="none", seq=row["seq"], batch=row["batch"], release="0.77.0", task=row["task"],
                     targets=tuple(row["targets"].split(",")), lora_r=row["r"], steps=row["steps"],
                     accumulation=row["accum"], soup=False, transformers="5.16.1")
    assert e.terms.get("unsplit_remainders", 0) == rests
    assert row["real_peak"] <= e.corrected_predicted < 1.002 * row["real_peak"]


ACCUMULATED = {"accumulation-and-fused-traces-h100-soup0.77.0-6327fff/seg-sft-llama32-1b-bf16-2048x1-r64-all-s3-a4":
               ("llama32-1b", 0, 0),
               "accumulation-and-fused-traces-h100-soup0.77.0-6327fff/seg-sft-llama32-1b-bf16-2048x1-r64-all-s3-a2":
               ("llama32-1b", 0, 0),
               "accumulation-and-fused-traces-h100-soup0.77.0-6327fff/seg-dpo-qwen-bf16-2048x1-r64-all-s3-a4":
               ("qwen", 22_413_312, 19_398_656)}


@pytest.mark.parametrize("path", ACCUMULATED)
def test_each_accumulated_history_holds_at_most_the_replayed_adapter_rests_at_its_peak(path):
    """Issue 52 item 1, accumulation's held gradients, against a history of their own (H100, r64 all-linear, 3 steps,
    4 and 2 micro-batches): at the real peak (step 2 or 3's loss, a later micro-batch) the adapter-shaped blocks hold
    at most what the replay charges beside every phase (the parameters' rests the history's to the byte; the states'
    and held gradients' 3.0 MB over on Qwen2.5 DPO, none on Llama-3.2-1B), and the corrected estimate is at or above
    the measured peak within 0.2%."""
    key, charged, held = ACCUMULATED[path]
    trace, row = _history_at(path)
    a, targets, per = _adapter(key, row)
    r = replay_trace(trace)
    sizes = {per * n for n in adapter_elements(a, targets, row["r"])}
    at_peak = sum(h.rest for h in held_at(trace, r.peak_at) if h.requested in sizes)
    e = estimate_key(key, quant="none", seq=row["seq"], batch=row["batch"], release="0.77.0", task=row["task"],
                     targets=tuple(row["targets"].split(",")), lora_r=row["r"], steps=row["steps"],
                     accumulation=row["accum"], soup=False, transformers="5.16.1")
    assert (e.terms.get("unsplit_remainders", 0), at_peak) == (charged, held)
    assert r.peak == row["real_peak"] <= e.corrected_predicted < 1.002 * row["real_peak"]


# -- NF4's step (nf4_step_rests): the parameters' and gradients' rests replayed, the states' and temporaries' bound --
_LARGE = "nf4-large-adapter-traces-h100-soup0.77.0-e1dab65/"
#: The H100 histories of NF4 large adapters on all seven linears whose adapter-shaped requests no other request of
#: the step matches in size (so each set is told apart by its order): the registry key, and whether the replay's
#: states keep less than the history's (the reason they are not charged).
NF4_STEP_TRACES = {_NF4 + "call-1/seg-sft-mistral-nf4-1024x1-r64-all-s3-a1": ("mistral-7b", True),
                   "walk-heldout-traces-h100-soup0.77.0-c6b8a76/seg-sft-llama31-8b-nf4-1024x1-r64-all-s3-a1":
                   ("llama31-8b", False),
                   _LARGE + "seg-sft-mistral-nf4-1024x2-r64-all-s3-a2": ("mistral-7b", True),
                   _LARGE + "seg-sft-llama31-8b-nf4-2048x1-r64-all-s1-a1": ("llama31-8b", True)}


def _adapter_sets(trace: dict, row: dict, sizes: list) -> dict:
    """The most each of the adapter's sets over 1 MiB holds past its requests at once in a history: the parameters
    (the setup's, live at its start), and, told apart by their order, step 1's gradients (its first micro-batch's: a
    later one's are added into .grad and freed), a later step's, step 1's states (two a parameter) and each step's
    temporaries."""
    n = len(sizes)
    plan = [kind for step in range(row["steps"]) for kind in
            ["gradients" if step == 0 else "later gradients"] * n + ["added"] * n * (row["accum"] - 1)
            + ["states"] * 2 * n * (step == 0) + ["temporaries"] * n]
    made, kinds, live, most = {}, iter(plan), Counter(), Counter()
    for ev in replaying_trace(trace):
        if "parameters" not in most:
            most["parameters"] = sum(b.size - block_bytes(b.requested) for b in ev.alloc.live()
                                     if b.requested in sizes)
        if ev.row[0] == "alloc" and ev.block.requested in sizes:
            made[id(ev.block)] = kind, rest = next(kinds), ev.block.size - block_bytes(ev.block.requested)
            live[kind] += rest
            most[kind] = max(most[kind], live[kind])
        elif ev.row[0] in ("free", "free_completed") and ev.block is not None and id(ev.block) in made:
            kind, rest = made.pop(id(ev.block))
            live[kind] -= rest
    assert next(kinds, None) is None  # every planned request met: the sets were told apart
    return most


@pytest.mark.parametrize("path", NF4_STEP_TRACES)
def test_nf4s_step_replay_keeps_at_least_each_historys_parameter_and_step_1_gradient_rests_but_not_its_states(path):
    """Issue 52 item 1, NF4 large adapters: the setup and step 1 replayed under both placements (nf4_step_rests) keep,
    in the adapter's parameters and in step 1's gradients (its first micro-batch's), at least what each history's
    own keep, the larger of the placements taken; so both are charged in place of the 1 MiB bound (SFT:
    NF4_STEP_CHECKED; DPO's one history keeps 1 MiB more in its gradients; a later step's gradients keep the bound).
    Step 1's states, made in one burst in the free blocks the backward leaves, keep less than the history's on three
    of the four (the histories' backward leaves more freed 8 MiB hidden-state blocks): not charged."""
    key, states_under = NF4_STEP_TRACES[path]
    trace, row = _history_at(path)
    a, targets, per = _adapter(key, row)
    sizes = [per * n for n in adapter_elements(a, targets, row["r"]) if block_bytes(per * n) > K_SMALL_SIZE]
    history = _adapter_sets(trace, row, sizes)
    replay = nf4_step_rests(a, targets, row["r"], row["task"], row["seq"], row["batch"], dropout=row["task"] == "sft",
                            accumulation=row["accum"])
    assert history["parameters"] > 0 and history["gradients"] > 0
    assert replay["parameters"] >= history["parameters"] and replay["gradients"] >= history["gradients"]
    assert (replay["states"] < history["states"]) == states_under


def test_nf4s_step_replay_is_charged_only_where_it_was_checked():
    """nf4_step_replayed admits an untied NF4 Mistral-7B or Llama-3.1-8B SFT run with LoRA dropout's masks and an
    adapter block over 1 MiB, on the checked stack with foreach AdamW and no fused gemm_4bit at its token count; not
    bf16, another family or task, a tied model, no dropout, a small-pool adapter (r8 on q and v), the fused
    optimizer, a probed stack, nor 512 tokens where the card (so whether gemm_4bit fuses) is unknown."""
    ok = dict(dropout=True, optimizer="adamw_torch", workspace=CUBLAS_WORKSPACE, card=CARDS["h100"].dispatch,
              release="0.77.0", transformers="5.16.1", stream={}, probed=False, buffers=2, environ={})
    big = (("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 64)
    archs = {k: arch_from_config(config_json(_model(k))) for k in ("mistral-7b", "llama31-8b", "phi3-mini",
                                                                  "llama32-1b", "gemma2-2b")}
    assert nf4_step_replayed(archs["mistral-7b"], "nf4", "sft", 1024, *big, **ok)
    assert not nf4_step_replayed(archs["mistral-7b"], "nf4", "dpo", 1024, *big, **ok)
    assert nf4_step_replayed(archs["llama31-8b"], "nf4", "sft", 512, *big, **ok)
    assert not nf4_step_replayed(archs["llama31-8b"], "nf4", "sft", 512, *big, **{**ok, "card": None})
    assert not nf4_step_replayed(archs["mistral-7b"], "nf4", "sft", 1024, ("q_proj", "v_proj"), 8, **ok)
    assert not nf4_step_replayed(archs["mistral-7b"], "none", "sft", 1024, *big, **ok)
    assert not nf4_step_replayed(archs["mistral-7b"], "nf4", "orpo", 1024, *big, **ok)
    for key in ("phi3-mini", "llama32-1b", "gemma2-2b"):
        assert not nf4_step_replayed(archs[key], "nf4", "sft", 1024, *big, **ok)
    for change in ({"dropout": False}, {"optimizer": "adamw_torch_fused"}, {"probed": True}, {"release": "0.73.3"},
                   {"workspace": 2 * CUBLAS_WORKSPACE}):
        assert not nf4_step_replayed(archs["mistral-7b"], "nf4", "sft", 1024, *big, **{**ok, **change})


#: NF4 large adapters measured on an H100 (nf4-large-adapter-traces-*; two of them are NF4_STEP_TRACES' too) and an
#: H200 (a one-step run, held out), the registry key and the card each ran on.
NF4_MEASURED = {_LARGE + "seg-sft-mistral-nf4-2048x1-r128-all-s3-a1": ("mistral-7b", "h100"),
                _LARGE + "seg-dpo-mistral-nf4-512x1-r64-all-s3-a1": ("mistral-7b", "h100"),
                _LARGE + "seg-sft-llama31-8b-nf4-512x1-r32-all-s2-a1": ("llama31-8b", "h100"),
                _LARGE + "seg-sft-mistral-nf4-1024x2-r64-all-s3-a2": ("mistral-7b", "h100"),
                _LARGE + "seg-sft-llama31-8b-nf4-2048x1-r64-all-s1-a1": ("llama31-8b", "h100"),
                _LARGE + "seg-sft-gemma2-2b-nf4-1024x1-r64-all-s3-a1": ("gemma2-2b", "h100"),
                _LARGE + "seg-sft-llama32-1b-nf4-2048x1-r64-all-s3-a1": ("llama32-1b", "h100"),
                "onestep-optimizer-and-phi-traces-h200-soup0.77.0-a6f461e/call-2/one-sft-mistral-nf4-1024x1-r64-all-s1":
                ("mistral-7b", "h200")}


@pytest.mark.parametrize("path", NF4_MEASURED)
def test_nf4_large_adapters_are_never_under_their_measured_peaks(path):
    """Issue 52: the corrected estimate, on the card each ran on, is at or above every measured NF4 large adapter's
    peak (the replayed parameters, and in a one-step run step 1's gradients, where nf4_step_replayed admits the run;
    the bound elsewhere)."""
    key, card = NF4_MEASURED[path]
    row = json.loads((ROOT / f"{path}.json").read_text())
    e = estimate_key(key, quant="nf4", seq=row["seq"], batch=row["batch"], release="0.77.0", task=row["task"],
                     targets=tuple(row["targets"].split(",")), lora_r=row["r"], steps=row["steps"],
                     accumulation=row["accum"], soup=False, transformers="5.16.1", dispatch=CARDS[card].dispatch)
    assert e.corrected_predicted >= row["real_peak"]


def test_a_one_step_nf4_run_is_charged_its_replayed_gradient_rests_and_a_longer_one_the_bound():
    """Where nf4_step_replayed admits a one-step run (Llama-3.1-8B NF4 r64 all-linear 2048x1, its H100 peak within
    1.1 MB of the estimate) its gradients' rests are the replay's (nf4_step_rests) and its parameters' placed_rests';
    from step 2 on the gradients keep the 1 MiB-a-block bound (a later step's land elsewhere) and the parameters keep
    the replay's."""
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    kw = dict(quant="nf4", seq=2048, release="0.77.0", targets=targets, lora_r=64, soup=False, transformers="5.16.1",
              dispatch=CARDS["h100"].dispatch)
    a, per = arch_from_config(config_json("llama31-8b")), adapter_bytes("sft", "nf4")
    rests = nf4_step_rests(a, targets, 64, "sft", 2048, 1, dropout=True)
    one, three = estimate_key("llama31-8b", steps=1, **kw), estimate_key("llama31-8b", steps=3, **kw)
    assert one.terms["gradient_remainders"] == rests["gradients"] < sum(
        MiB for n in adapter_elements(a, targets, 64) if block_bytes(per * n) > K_SMALL_SIZE)
    assert three.terms["gradient_remainders"] == sum(
        MiB for n in adapter_elements(a, targets, 64) if block_bytes(per * n) > K_SMALL_SIZE)
    assert rests["parameters"] == placed_rests(a, targets, 64, False, "nf4") > 0


@pytest.mark.parametrize("path", [p for p, (_, under) in NF4_STEP_TRACES.items() if under and "a2" not in p]
                         + ["walk-heldout-traces-h100-soup0.77.0-c6b8a76/seg-sft-llama31-8b-nf4-1024x1-r64-all-s3-a1"])
def test_the_states_burst_from_a_historys_own_free_blocks_keeps_its_states_rests_to_the_byte(path):
    """Why the NF4 states keep their bound (docs/PEAK.md): step 1's states are one burst of requests with no free
    between them, so best fit decides their rests from the free blocks the backward left alone. Started from a
    history's own allocator where its first state is requested, the burst (two states a parameter, in the optimizer's
    order) keeps exactly the history's states' rests; the replay keeps other ones, its backward having left other
    free blocks (on two of these three, fewer lone freed 8 MiB hidden-state blocks)."""
    key, _ = NF4_STEP_TRACES[path]
    trace, row = _history_at(path)
    a, targets, per = _adapter(key, row)
    elements = adapter_elements(a, targets, row["r"])
    sizes = [per * n for n in elements if block_bytes(per * n) > K_SMALL_SIZE]
    first_state = len(sizes) * row["accum"] + 1  # step 1's gradients come first
    made = 0
    for ev in replaying_trace(trace):
        if ev.row[0] == "alloc" and ev.block.requested in sizes:
            made += 1
            if made == first_state:
                ev.alloc.free(ev.block)  # the burst below makes it again, first
                burst = [ev.alloc.malloc(per * n) for n in elements for _ in range(2) if per * n in sizes]
                break
    kept = sum(b.size - block_bytes(b.requested) for b in burst)
    assert kept == _adapter_sets(trace, row, sizes)["states"] > 0
    replay = nf4_step_rests(a, targets, row["r"], row["task"], row["seq"], row["batch"], dropout=True,
                            accumulation=row["accum"])
    assert replay["states"] != kept
