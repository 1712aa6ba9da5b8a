"""issue395.run.configarm: the user's soup.yaml as one measured arm (issue 20's "Does it fit?" on a real
card). A tiny local checkpoint's soup.yaml runs through --config --dry-run: Soup's own loader reads
the file and Soup's real setup (on CPU) builds the arm, whose PEFT adapter is read back off the
trainer Soup built. A family's hub id is its registry model; any other base, and every option the
file already gives, is one line. Nothing is faked (a missing bitsandbytes is, where a test says so)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from conftest import TINY, estimate_config_json, h, main, one_error_line

from issue395.run import configarm
from issue395.measure.builder import prepare_checkpoint
from issue395.run.configarm import CONFIG_GIVES
from issue395.run.options import settle
from issue395.run.parser import build_parser
from issue395.measure.shapes import soup_has_stream_modes

YAML = """base: {base}
task: sft
data: {{train: data.jsonl, max_length: {seq}}}
training:
  batch_size: 1
  quantization: {quant}
  stream_layers: true
  lora: {{r: 4, alpha: 8, target_modules: [q_proj]}}
{extra}"""


def soup_yaml(tmp_path, base, seq=64, quant="none", extra=""):
    path = tmp_path / "soup.yaml"
    path.write_text(YAML.format(base=base, seq=seq, quant=quant, extra=extra))
    return path


def settled(argv):
    argv = [str(a) for a in argv]
    return settle(build_parser().parse_args(argv), argv)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A tiny streamable checkpoint folder, the harness's builder at TINY's shape."""
    path = tmp_path_factory.mktemp("config-arm") / "tiny"
    prepare_checkpoint(TINY, path)()
    return path


def test_the_files_r_alpha_and_targets_are_what_soups_setup_builds(capfd, tmp_path, monkeypatch, cache_dir,
                                                                   tiny_checkpoint):
    """r 4, alpha 8 on q_proj alone: the adapter Soup's own setup put on the model (read off the trainer
    it built: rank 4, scaling alpha/r = 2.0, q_proj and nothing else), the row saying the file and its
    r and alpha, and the header naming the file: a reader knows it is the user's config, not the protocol."""
    built = {}
    real = h.realised_lengths

    def adapter_seen(trainer, *guarded):  # Soup's setup is done: read what it built, then go on as the protocol does
        for name, module in trainer.model.named_modules():
            if getattr(module, "lora_A", None):
                built[name.rsplit(".", 1)[-1]] = (module.lora_A["default"].weight.shape[0], module.scaling["default"])
        return real(trainer, *guarded)

    monkeypatch.setattr(h, "realised_lengths", adapter_seen)
    out = tmp_path / "out.json"
    config = soup_yaml(tmp_path, tiny_checkpoint)
    code, text, err = main(capfd, ["--config", config, "--dry-run", "--cache-dir", cache_dir, "--json", out])
    assert code == 0, err
    assert built == {"q_proj": (4, 2.0)}
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["config"], row["targets"]) == ({"path": str(config), "lora_r": 4, "lora_alpha": 8}, ["q_proj"])
    assert (row["model_key"], row["seq"], row["batch"], row["quant"], row["realised_width"]) == ("custom", 64, 1, "none", 64)
    assert row["gate"]["terms"]["adapter_params"] == 2 * 1 * 2 * 4 * 64  # Soup's own count: layers x targets x 2 x r x hidden
    assert (f"the arm is --config {config}'s (none, LoRA r 4 alpha 8 on q_proj, optimizer adamw_torch, gradient "
            "accumulation ") in text.splitlines()[0]


def test_a_familys_hub_id_is_its_registry_arm_at_the_files_own_settings(tmp_path):
    run = settled(["--config", soup_yaml(tmp_path, "mistralai/Mistral-7B-v0.3", seq=512, quant="4bit"), "--dry-run"])
    assert (run.models, run.quants, run.seqs, run.batches) == (("mistral-7b",), ("nf4",), (512,), (1,))
    assert (run.arm.adapter.targets, run.arm.adapter.lora_r, run.arm.adapter.lora_alpha, run.arm.checkpoint, run.weights) == (
        ("q_proj",), 4, 8, None, "synthetic")
    assert settled(["--config", soup_yaml(tmp_path, "HuggingFaceTB/SmolLM2-135M")]).models == ("smol",)


