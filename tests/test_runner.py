"""issue395.runner's --estimate output (issue 22): what it leaves out said where its numbers are
read, and a JSON that says what it is."""

from __future__ import annotations

import json

from conftest import main


def test_a_quantization_config_is_said_to_be_not_modelled(capfd, tmp_path):
    from issue395.registry import config_json

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**config_json("llama31-8b"), "quantization_config": {
        "quant_method": "bitsandbytes", "load_in_4bit": True}}))
    code, out, err = main(capfd, ["--estimate", "--model", path, "--seq", "512"])
    assert code == 0, err
    assert [ln for ln in out.splitlines() if ln.startswith("note:") and "quantization" in ln] == [
        "note: the config's quantization_config (bitsandbytes) is NOT modelled: these figures are Soup's "
        "--quant none of the full-precision shapes the config describes"]
    code, out, _ = main(capfd, ["--estimate", "--model", "llama31-8b", "--seq", "512"])
    assert "quantization_config" not in out


def test_the_estimate_says_what_it_assumes_and_what_it_leaves_out(capfd, tmp_path):
    out_json = tmp_path / "e.json"
    code, out, err = main(capfd, ["--estimate", "--model", "mistral-7b", "--quant", "nf4", "--seq", "512",
                                  "--card", "24GB", "--json", out_json])
    assert code == 0, err
    assert "expandable segments, as `soup train` sets them" in out
    assert "not estimated: host RAM" in out
    data = json.loads(out_json.read_text())
    assert data["schema"] >= 2 and data["kind"] == "estimate"
    assert data["targets"] == ["q_proj", "v_proj"] and data["lora_r"] == 8
    [card] = data["rows"][0]["cards"]  # the fit per card lives in each row (issue 20's shape)
    assert card["card"] == "24GB" and card["fits"] is True and card["soup_admits"] is True
    assert any("host RAM" in n for n in data["notes"])
