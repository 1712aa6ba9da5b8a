"""issue 50 item 1: how a run streams is one typed record (issue395.model.streaming.Streaming), the one place a mode is
spelled in a map key. Pure: no Soup, no torch."""

import pytest

from issue395.errors import UsageError
from issue395.model.registry import mode_key, stream_mode, stream_mode_keys
from issue395.model.streaming import Streaming


@pytest.mark.parametrize("key", ["moonlight+per_expert+chunk512+recompute-off", "llama32-1b+resident+gc",
                                 "smol+probe", "qwen+resident", "smol", "moonlight+chunk1024+probe"])
def test_a_map_key_round_trips_through_the_record(key):
    """Parsing a key and rendering its record gives the key back, and its Soup training keys are the ones the key
    names (written out here by hand, not by the record)."""
    family, streaming = Streaming.parse(key)
    assert streaming.key(family) == key
    assert Streaming.of_training(streaming.training()) == streaming


def test_the_record_gives_the_soup_training_keys_each_mode_sets():
    """Each mode is the Soup key the soup.yaml would set; Soup's defaults set nothing."""
    assert Streaming.parse("moonlight+per_expert+chunk512+recompute-off")[1].training() == {
        "stream_expert_layout": "per_expert", "stream_loss_chunk": 512, "stream_recompute": "off"}
    assert Streaming.parse("llama32-1b+resident+gc")[1].training() == {"stream_layers": False,
                                                                       "gradient_checkpointing": True}
    assert Streaming.parse("smol+probe")[1].stream() == {"stream_vram_probe": True}
    assert Streaming.parse("llama32-1b+resident+gc")[1].stream() == {}
    assert Streaming().training() == {} and Streaming.parse("smol")[1] == Streaming()


@pytest.mark.parametrize("streaming, words", [
    (Streaming(layers=False, loss_chunk=512), "smol: a resident run (stream_layers off) takes no streaming mode"),
    (Streaming(layers=False, probe=True), "smol: a resident run (stream_layers off) takes no streaming mode"),
    (Streaming(checkpointing=True), "smol: gradient checkpointing is a resident run's (a streamed run checkpoints "
                                    "every layer itself)"),
])
def test_a_combination_no_run_has_is_refused_with_the_existing_line(streaming, words):
    """The record refuses what mode_key refused, in its words, whether built or parsed from a key."""
    with pytest.raises(UsageError) as built:
        streaming.key("smol")
    assert str(built.value) == words
    with pytest.raises(UsageError):
        mode_key("smol", loss_chunk=512, resident=True)
    with pytest.raises(UsageError, match="gradient checkpointing is a resident run's"):
        Streaming.parse("smol+gc")  # parsed: the same refusal (stream_mode took it before)


def test_an_unknown_mode_is_refused_naming_the_modes():
    with pytest.raises(UsageError, match=r"smol\+chunk0: unknown streaming mode 'chunk0' \(modes: per_expert"):
        stream_mode("smol+chunk0")


def test_the_map_axes_are_every_family_under_every_mode_in_order():
    """stream_mode_keys' grid, built from records, in the map's order: a family's streamed keys, then its resident."""
    assert stream_mode_keys(["moonlight", "smol"], ["fused", "per_expert"], [None], ["on"], ("on", "off"),
                            ("off", "on")) == ("moonlight", "moonlight+per_expert", "moonlight+resident",
                                               "moonlight+resident+gc", "smol", "smol+resident", "smol+resident+gc")
