"""Fine-tuning: `python -m bertjax.finetune` (run.py). One module per task family (families/: head,
objective, features, metric, predictions, export class); the benchmarks as readers that hand a
family their examples (tasks.py over glue, squad*, ner, builtin); one's own files (custom.py)."""
