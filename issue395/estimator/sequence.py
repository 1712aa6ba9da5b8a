"""A resident LoRA step's large-pool requests built from the estimator's own shapes (``Arch``), op by op as Hugging
Face's plain decoder runs them on CUDA under bf16 autocast, and replayed through estimator/allocator.py: the rests
the blocks a layer keeps through the loss hold past their requests (issue 52 item 2: a term built from the
allocator's history, block by block, with its rounding). Stdlib only.

The sequence, as bench/allocator_replay.py captures it from the real model on the meta device (its oracle):
transformers' caching_allocator_warmup (one block of every parameter's bytes, freed at once), the checkpoint's
tensors in sorted key order, peft's LoRA tensors, then the forward: the embedding, the rotary tables and the cuBLAS
workspace their first matmul makes, each layer (the norm in fp32, each projection, each LoRA target's fp32 cast,
dropout and bf16 cast, the rotary embedding of q and k, flash SDPA, the residual adds, the gated MLP), the final
norm. A request of 1 MiB or less is the small pool's, cut at 512 B (its blocks keep no rest) and never shares a
segment with a large one: it is left out. What a block keeps past its request is fixed when it is cut, so the
layers' rests at the loss peak are those of the forward's blocks still live at its end: the loss and the backward
add none of theirs to them (their own rests are the loss terms'). The final norm's fp32 input and bf16 output
are the forward's (in ``kept``) and also among the loss terms' hidden blocks (allocator_rounding's
loss_remainders): their rests are counted twice, at most about 1 MiB over, the safe side, left so.

Each layer's ops are decoder's (bf16; Phi-3's fused layer and Gemma-2's among them), decoder_nf4's
(NF4) and decoder_phi's (phi's parallel layer); this module runs them as a step (``forward``, ``forward_nf4``,
``forward_phi``, ``kl_forward``; from the load on, ``loaded_forward``), replays them (``layer_rests``, ``load_rests``)
and says where they are the run's (``replayed``).

Built only where it was checked against the capture (``replayed``: the plain llama-type decoder, bf16 or NF4, the
protocol's SFT with LoRA dropout (bf16 on the plain llama-type decoder, any targets with q_proj, k_proj or v_proj
among them: checked_targets), transformers 5.16.1, the default allocator; under either default cuBLAS
workspace, the larger charged; under NF4 at 1,536 tokens or fewer, the largest of every gemm_4bit choice; Phi-3
and phi bf16 and NF4: BF16_SEQUENCE_TYPES, NF4_SEQUENCE_TYPES); everywhere else resident.py keeps its bound.
Checked too against a real step's own history (tests/estimator/test_sequence.py): the NF4 forward is the H100
traces' request for request (SmolLM2 1024x4, phi-2 512x1, Qwen2.5-0.5B 1024x4; bench/task_peak_anatomy.py --trace).
ORPO, SimPO and DPO run this forward (or forward_nf4) once over their stacked rows, first (SEQUENCE_TASKS,
NF4_SEQUENCE_TASKS); KTO runs it after its KL batch's forward under no_grad (``kl_forward``: the same ops with nothing
saved, then its head and TRL's per-row logsumexp), whose freed blocks the policy's are cut from: the H100 KTO
histories' request for request. Transformers'
warmup block is short of the parameters by the bytes the process holds reserved and unallocated (``WARMUP_UNUSED``:
the H100 KTO histories' starts, where a small tensor came before the load); both warmups are replayed, the larger
rests charged.
"""

from __future__ import annotations

import os
import re

from ..constants import (ALLOC_CONF_VARS, CUBLAS_WORKSPACE, CUBLAS_WORKSPACE_PRE_HOPPER, K_MIN_BLOCK_SIZE,
                         WORKSPACE_CONFIG_VAR)
from .allocator import K_SMALL_BUFFER
from .arch import Arch, protocol_targets
from .gemm4bit import Dispatch, gemm_choices
from .recorder import FP32, Requests
from .decoder import ATTN, GRADIENT_ATTENTION, MLP, gemma_norm, layer, load, norm, tables
from .decoder_nf4 import layer_nf4, load_nf4, norm32
from .decoder_phi import layer_phi, layer_phi_nf4


#: The model types whose resident step this sequence follows (their decoder is llama's: RMSNorm, rotary, SDPA,
#: a gated SiLU MLP; qwen2's q/k/v biases and qwen3's q/k norms included; phi's parallel LayerNorm layer, its own
#: functions).
SEQUENCE_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "phi")


