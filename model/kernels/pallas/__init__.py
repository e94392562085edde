"""Pallas kernels for accelerators, chosen per platform when a program is lowered
(``model.kernels.on_gpu``) and run in Pallas interpret mode by the CPU test suite."""
