"""`bertjax.optimizer.adamw` / `lamb`, as docs/using-the-modules.md names them: the optimizers are
defined in bertjax/training/optimizer.py, where bertjax's own modules import them from."""

from bertjax.training.optimizer import (NO_DECAY_MODULES, NO_DECAY_PARAMS, OPTIMIZERS, SCHEDULES,
                                        BertAdamState, MaskOrFn, adamw, create_optimizer,
                                        default_decay_mask, default_stacked_mask, frozen, lamb,
                                        learning_rate_schedule, step_counts, with_step_count,
                                        wsd_schedule)