@pytest.mark.parametrize("base, quant", [("mistralai/Mistral-7B-v0.3", "4bit"), ("folder", "none")])
def test_a_measured_runs_grid_arm_is_the_files_arm_field_for_field(tmp_path, tiny_checkpoint, base, quant):
    """Issue 50 item 2 (house5d): the measured run's one arm is the soup.yaml's Arm (UserRun.arm, its base
    resolved by config_arm) in every field: base, seq, batch, quantization, task, settings, streaming, adapter,
    steps, checkpoint (a folder's, or none for a registry model), stack; the run's Arm is it too."""
    from dataclasses import fields

    from issue395.model.arm import Arm
    from issue395.run.userconfig import read_soup_config

    extra = "  optimizer: adamw_8bit\n  gradient_accumulation_steps: 3\n"
    config = soup_yaml(tmp_path, tiny_checkpoint if base == "folder" else base, seq=512 if quant == "4bit" else 64,
                       quant=quant, extra=extra)
    run = settled(["--config", config, "--dry-run"])
    file_arm = configarm.config_arm(read_soup_config(str(config)), "synthetic", True)
    (arm,) = run.arms()
    for f in fields(Arm):
        assert getattr(arm, f.name) == getattr(file_arm, f.name), f.name
    assert run.arm == file_arm and (arm.settings.optimizer, arm.settings.accumulation) == ("adamw_8bit", 3)
    assert arm.checkpoint == (str(tiny_checkpoint) if base == "folder" else None)
    assert settled(["--config", config, "--dry-run", "--steps", "4"]).arms() == [replace(file_arm, steps=4)]


def test_a_files_lora_dropout_is_its_measured_arms_and_the_protocols_config_names_none(tmp_path):
    """Issue 50 item 1: a --config file's training.lora.dropout is its measured arm's (the Soup config the protocol
    builds for the arm, read back by Soup's own loader, holds it), so the row and the run agree; the protocol's
    and the map's arms name no dropout (Soup's default: their config is as it was)."""
    from soup_cli.config.loader import load_config_from_string

    path = soup_yaml(tmp_path, "mistralai/Mistral-7B-v0.3", seq=512, quant="4bit")
    path.write_text(path.read_text().replace("alpha: 8,", "alpha: 8, dropout: 0,"))
    (arm,) = settled(["--config", path, "--dry-run"]).arms()
    (protocol,) = settled(["--model", "smol", "--seq", "512", "--dry-run"]).arms()

    def measured(a):
        return h.soup_config_yaml("x/base", "/tmp/d.jsonl", "/tmp/out", a.seq, 1, a.quant, ("q_proj",), (),
                                  a.adapter.lora_r, a.adapter.lora_alpha, a.task, a.training, a.adapter.soup_lora())

    assert arm.adapter.dropout == 0.0 and load_config_from_string(measured(arm)).training.lora.dropout == 0.0
    assert "dropout" not in measured(protocol) and protocol.adapter.dropout == 0.05


@pytest.mark.skipif(not soup_has_stream_modes(), reason="soup-cli 0.77.0's streaming modes")
def test_the_files_streaming_modes_name_the_arm_as_the_map_spells_them(capfd, tmp_path):
    extra = "  stream_loss_chunk: 512\n  stream_recompute: 'off'\n"
    run = settled(["--config", soup_yaml(tmp_path, "mistralai/Mistral-7B-v0.3", seq=512, extra=extra)])
    assert run.models == ("mistral-7b+chunk512+recompute-off",)
    auto = soup_yaml(tmp_path, "mistralai/Mistral-7B-v0.3", extra="  stream_recompute: auto\n")
    one_error_line(*main(capfd, ["--config", auto]), "stream_recompute", "auto")


@pytest.mark.parametrize("flag, value", [(f, "1") for f in CONFIG_GIVES] + [("--map", None)])
def test_an_option_the_file_gives_is_one_line_naming_the_clash(capfd, tmp_path, flag, value):
    config = soup_yaml(tmp_path, "mistralai/Mistral-7B-v0.3")
    one_error_line(*main(capfd, ["--config", config, flag] + ([value] if value else [])), "--config", flag)


@pytest.mark.parametrize("base, words", [("someorg/not-a-family", ["--weights hub"]), ("mistral-7b", ["write base: mistralai/Mistral-7B-v0.3"]),
                                         ("./no-such-folder", ["no such folder"])])  # a path is not a hub id
def test_a_base_that_is_neither_a_checkpoint_here_nor_a_registry_model_is_one_line(capfd, tmp_path, base, words):
    one_error_line(*main(capfd, ["--config", soup_yaml(tmp_path, base), "--dry-run"]), "base", base, *words)


