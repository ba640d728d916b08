"""The ZeRO engine: flat layout and partitioning, gradient reduction, sharded optimizer, precision."""
