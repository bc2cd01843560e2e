"""Pricing multi-turn agentic rollouts (multiturn.py). Imports nothing of ours outside the simulator."""