def test_with_weights_hub_any_hub_id_is_the_arm_as_model_runs_one(tmp_path):
    run = settled(["--config", soup_yaml(tmp_path, "someorg/not-a-family"), "--weights", "hub"])
    assert (run.models, run.arm.checkpoint) == (("custom",), "someorg/not-a-family")


def test_a_seq_past_the_bases_positions_and_nf4_without_bitsandbytes_are_one_line(capfd, tmp_path, monkeypatch):
    one_error_line(*main(capfd, ["--config", soup_yaml(tmp_path, "microsoft/phi-2", seq=4096), "--dry-run"]),
                   "data.max_length 4096", "2048")
    monkeypatch.setattr(configarm, "bitsandbytes_present", lambda: False)  # FAKED: bitsandbytes absent
    config = soup_yaml(tmp_path, "mistralai/Mistral-7B-v0.3", quant="4bit")
    one_error_line(*main(capfd, ["--config", config, "--emulate-card", "T4"]), "4bit", "bitsandbytes")
    assert settled(["--config", config, "--dry-run"]).quants == ("nf4",)  # a dry run skips the arm instead


def test_a_local_bases_positions_are_named_as_the_files_max_length(capfd, tmp_path, tiny_checkpoint):
    """The seq came from the file, so the one line names the file's data.max_length, not --seq."""
    import json as _json

    positions = _json.loads((tiny_checkpoint / "config.json").read_text())["max_position_embeddings"]
    code, out, err = main(capfd, ["--config", soup_yaml(tmp_path, tiny_checkpoint, seq=positions + 64), "--dry-run"])
    one_error_line(code, out, err, "data.max_length", str(positions + 64))
    assert "--seq" not in err


def test_the_files_task_is_the_arms_and_its_row_says_so(capfd, tmp_path, cache_dir, tiny_checkpoint):
    """task: dpo in the soup.yaml: the arm runs Soup's DPO setup (its guard reads 2 x batch rows) and
    the row carries the task; --estimate answers the same file for its task."""
    config = soup_yaml(tmp_path, tiny_checkpoint)
    config.write_text(config.read_text().replace("task: sft", "task: dpo"))
    assert settled(["--config", config, "--dry-run"]).tasks == ("dpo",)
    out = tmp_path / "dpo.json"
    code, text, err = main(capfd, ["--config", config, "--dry-run", "--cache-dir", cache_dir, "--json", out])
    assert code == 0, err
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["task"], row["derived"]["status"], row["realised_rows"]) == ("dpo", "dry-run", [64, 64])
    code, text, err = main(capfd, ["--estimate", "--config", config])
    assert code == 0 and "dpo" in text, err


@pytest.mark.parametrize("family, hub", [("mistral-7b", "mistralai/Mistral-7B-v0.3"), ("qwen", "Qwen/Qwen2.5-0.5B")])
def test_a_base_spelled_as_a_family_key_gets_one_answer_in_every_mode(capfd, tmp_path, monkeypatch, family, hub):
    """Issue 53 item 4: `base: mistral-7b` got exit 0 from --estimate --exit-code while --find-max refused it;
    `soup train` cannot load it (no such folder, nor a hub id). Every mode now says the same line, naming the
    family's hub id to write instead; a folder of that name here is a base, and is read as one."""
    monkeypatch.chdir(tmp_path)
    yaml = tmp_path / "soup.yaml"
    yaml.write_text(YAML.format(base=family, seq=512, quant="none", extra=""))
    lines = set()
    for argv in (["--estimate", "--card", "T4", "--exit-code"], ["--find-max", "seq", "--card", "T4", "--dry-run"],
                 ["--dry-run"]):
        lines.add(one_error_line(*main(capfd, ["--config", yaml, *argv]), f"base {family!r}", f"write base: {hub}"))
    assert len(lines) == 1


