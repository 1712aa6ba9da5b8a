"""Resident runs (training.stream_layers off) on the map: the arm Soup runs keeps every layer on the card, with
HF's gradient checkpointing where the key asks for it, and its row carries Soup's resident gate as `soup train`
runs it (commands/train.py's input from the arm's config, hardware_fit's number and verdict), judged against the
real peak. The CUDA step is faked here (it cannot run on CPU) and so is the card Soup's gate reads (there is no
GPU): Soup's setup, its config loader and its gate's code are the real ones."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from conftest import h, main, one_error_line

from issue395.model.registry import is_resident, mode_key, stream_mode, stream_mode_keys
from issue395.errors import UsageError

GB = 10**9


def checkpoint_parameters(folder: Path) -> int:
    """The parameters the built checkpoint's safetensors hold, read off their headers (what a local
    checkpoint has, independent of how Soup counts it)."""
    total = 0
    for f in folder.glob("*.safetensors"):
        raw = f.read_bytes()
        header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
        for name, meta in header.items():
            if name != "__metadata__":
                n = 1
                for d in meta["shape"]:
                    n *= d
                total += n
    return total


def test_resident_keys_are_the_family_with_its_resident_modes_and_gradient_checkpointing_only_with_them():
    """--stream-layers off adds a resident key per family (and, with --gradient-checkpointing on, a checkpointed
    one) after the family's streamed keys; checkpointing or a streaming mode on a resident key is refused."""
    keys = stream_mode_keys(["smol", "qwen"], ["fused"], [None], ["on"], ("on", "off"), ("off", "on"))
    assert keys == ("smol", "smol+resident", "smol+resident+gc", "qwen", "qwen+resident", "qwen+resident+gc")
    assert stream_mode("qwen+resident+gc") == ("qwen", {"stream_layers": False, "gradient_checkpointing": True})
    assert is_resident("qwen+resident") and not is_resident("qwen") and not is_resident("qwen+recompute-off")
    assert stream_mode_keys(["smol"], ["fused"], [None], ["on"], ("off",)) == ("smol+resident",)
    with pytest.raises(UsageError, match="a resident run's"):
        stream_mode_keys(["smol"], ["fused"], [None], ["on"], ("on",), ("on",))
    with pytest.raises(UsageError, match="takes no streaming mode"):
        mode_key("smol", recompute="off", resident=True)


def test_stream_layers_and_checkpointing_without_the_map_are_one_line(capfd):
    """A soup.yaml says stream_layers itself; the two axes are the map's: one line each, exit 2."""
    one_error_line(*main(capfd, ["--stream-layers", "off", "--dry-run"]), "--stream-layers", "--map")
    one_error_line(*main(capfd, ["--map", "--gradient-checkpointing", "on", "--dry-run"]), "--stream-layers off")
    one_error_line(*main(capfd, ["--map", "--stream-layers", "off,sideways", "--dry-run"]), "--stream-layers")


class ResidentStep:
    """Stands in for h.real_peak (the CUDA step cannot run here): what the trainer was built with, and a peak."""

    def __init__(self, peak: int):
        self.peak, self.seen = peak, []

    def __call__(self, trainer, snapshot=False, steps=1):
        self.seen.append({"gc": bool(trainer.args.gradient_checkpointing),
                          "meta": any(p.is_meta for p in trainer.model.parameters())})
        return {"real_peak": self.peak, "resident": 1234, "reserved": self.peak, "step_s": 0.01, "snapshot": None}


def test_a_resident_rows_soup_gate_is_its_clis_on_the_arms_config_and_judged_against_the_peak(
        capfd, monkeypatch, cache_dir, tmp_path):
    """A resident map of SmolLM2 at seq 64 with checkpointing off and on: Soup's setup keeps every layer real (no
    meta skeleton) and turns HF's checkpointing on for the +gc arm only; each row's gate input is the one Soup's
    CLI builds (the checkpoint's own parameter count, the arm's seq, batch, quantization and checkpointing), its
    number is hardware_fit's on that input, its verdict decide_hardware_fit's on the card Soup read (faked: 0.85 GB, under its number with the margin),
    and a peak past Soup's number is UNDER, in the JSON and in the resident gate table."""
    from soup_cli.utils import gpu
    from soup_cli.utils.hardware_fit import HardwareFitInput, decide_hardware_fit, estimate_peak_vram_gb

    monkeypatch.setattr(h, "STEP_DEVICE", "cpu")
    step = ResidentStep(peak=2 * GB)
    monkeypatch.setattr(h, "real_peak", step)
    monkeypatch.setattr(gpu, "get_gpu_info", lambda backend=None: {"memory_total_bytes": 850_000_000})
    out_json = tmp_path / "resident.json"
    code, out, err = main(capfd, ["--map", "--families", "smol", "--stream-layers", "off", "--gradient-checkpointing",
                                  "off,on", "--quant", "none", "--seq", "64", "--batch", "1", "--cache-dir", cache_dir,
                                  "--json", out_json])
    assert code == 1, err  # Soup's resident gate under the peak is a finding
    assert step.seen == [{"gc": False, "meta": False}, {"gc": True, "meta": False}], "one step an arm, no margin rerun"
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["model_key"] for r in rows] == ["smol+resident", "smol+resident+gc"]
    params = checkpoint_parameters(Path(rows[0]["ran"]["base"]))
    for r, gc in zip(rows, (False, True)):
        g = r["soup_resident"]
        inp = HardwareFitInput(params_b=params / 1e9, seq_len=64, batch_size=1, optimizer="adamw_torch", quant="none",
                               peft="lora", gradient_checkpointing=gc)
        assert g["input"] == {k: getattr(inp, k) for k in inp.__dataclass_fields__}
        assert g["peak"] == round(estimate_peak_vram_gb(inp).total_gb * GB)
        assert g["card_total"] == 850_000_000 and g["admits"] == decide_hardware_fit(inp, available_vram_gb=0.85).ok
        assert r["derived"]["status"] == "UNDER" and g["peak"] < 2 * GB
    table = out[out.index("Soup's resident gate"):]
    assert "SmolLM2-135M [resident+gc]" in table and "REFUSES" in table and "verdict: Soup UNDER-predicts 2 of 2" in out


