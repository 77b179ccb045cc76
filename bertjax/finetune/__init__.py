"""Fine-tuning. `python -m bertjax.finetune` (__main__.py) runs job/search.py's `finetune`: the
search `config.search` asks for, or else the one run of the config (job/run.py).

  job/       the run and the search: run, search, trials (several as one program), init_from and
             init_heads (where the encoder and heads start), evaluations, svg (a search's picture)
  tasks/     the benchmark tasks as readers that hand a family their examples: tasks (each task
             as the run sees it), glue, squad, ner, bm25 (retrieval's baseline)
  kit/       what the families share: config, custom (one's own files), metrics, objectives,
             taskdata, retrieval, squad_metrics and squad_postprocess
  families/  one module per task family (head, objective, features, metric, predictions, export
             class) and their registry
  builtin.py, search_aot.py: the commands of the built-in task NEXT and of a search's fit on a chip.
"""
