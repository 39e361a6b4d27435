"""Reward functions (funcs.py): built-ins, user functions by module or file, weighting, output validation, scoring;
the final-answer parsing of math tasks (math_answers.py). Imports config and data."""
