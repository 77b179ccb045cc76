"""The formats of weights folders, below the one reader (bertjax/weights/reader.py): Hugging Face BERT
(hf), Google's TF1 checkpoints (google, tf_bundle: TensorFlow's bundle read without it),
ModernBERT (modernbert), the folder bertjax's imports write (converted) and the folder an export
writes (outfolder). Each parses and writes its names, configs and arrays; none reads a folder
through weights/reader.py (the import and export commands above it do: bertjax/convert/)."""