def forward(q: Requests, a: Arch, T: int, seq: int, lora: tuple, workspace: int = CUBLAS_WORKSPACE) -> list:
    """The embedding, the rotary tables, every layer, the final norm: the blocks live at the forward's end that
    the layers made (phi's: forward_phi)."""
    if a.model_type == "phi":
        return forward_phi(q, a, T, seq, lora, workspace)
    gemma = a.model_type == "gemma2"
    emb = q.get(2 * T * a.h)
    if gemma:  # the lookup scaled by the hidden size's root: its own block, the lookup's freed
        scaled = q.get(2 * T * a.h)
        q.put(emb)
        emb = scaled
    cos, sin = tables(q, a, seq, False, workspace)
    kept, x = [], emb
    for k in range(a.L):
        out, held = layer(q, a, T, x, k == 0, lora)
        kept += held
        if k:
            q.put(x)
        x = out
    final, held = (gemma_norm if gemma else norm)(q, T, a.h, True)
    q.put(x, emb)  # the decoder's return drops the last layer's output and the embedding's
    return kept + held + [final, cos, sin]


def kl_forward(q: Requests, a: Arch, T: int, seq: int, lora: tuple, rows: int,
               workspace: int = CUBLAS_WORKSPACE, nf4: bool = False) -> None:
    """TRL 0.29's KTO KL batch, first in the step under torch.no_grad (the mismatched completions through the policy):
    ``forward``'s ops with nothing saved (``nf4``: forward_nf4's), each block gone with its last reference
    (``Requests.graph`` off); the head's bf16 logits (under NF4 after autocast's bf16 casts of its fp32 weight and
    input, freed with it; the final norm's output freed as the model returns), accelerate's fp32 copy (the bf16
    freed), TRL's selective_log_softmax over the shifted fp32 logits, one row's logsumexp ((seq - 1) x V fp32) at a
    time for each of the batch's ``rows``, then the fp32 logits freed. Every block it makes is freed by its end, the
    cuBLAS ``workspace`` (the process's, from its first matmul) and the free segments it leaves aside: the policy's
    forward is cut from them (phi's: layer_phi's, its final LayerNorm's unsaved fp32 copy, the head's bf16 cast of its
    fp32 output). Built for KL_FORWARD_TYPES (NF4: NF4_KL_FORWARD_TYPES) alone: Gemma-2's layer and phi's NF4 one
    have no no-grad path."""
    if a.model_type not in (NF4_KL_FORWARD_TYPES if nf4 else KL_FORWARD_TYPES) or a.layers is not None:
        raise ValueError(f"{a.model_type}: no KL forward is built for it{' under NF4' if nf4 else ''}")
    with q.no_graph():
        _kl_forward(q, a, T, seq, lora, rows, workspace, nf4)


def _kl_forward(q: Requests, a: Arch, T: int, seq: int, lora: tuple, rows: int, workspace: int, nf4: bool) -> None:
    phi = a.model_type == "phi"
    emb = q.get((4 if nf4 else 2) * T * a.h)
    cos, sin = tables(q, a, seq, nf4, workspace)
    x = emb
    for k in range(a.L):
        if phi:
            out = layer_phi(q, a, T, x, k == 0, lora)
        else:
            out = layer_nf4(q, a, T, x, k == 0, lora) if nf4 else layer(q, a, T, x, k == 0, lora)[0]
        if k:
            q.put(x)
        x = out
    if phi:  # the final LayerNorm's fp32 copy of its input, unsaved, and its fp32 output
        copy = q.get(4 * T * a.h)
        final = q.get(4 * T * a.h)
        q.put(copy)
    else:
        final = norm32(q, T, a.h, False) if nf4 else norm(q, T, a.h, False)[0]
    q.put(x, emb, cos, sin)
    if nf4:  # autocast's bf16 casts of the fp32 head's weight and input
        casts = [q.get(2 * a.V * a.h), q.get(2 * T * a.h)]
    else:  # phi's LayerNorm output is fp32: autocast's bf16 cast of it for the head
        casts = [q.get(2 * T * a.h)] if phi else []
    logits = q.get(2 * T * a.V)
    q.put(*casts)
    q.put(final)
    fp32 = q.get(FP32 * T * a.V)
    q.put(logits)
    for _ in range(rows):
        q.put(q.get(FP32 * (seq - 1) * a.V))
    q.put(fp32)


