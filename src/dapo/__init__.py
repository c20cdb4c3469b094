"""dapo: Decoupled Clip and Dynamic sAmpling Policy Optimization for language models."""

__version__ = "0.1.0"
