"""--estimate on a resident soup.yaml (training.stream_layers false): Soup's resident gate as `soup train` runs it
(computed by Soup: the input its CLI built from the file, hardware_fit's number, decide_hardware_fit against each
card's total memory) beside this tool's resident estimate (issue395.estimator.resident) and its fit on each card,
the verdict first; where the estimator does not model the run, it says so and answers no fit."""

from __future__ import annotations

from ..constants import ALLOC_CONF_VAR, EXPANDABLE_SEGMENTS
from ..errors import EXIT_FINDING, EXIT_OK, EXIT_SOUP_REFUSES, EXIT_USAGE, InvalidRun, UsageError
from ..report.outputs import write_json
from ..results.extras import ResidentGate
from .request import EstimateRequest


def card_answer(card, context, est, soup_input) -> dict:
    """One card's answer (the JSON's ``cards`` entry): this tool's fit of ``est`` (None: not estimated) with the runtime's
    growth on the card's own architecture (cards.step_growth), and Soup's resident gate on its total as CUDA reports it."""
    from ..estimator.cards import budget

    b = budget(card, context, resident=True)
    return {"card": card.name, "total_bytes": card.total_bytes, "free_bytes": b.free_bytes,
            "step_free_bytes": b.step_free_bytes, "growth_bytes": b.growth, "growth_source": b.growth_from,
            "fits": None if est is None else b.fits(est.needs_free),
            "soup_admits": ResidentGate.computed(soup_input, card.total_bytes - card.hidden_bytes).admitted}