def load_rests(a: Arch) -> int:
    """What the quantised linears' blocks hold past their requests once a resident NF4 load is done: each is cut
    from the blocks the earlier linears' bf16 sources and fp32 absmax left free, and one served whole from a cached
    block up to 1 MiB larger keeps the rest (load_nf4; the LoRA matrices come after them, so no target moves them).
    Which blocks those are moves with the warmup's block, so both of WARMUP_UNUSED's are replayed and the larger
    charged. Every dense model (one kind of layer: the loader's order is the checkpoint's sorted keys whatever the
    type; checked on six types' H100 histories, tests/estimator/test_sequence.py), on any stack and allocator: no
    bound is narrower than the 1 MiB a packed block any other charge would be, and the replay's is the mechanism's
    own; expandable segments keep none (over). A model of several kinds of layer: 0 (not replayed).
    Evidence: docs/PEAK.md, "load_rests"."""
    if a.layers is not None:
        return 0
    key = ("load", repr(a))
    if key not in _RESTS:
        _RESTS[key] = max(replayed_load(a, unused) for unused in WARMUP_UNUSED)
    return _RESTS[key]


def replayed_load(a: Arch, unused: int) -> int:
    """What the quantised linears' blocks of a replayed NF4 load (load_nf4, its warmup ``unused`` bytes short) hold
    past their requests."""
    q = Requests()
    return q.rests(load_nf4(q, a, (), 0, unused))


def forward_phi(q: Requests, a: Arch, T: int, seq: int, lora: tuple, workspace: int = CUBLAS_WORKSPACE) -> list:
    """phi's bf16 forward: the embedding's output, the rotary tables, every layer (each input freed after the
    next layer: its LayerNorm keeps its own fp32 copy), the final LayerNorm's fp32 copy and output (the blocks
    live at its end that the forward made, returned), then autocast's bf16 cast of the head's input (the frozen
    head saves none; its bias's cast, first, is small)."""
    first = q.n + 1
    emb = q.get(2 * T * a.h)
    tables(q, a, seq, False, workspace)
    x = emb
    for k in range(a.L):
        out = layer_phi(q, a, T, x, k == 0, lora)
        if k:
            q.put(x)
        x = out
    q.get(4 * T * a.h), q.get(4 * T * a.h)
    q.put(x, emb)
    kept = [k for k in q.held if k >= first]
    q.get(2 * T * a.h)
    return kept


def forward_nf4(q: Requests, a: Arch, T: int, seq: int, lora: tuple, workspace: int = CUBLAS_WORKSPACE) -> list:
    """The NF4 forward: the fp32 embedding's output, the fp32 rotary tables, every layer (each output kept: the
    next norm saves it), the final norm (the blocks live at its end that it made, returned), then autocast's bf16
    casts of the head's fp32 weight and input."""
    first = q.n + 1
    emb = q.get(4 * T * a.h)
    tables(q, a, seq, True, workspace)
    x, phi = emb, a.model_type == "phi"
    for k in range(a.L):
        x = (layer_phi_nf4 if phi else layer_nf4)(q, a, T, x, k == 0, lora)
    if phi:
        q.get(4 * T * a.h)  # the final LayerNorm's fp32 output
    else:
        norm32(q, T, a.h)
    q.put(emb)
    kept = [k for k in q.held if k >= first]
    # autocast's bf16 casts for the head (its linear's weight, then its input: the wrapper's argument pack, right to
    # left), whose weight copy is HEAD_COPY's
    q.get(2 * a.V * a.h), q.get(2 * T * a.h)
    return kept


