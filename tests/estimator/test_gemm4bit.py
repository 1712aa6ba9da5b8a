"""estimator/gemm4bit.py (issue 52): which kernel bitsandbytes' NF4 gemm_4bit runs on a card, ported from the pinned
release and held to its own heuristic, to the H100 histories' requests, and read off a saved result's card."""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections import Counter

import pytest
from conftest import ROOT

from issue395.estimator import gemm4bit
from issue395.estimator.arch import arch_from_config
from issue395.estimator.cards import CARDS, saved_dispatch
from issue395.estimator.gemm4bit import Dispatch, fused_shapes, gemm_choices, uses_fused
from issue395.estimator.stacks import package_version
from issue395.model.registry import config_json

H100 = CARDS["h100"].dispatch


def _cuda_ops():
    spec = importlib.util.spec_from_file_location("bench_allocator_replay", ROOT / "bench" / "allocator_replay.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.cuda_ops()


@pytest.mark.skipif(package_version("bitsandbytes") != gemm4bit.SEQUENCE_BITSANDBYTES,
                    reason="the port is of the pinned bitsandbytes' heuristic")
def test_the_port_answers_as_bitsandbytes_own_heuristic_on_every_branch(monkeypatch):
    """uses_fused against the installed bitsandbytes' _gemm_4bit_use_custom_cuda (bf16 input), on every compute
    capability it branches on, SM counts from a laptop part's to past any card's, row counts at and around each
    threshold it names, and weight shapes small and large, square, tall and short in K, from the registry's families
    and around its wave boundaries."""
    import torch

    ops = _cuda_ops()
    use = ops._gemm_4bit_use_custom_cuda.__wrapped__
    caps = [(6, 1), (7, 0), (7, 5), (8, 0), (8, 6), (8, 7), (8, 9), (9, 0), (10, 0), (11, 0), (12, 0), (12, 1)]
    rows = sorted({1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 16, 17, 23, 24, 32, 33, 48, 49, 64, 65, 96, 97, 128, 129,
                   192, 193, 256, 257, 320, 321, 384, 385, 512, 513, 1024, 1536})
    shapes = {s for k in ("qwen3-0.6b", "llama32-1b", "mistral-7b", "phi3-mini", "phi-2", "gemma2-2b", "smol")
              for s in gemm4bit.gemm_shapes(arch_from_config(config_json(k)))}
    shapes |= {(n, k) for n in (64, 576, 1024, 2048, 3072, 4096, 8192, 14336, 28672)
               for k in (64, 512, 1024, 2048, 4096, 12288, 14336)}
    differ = []
    for sms in (20, 40, 58, 82, 108, 132, 170, 400):
        for cap in caps:
            monkeypatch.setattr(ops, "_gpu_dispatch_props", lambda index, cap=cap, sms=sms: (sms, *cap))
            card = Dispatch(sms, *cap)
            differ += [(card, M, n, k) for M in rows for n, k in shapes
                       if uses_fused(card, M, n, k) != use(0, torch.bfloat16, M, n, k)]
    assert differ == []


#: H100 histories of streamed NF4 SFT steps (r8 on q and v, one step): (the model's key, the layers' count of
#: requests of the MLP's dequantised-weight size, h x intermediate bf16, as the history has them).
H100_NF4 = {"walk-heldout-traces-h100-soup0.77.0-c6b8a76/lay-sft-qwen3-0.6b-nf4-128x1-r8": "qwen3-0.6b",
            "accumulation-and-fused-traces-h100-soup0.77.0-6327fff/lay-sft-qwen3-0.6b-nf4-512x1-r8": "qwen3-0.6b",
            "nf4-layer-traces-h100-soup0.77.0-3a30b5a/call-2/lay-sft-qwen3-0.6b-nf4-2048x1-r8": "qwen3-0.6b",
            "walk-heldout-traces-h100-soup0.77.0-c6b8a76/lay-sft-mistral-nf4-64x1-r8": "mistral-7b",
            "nf4-layer-traces-h100-soup0.77.0-3a30b5a/call-1/lay-sft-mistral-nf4-512x1-r8": "mistral-7b",
            "nf4-layer-traces-h100-soup0.77.0-3a30b5a/call-1/lay-sft-llama31-8b-nf4-1024x1-r8": "llama31-8b"}


@pytest.mark.parametrize("path", H100_NF4)
def test_each_h100_history_dequantises_the_mlp_weights_the_port_leaves_unfused(path):
    """Where the dequantising fallback runs, a streamed layer makes a linear's bf16 weight three times (its forward,
    its recompute, its backward's input gradient); where the fused kernel runs, only in the backward. On the H100
    (132 SMs, sm_90) the port fuses Qwen3-0.6B's gate and up at 128 tokens, not at 512 or 2048, and none of
    Mistral-7B's or Llama-3.1-8B's at 64 to 1024: each history's count of MLP-weight-sized requests is that, where
    every card's worst case (all dequantised) would be 252 on Qwen3 at 128 tokens."""
    stem = ROOT / "results" / path
    row = json.loads(stem.with_name(stem.name + ".json").read_text())
    trace = json.loads(gzip.open(stem.with_name(stem.name + ".trace.json.gz"), "rt").read())
    a = arch_from_config(config_json(H100_NF4[path]))
    T, size = row["seq"] * row["batch"], 2 * a.h * a.i
    fused = fused_shapes(a, T, H100)
    per_layer = sum(1 if (fo, fi) in fused else 3 for fi, fo, _ in a.modules.values() if 2 * fi * fo == size)
    made = Counter(e[2] for e in trace["events"] if e[0] == "alloc")[size]
    assert made == a.L * per_layer
    assert bool(fused) == (H100_NF4[path] == "qwen3-0.6b" and T == 128)


def test_a_known_card_has_one_choice_and_an_unknown_one_every_choice_some_card_may_make():
    """The estimate replays every subset of the shapes some card may fuse where the card is unknown (the largest is
    never under the run's); on a known card its one answer: Mistral-7B at 512 tokens dequantises on an H100 and an
    H200, where a card-agnostic estimate must also replay its k/v fused."""
    mistral = arch_from_config(config_json("mistral-7b"))
    assert gemm_choices(mistral, 512, H100) == [frozenset()] == gemm_choices(mistral, 512, CARDS["h200"].dispatch)
    assert len(gemm_choices(mistral, 512)) > 1
    assert gemm_choices(mistral, 4, H100) == [frozenset(gemm4bit.gemm_shapes(mistral))]  # bitsandbytes' floor


def test_the_card_a_saved_result_ran_on_is_read_from_what_it_recorded():
    """A result records the device's SM count and compute capability (results/stack.py); an older one only its CUDA
    name, read where a named card's is that name (the H100 and H200 of the committed stacks); an unknown name, no
    bitsandbytes recorded or another than the ported release, or a card without bf16, gives none, and the estimate
    keeps every card's choices."""
    assert saved_dispatch({"gpu_sms": 58, "gpu_cc": "8.9", "bitsandbytes": "0.50.2"}) == Dispatch(58, 8, 9)
    assert saved_dispatch({"gpu": "NVIDIA H100 80GB HBM3", "bitsandbytes": "0.50.2"}) == Dispatch(132, 9, 0)
    assert saved_dispatch({"gpu": "NVIDIA H200", "bitsandbytes": "0.50.2"}) == Dispatch(132, 9, 0)
    assert saved_dispatch({"gpu": "NVIDIA H200"}) is None  # which bitsandbytes chose is not known
    assert saved_dispatch({"gpu": "NVIDIA H100 PCIe", "bitsandbytes": "0.50.2"}) is None
    assert saved_dispatch({"gpu": "NVIDIA H200", "bitsandbytes": "0.45.0"}) is None
    assert saved_dispatch(None) is None and CARDS["a10g"].dispatch is None
    # before compute capability 8 Soup computes in fp16 (no bf16), whose branches are not ported: no Dispatch
    assert CARDS["t4"].dispatch is None and CARDS["v100-16gb"].dispatch is None
    assert saved_dispatch({"gpu_sms": 40, "gpu_cc": "7.5", "bitsandbytes": "0.50.2"}) is None
