"""`python -m bertjax.predict`: the command of bertjax/predict/predictor.py, whose docstring its
--help prints."""

from bertjax import cli
from bertjax.predict import predictor

__doc__ = predictor.__doc__  # absl's --help prints the main module's docstring

if __name__ == "__main__":
  predictor.define_flags()
  cli.run(predictor.main)