#: The model types whose NF4 step the sequence replays. qwen2 (its q/k/v biases) is: its NF4 forward is the H100
#: trace's request for request (Qwen2.5-0.5B 1024x4, 2,388 requests and frees from the embedding to the head's casts:
#: tests/estimator/test_sequence.py), its replay exact (real_peak 15,884,001,280 B, no departure). Its load leaves the
#: trace's start but for the warmup's 2 MiB (450,887,680 B there, 452,984,832 B here: transformers'
#: caching_allocator_warmup takes the process's reserved but unused bytes off its block, as on phi-2 below); with
#: that warmup the meta capture is within 1,536 B of four of the six committed NF4 rows (512x1, 1024x1, 1024x4,
#: 2048x4) and 2,360,832 B under the two at 2,048 tokens (512x4, 2048x1), unnamed (no trace there); without it
#: 162,304 B over at 1024x4 and up to 2,721,280 B under at 2048x4, the "2.72 MB under" that had kept the bound. The
#: trace's one departure from the capture before its backward is outside the forward: four (1023, 151936) fp32
#: blocks (621,722,112 B, one a batch row) made and freed right after the loss frees the shifted logits' fp32 copy,
#: inside that copy's freed block, before the peak (the logits gradient's). With the replayed rests every committed
#: qwen2 NF4 row is 1.00009x-1.00233x, 2.9-6.8 MB over (was 1.0041x-1.0110x on the bound).
#: phi is: its NF4 forward is the H100 trace's request for request (phi-2 512x1, tests/estimator/test_sequence.py),
#: and with peft's empty_cache after the load's fp32 casts (load_nf4; it released a wholly free 50 MiB segment the
#: capture had kept) the capture's peak is within 1,652,736 B of five of the six phi-2 NF4 rows (958,976 B,
#: 412,160 B, 956,416 B and 367,104 B over at 512x4, 1024x4, 2048x1, 2048x4; 1,652,736 B under at 1024x1) and
#: 7,741,440 B under the 512x1 row (10,362,880 B before). That one is the load's history, named from the trace: the
#: run's process held 2 MiB reserved but unused before its load, which transformers' caching_allocator_warmup takes
#: off its block (modeling_utils.py, ``byte_count - unused_memory``: 1,782,579,200 B, the capture's 1,784,676,352),
#: so the last packed weights overflow into other segments and the step starts among other free blocks; with that
#: warmup the capture's start is the trace's segment for segment, and it is 4,726,784 B under, from the first of
#: the step's large requests that picks among free blocks of one size by address (the 756th: cudaMalloc's
#: addresses, which allocator.py does not know). With the
#: replayed rests every phi-2 NF4 row is 1.00015x-1.00307x, 8.9-19.5 MB over (512x1 3.1 MB over under the H100's
#: own gemm_4bit choice, none fused; the largest of every choice is charged, the card not known).
NF4_SEQUENCE_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "phi")


#: ...but not these at a batch over 1. None now: llama was, while SmolLM2 NF4 1024x4's capture was 24,425,984 B
#: under that row's max_memory_allocated (6,339,354,624 B against 6,363,780,608), unnamed. The H100 trace of that
#: row named it: autocast casts SDPA's fp32 q, k, v to bf16 right to left (its argument pack, as linear's: v's and
#: k's kv-wide blocks before q's), where the capture cast q first and so put every layer's 2.25 MiB dropout masks
#: in other free blocks (43 of them keep a rest at the real peak, 14 at the capture's); and peft's
#: prepare_model_for_kbit_training empties the cache after its fp32 casts (peft/utils/other.py, auto_clear_cache),
#: which released the warmup's 111 MB segment, wholly free, that the capture kept and cut the step's blocks from.
#: With both the capture is 1,264,128 B over that row, its forward the trace's request for request, and SmolLM2's
#: batched captures within 91,648 B of their rows (512x4 24,064 B under, 2048x4 91,648 B under: inside the
#: allowance, estimate.ALLOCATED_ALLOWANCE_BYTES); the batched SmolLM2 NF4 rows go 1.0190x-1.0240x (bounded) ->
#: 1.0004x-1.0016x.
NF4_BATCHED_HELD_BACK = ()


#: The model types whose bf16 step the sequence replays. phi3 is (its fused qkv and gate_up): its sequence is the
#: capture's request for request (Phi-3-mini 512x1-1024x4); before the capture laid flash's output out as q (its
#: cat-built q's output copied by transformers' transpose(1, 2).contiguous(): output_copy) its own peak at 512x1 was
#: 23,332,352 B under that row's max_memory_allocated and with the replayed rests the row would have been 16,953,152 B
#: under; now the capture is 263,680 B under at 512x1, 512x4 and 1024x4 (3,917,824 B over at 1024x1), and with the
#: replayed rests every committed Phi-3-mini bf16 row (512x1-1024x4, the 2048 ones past its window refused) is
#: 1.00012x-1.00068x, what the real exceeds the capture by inside the allowance (estimate.ALLOCATED_ALLOWANCE_BYTES),
#: as on the other replayed families.
#: phi is (forward_phi): with layer_norm and pow under autocast's fp32 policy in the capture (bench/
#: allocator_replay.py's FP32_POLICY) the capture's peak is within 778,240 B of every committed phi-2 bf16 row's
#: max_memory_allocated (the real 778,240 B under at 512x1, where it kept no rest of the capture's 786,432 B;
#: 24,064-538,624 B over at the other five, with CUDA's request order in the capture),
#: both holding 5,569,854,464 B before the step; with the replayed
#: rests and resident.norm_casts (the LayerNorms' fp32 weight copies, 655,360 B, seen in the capture) charged,
#: the estimate's physics is within 30,720 B of the capture's peak (under at 512x4, 1024x4, 2048x1, 2048x4), and
#: what the real exceeds the capture by is inside the allowance (estimate.ALLOCATED_ALLOWANCE_BYTES): every row
#: 1.0000x-1.0007x, 2.67-6.50 MB over.
BF16_SEQUENCE_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi", "phi3")


