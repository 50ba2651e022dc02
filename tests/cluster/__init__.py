"""Helpers for launcher tests: a toy distributed job and a real one-node Slurm cluster."""
