"""The run plumbing around the methods: the CLI (`engine.cli`), checkpoints, preemption and reproducibility
(`engine.reliability`), W&B tracking (`engine.tracking`), optimizers and learning-rate schedules
(`engine.optim`), config-spec helpers (`engine.config`), and `engine.compat`, the one module that touches private
Lightning and W&B attributes."""
