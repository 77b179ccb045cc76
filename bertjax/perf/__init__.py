"""What a compiled step costs: its roofline (roofline.py), an optimised XLA module's text and each
instruction's cost (hlotext.py, hlocost.py), its cost per encoder layer (layercost.py), a profile
by kind of operation (opprofile.py). `python -m bertjax.aot` and `python -m bertjax.tune` compile
against them, the benchmarks (bertjax/benchmark/) measure with them; a step's model FLOPs and the
chips' peaks are training's (bertjax/training/flops.py: the loop reports MFU)."""
