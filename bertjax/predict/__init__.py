"""Prediction: a fine-tuned workdir (or any encoder) on new text. The predictor and the command's
work (predictor.py), how texts are laid into a device's calls (rows.py), what it writes and may
write over (outputs.py), its embed and search modes (vectors.py); `python -m bertjax.predict`
runs __main__.py.

`from bertjax.predict import Predictor`, as docs/your-own-task.md writes it, imports from here;
bertjax's own modules import each name from the module that defines it.
"""

from bertjax.predict.predictor import (CHUNK_ROWS, CONCURRENT_CALLS, MODES, POOLINGS,
                                       TOKENS_PER_DEVICE, Predictor, predict_file, run)