def test_the_measured_arm_runs_the_optimizer_and_accumulation_estimate_charges(capfd, tmp_path, monkeypatch,
                                                                               cache_dir, tiny_checkpoint):
    """Issue 50's probe: one soup.yaml with training.optimizer adamw_8bit and gradient_accumulation_steps 4.
    --estimate --config charged both; the measured arm of the same file (--config --dry-run) ran adamw_torch at
    one micro-batch and its row named neither. Now Soup's own setup builds the arm's trainer with the file's
    optimizer and accumulation (read off the trainer it built), and the two JSONs' rows say the same."""
    config = soup_yaml(tmp_path, tiny_checkpoint, extra="  optimizer: adamw_8bit\n  gradient_accumulation_steps: 4\n")
    built = {}
    real = h.realised_lengths

    def args_seen(trainer, *guarded):  # Soup's setup is done: read the trainer's arguments it built
        built.update(optim=str(trainer.args.optim.value), accumulation=trainer.args.gradient_accumulation_steps,
                     rows=len(trainer.train_dataset))
        return real(trainer, *guarded)

    monkeypatch.setattr(h, "realised_lengths", args_seen)
    out = tmp_path / "dry.json"
    code, text, err = main(capfd, ["--config", config, "--dry-run", "--cache-dir", cache_dir, "--json", out])
    assert code == 0, err
    assert (built["optim"], built["accumulation"]) == ("adamw_8bit", 4)
    assert built["rows"] >= 4  # one optimizer step reads batch x 4 micro-batches of the protocol's rows
    (row,) = json.loads(out.read_text())["rows"]
    estimated, _ = estimate_config_json(capfd, tmp_path, config)
    (answer,) = estimated["rows"]
    assert (row["optimizer"], row["accumulation"]) == (answer["optimizer"], answer["accumulation"]) == ("adamw_8bit", 4)
    assert "optimizer adamw_8bit, gradient accumulation 4" in text.splitlines()[0]


def test_a_file_without_the_keys_runs_soups_defaults_and_says_them(capfd, tmp_path, cache_dir, tiny_checkpoint):
    """A soup.yaml that sets neither key is run as `soup train` runs it: Soup's defaults (adamw_torch and, on
    soup-cli's schema, 4 micro-batches a step), the same values --estimate --config charges; the protocol's own
    arm names neither (its row has no such keys)."""
    config = soup_yaml(tmp_path, tiny_checkpoint)
    run = settled(["--config", config, "--dry-run"])
    from soup_cli.config.schema import TrainingConfig

    default = TrainingConfig.model_fields["gradient_accumulation_steps"].default
    assert (run.arm.settings.optimizer, run.arm.settings.accumulation) == ("adamw_torch", default)
    assert {(a.settings.optimizer, a.settings.accumulation) for a in run.arms()} == {("adamw_torch", default)}
    estimated, _ = estimate_config_json(capfd, tmp_path, config)
    assert (estimated["rows"][0]["optimizer"], estimated["rows"][0]["accumulation"]) == ("adamw_torch", default)
    protocol = settled(["--dry-run", "--models", "smol", "--seq", "64"])
    assert {(a.settings.optimizer, a.settings.accumulation) for a in protocol.arms()} == {(None, None)}


def test_a_bitsandbytes_optimizer_without_bitsandbytes_is_one_line_before_any_work(capfd, tmp_path, monkeypatch):
    """The measured arm runs the file's optimizer, so an 8-bit one where bitsandbytes is missing is one line
    naming the key, as NF4 is; a dry run builds no optimizer and goes on."""
    monkeypatch.setattr(configarm, "bitsandbytes_present", lambda: False)  # FAKED: bitsandbytes absent
    config = soup_yaml(tmp_path, "mistralai/Mistral-7B-v0.3", extra="  optimizer: paged_adamw_8bit\n")
    one_error_line(*main(capfd, ["--config", config, "--emulate-card", "T4"]), "training.optimizer paged_adamw_8bit",
                   "bitsandbytes")
    assert settled(["--config", config, "--dry-run"]).arm.settings.optimizer == "paged_adamw_8bit"


