"""The parts of offline preparation (bertjax/data/prepare.py, its command and local driver): the
two steps each driver runs (shards.py), the NSP pairs they build (instances.py), the local worker
processes (processes.py) and the Apache Beam driver (beam.py)."""
