"""doplus: machine unlearning for LLMs with the DualOptim+ optimizer."""

__version__ = "0.2.0"
