"""The five tasks Soup streams (soup_cli's ``SUPPORTED_STREAM_TASKS``: sft, dpo, orpo, simpo, kto),
as data: which wrapper runs each, how many rows its model runs per configured example, which
forwards a step makes, which collated keys carry the token ids the realised-length guard reads,
and the smallest batch Soup's schema takes. "A new task goes here" (docs/LAYOUT.md).

Read from soup-cli 0.73.3 and 0.77.0 (``soup_cli/trainer/{sft,dpo,orpo,simpo,kto}.py``) and TRL
0.29.1, whose trainers they wrap; stdlib only, so the estimator reads it without torch. The
physics of each task's peak is the estimator's (issue395/estimator); this table only names what a
task is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .errors import UsageError


@dataclass(frozen=True)
class Task:
    """One task Soup streams."""

    name: str  # Soup's ``task:``
    wrapper: tuple  # (module, class) of Soup's trainer wrapper; each takes device="cpu" as well
    #: chosen and rejected run as ONE concatenated batch: the model sees 2 x batch rows per step
    #: (TRL's concatenated forward; Soup's _STREAM_ROWS_PER_EXAMPLE = 2)
    paired: bool
    #: a reference forward per step, under no_grad, between the policy forward and its backward
    #: (TRL 0.29 keeps the reference as a frozen "ref" adapter; KTO disables the adapter instead)
    reference: bool
    #: KTO's KL batch: mismatched completions run through policy and reference without grad
    kl_batch: bool
    #: the collated keys whose width the step runs at (the realised-length guard reads each)
    guard_keys: tuple
    #: Soup's ``data.format`` for the rows this harness writes
    data_format: str
    #: the smallest batch Soup's config schema takes (KTO needs both labels in a batch)
    min_batch: int = 1
    #: TRL cuts the collated batch to ``args.max_length`` inside compute_loss, so the width the
    #: model runs at is that cut, not the collated width: the trainer's method that cuts it and the
    #: collated keys it takes and gives back, in order (DPO: TRL 0.29.1's private
    #: ``DPOTrainer._truncate_inputs``, trl/trainer/dpo_trainer.py:972-993, called before the policy
    #: and the reference forward); () where the forwards run at the collated width
    loss_cut: tuple = ()
    #: the prompt of each row this harness writes (a preference or KTO task's), the words that
    #: realise exactly seq on soup-cli 0.73.3 and 0.77.0 alike (the builder's tokenizer has no BOS):
    #: DPO's "hi", since an empty prompt crashes TRL's DPO (its prompt_ids[0]); an empty one for
    #: ORPO, SimPO and KTO, where a prompt token would come on top of the answer's cut (ORPO/SimPO on
    #: 0.73.3: seq + 1) or off it (KTO: seq - 1)
    prompt: str = ""
    #: the trainer casts the trainable (LoRA) parameters to bf16 when the model is 4-bit: TRL 0.29.1's
    #: SFTTrainer and DPOTrainer (``if getattr(model, "is_loaded_in_4bit", False) ...:
    #: param.data = param.data.to(torch.bfloat16)``, QLoRA's recipe), and Soup's streamed NF4 build
    #: stamps ``is_loaded_in_4bit`` (layer_stream_runtime ``_stamp_4bit_markers``); TRL's experimental
    #: KTO, ORPO and CPO (SimPO) trainers keep them fp32. Evidence: docs/PEAK.md, "adapter_bytes".
    adapter_bf16_under_4bit: bool = False
    #: the trainer sets every nn.Dropout's p to 0 before training (TRL 0.29.1's DPO, ORPO, CPO (SimPO) and KTO
    #: configs: ``disable_dropout`` defaults to True and Soup's wrappers leave it so; ``disable_dropout_in_model``),
    #: LoRA's dropout among them; SFTTrainer has no such setting
    dropout_disabled: bool = False

    def batch_refused(self, batch: int) -> Optional[str]:
        """Why Soup's schema refuses ``batch`` for this task (None: it takes it), in the words every check
        of the smallest batch says (the command line, the estimator, a measured arm's SKIPPED row)."""
        return f"Soup's schema refuses a {self.name} batch under {self.min_batch}" if batch < self.min_batch else None

    def rows(self, words: int, n: int) -> list[dict]:
        """``n`` rows of this (non-SFT) task in its ``data_format``, each completion ``words`` words long,
        chosen AND rejected alike (TRL's ORPO/CPO cut is set by the longer answer and would cut a short
        side further); KTO's labels alternate, so a batch of two holds both."""
        answer = ("word" if not self.prompt else " word") + " word" * (words - 1)
        if self.data_format == "kto":
            return [{"prompt": self.prompt, "completion": answer, "label": i % 2 == 0} for i in range(n)]
        return [{"prompt": self.prompt, "chosen": answer, "rejected": answer}] * n

    @property
    def rows_per_example(self) -> int:
        """The rows the model runs per configured example."""
        return 2 if self.paired else 1

    def guard_rows(self, batch: int) -> int:
        """The rows the guard reads over all its keys at this batch: the model's rows, and KTO's
        KL batch as many again."""
        return batch * self.rows_per_example * (2 if self.kl_batch else 1)


TASKS: dict[str, Task] = {
    "sft": Task("sft", ("soup_cli.trainer.sft", "SFTTrainerWrapper"), paired=False, reference=False,
                kl_batch=False, guard_keys=("input_ids",), data_format="chatml", adapter_bf16_under_4bit=True),
    # TRL collates chosen then rejected as one (2B, W) batch and cuts it to max_length inside
    # compute_loss (soup-cli 0.73.3 collates 3 x seq wide; 0.77.0 caps the tokenized rows itself)
    "dpo": Task("dpo", ("soup_cli.trainer.dpo", "DPOTrainerWrapper"), paired=True, reference=True,
                kl_batch=False, guard_keys=("input_ids",), data_format="dpo",
                loss_cut=("_truncate_inputs", ("input_ids", "attention_mask", "completion_mask")), prompt="hi",
                adapter_bf16_under_4bit=True, dropout_disabled=True),
    "orpo": Task("orpo", ("soup_cli.trainer.orpo", "ORPOTrainerWrapper"), paired=True, reference=False,
                 kl_batch=False, guard_keys=("chosen_input_ids", "rejected_input_ids"), data_format="dpo",
                 dropout_disabled=True),
    # SimPO is TRL's CPO trainer with loss_type "simpo" (Soup keeps cpo_alpha > 0: the chosen NLL stays)
    "simpo": Task("simpo", ("soup_cli.trainer.simpo", "SimPOTrainerWrapper"), paired=True, reference=False,
                  kl_batch=False, guard_keys=("chosen_input_ids", "rejected_input_ids"), data_format="dpo",
                 dropout_disabled=True),
    "kto": Task("kto", ("soup_cli.trainer.kto", "KTOTrainerWrapper"), paired=False, reference=True,
                kl_batch=True, guard_keys=("completion_input_ids", "KL_completion_input_ids"),
                data_format="kto", min_batch=2, dropout_disabled=True),
}

#: The protocol's task: every arm without a task is SFT, as the record's are.
PROTOCOL_TASK = "sft"


def task(name: str) -> Task:
    """The task named, or one line naming the five."""
    try:
        return TASKS[name]
    except KeyError:
        raise UsageError(f"task {name!r} is not one Soup streams; choose from {', '.join(TASKS)}") from None
