"""Fine-tuning: `python -m bertjax.finetune` (run.py), one module per task family for its data,
metrics and prediction files (glue, squad*, ner), the heads' objectives, and the built-in task."""
