"""Fine-tuning tasks: data, post-processing and metrics, one module per task family."""
