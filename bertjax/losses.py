"""`from bertjax import losses`, as the README writes it: the losses are defined in
bertjax/model/losses.py, where bertjax's own modules import them from."""

from bertjax.model.losses import (Metric, MlmScores, figures, mlm_accuracy, mlm_loss,
                                  nsp_accuracy, nsp_loss, pretraining_metrics, scores, scores_of,
                                  total_loss, weighted_accuracy, weighted_cross_entropy)