def test_the_packing_bound_covers_every_committed_resident_peak():
    """The lanes pack a resident LoRA arm the corrected estimate refuses by an upper bound (never printed): it is above each committed resident
    anatomy's real peak and each committed resident map row's, so no arm is packed beside more than the card holds."""
    from issue395.host.spread import resident_packing_bound

    root = Path(h.__file__).parent / "results"
    seen = 0
    for path in root.glob("resident-map-*/call-*/*.json"):
        for r in json.loads(path.read_text())["rows"]:
            if r.get("real_peak"):
                bound = resident_packing_bound(r["model_key"], quant=r["quant"], seq=r["seq"], batch=r["batch"],
                                               targets=tuple(r["targets"]), task=r.get("task") or "sft")
                assert bound > r["real_peak"], (r["model_key"], r["quant"], r["seq"], r["batch"], r.get("task"))
                seen += 1
    assert seen >= 150


def skeleton_parameters(key: str) -> int:
    """The values of the checkpoint this tool builds for a family (its meta skeleton's state dict, a tied head once)."""
    import torch
    from transformers import AutoModelForCausalLM

    from issue395.measure.builder import hf_config
    from issue395.measure.shapes import family_shape

    config = hf_config(family_shape(key))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tied = bool(getattr(config, "tie_word_embeddings", True))
    # the tensors the checkpoint holds (its state dict: DeepSeek-V3's e_score_correction_bias is a buffer there, and
    # Soup counts it), a tied head once, as the builder writes them
    return sum(t.numel() for name, t in model.state_dict().items() if not (tied and name == "lm_head.weight"))


def test_soups_resident_number_on_every_committed_row_is_its_own_code_on_the_input_its_cli_built():
    """Every committed resident row (results/resident-map-*): the input Soup's CLI built holds the row's own seq,
    batch, quantization and checkpointing, and the exact parameter count of the checkpoint it ran (Soup reads a
    local checkpoint's safetensors; here the builder's meta skeleton counts them); its number is hardware_fit's on
    that input, and its verdict decide_hardware_fit's against the card total it read."""
    from soup_cli.utils.hardware_fit import HardwareFitInput, decide_hardware_fit, estimate_peak_vram_gb

    root = Path(h.__file__).parent / "results"
    counts: dict[str, int] = {}
    seen = 0
    for path in sorted(root.glob("resident-map-*/call-*/*.json")):
        for r in json.loads(path.read_text())["rows"]:
            g, (family, modes) = r["soup_resident"], stream_mode(r["model_key"])
            inp = HardwareFitInput(**g["input"])
            assert (inp.seq_len, inp.batch_size, inp.quant, inp.gradient_checkpointing) == (
                r["seq"], r["batch"], {"none": "none", "nf4": "4bit"}[r["quant"]], modes.get("gradient_checkpointing", False))
            assert inp.peft == ("qlora" if r["quant"] == "nf4" else "lora") and inp.optimizer == "adamw_torch"
            if family not in counts:
                try:
                    counts[family] = skeleton_parameters(family)
                except UsageError:  # a family only a later Soup streams: its shape is not derived on this one
                    counts[family] = None
            assert counts[family] is None or round(inp.params_b * 1e9) == counts[family], family
            assert g["peak"] == round(estimate_peak_vram_gb(inp).total_gb * GB)
            assert g["admits"] == decide_hardware_fit(inp, available_vram_gb=g["card_total"] / 1e9).ok
            seen += 1
    assert seen >= 227 and sum(1 for n in counts.values() if n) >= 11, counts
