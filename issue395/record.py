"""The record, as data: its grid and the map's, the protocol's constants, and every published
figure. The record's two models live in the registry with every other; an arm and Soup's
prediction for it, in ``arm``.
"""

from __future__ import annotations


RECORD_GRID: dict[str, tuple[int, ...]] = {
    "smol": (2048, 3072, 4096, 4352, 5120, 6144),
    "qwen": (2048, 4096, 5120, 6144),
}


LORA_R, LORA_ALPHA, LORA_TARGETS = 8, 16, ("q_proj", "v_proj")
#: The protocol's LoRA dropout: its config names none, so Soup's schema default (soup_cli/config/schema.py,
#: LoraConfig.dropout) holds, and peft puts an nn.Dropout of this p on every targeted module. No option of
#: this tool spells another: the protocol's and the map's arms run at it; a --config file's is its own.
LORA_DROPOUT = 0.05


SOUP_QUANT = {"none": "none", "nf4": "4bit"}  # the harness's name: Soup config's spelling
#: Soup config's quantization spelling -> the harness's: SOUP_QUANT read the other way, so the two cannot drift
OURS_QUANT = {soup: ours for ours, soup in SOUP_QUANT.items()}


#: The grid's adapter count is twice the LoRA A+B parameters (921,600 = 2 x 460,800).
GRID_ADAPTER_FACTOR = 2


DATA_ROWS, OVERSHOOT = 4, 3


A10G_STACK = ("NVIDIA A10G 23 GB (AWS g5.xlarge), Ubuntu 22.04, driver 580.126.09, "
              "torch 2.13.0+cu130, transformers 5.16.1, trl 0.29.1, peft 0.20.0, "
              "Python 3.10, Soup 0.73.3")


#: The A10G record's real peaks, bytes, and its published (predicted GB, pred/real).
RECORD_A10G_PEAK: dict[tuple[str, int], int] = {
    ("smol", 2048): 1365200000, ("smol", 3072): 2016700000, ("smol", 4096): 2657800000,
    ("smol", 4352): 2818400000, ("smol", 5120): 3303000000, ("smol", 6144): 3943000000,
    ("qwen", 2048): 4177000000, ("qwen", 4096): 8012300000, ("qwen", 5120): 9929400000,
    ("qwen", 6144): 11848100000,
}


RECORD_A10G_PREDICTED: dict[tuple[str, int], tuple[float, float]] = {
    ("smol", 2048): (1.596, 1.169), ("smol", 3072): (2.345, 1.163), ("smol", 4096): (3.094, 1.164),
    ("smol", 4352): (3.281, 1.164), ("smol", 5120): (3.842, 1.163), ("smol", 6144): (4.591, 1.164),
    ("qwen", 2048): (4.854, 1.162), ("qwen", 4096): (9.346, 1.166), ("qwen", 5120): (11.592, 1.167),
    ("qwen", 6144): (13.837, 1.168),
}


RECORD_A10G_OVERESTIMATE = {"mean": 1.152, "pstdev": 0.0249}


#: The first stack (RTX 3050 Laptop), SmolLM2: (predicted GB, real GB).
RECORD_RTX3050 = {("smol", 4352): (3.282, 3.036), ("smol", 5120): (3.844, 4.118),
                  ("smol", 6144): (4.590, 5.830)}


RECORD_MEASURE = {"repeat": 12.0, "spread": 0.0,
                  "vocab": {8192: 12.0, 32768: 12.0, 49152: 12.0, 151936: 12.01010951979781}}


MEASURE_VOCABS = (8192, 32768, 49152, 151936)


SDPA_SEQS, SDPA_HEADS, SDPA_HEAD_DIM = (2048, 3072, 4096, 5120, 6144), 9, 64


SDPA_BACKENDS = ("flash", "mem_efficient", "math", "default")


RECORD_SDPA_MB = {"flash": (2.4, 3.7, 4.9, 6.1, 7.3), "mem_efficient": (2.4, 3.5, 4.7, 5.9, 7.1),
                  "math": (383.9, 831.5, 1463.8, 2279.7, 3267.4)}


#: SmolLM2 repeated in a fresh process: (GB, GB, spread %).
RECORD_DETERMINISM = {("smol", 4096): (2.6578, 2.6493, 0.32), ("smol", 6144): (3.9430, 3.9439, 0.02)}



#: The map's grid. Seq 512 and 1024 were added where Soup's NF4 misses live (its first grid
#: started at 2048 and never saw them).
MAP_SEQS, MAP_BATCHES, QUANTS = (512, 1024, 2048, 4096, 8192, 16384), (1, 4), ("none", "nf4")


#: Soup's published streamed NF4 peak (Llama-3.1-8B, batch 1 x seq 512; docs/FAMILIES.md): bytes
#: allocated, from its v0.73.1 test docstring (issue #349). The map holds one arm against it.
PUBLISHED_NF4 = {("llama31-8b", "nf4", 512, 1): 3_411_600_000}
