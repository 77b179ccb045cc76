"""Fine-tuning: task data, metrics and prediction files (one module per task family)."""
