"""Devices, hosts and processes: the mesh and its logical-axis rules (sharding.py), several
processes of one job (distributed.py) and the watchdog over them (watchdog.py), the backends a
command lets jax start (platforms.py), Cloud TPU slices (topologies.py), the order a chip stores
a shard in (layouts.py), host memory for steps on the CPU (hostmem.py)."""
