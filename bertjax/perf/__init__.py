"""What a step costs: model FLOPs and chips' peaks (flops.py), the roofline of a compiled step
(roofline.py), an optimised XLA module's text and each instruction's cost (hlotext.py,
hlocost.py), a step's cost per encoder layer (layercost.py), a profile by kind of operation
(opprofile.py). `python -m bertjax.aot` and `python -m bertjax.tune` compile against them; the
benchmarks (bertjax/benchmark/) measure with them."""
