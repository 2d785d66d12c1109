"""doplus: machine unlearning for LLMs with the DualOptim+ optimizer."""

__version__ = "0.1.0"
