"""The command line of `main_pretrain.py` and `main_linear.py` (`ContrastlabCLI`, on top of every other package):
the LightningCLI and its parser (`lightning_cli`), bad inputs as one error line (`errors`), which run a `fit`
continues (`resume`) and the final metrics (`results`)."""

from engine.cli.lightning_cli import ContrastlabCLI, instantiate_config

__all__ = ["ContrastlabCLI", "instantiate_config"]
