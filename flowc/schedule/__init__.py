"""The static schedule: each rank's work as actors and registers (actors.py), simulated at
compile time with the cost model (simulate.py); the simulation's firing order per stream is
the program (streams.py assigns streams). Pipeline parallelism adds stage partitioning
(partition.py) and micro-batch schedules (pipeline.py)."""
