"""The unlearning engine: the forget/retain schedule, optimizers, the training loop and its outputs."""
