"""Soup's measured-fit probe (``training.stream_vram_probe``, its #349: one step measured at setup decides the fit,
not its formula) on an arm that asks for it, for every task Soup streams (#840 asks for DPO, ORPO, SimPO and KTO,
which Soup's schema refuses): Soup's config with the key where its loader takes it (``probe_config``); what Soup's
probe function and its decision returned (``watch_soup_probe``), whether Soup's own setup called them or, where
its schema refuses the key for the task, this tool did (``call_soup_probe``), into the row's ``SoupProbe``. Nothing
here measures or decides: the peak is Soup's function's, the verdict Soup's ``decide_measured_fit``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Optional

from ..results.extras import SoupProbe

#: The outcome of a probe that did not run: off CUDA Soup's setup never calls it and its function returns None.
NOT_RUN = "not run"


def probe_missing() -> Optional[str]:
    """One line where the installed Soup has no training.stream_vram_probe (the key, its probe function, its
    measured decision); None where it has them (soup-cli 0.73.3 and 0.77.0 both do)."""
    from importlib.metadata import version

    from soup_cli.config.schema import TrainingConfig
    from soup_cli.utils import layer_stream, layer_stream_runtime

    if ("stream_vram_probe" in TrainingConfig.model_fields and hasattr(layer_stream, "decide_measured_fit")
            and hasattr(layer_stream_runtime, "measure_step_peak_bytes")):
        return None
    return (f"--stream-vram-probe on: the installed soup-cli {version('soup-cli')} has no training.stream_vram_probe "
            "(its measured-fit probe, layer_stream_runtime.measure_step_peak_bytes)")


def soup_ceiling() -> Optional[float]:
    """How far over its free memory Soup's formula may predict and still defer to the probe (read from Soup)."""
    from soup_cli.trainer import stream_setup

    return getattr(stream_setup, "_PROBE_DEFERRAL_CEILING", None)


def probe_config(load: Callable[[str], Any], text: str) -> tuple[Any, Optional[SoupProbe]]:
    """Soup's loader on the arm's config, and where the arm asks for the probe its record: Soup's own (SOUP) where
    Soup's loader takes the key; where it refuses the key (its schema: SFT only) and takes the config without it,
    that config and CALLED, for this tool to call Soup's probe after Soup's setup, as #840's extension would."""
    import yaml

    data = yaml.safe_load(text)
    if not data["training"].get("stream_vram_probe"):
        return load(text), None
    try:
        return load(text), SoupProbe(SoupProbe.SOUP, ceiling=soup_ceiling(), outcome=NOT_RUN)
    except Exception as exc:  # noqa: BLE001 - Soup's loader raises its own validation errors
        if "stream_vram_probe" not in str(exc):
            raise
        del data["training"]["stream_vram_probe"]
        return load(yaml.safe_dump(data, sort_keys=False)), SoupProbe(SoupProbe.CALLED, ceiling=soup_ceiling(),
                                                                      outcome=NOT_RUN)


@contextlib.contextmanager
def watch_soup_probe(m: Any) -> Iterator[Any]:
    """Soup's probe function and its measured decision, as they return, into ``m.soup_probe`` (only where the arm
    asked for the probe). Soup's setup imports both inside its method (0.73.3 and 0.77.0 alike), so wrapping the
    modules' sees its calls, and this tool's (``call_soup_probe``) go through the same. On Soup's own path its
    decision is its gate's: a refusal there is the arm's REFUSED (``m.soup_fit``)."""
    from soup_cli.utils import layer_stream, layer_stream_runtime

    measure, decide = layer_stream_runtime.measure_step_peak_bytes, layer_stream.decide_measured_fit

    def measure_seen(*args: Any, **kwargs: Any) -> Any:
        peak = measure(*args, **kwargs)
        if m.soup_probe is not None:
            taken = {} if peak is None else {"outcome": "oom"} if peak.oom else (
                {"outcome": f"failed: {peak.error}"} if peak.failed else
                {"outcome": None, "peak": int(peak.peak_bytes), "reserved": int(peak.reserved_bytes) or None,
                 "seconds": round(float(peak.seconds), 3)})
            m.soup_probe = dataclasses.replace(m.soup_probe, rows=kwargs.get("rows"), seq=kwargs.get("seq_len"),
                                               **taken)
        return peak

    def decide_seen(*args: Any, **kwargs: Any) -> Any:
        fit = decide(*args, **kwargs)
        if m.soup_probe is not None:
            m.soup_probe = dataclasses.replace(m.soup_probe, available=int(fit.available_bytes), admits=bool(fit.fits))
            if m.soup_probe.path == SoupProbe.SOUP:
                m.soup_fit = fit
        return fit

    layer_stream_runtime.measure_step_peak_bytes, layer_stream.decide_measured_fit = measure_seen, decide_seen
    try:
        yield m
    finally:
        layer_stream_runtime.measure_step_peak_bytes, layer_stream.decide_measured_fit = measure, decide


def call_soup_probe(wrapper: Any, config: Any, m: Any) -> None:
    """Where Soup's schema refuses the key for the task (CALLED), #840's extension run by this tool after Soup's
    setup: Soup's probe function on the task's streamed model (the one Soup's setup built) at the rows Soup's setup
    counts for the task (batch x its wrapper's _STREAM_ROWS_PER_EXAMPLE) and data.max_length, on Soup's device, and
    Soup's decide_measured_fit on its peak against the free memory Soup's gate read and Soup's own prediction (no
    decision where either is missing: off CUDA). Nothing where Soup ran its own probe or none was asked."""
    if m.soup_probe is None or m.soup_probe.path != SoupProbe.CALLED:
        return
    from soup_cli.utils import layer_stream, layer_stream_runtime

    model = wrapper.model
    peak = layer_stream_runtime.measure_step_peak_bytes(
        model, rows=int(config.training.batch_size) * int(wrapper._STREAM_ROWS_PER_EXAMPLE),
        seq_len=int(config.data.max_length), vocab_size=int(model.config.vocab_size), device=str(wrapper.device))
    available = getattr(m.soup_fit, "available_bytes", None)
    if peak is not None and not (peak.oom or peak.failed) and available and m.soup_predicted:
        layer_stream.decide_measured_fit(measured_bytes=peak.peak_bytes, predicted_bytes=m.soup_predicted,
                                         available_bytes=available)
