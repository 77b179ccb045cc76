"""A user's text on its way to the model, below the task families and prediction: reading rows
(textfiles: CSV, TSV, JSON Lines) and encoding texts one or a pair to a row (pairs). It imports
nothing of the model, of fine-tuning or of the benchmarks; those build on it."""
