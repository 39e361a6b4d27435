"""Reward functions for the shipped configs: user code, written as a user would write theirs."""
