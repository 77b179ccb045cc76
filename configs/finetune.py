"""Fine-tuning: `python -m bertjax.finetune --config=configs/finetune.py:TASK --workdir=DIR
--config.checkpoint.init_from=PATH [--config.data.data_dir=... | --config.data.train_file=...
--config.data.dev_file=...]`

TASK: cola, sst-2, mrpc, sts-b, qqp, mnli (also predicts AX), qnli, rte, wnli; squad_v1.1,
squad_v2.0; conll2003; next (the built-in task of `make finetune`); or one's own task from files:
classification, regression, tagging, span, embeddings (a retriever from (query, passage) pairs,
config.contrastive; docs/your-own-task.md; no learning rate given: chosen on dev, config.search). Any key can be overridden. The original recipe (run_classifier.py /
run_squad.py and the paper's appendix A.3) is the default: AdamW (weight decay 0.01, no bias
correction), 10% linear warmup then linear decay to 0, batch 32, dropout 0.1, max_seq_length 128;
GLUE and CoNLL 3 epochs at 2e-5 (the paper searched 5e-5, 3e-5, 2e-5 on dev); SQuAD 2 epochs at
3e-5, max_seq_length 384, doc_stride 128, max_query_length 64, n-best 20, max_answer_length 30. The
dev set is scored after every epoch and the best checkpoint kept.
NEXT (the built-in task) fine-tunes the tiny model of configs/tiny.py: max_seq_length 64, 3e-4
(chosen on dev: docs/lab-notes.md#configsfinetunepy), 3 epochs of 8,000 pairs.
"""

import dataclasses

import ml_collections

from bertjax.configs import base
from bertjax.finetune import families
from bertjax.model.config import INHERITED_FIELDS, BertConfig

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(BertConfig)}

SQUAD = ("squad_v1.1", "squad_v2.0")
# One's own tasks are named by their family: a name of the registry (bertjax/finetune/families/),
# read here, so this file sits above fine-tuning (docs/contributing.md#layers).


