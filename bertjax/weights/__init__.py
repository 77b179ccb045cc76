"""Weights in: the one reader of a weights folder (reader.py: what a path holds and its
parameters, over the formats of bertjax/formats/), a folder against the run that takes it
(match.py: vocabulary, casing, model), and a pre-trained encoder for one's own code
(pretrained.py: load_pretrained). The converters (bertjax/convert/) write and export above it."""
