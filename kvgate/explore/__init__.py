"""Stateful exploration of the model (Hypothesis), alone or against vLLM."""