def answer_resident(e: EstimateRequest) -> int:
    """The resident run's rows, verdict, text and JSON (one (task, quant, seq, batch): the file's)."""
    from ..estimator.fits import reserve_words
    from ..estimator.resident import estimate_run
    from ..estimator.steady import bound_words, is_bounded
    from ..estimator.terms import phases_of

    r, a, arm = e.user.resident, e.adapter, e.arms()[0]
    task, quant, seq, batch, checkpointing = arm.task, arm.quant, arm.seq, arm.batch, arm.streaming.checkpointing
    try:  # a setting the estimate does not model: no estimate of another run (soup_gate.ASSUMED)
        est, why = (None, r.unmodelled) if r.unmodelled else (estimate_run(arm, e.config), None)
    except InvalidRun as exc:  # no stack starts it: bad input, as for a streamed file, not "not estimated"
        raise UsageError(f"--estimate --config {a.soup_config} (base {e.model}): {exc}") from None
    except UsageError as exc:
        est, why = None, str(exc)
    if why and e.fit_exit:
        raise UsageError(f"--exit-code: this tool cannot say whether {e.model} fits: {why}")
    soup = ResidentGate.computed(r.soup_input)
    soup_gb = None if soup.peak is None else soup.peak / 1e9
    cards = [card_answer(card, e.context, est, r.soup_input) for card in e.cards]
    tag = (f"{task} {quant} {seq}x{batch}" + (" with gradient checkpointing" if checkpointing else "")
           + (", full fine-tuning (training.lora.r 0: no adapter, every parameter trains)" if a.lora_r == 0 else ""))
    mine = (f"needs {est.needs_free / 1e9:.2f} GB free by this tool's resident estimate"
            + (f" ({reserve_words(est)})" if reserve_words(est) else "") if est else f"not estimated by this tool ({why})")
    gate = (f"Soup's resident gate: {soup_gb:.2f} GB, +10% margin {soup_gb * 1.1:.2f} GB against a card's total"
            if soup_gb is not None else "Soup's resident gate: no number (its CLI builds no input, so it skips its gate)")
    verdict = "verdict: " + ("; ".join(
        f"{c['card']}: " + ("fits" if c["fits"] else "does NOT fit" if c["fits"] is False else "fit not estimated")
        + (", Soup's gate admits it" if c["soup_admits"] else ", Soup's gate REFUSES it") for c in cards)
        if cards else mine + "; give --card to fit it on a card")
    optimizer = e.settings.optimizer
    charged = est and (e.steps > 1 or est.phase == "optimizer")  # where the optimizer's states count
    bound = bound_words(optimizer) if charged and optimizer and is_bounded(optimizer) else None
    if bound:  # every figure is the bound's: said on the verdict's line and on its own
        verdict = verdict.replace("verdict: ", f"verdict (an UPPER BOUND: training.optimizer {optimizer} is not modelled): ", 1)
    lines = [verdict, f"--estimate: {e.model}, from --config {a.soup_config}: a resident run (training.stream_layers "
             f"false), {tag}, {e.steps} optimizer step(s)", f"  this tool: {mine}", f"  {gate}"]
    if est:  # soup train leaves a resident run on the default allocator, whose fragmentation the need does not bound
        lines.append(f"  the need holds on expandable segments: run it with {ALLOC_CONF_VAR}={EXPANDABLE_SEGMENTS} "
                     "exported (stock `soup train` sets it in time for a streamed run of 0.77.0 only, a --soup-patch'ed one "
                     "for every run; a value exported is kept); on the default allocator a resident run can need more, "
                     "by its fragmentation, which this tool does not bound")
    lines += ([f"  {bound}"] if bound else []) + [f"  from the file: {k}" for k in e.keys]
    if r.soup_profile:  # Soup's other estimator, which no gate reads: said beside its gate's
        p = r.soup_profile
        lines.append(f"  `soup profile`: {p['total_bytes'] / 1e9:.2f} GB (computed by Soup: its profile command's "
                     f"estimate_total, the model taken as {p['model_params_b']:g}B parameters by its name or "
                     "checkpoint; no gate reads it)")
    if est:
        lines += [f"  corrected allocated peak {est.corrected_predicted / 1e9:.4f} GB ({est.phase} phase); terms, each "
                  "with the phases it is live in:"]
        lines += [f"    {k:<28} {v / 1e9:.4f} GB  {', '.join(phases_of(k))}" for k, v in est.terms.items() if v]
    lines += [f"  {c['card']}: " + (f"needs {est.needs_free / 1e9:.2f} of {c['free_bytes'] / 1e9:.2f} GB free, "
                                     f"{c['step_free_bytes'] / 1e9:.2f} GB less the runtime's growth by the step's end "
                                     f"({c['growth_bytes'] / 1e6:.1f} MB, {c['growth_source']}); " if est
                                     else "") + ("Soup admits it" if c["soup_admits"] else "Soup REFUSES it")
              + (f" (its +10% number against the card's {c['total_bytes'] / 1e9:.2f} GB total)" if soup_gb else "")
              for c in cards]
    lines.append("(Soup's resident gate: computed by Soup's own code; needs free and the terms: this tool's estimator, "
                 "from the config alone)")
    print("\n".join(lines))
    if e.outputs.json and not write_json(e.outputs.json, "estimate", {
            "model": e.model, "config": a.soup_config, "resident": {"checkpointing": checkpointing,
                                                                     "soup_input": r.soup_input},
            "task": task, "quant": quant, "seq": seq, "batch": batch, "steps": e.steps,
            "soup_resident_bytes": soup.peak,
            "soup_profile": r.soup_profile, "config_keys": list(e.keys), "upper_bound": bound, "corrected": est.corrected_predicted if est else None,
            "needs_free_allocator": EXPANDABLE_SEGMENTS if est else None,
            "needs_free": est.needs_free if est else None, "not_estimated": why,
            "terms": est.terms if est else None,
            "term_phases": {k: list(phases_of(k)) for k in est.terms} if est else None, "cards": cards}):
        return EXIT_USAGE
    if not e.fit_exit:
        return EXIT_OK
    if not all(c["fits"] for c in cards):
        return EXIT_FINDING
    return EXIT_OK if all(c["soup_admits"] for c in cards) else EXIT_SOUP_REFUSES
