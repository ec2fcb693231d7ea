"""The run plumbing around the methods: the command line (`engine.cli`, the top layer), and below every other
package the pieces the methods and DataModules use: checkpoint files (`engine.files`) and records
(`engine.checkpoint_record`), preemption (`engine.preemption`), random states (`engine.random_state`), the
non-finite-loss guard (`engine.non_finite`), W&B tracking (`engine.tracking`), optimizers and learning-rate
schedules (`engine.optim`), config-spec helpers (`engine.config`), the scripts' argument parser (`engine.arguments`),
and `engine.compat`, the one module that touches private Lightning and W&B attributes."""