#: The model types whose step the sequence replays on any LoRA targets among the layer's linears, not only the
#: protocol's, bf16 and NF4 (``layer``, ``layer_nf4`` and phi's build every target alike). Issue 51 item 3: on SmolLM2
#: bf16 777x1 with all seven linears the bound charged 23,003,136 B where the capture's blocks kept 56,182,784 B past
#: their requests (a request served whole from a cached block up to 1 MiB larger keeps its rest, one a block, which
#: the bound's "1 MiB a 20 MiB segment" for blocks under 10 MiB does not cover): 29,538,228 B under the capture's
#: peak. Issue 52: NF4, Phi-3 and phi too, once three things the protocol's targets never ran were built: under NF4
#: o_proj's (phi: dense's) LoRA layer takes SDPA's bf16 output, so its base output, peft's clone, dropout's output
#: (what lora_A saves) and the sum are bf16 (lora4bit's ``fp32``); without LoRA dropout lora_A saves its input
#: itself, the transposed copy Phi-3 and phi make of SDPA's output, which then lives to the backward; phi's MLP reads
#: the LayerNorm's output, not the attention's, so in layer 0 only an fc1 target gives it a graph. Checked against
#: the meta capture request for request (tests/estimator/test_sequence.py) and held out on the H100
#: (results/resident-anylora-traces-*: twelve arms, all seven linears, q/k/v/o, v/o, an MLP mix, 1.0002x-1.0053x
#: where these rests were what the bound had over, which was up to 1.0409x). Each with a decoder.GRADIENT_ATTENTION
#: target among them (checked_targets).
ANY_TARGET_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "phi")


#: ...or, bf16 or NF4 on these, with none of decoder.GRADIENT_ATTENTION among them (o_proj and the MLP's linears alone):
#: layer 0's q, k, v and SDPA run as without a graph (``attention``'s and ``attention_nf4``'s ``quiet``), o_proj records
#: only as a target (its LoRA saves what it would elsewhere, with no mask: its input needs no gradient), and with no
#: o_proj target the post-attention norm saves nothing and the MLP only what its targets need (``mlp``'s ``grad``): the
#: capture's request for request on SmolLM2, Qwen2.5, Llama-3.2-1B and Mistral-7B, bf16 and NF4 (Llama-3.1-8B too),
#: under bitsandbytes' own gemm_4bit choice and its fallback (tests/estimator/test_sequence.py; on Qwen3 each run of
#: frees in another order, which leaves the allocator as it is), and the H100's histories request for request on nine
#: arms held out from it (results/resident-quiet-traces-*: SmolLM2, Qwen2.5, Qwen3, Llama-3.2-1B, Llama-3.1-8B,
#: Mistral-7B; SFT, ORPO, DPO; then eight more, KTO, SimPO, checkpointing and accumulation among them:
#: resident-quiet2-traces-*). Not Phi-3, whose quiet attention (its output copy) and fused gate_up are not built.
QUIET_ATTENTION_TYPES = ("llama", "mistral", "qwen2", "qwen3")
#: ...and in bf16 alone, phi's parallel layer on dense and fc1, fc2 alone: its layer 0's q, k, v, rotary cats and SDPA
#: as without a graph, dense recording only as a target (decoder_phi.phi_attention's ``quiet``; its MLP reads the
#: LayerNorm's output, so only an fc1 target gives it a graph there, as before): the capture's request for request,
#: up to the order of a run of frees (phi-2 512x1-2048x1 and 512x4-1024x4, dense, fc1, fc2 and their mixes, LoRA
#: dropout on and off), its rests the capture's to the byte. Its NF4 layer (phi_attention_nf4 keeps every block)
#: is not built so.
QUIET_BF16_TYPES = ("phi",)


