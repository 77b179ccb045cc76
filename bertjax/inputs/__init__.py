"""A user's text on its way to the model, below the task families and prediction: reading rows
(textfiles: CSV, TSV, JSON Lines, Parquet), encoding texts one or a pair to a row (pairs), tagged
words and their schemes (tagged: IOB1, IOB2, IO, IOBES; CoNLL column files) and their word windows
(word_windows), questions and their contexts in SQuAD's layout and their span windows
(questions). It imports nothing of the model, of fine-tuning or of the benchmarks; those build
on it."""
