"""Parallel wiring: process groups, tensor/sequence parallel with branches, ring attention, data parallel."""