def checked_targets(a: Arch, quant: str, targets: tuple) -> bool:
    """Whether the sequence was checked on these LoRA targets (a set; each named once): the protocol's on every
    type it replays, or, bf16 or NF4 on ANY_TARGET_TYPES, any of the layer's linears with a GRADIENT_ATTENTION one
    among them, or, bf16 or NF4 on QUIET_ATTENTION_TYPES (bf16 on QUIET_BF16_TYPES too), o_proj (phi's dense) and the
    MLP's linears alone (the capture's request for request: tests/estimator/test_sequence.py)."""
    if len(targets) != len(set(targets)):
        return False
    if set(targets) == set(protocol_targets(a)):
        return True
    quiet = QUIET_ATTENTION_TYPES + (QUIET_BF16_TYPES if quant == "none" else ())
    if (quant in ("none", "nf4") and a.model_type in quiet
            and set(targets) <= (set(MLP) | {"o_proj", "dense"}) & set(a.modules)):
        return True
    return (quant in ("none", "nf4") and a.model_type in ANY_TARGET_TYPES and set(targets) <= set(a.modules)
            and bool(set(targets) & set(GRADIENT_ATTENTION)))


#: The tasks whose resident forward is this sequence at its rows' tokens: SFT's (the captures), and the preference
#: tasks whose policy runs once over the chosen and rejected rows stacked (2 x batch rows) before anything else of
#: the step: ORPO's and SimPO's (no reference), and DPO's (TRL 0.29's _compute_loss runs the reference's no-grad
#: forward after the policy's, so the policy's blocks are placed as SFT's). Checked: at each H100 history's real
#: peak the forward's blocks keep the replay's rests (Qwen2.5-0.5B ORPO 1024x2 and DPO 1024x2 none, the replay
#: none, where the bound charged 162 MB; held out after them: Llama-3.2-1B ORPO, SmolLM2 SimPO and DPO,
#: Qwen3-0.6B SimPO and DPO; results/resident-gemma2-qwen-traces-*, heldout-orpo-simpo-setup-traces-*,
#: resident-dpo-traces-*). KTO's KL forward runs under no grad before its policy's and leaves its freed blocks in
#: the policy's way: replayed first (kl_forward, below). SmolLM2's two at 8,192 tokens keep 131,072 B in one layer-0
#: block that the fresh warmup's replay does not and WARMUP_UNUSED's short warmup does; the estimate is at or above
#: every one of the seven real peaks, 1.0003x-1.0013x.
#: Evidence: docs/PEAK.md, "SEQUENCE_TASKS".
SEQUENCE_TASKS = ("sft", "orpo", "simpo", "dpo", "kto")


#: ...KTO's on these model types alone: its KL batch's no-grad forward first (kl_forward), checked on their H100
#: histories (Qwen2.5-0.5B 1024x2 and 512x2, SmolLM2-135M 2048x2, Llama-3.2-1B 1024x2; then held out, SmolLM2
#: 1024x4, Qwen3-0.6B 1024x2, Phi-3-mini 1024x2 on qkv_proj, Mistral-7B 512x2), and phi's parallel layer (layer_phi's
#: no-grad path: phi-2 1024x2's history, results/resident-kto-nf4-phi2-traces-*).
KL_FORWARD_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "phi")


#: ...and on LoRA targets other than the protocol's, the llama-type decoder's alone: its NF4 KL forward on all seven
#: linears is Qwen3-0.6B's H100 history request for request (results/resident-anylora-traces-*); Phi-3's and phi's
#: no-grad layer on their other targets (o_proj's or dense's copy, fc1) never ran against a history.
KL_ANY_TARGET_TYPES = ("llama", "mistral", "qwen2", "qwen3")


#: ...and under NF4: SFT's forward, which ORPO, SimPO and DPO run at their stacked rows too (the H100 histories of
#: SmolLM2 DPO and ORPO 1024x2, Qwen2.5-0.5B DPO 1024x2 and SimPO 512x2 request for request: their adapter, bf16 or
#: fp32, is the small pool's), and KTO's after its KL forward (kl_forward's NF4 path, on NF4_KL_FORWARD_TYPES).
NF4_SEQUENCE_TASKS = ("sft", "orpo", "simpo", "dpo", "kto")


#: ...KTO's NF4 KL forward on these model types alone (its layer is layer_nf4, not layer): SmolLM2's history, then
#: held out, Qwen2.5-0.5B, Qwen3-0.6B and Phi-3-mini (qkv_proj) 1024x2 (results/resident-kto-nf4-phi2-traces-*), each
#: request for request.
NF4_KL_FORWARD_TYPES = ("llama", "qwen2", "qwen3", "phi3")


#: The transformers release whose modeling code every capture the sequence was checked against ran (the pinned
#: stack's): another one may order, fuse or keep the forward's tensors otherwise.
SEQUENCE_TRANSFORMERS = "5.16.1"


#: ...and the peft release they ran (its LoRA layers' casts and order): the tests that capture the real model hold
#: the sequence to it on this stack only (replayed() reads the transformers release alone).
SEQUENCE_PEFT = "0.20.0"