def test_the_files_stream_buffers_is_the_pool_soups_setup_builds_and_every_estimate_charges(
        capfd, tmp_path, monkeypatch, cache_dir, tiny_checkpoint):
    """Issue 50 item 4, a new Soup setting done by docs/LAYOUT.md's recipe (model/arm.py's SETTINGS, the estimator's
    keyword, Soup's number's keyword): training.stream_buffers 3 was refused in one line. Now Soup's own setup
    builds the measured arm's pool with the file's 3 slots (read off the LayerBufferPool it built), the row and
    --estimate's JSON row say buffers 3, and the corrected estimate's pool term is the bytes of the pool Soup
    built (its tensors' own elements, at bf16 as on a card), one layer slot more than at Soup's default 2."""
    from soup_cli.utils import layer_stream_runtime as runtime
    from issue395.estimator.estimate import estimate

    pools = []
    built = runtime.LayerBufferPool.__init__

    def kept(self, *args, **kwargs):  # the real pool, kept to read after the setup
        built(self, *args, **kwargs)
        pools.append(self)

    monkeypatch.setattr(runtime.LayerBufferPool, "__init__", kept)
    config = soup_yaml(tmp_path, tiny_checkpoint, extra="  stream_buffers: 3\n")
    out = tmp_path / "dry.json"
    code, text, err = main(capfd, ["--config", config, "--dry-run", "--cache-dir", cache_dir, "--json", out])
    assert code == 0, err
    (pool,) = pools
    # Soup builds the pool in fp32 on CPU and in bf16 on a card: its elements at bf16's 2 B are a card's slot
    slots = [2 * sum(t.numel() for t in slot.values()) for slot in pool.buffers]
    assert len(slots) == 3
    (row,) = json.loads(out.read_text())["rows"]
    assert row["buffers"] == 3
    estimated, _ = estimate_config_json(capfd, tmp_path, config)
    assert estimated["config_keys"][-1].startswith("training.stream_buffers 3: modelled")
    model = json.loads((tiny_checkpoint / "config.json").read_text())
    three, two = (estimate(model, seq=64, buffers=n, soup=False).terms["pool"] for n in (3, 2))
    assert three == sum(slots) and three - two == slots[0]


def test_a_resident_soup_yaml_is_measured_as_the_maps_resident_arm(capfd, tmp_path, monkeypatch, cache_dir,
                                                                   tiny_checkpoint):
    """Issue 51 item 1: a resident soup.yaml (training.stream_layers false) is a measured arm too, as the map's
    resident arm (`+resident`, `+gc` with gradient checkpointing): Soup's own setup builds it resident with the
    file's checkpointing, the row records Soup's resident gate as `soup train` runs it, and its row names no setting
    a streamed step alone reads (stream_buffers). Before, the measured --config arm refused the file in one line."""
    seen = {}
    real = h.realised_lengths

    def kept(trainer, *guarded):  # Soup's setup is done: what it built
        seen["checkpointing"] = bool(trainer.args.gradient_checkpointing)
        return real(trainer, *guarded)

    monkeypatch.setattr(h, "realised_lengths", kept)
    config = soup_yaml(tmp_path, tiny_checkpoint, extra="  gradient_checkpointing: true\n")
    config.write_text(config.read_text().replace("stream_layers: true", "stream_layers: false"))
    out = tmp_path / "dry.json"
    code, text, err = main(capfd, ["--config", config, "--dry-run", "--cache-dir", cache_dir, "--json", out])
    assert code == 0, err
    (row,) = json.loads(out.read_text())["rows"]
    assert row["model_key"] == "custom+resident+gc" and row["soup_resident"] is not None
    assert seen["checkpointing"] and "buffers" not in row and "[resident+gc]" in text


# Issue 50 items 1 and 3 (house5b): a soup.yaml and the command line are read into one typed Arm.

QWEN_YAML = """base: Qwen/Qwen2.5-0.5B
task: sft
data: {{train: data.jsonl, max_length: 1024}}
training:
  batch_size: 2
  gradient_accumulation_steps: 1
  quantization: none
{training}  lora: {{r: 16, alpha: 16, target_modules: [q_proj, v_proj]}}
"""


def qwen_yaml(tmp_path, training, name="soup.yaml"):
    path = tmp_path / name
    path.write_text(QWEN_YAML.format(training=training))
    return path


def file_arm(path):
    from issue395.run.configarm import config_arm
    from issue395.run.userconfig import read_soup_config

    return config_arm(read_soup_config(str(path)), "synthetic", dry_run=True)


def as_the_command_line_can_say_it(arm):
    """What a soup.yaml carries that no option spells: its run settings as Soup's loader read them (optimizer,
    gradient accumulation and, streamed, stream buffers: each Soup's default unless the file sets it), and the
    adapter's file; the command line's arm has none of them."""
    from dataclasses import replace

    from issue395.model.arm import Settings

    return replace(arm, settings=Settings(), adapter=replace(arm.adapter, soup_config=None))


