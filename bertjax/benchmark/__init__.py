"""Every benchmark, each a subcommand of `python -m bertjax.benchmark` (commands.py): the train
step (train.py; beside Hugging Face's, hf.py), prediction (predict.py), the data side (data.py,
prepare.py, sentences.py), fine-tuning's host-side data (finetune.py), the accelerator check
(accel.py) and where a layer's time goes (layers.py), a retriever's quality (retrieval.py)."""