#: The PYTORCH_CUDA_ALLOC_CONF keys that change where a block is cut or how it is rounded (allocator.py models
#: neither): under either the replay's rests are not the run's. expandable_segments:True is not among them: it
#: splits every block at 512 B, so max_memory_allocated keeps no rest at all, and the replayed rests charged
#: there are over (the safe side; the resident-findmax probes ran so, tests/run/test_resident_estimate.py).
SPLIT_SETTINGS = ("max_split_size_mb", "roundup_power2_divisions")


#: The cuBLAS workspace a run's first matmul holds: 32 MiB from Hopper on, 8.125 MiB before it
#: (cards.cublas_workspace). The estimate does not know the card, so it replays both and charges the larger.
WORKSPACE_SIZES = (CUBLAS_WORKSPACE, CUBLAS_WORKSPACE_PRE_HOPPER)


def default_allocator(environ=None) -> bool:
    """Whether ``environ`` (None: this process's) leaves the caching allocator's cutting and rounding as
    allocator.py replays them (no SPLIT_SETTINGS) and the cuBLAS workspace at its defaults (no
    CUBLAS_WORKSPACE_CONFIG: a size the replay does not take)."""
    environ = os.environ if environ is None else environ
    conf = ",".join(environ.get(v) or "" for v in ALLOC_CONF_VARS)
    keys = {k.strip() for k in re.findall(r"([^,:]+):", conf)}
    return not keys & set(SPLIT_SETTINGS) and not environ.get(WORKSPACE_CONFIG_VAR)


def replayed(a: Arch, quant: str, targets: tuple, task: str, *, transformers: str, environ=None,
             batch: int = 1) -> bool:
    """Whether this sequence is the run's: a plain llama-type decoder (SEQUENCE_TYPES, one kind of layer; Phi-3's fused
    qkv and gate_up at a full rotary; phi's parallel layer), bf16 (BF16_SEQUENCE_TYPES), or NF4 (NF4_SEQUENCE_TYPES)
    at any token count (at GEMM_4BIT_FUSED_MAX_ROWS or fewer layer_rests charges the largest replay of every
    gemm_4bit choice), the protocol's LoRA targets (protocol_targets: q_proj and v_proj, in any order; Phi-3's
    qkv_proj), any of the layer's linears with q_proj, k_proj, v_proj or qkv_proj among them, or on
    QUIET_ATTENTION_TYPES o_proj and the MLP's linears alone (checked_targets), and
    task (whose policy forward runs first, or after KTO's KL forward on the types it was checked on: SEQUENCE_TASKS,
    KL_FORWARD_TYPES; under NF4 NF4_SEQUENCE_TASKS, NF4_KL_FORWARD_TYPES; off the protocol's targets
    KL_ANY_TARGET_TYPES), LoRA dropout on or off, under transformers SEQUENCE_TRANSFORMERS (``transformers``: the
    release the run has, its local tag dropped) and the default allocator (``default_allocator`` of ``environ``):
    every capture it was checked against. Never phi's qk_layernorm, nor a model dropout the config turns on
    (arch.MODEL_DROPOUTS: resid_pdrop's masks, embd_pdrop's and SDPA's dropout): no capture ran them. Nor NF4 of a
    type NF4_BATCHED_HELD_BACK names at ``batch`` over 1 (none now)."""
    return (a.model_type in SEQUENCE_TYPES and a.layers is None and not a.qk_layernorm and not a.dropouts
            and (quant == "none" and a.model_type in BF16_SEQUENCE_TYPES
                 or quant == "nf4" and a.model_type in NF4_SEQUENCE_TYPES
                 and not (batch > 1 and a.model_type in NF4_BATCHED_HELD_BACK))
            # phi3's partial rotary (its pass-through part) was never captured; phi's was, at phi-2's 0.4
            and (a.rotary_dim == a.head_dim or a.model_type == "phi")
            and checked_targets(a, quant, targets)
            and task in (NF4_SEQUENCE_TASKS if quant == "nf4" else SEQUENCE_TASKS)
            and (task != "kto" or a.model_type in (NF4_KL_FORWARD_TYPES if quant == "nf4" else KL_FORWARD_TYPES)
                 and (a.model_type in KL_ANY_TARGET_TYPES or set(targets) == set(protocol_targets(a))))
            and transformers == SEQUENCE_TRANSFORMERS and default_allocator(environ))


