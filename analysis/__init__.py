"""Prediction-versus-measurement tables, W&B, report."""