def test_a_resident_gc_file_and_the_maps_key_for_it_are_one_arm(tmp_path):
    """A resident soup.yaml with gradient checkpointing (Qwen2.5-0.5B at 1024x2, r 16 on q_proj,v_proj) is read into
    the Arm the map builds from --families qwen --stream-layers off --gradient-checkpointing on at the same seq and
    batch, but for what the map does not spell: its adapter (the map's arms train the protocol's: --lora-r and
    --targets are --estimate's options) and the file's settings."""
    from dataclasses import replace

    from issue395.model.arm import Adapter

    arm = file_arm(qwen_yaml(tmp_path, "  stream_layers: false\n  gradient_checkpointing: true\n"))
    assert (arm.key, arm.label(), arm.checkpoint) == ("qwen+resident+gc", "Qwen2.5-0.5B [resident+gc]", None)
    assert (arm.adapter.targets, arm.adapter.lora_r, arm.adapter.lora_alpha) == (("q_proj", "v_proj"), 16, 16)
    (mapped,) = settled(["--map", "--families", "qwen", "--quant", "none", "--stream-layers", "off",
                         "--gradient-checkpointing", "on", "--seq", "1024", "--batch", "2", "--dry-run"]).arms()
    assert replace(as_the_command_line_can_say_it(arm), adapter=Adapter()) == mapped
    assert arm.settings.buffers is None  # a resident run reads no stream_buffers: none is carried


def test_a_streamed_file_and_estimates_options_for_it_are_one_arm(tmp_path):
    """The same run streamed: the soup.yaml's Arm (the measured arm's, and --estimate --config's at --steps 1) is
    --estimate --model qwen --seq 1024 --batch 2 --lora-r 16 --targets q_proj,v_proj's Arm, but for the file's
    settings and its path on the adapter."""
    config = qwen_yaml(tmp_path, "  stream_layers: true\n")
    arm = file_arm(config)
    (options,) = settled(["--estimate", "--model", "qwen", "--seq", "1024", "--batch", "2", "--lora-r", "16",
                          "--targets", "q_proj,v_proj"]).arms()
    assert as_the_command_line_can_say_it(arm) == options
    (from_file,) = settled(["--estimate", "--config", config, "--steps", "1"]).arms()
    assert from_file == arm
    assert (arm.settings.optimizer, arm.settings.accumulation, arm.settings.buffers) == ("adamw_torch", 1, 2)


@pytest.mark.skipif(not soup_has_stream_modes(), reason="soup-cli 0.77.0's streaming modes")
def test_a_files_streaming_modes_are_the_maps_key_for_them(tmp_path):
    """A streamed file's per_expert layout and loss chunk are the Streaming the map's key spells: the file's arm is
    Arm.at of "moonlight+per_expert+chunk512" at its seq and batch, its adapter and settings aside."""
    from dataclasses import replace

    from issue395.model.arm import Adapter, Arm

    path = tmp_path / "moe.yaml"
    path.write_text(QWEN_YAML.format(training="  stream_layers: true\n  stream_expert_layout: per_expert\n"
                                              "  stream_loss_chunk: 512\n")
                    .replace("Qwen/Qwen2.5-0.5B", "moonshotai/Moonlight-16B-A3B").replace("1024", "512"))
    arm = file_arm(path)
    assert replace(as_the_command_line_can_say_it(arm), adapter=Adapter()) == Arm.at(
        "moonlight+per_expert+chunk512", 512, 2)


def test_a_probed_files_estimate_takes_the_probe_as_the_maps_probe_arm_does(tmp_path):
    """Issue 50 F: a streamed soup.yaml with training.stream_vram_probe true is estimated with the probe's backward
    at setup (its cuBLAS workspace beside every phase), as the map's `+probe` arm is; before, only Soup's gate read
    the probe and --estimate answered the file as if unprobed. At one step and one micro-batch the probe binds:
    the corrected figure moves, to the `qwen+probe` arm's estimate of the same run."""
    from dataclasses import replace

    from issue395.estimator.resident import estimate_run
    from issue395.model.arm import Arm

    figures = {}
    for probe in (False, True):
        config = qwen_yaml(tmp_path, f"  stream_layers: true\n  stream_vram_probe: {str(probe).lower()}\n",
                           f"soup-{probe}.yaml")
        out = tmp_path / f"estimate-{probe}.json"
        request = settled(["--estimate", "--config", config, "--steps", "1", "--json", out])
        from issue395.run.estimate_mode import execute

        assert execute(request) == 0
        (row,) = json.loads(out.read_text())["rows"]
        figures[probe] = row["corrected_predicted"]
        assert request.gate.probe is probe and request.arms()[0].key == ("qwen+probe" if probe else "qwen")
        assert file_arm(config).key == request.arms()[0].key  # the measured arm runs the probe too
    arm = request.arms()[0]
    assert figures[True] > figures[False]
    assert figures[True] == estimate_run(Arm.at("qwen+probe", 1024, 2, settings=arm.settings,
                                                adapter=replace(arm.adapter, soup_config=None))).corrected_predicted
    assert figures[False] == estimate_run(Arm.at("qwen", 1024, 2, settings=arm.settings,
                                                 adapter=arm.adapter)).corrected_predicted


