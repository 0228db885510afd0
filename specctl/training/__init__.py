"""Training drafts for speculative decoding: the data (``data``: records, prompts, self-distillation,
tokenisation with loss masks), one trainer per draft kind (``medusa`` with ``medusa_losses`` and
``medusa_runs``; ``eagle`` with ``eagle_states`` and ``eagle_ttt``; ``mtp``), and what they share
(``loop``: the config fields, the Accelerator, the schedule, global batches, resume, model cards;
``checkpoints``: the output folder's training_config.json and checkpoints/step-NNNNNNN/).

What it does not know: the draft networks and their on-disk formats (``specctl.drafts``), the CLI
(``specctl.commands``), verification. Modules import torch, transformers, accelerate and peft only
where they need them, so importing this package is cheap.
"""
