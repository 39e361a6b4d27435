"""Reward functions (funcs.py): built-ins, user functions by module or file, weighting, output validation, scoring
(each call bounded in time and cut short by a stop signal); the final-answer parsing of math tasks
(math_answers.py). Imports config, dist and data."""