#: What transformers' caching_allocator_warmup leaves out of its block: the bytes the process holds reserved and not
#: allocated (its ``byte_count - unused_memory``): none in a fresh process (the meta captures'), and where a small
#: tensor came before the load (the H100 KTO histories' starts are laid out so: a 2 MiB small-pool segment) all of
#: that segment but its block. The warmup's segment is then its parameters' 2 MiB granules or one fewer, and the
#: forward's first blocks are cut from what the weights leave of it; both are replayed and the larger rests charged.
#: Evidence: docs/PEAK.md, "WARMUP_UNUSED".
WARMUP_UNUSED = (0, K_SMALL_BUFFER - K_MIN_BLOCK_SIZE)


_RESTS: dict = {}


def layer_rests(a: Arch, targets: tuple, r: int, T: int, seq: int, dropout: bool = True, quant: str = "none",
                workspace: int | None = None, fused: frozenset | None = None, card: Dispatch | None = None,
                kl_rows: int = 0, unused: int | None = None) -> int:
    """What the blocks a resident forward keeps through the loss (its layers' and its final norm's, the rotary
    tables) hold past their requests, replayed (``dropout``: whether LoRA dropout writes a mask; ``quant`` none
    or nf4) with a cuBLAS ``workspace`` of that many bytes, or (None) the larger of the replays under each
    default (WORKSPACE_SIZES: the workspace moves every later block, and with it which blocks keep a rest:
    Mistral-7B 1000x4 keeps 86,114,304 B under the 32 MiB one, 128,581,632 B under the pre-Hopper one); under
    NF4 with the shapes ``fused`` whose gemm_4bit runs the fused kernel, or (None) the largest replay of every
    choice the card's heuristic could make (gemm_choices: on a known ``card`` its one answer); in bf16 with the
    warmup's block short of the parameters by ``unused`` bytes, or (None) the larger under each of WARMUP_UNUSED
    (not NF4's: peft's empty_cache releases the warmup's segment before the step, so its forward's blocks do not
    move with it; the load's own packed blocks do, load_rests);
    after KTO's KL batch of ``kl_rows`` rows (kl_forward; 0: none); once an arm (--find-max and the map ask many
    times)."""
    if workspace is None or quant == "nf4" and fused is None or unused is None and quant != "nf4":
        return max(layer_rests(a, targets, r, T, seq, dropout, quant, w, f, kl_rows=kl_rows, unused=u)
                   for w in ((workspace,) if workspace else WORKSPACE_SIZES)
                   for f in (gemm_choices(a, T, card) if quant == "nf4" and fused is None else (fused,))
                   for u in (WARMUP_UNUSED if unused is None and quant != "nf4" else (unused,)))
    targets = tuple(t for t in ATTN + MLP if t in targets)  # the layer's own order: a set, as replayed reads it
    key = (repr(a), targets, r, T, seq, dropout, quant, workspace, fused, kl_rows, unused)
    if key not in _RESTS:
        q = Requests(fused=fused or frozenset())
        _, kept = loaded_forward(q, a, quant, (targets, r, dropout), T, seq, workspace, kl_rows, unused or 0)
        _RESTS[key] = q.rests(kept)
    return _RESTS[key]


def loaded_forward(q: Requests, a: Arch, quant: str, lora: tuple, T: int, seq: int,
                   workspace: int = CUBLAS_WORKSPACE, kl_rows: int = 0, unused: int = 0) -> tuple[int, list]:
    """A resident step from its load to its forward's end: the load (bf16 ``load``, its warmup ``unused`` bytes
    short; NF4 ``load_nf4``, whose warmup segment peft's empty_cache releases), KTO's KL batch of ``kl_rows`` rows
    where there is one (kl_forward: it makes the process's cuBLAS ``workspace``, so the policy's makes none), then
    the policy's forward (``forward_nf4`` or ``forward``; ``lora``: the targets, r, dropout). Returns how many
    requests and frees the load made (``q.trace``'s length after it, where ``q`` traces) and the blocks the forward
    keeps. ``unused`` is bf16's alone: under NF4 the warmup's segment is gone before the step (its rests are
    load_rests')."""
    nf4 = quant == "nf4"
    if nf4:
        load_nf4(q, a, lora[0], lora[1])
    else:
        load(q, a, lora[0], lora[1], unused)
    loaded = len(q.trace) if q.trace is not None else 0
    if kl_rows:
        kl_forward(q, a, T, seq, lora, kl_rows, workspace, nf4=nf4)
    return loaded, (forward_nf4 if nf4 else forward)(q, a, T, seq, lora, 0 if kl_rows else workspace)