def test_a_full_fine_tuning_file_is_an_arm_whose_label_and_header_say_full(tmp_path):
    """Issue 51 (house5b E): a resident soup.yaml with training.lora.r 0 and target_modules auto (Soup's default) is
    accepted as a measured arm (no target is trained, so auto is not refused), its key stays its streaming's
    (`llama32-1b+resident+gc`, as saved rows parse it), its row's name says full, its header says no LoRA, and
    every estimate of it is the full fine-tuning's (estimate_resident at lora_r 0: no LoRA weights)."""
    from issue395.estimator.resident import estimate_resident, estimate_run
    from issue395.model.registry import config_json

    path = tmp_path / "full.yaml"
    path.write_text("base: meta-llama/Llama-3.2-1B\ntask: sft\ndata: {train: data.jsonl, max_length: 1024}\n"
                    "training:\n  batch_size: 1\n  quantization: none\n  stream_layers: false\n"
                    "  gradient_checkpointing: true\n  lora: {r: 0}\n")
    arm = file_arm(path)
    assert (arm.key, arm.label(), arm.full) == ("llama32-1b+resident+gc", "Llama-3.2-1B [resident+gc+full]", True)
    assert "LoRA" not in arm.adapter_words() and "full fine-tuning" in arm.adapter_words()
    e = estimate_run(arm)
    assert "lora_weights" not in e.terms or not e.terms["lora_weights"]
    assert e.corrected_predicted == estimate_resident(config_json("llama32-1b"), seq=1024, lora_r=0, checkpointing=True,
                                                      **arm.run).corrected_predicted


# A resident soup.yaml of a model Soup does not stream (Moonlight on soup-cli 0.73.3, a DeepSeek-V3 MoE): a resident
# run streams nothing, so only a streamed file is refused for what Soup streams.

#: Each registry family's config shrunk in every width (its model type and its kinds of layer kept: Moonlight's latent
#: attention, shared and routed experts and dense first layer; Qwen3.5-MoE's delta-net and full-attention layers and
#: experts), so Soup's real setup builds it on CPU in seconds; with the LoRA targets its layers have.
TINY_FAMILIES = {
    "moonlight": (dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                       n_shared_experts=1, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
                       vocab_size=512), "q_proj, kv_b_proj"),
    "qwen3.5-moe": (dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                         vocab_size=512, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                         linear_value_head_dim=16), "q_proj, v_proj"),
}


def moonlight_yaml(tmp_path, base, stream_layers="false", targets="q_proj, kv_b_proj"):
    path = soup_yaml(tmp_path, base)
    path.write_text(path.read_text().replace("stream_layers: true", f"stream_layers: {stream_layers}")
                    .replace("[q_proj]", f"[{targets}]"))
    return path


def config_folder(root, model_type, **config):
    """A folder holding only a config.json (synthetic weights are built from it)."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(dict(config, model_type=model_type)))
    return root


@pytest.mark.parametrize("key", list(TINY_FAMILIES))
def test_a_resident_moe_file_dry_runs_as_the_maps_resident_arm(capfd, tmp_path, monkeypatch, cache_dir, key):
    """A resident soup.yaml of Moonlight (base moonshotai/Moonlight-16B-A3B, stream_layers false; and of Qwen3.5-MoE)
    runs --dry-run as the map's resident arm (`moonlight+resident`): exit 0, its row and its table name the resident
    arm, Soup's resident gate is on the row, whether or not the installed Soup streams the model type. Before, the
    shape refused it as 'cannot be layer-streamed' (soup-cli 0.73.3). The registry's family is the real one with its
    widths shrunk (monkeypatched here, so the checkpoint builds in seconds); the path is the registry's, by hub id."""
    from issue395.model.registry import FAMILIES

    family, (tiny, targets) = FAMILIES[key], TINY_FAMILIES[key]
    monkeypatch.setitem(FAMILIES, key, replace(family, config=dict(family.config, **tiny)))
    out = tmp_path / "dry.json"
    code, text, err = main(capfd, ["--config", moonlight_yaml(tmp_path, family.hub_id, targets=targets), "--dry-run",
                                   "--cache-dir", cache_dir, "--json", out])
    assert code == 0, err
    (row,) = json.loads(out.read_text())["rows"]
    assert row["model_key"] == f"{key}+resident" and row["dry_run"] and row["error"] is None
    assert row["soup_resident"] is not None and family.name in text and "[resident]" in text


