"""Slurm templates for evaluation jobs (package data)."""
