"""Predict before you run: memory per rank and time per step for a model, layout and link."""