def get_config(task: str = "next"):
  config = ml_collections.ConfigDict()
  config.task = task  # see the module docstring; checked when the run starts

  # What is read, with the key paths pre-training uses for the same things (configs/base.py).
  d = config.data = ml_collections.ConfigDict()
  d.source = "files"  # "files" (the task's original files) or "tfds" (built under tfds_data_dir)
  d.data_dir = ""  # GLUE: the folder of GLUE's download (CoLA/train.tsv, MNLI/..., ...)
  d.train_file = ""  # SQuAD: train-v1.1.json ...; CoNLL-2003: eng.train
  d.dev_file = ""  # SQuAD: dev-v1.1.json ...; CoNLL-2003: eng.testa
  d.test_file = ""  # CoNLL-2003: eng.testb (scored and written); "" = none
  d.tfds_data_dir = ""  # where TFDS datasets are built (nothing is ever downloaded)
  d.vocab_path = ""  # "" = init_from's vocabulary (the one it was trained with)
  # None = init_from's casing (True without init_from); set, it is used and a difference from
  # init_from's is warned about.
  d.do_lower_case = ml_collections.FieldReference(None, field_type=bool)
  d.max_seq_length = 128  # [CLS] A [SEP] B [SEP]; longest-first truncation
  d.doc_stride = 128  # SQuAD: tokens between the starts of a long context's windows
  d.max_query_length = 64  # SQuAD: question tokens kept
  # One's own task (classification, regression, tagging, span): its files' layout.
  d.format = ""  # "" = from the extension (.csv, .tsv, .jsonl, .parquet; tagging also .conll); or
  #                csv, tsv, jsonl, parquet, conll
  d.text_a = "text"  # the column of the text (the first one of a pair)
  d.text_b = ""  # the column of a pair's second text; "" = one text per example
  d.label = "label"  # the column of the label name (classification) or number (regression)
  d.tokens = "tokens"  # tagging: the column of the words (a JSON list or space-separated) ...
  d.tags = "tags"  # ... and of their tags
  d.tag_scheme = ""  # tagging: IO, BIO, IOB1 or IOBES; "" = detected from the training file
  d.labels = ""  # "a,b,c": the label map in this order; "" = the training file's labels, sorted
  # span: v2.0-style (unanswerable questions) or not; None = v2.0 if the training file has any
  d.version_2_with_negative = ml_collections.FieldReference(None, field_type=bool)
  # embeddings (a retriever): the columns of the training and dev files, the passages' length is
  # max_seq_length and the queries' max_query_length.
  d.query = "query"  # the query's column
  d.positive = "positive"  # its positive passage (dev with corpus_file: its relevant ids)
  d.negatives = ""  # columns of hard negatives, "neg" or "neg1,neg2"; "" = in-batch ones alone
  d.corpus_file = ""  # the passages dev and test queries search (columns id and `passage`); "" =
  #                     the dev (test) file's own passages
  d.passage = "text"  # the corpus's text column (and bertjax.predict's passages)

  # How predictions are decoded (SQuAD).
  e = config.eval = ml_collections.ConfigDict()
  e.n_best_size = 20
  e.max_answer_length = 30
  e.null_score_diff_threshold = 0.0  # v2.0: answer "" when null - best > this
  # One's own task: the dev score that picks the best checkpoint ("" = accuracy for classification,
  # pearson for regression, f1 for tagging and span, mrr_at_10 for embeddings; each family's
  # main_metrics, finetune/families/).
  e.main_metric = ""

  # The encoder: 0 / "" takes init_from's value (shape keys must then match it): its shape,
  # dtype (compute) and param_dtype, ..., and the new head's initializer_range (0.02 for BERT);
  # the head's kind (task_head: a ModernBERT folder or modern run gives "modernbert") and its
  # classifier_pooling ("cls", or "mean" over real tokens for the modernbert head).
  m = config.model = ml_collections.ConfigDict()
  for key in INHERITED_FIELDS:
    m[key] = type(_DEFAULTS[key])()  # 0, 0.0 or ""
  m.hidden_dropout = 0.1  # the paper's fine-tuning dropout, whatever pre-training used
  m.attention_dropout = 0.1

  t = config.train = ml_collections.ConfigDict()
  t.batch_size = 32  # global
  t.eval_batch_size = 0  # 0 = batch_size
  t.num_epochs = 3.0
  t.learning_rate = 2e-5
  t.warmup_proportion = 0.1
  t.seed = 0  # head init, dropout, the order of examples
  t.optimizer = "adamw"
  t.weight_decay = 0.01
  t.adam_b1 = 0.9
  t.adam_b2 = 0.999
  t.adam_eps = 1e-6
  t.bias_correction = False
  t.max_grad_norm = 1.0
  t.num_microbatches = 1  # embeddings: chunks encoded apart, every passage still a negative
  t.log_every_steps = 50
  t.watchdog_seconds = 300  # several processes: a hung one ended after this (configs/base.py)
  # Classification: "" (none), "balanced" (each class weighs as much as any other in the loss) or
  # "label=weight,..." (others 1).
  t.class_weights = ""

  # Settings chosen on dev (bertjax/finetune/job/search.py, docs/finetuning.md#settings-chosen-on-dev):
  # each key lists the values of its `train` key to try ("5e-5,3e-5"; "" = train's one value);
  # every combination is a trial, the best on dev is kept in best/. Trials of one batch size train
  # together as one program. learning_rate=auto: the four rates scaled to the encoder's width
  # that a task without a rate runs (search.auto_learning_rates), here where the task sets one.
  s = config.search = ml_collections.ConfigDict()
  s.learning_rate = ""
  s.num_epochs = ""
  s.warmup_proportion = ""
  s.weight_decay = ""
  s.seed = ""  # restarts: the median and range over them are reported
  s.batch_size = ""
  s.trials_per_program = 0  # 0 = as many as memory allows; more is refused before any work
  s.memory_gb = 0.0  # what the trials may take; 0 = what the devices (or a CPU host) have free

  # embeddings: how vectors are made and scored (bertjax/model/contrastive.py says more).
  k = config.contrastive = ml_collections.ConfigDict()
  k.loss = "infonce"  # or "sigmoid" (SigLIP's)
  k.pooling = "mean"  # over real tokens, or "cls" (the last layer's [CLS] state, not the pooler)
  k.normalize = True  # unit vectors: the score is the cosine
  k.scale = 20.0  # 1 / temperature (sentence-transformers' MNRL: 20)
  k.learn_scale = False  # learn log(scale) from `scale`, capped at max_scale
  k.max_scale = 100.0
  k.bias = 0.0  # sigmoid only (SigLIP starts scale 10, bias -10, both learned)
  k.learn_bias = False
  k.symmetric = False  # infonce: add the passage -> query direction
  k.negative_groups = 1  # 1: every passage of the global batch; G: each 1/G of it alone

  c = config.checkpoint = ml_collections.ConfigDict()
  c.init_from = ""  # any folder of weights bertjax reads (the kinds: bertjax/weights/reader.py); "" =
  #                   random init
  c.random_init = False  # True: init_from's architecture and vocabulary, fresh weights
  c.init_from_other_vocab = False  # True: take init_from's weights with another vocabulary
  c.save_every_steps = 0  # 0 = at the end of every epoch (also on SIGTERM and at the end)
  c.keep = 2  # latest checkpoints kept; the best one is kept apart in best/
  c.async_save = True

  config.mesh = base.get_config().mesh

  key = task.strip().lower()
  if key in SQUAD or key.startswith("squad"):
    d.max_seq_length = 384
    t.num_epochs = 2.0
    t.learning_rate = 3e-5
  elif key in families.FAMILIES:
    # No rate known in advance for one's own task: None has the command choose it on dev among
    # rates scaled to the encoder's width (bertjax/finetune/job/search.py auto_learning_rates), 4
    # trials in one program; a rate given on the command line runs that rate alone.
    t.learning_rate = ml_collections.FieldReference(None, field_type=float)
  elif key == "next":
    d.data_dir = ".cache/bertjax/finetune"  # written by `make finetune`
    c.init_from = "workdirs/tiny"
    d.max_seq_length = 64
    t.learning_rate = 3e-4  # chosen on dev (module docstring)
  return config
