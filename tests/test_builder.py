"""issue395.builder: building a checkpoint says nothing of transformers' own (issue 22, defect 17:
a stray "Unrecognized keys in `rope_parameters`" leaked to stderr in the map's dry run: Gemma 3's
per-layer-type rope, as transformers 5 validates it while the builder made and saved its config).
CPU, a tiny Gemma 3. Soup's own read of the config inside an arm goes to the arm's Soup log."""

from __future__ import annotations

import dataclasses

from issue395.builder import prepare_checkpoint
from issue395.shapes import family_shape, load_custom_shape


def test_a_gemma3_checkpoint_is_built_and_its_shape_read_with_no_rope_warning_on_stderr(capfd, tmp_path):
    gemma3 = family_shape("gemma3-1b")
    tiny = dataclasses.replace(gemma3, key="g3", vocab=512, hidden=64, intermediate=128, n_layers=2,
                               arch=dict(gemma3.arch, num_attention_heads=2, num_key_value_heads=1, head_dim=32))
    prepare_checkpoint(tiny, tmp_path)
    load_custom_shape(str(tmp_path))
    _, err = capfd.readouterr()
    assert "Unrecognized keys" not in err, err
