"""`from bertjax.heads import ...`, as the README writes it: the heads are defined in
bertjax/model/heads.py, where bertjax's own modules import them from."""

from bertjax.model.heads import (PREDICTION_HEAD, BertForPreTraining,
                                 BertForSequenceClassification, BertForSpanExtraction,
                                 BertForTokenClassification, MlmHead, NspHead, PredictionHead,
                                 decoded_scores, kept_scores, mean_pool, tied_decoder)
