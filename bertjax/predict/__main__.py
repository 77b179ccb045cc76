"""`python -m bertjax.predict --workdir=FT_WORKDIR --input=FILE --output=FILE`: a fine-tuned
model (or any encoder) on new text; its flags and what it writes: bertjax/predict/predictor.py."""

from bertjax import cli
from bertjax.predict import predictor

if __name__ == "__main__":
  predictor.define_flags()
  cli.run(predictor.main)