def test_a_resident_file_on_a_local_moe_config_soup_does_not_stream_dry_runs(capfd, tmp_path, cache_dir):
    """A resident soup.yaml whose base is a local config.json of an MoE no Soup release streams (Mixtral) runs
    --dry-run (exit 0, the row `custom+resident`): a resident run loads what transformers builds."""
    folder = config_folder(tmp_path / "mixtral", "mixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           vocab_size=512, max_position_embeddings=512)
    out = tmp_path / "dry.json"
    code, text, err = main(capfd, ["--config", moonlight_yaml(tmp_path, folder, targets="q_proj, v_proj"),
                                   "--dry-run", "--cache-dir", cache_dir, "--json", out])
    assert code == 0, err
    (row,) = json.loads(out.read_text())["rows"]
    assert row["model_key"] == "custom+resident" and "[resident]" in text


def test_a_streamed_file_of_a_model_soup_cannot_stream_is_still_one_line(capfd, tmp_path):
    """The same files streamed (stream_layers true) are refused in one line naming the architecture, before anything
    is built: Mixtral (no release streams it) from a local config, and Moonlight where the installed Soup does not
    stream deepseek_v3 (0.73.3)."""
    from issue395.estimator.soup_number import streamed_as

    folder = config_folder(tmp_path / "mixtral", "mixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    mixtral = moonlight_yaml(tmp_path, folder, stream_layers="true", targets="q_proj, v_proj")
    one_error_line(*main(capfd, ["--config", mixtral, "--dry-run"]), "'mixtral'", "cannot be layer-streamed")
    if streamed_as("deepseek_v3") is None:
        moon = moonlight_yaml(tmp_path, "moonshotai/Moonlight-16B-A3B", stream_layers="true")
        one_error_line(*main(capfd, ["--config", moon, "--dry-run"]), "does not stream deepseek_v3")


def test_a_resident_file_of_an_architecture_transformers_does_not_build_is_one_line(capfd, tmp_path):
    """A resident file whose base's config.json names a model type the installed transformers does not know is one
    line naming it (not transformers' list of every model type), exit 2."""
    folder = config_folder(tmp_path / "bogus", "not_a_model", hidden_size=64, num_hidden_layers=2, vocab_size=512)
    line = one_error_line(*main(capfd, ["--config", moonlight_yaml(tmp_path, folder), "--dry-run"]),
                          "'not_a_model'", "transformers")
    assert len(line) < 300


@pytest.mark.parametrize("stream, extra, named", [
    ("true", "  activation_offloading: cpu\n", "training.activation_offloading cpu"),
    ("false", "  use_liger: true\n", "training.use_liger true"),
    ("false", "  use_cut_ce: true\n", "training.use_cut_ce true"),
])
def test_a_measured_arm_refuses_a_setting_its_soup_config_would_drop(capfd, tmp_path, stream, extra, named):
    """Sweep: a measured --config arm runs the protocol's Soup config with the file's shape, adapter, streaming modes
    and SETTINGS; a file setting that moves the peak beyond them (activation offloading, Liger, Cut CE) was dropped in
    silence, so the row measured another run than the file's. Now one line names it, before anything is built."""
    path = soup_yaml(tmp_path, "HuggingFaceTB/SmolLM2-135M", extra=extra)
    path.write_text(path.read_text().replace("stream_layers: true", f"stream_layers: {stream}"))
    one_error_line(*main(capfd, ["--config", path, "--dry-run"]), named, "does not carry it")


def test_a_measured_arm_names_every_resident_setting_its_soup_config_would_drop(capfd, tmp_path):
    """A resident file with several settings the resident estimate does not model (Liger, Cut CE, DoRA) is refused in
    one line naming every one, not the first alone (soup_gate.resident_departures)."""
    path = soup_yaml(tmp_path, "HuggingFaceTB/SmolLM2-135M", extra="  use_liger: true\n  use_cut_ce: true\n")
    path.write_text(path.read_text().replace("stream_layers: true", "stream_layers: false")
                    .replace("r: 4,", "r: 4, use_dora: true,"))
    one_error_line(*main(capfd, ["--config", path, "--dry-run"]), "training.use_liger true", "training.use_cut_ce true",
                   "training.lora.use_dora true", "does not carry them")
